#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests/test_slurm.py: Debian's slurmctld, two
# slurmd daemons (node1 and node2, two "nodes" of one host) and munge for authentication.
# Needs root and apt (Debian/Ubuntu); .ci/run starts it before `make test`.
#   bash tests/slurm_cluster.sh start   # then: export SLURM_CONF=/tmp/mixprec-slurm/slurm.conf
#   bash tests/slurm_cluster.sh stop
set -euo pipefail
dir=${MIXPREC_SLURM_DIR:-/tmp/mixprec-slurm}
export SLURM_CONF="$dir/slurm.conf"

start() {
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
  fi
  mkdir -p "$dir/state" /run/munge
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
  pgrep -x munged >/dev/null || munged --force
  # the node names resolve to this host (torch.distributed's rendezvous uses the first one)
  grep -qw node1 /etc/hosts || echo "127.0.0.1 node1 node2" >> /etc/hosts
  local cpus mem host
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
  host=$(hostname)
  cat > "$SLURM_CONF" <<EOF
ClusterName=mixprec-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again after cred_expire + 1 s (default 120 s; Slurm's least is 5):
# the test requeues
AuthInfo=cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# no event starts a requeued job once its hold ends, the periodic pass does: every second, not 60
SchedulerParameters=sched_min_interval=200000,sched_interval=1
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=600
SlurmdTimeout=60
NodeName=node1 NodeHostname=$host NodeAddr=127.0.0.1 Port=6818 CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=node2 NodeHostname=$host NodeAddr=127.0.0.1 Port=6819 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  for _ in 1 2 3; do  # a controller that is still shutting down holds the port: try again
    pgrep -x slurmctld >/dev/null || slurmctld
    timeout 10 scontrol ping 2>/dev/null | grep -q UP && break
    sleep 2
  done
  if [ "$(timeout 5 sinfo -h -t idle -o %D 2>/dev/null)" != "2" ]; then
    pkill -9 -x slurmd 2>/dev/null || true  # a slurmd left waiting for an earlier controller
    sleep 0.5
    slurmd -N node1
    slurmd -N node2
  fi
  for _ in $(seq 60); do
    if [ "$(timeout 5 sinfo -h -t idle -o %D 2>/dev/null)" = "2" ]; then
      echo "SLURM cluster up: 2 nodes (SLURM_CONF=$SLURM_CONF)"
      return 0
    fi
    sleep 0.5
  done
  echo "SLURM cluster did not come up; logs in $dir" >&2
  tail -n 5 "$dir"/*.log >&2 || true
  return 1
}

stop() {
  timeout 10 scancel --user=root 2>/dev/null || true
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
  for _ in $(seq 40); do  # gone, so that a start right after finds the ports free
    pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || return 0
    sleep 0.25
  done
  pkill -9 -x slurmd 2>/dev/null || true
  pkill -9 -x slurmctld 2>/dev/null || true
}

"${1:-start}"

"""The process group: torchrun (or SLURM through submitit) starts one process per GPU (NCCL)
or per CPU worker (gloo); rank 0 alone writes. What runs over it is the strategy's (ddp.py,
fsdp.py).

No home-made launcher: the environment torchrun/SLURM set up is read here, nothing else.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    grouped: bool = False  # in a process group (a world of one too, for parallel=fsdp)
    mesh: object = None  # the DeviceMesh FSDP2 shards over (None: the whole world's)
    strategy: object = None  # the parallel strategy (strategy.py): it owns no_sync

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def no_sync(self, model: nn.Module):
        """Skip the gradient all-reduce (all but the last micro-batch of an accumulation)."""
        return self.strategy.no_sync(model) if self.strategy is not None else nullcontext()

    def reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A reduced copy over all ranks (sum or max); the tensor itself in a world of one."""
        return all_reduce(t, op)


def _env_world() -> tuple[int, int, int] | None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun
        return (
            int(os.environ["RANK"]),
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ["WORLD_SIZE"]),
        )
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return (
            int(os.environ["SLURM_PROCID"]),
            int(os.environ.get("SLURM_LOCALID", 0)),
            int(os.environ["SLURM_NTASKS"]),
        )
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("gpu[03-04,07],cpu1" -> "gpu03"): scontrol's own
    expansion where it is installed, else the common prefix[range] form."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m or not m.group(2):
        return nodelist.split(",")[0]
    return m.group(1) + m.group(2).split(",")[0].split("-")[0]


def init(device_type: str, strategy=None) -> Dist:
    """Join the process group if this process was started as one of several; else world 1,
    in a group of its own if the strategy needs one (parallel=fsdp on one GPU: FSDP2 does)."""
    env = _env_world()
    if env is None:
        if not getattr(strategy, "group_of_one", False):
            return Dist(strategy=strategy)
        if not dist.is_initialized():
            dist.init_process_group(
                _backend(device_type), store=dist.HashStore(), rank=0, world_size=1
            )
        return Dist(grouped=True, strategy=strategy)
    rank, local_rank, world = env
    die_with_agent()
    if "MASTER_ADDR" not in os.environ:  # SLURM: the first node of the job hosts the store
        os.environ["MASTER_ADDR"] = first_host(os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        os.environ.setdefault(
            "MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", 0)) % 1000)
        )
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(_backend(device_type), timeout=datetime.timedelta(minutes=10))
    return Dist(rank, local_rank, world, grouped=True, strategy=strategy)


def die_with_agent() -> None:
    """Under torchrun (Linux): this rank is sent SIGTERM when its agent dies, a stop signal
    like any other (checkpoint at the next step, every rank at the same one). A SIGKILL to
    torchrun's group (`timeout -s KILL`, `kill -9 -PGID`) reaches only the agent, whose ranks
    lead sessions of their own: left alone they trained on as orphans into the run dir."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    agent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as e:
        log.warning("torchrun: this rank cannot follow its agent's death (%s)", e)
        return
    if os.getppid() != agent or agent == 1:  # the agent died before the call: stop now
        os.kill(os.getpid(), signal.SIGTERM)


def probe_dist(strategy, device_type: str) -> Dist:
    """The Dist a batch=auto probe is built with, on every rank at once: none (a probe that runs
    out of memory on one rank must not leave the others waiting in a DDP all-reduce), or, for
    parallel=fsdp, a mesh of this rank alone. FSDP2 then shards over one rank, which holds all
    of the state a rank of the real world holds a share of (its peak bounds theirs from above;
    in a world of one it is the run's own), and its collectives wait on no other rank."""
    if not strategy.group_of_one:
        return Dist(strategy=strategy)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Dist(grouped=True, strategy=strategy)
    from torch.distributed.device_mesh import DeviceMesh

    alone, _ = dist.new_subgroups(group_size=1)  # a collective: every rank makes its group
    return Dist(grouped=True, mesh=DeviceMesh.from_group(alone, device_type), strategy=strategy)


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def rank() -> int:
    """This process's rank in its process group; 0 without one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """A reduced copy over all ranks (op: sum or max); the tensor itself without a group."""
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def all_min(value: int) -> int:
    """The smallest value over all ranks (batch=auto agreement; any rank's 'no' wins)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_str(value: str, d: Dist) -> str:
    """Rank 0's string on every rank (the run dir: only rank 0's Hydra made one)."""
    if not d.enabled:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

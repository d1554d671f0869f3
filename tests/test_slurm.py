"""A real SLURM cluster (tests/slurm_cluster.sh: slurmctld, two slurmd, munge on this machine;
.ci/run starts it): `python train.py -m hydra/launcher=slurm ...` submits through
hydra-submitit-launcher. A job that hits its time limit gets SIGUSR2 before it, checkpoints, is
requeued and resumes to end bit-identical to an uninterrupted run; scancel leaves `preempted`;
two nodes train as one data-parallel job. Skipped where no cluster answers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import completed, last_weights, run_train, start_train, train_losses

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

# one CPU per task and one thread, so that a job and the local reference compute alike
LAUNCH = [
    "hydra/launcher=slurm",
    "hydra.launcher.partition=debug",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.tasks_per_node=1",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=2",
]
# (torch gives MKL OpenMP's thread count: MKL_NUM_THREADS is not needed, and as MKL reads it
# when it loads, it would keep a run from forking from the zygote)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# the signal lands a few steps after the first checkpoint (step 25): 175 steps, about 3 s, before
# the end on an idle machine
STEPS = 200
TRAIN = [
    "logger=none",
    "hardware=cpu",
    f"trainer.max_steps={STEPS}",
    "ckpt.every_steps=25",
    "trainer.log_every=25",
]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """Skip without a cluster, unless MIXPREC_REQUIRE_SLURM is set (CI): then fail."""
    missing = pytest.fail if os.environ.get("MIXPREC_REQUIRE_SLURM") else pytest.skip
    if not shutil.which("sinfo") or "SLURM_CONF" not in os.environ:
        missing(
            "no local SLURM cluster: `bash tests/slurm_cluster.sh start` (root, apt), "
            "then export SLURM_CONF=/tmp/mixprec-slurm/slurm.conf"
        )
    up = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True)
    if up.returncode:
        missing(f"the SLURM cluster does not answer: {up.stderr.strip()}")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


weights = last_weights


def job_logs(sweep: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sweep.glob(".submitit/*/*.out"))


def launch(args: list[str], sweep: Path) -> subprocess.Popen:
    """`python train.py -m ...` in the background (it waits for its SLURM jobs); its jobs start
    as SLURM starts them."""
    sweep_args = ["-m", *LAUNCH, *args, f"hydra.sweep.dir={sweep}"]
    return start_train(sweep_args, env_extra=ONE_THREAD, merge=True)


def job_training(sweep: Path, launcher: subprocess.Popen) -> str:
    """The SLURM job id, once its run has written a checkpoint (training is under way)."""
    deadline = time.time() + 180
    while time.time() < deadline and not list((sweep / "0" / "checkpoints").glob("step_*.pt")):
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        time.sleep(0.2)
    jobs = [p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
    assert jobs, "no job submitted"
    return jobs[0]


def test_the_time_limit_signal_checkpoints_requeues_and_resumes_bit_identical(tmp_path):
    """submitit asks SLURM for SIGUSR2 signal_delay_s before the time limit (#SBATCH --signal).
    SLURM's limit timer has a resolution of about a minute, so the test sends that same signal
    to the running job itself (scancel --signal=USR2): mixprec checkpoints at the next step,
    hands the signal to submitit, which requeues the job; it resumes with resume=auto and ends
    with the weights of an uninterrupted run, bit for bit."""
    sweep, ref = tmp_path / "sweep", tmp_path / "reference"
    launcher = launch(
        [
            "hydra.launcher.timeout_min=10",
            "hydra.launcher.signal_delay_s=120",
            "resume=auto",
            *TRAIN,
        ],
        sweep,
    )
    job = job_training(sweep, launcher)
    assert (
        "#SBATCH --signal=USR2@120"
        in (sweep / ".submitit" / job / f"{job}_submission.sh").read_text()
    )
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    # the uninterrupted reference trains while SLURM holds the requeued job
    local = start_train([*TRAIN, f"hydra.run.dir={ref}"], env_extra=ONE_THREAD)
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out[-4000:]
    logs = (sweep / "0" / "train.log").read_text()
    assert "Caught signal SIGUSR2" in job_logs(sweep)  # submitit's requeue, after our checkpoint
    assert "preempted" in logs and "resumed from" in logs
    assert summary(sweep / "0")["status"] == "completed"
    assert summary(sweep / "0")["steps"] == STEPS
    local = completed(local, 600)
    assert local.returncode == 0, local.stderr[-3000:]
    mine, theirs = weights(sweep / "0"), weights(ref)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_scancel_of_a_job_with_loader_workers_leaves_a_preempted_run_with_a_checkpoint(tmp_path):
    """scancel signals every process of the job's step: the trainer and its two DataLoader
    workers. One stop, at a checkpoint of the step it stopped at."""
    from test_data import make_folder

    images = make_folder(tmp_path / "images", n=24)
    data = [
        "data=imagenet",
        f"data.root={images}",
        "data.image_size=32",
        "data.eval_resize=36",
        "hardware.num_workers=2",
        "batch=8",
        "ckpt.every_steps=5",
    ]
    sweep = tmp_path / "sweep"
    args = ["hydra.launcher.timeout_min=10", *TRAIN, *data, "trainer.max_steps=100000"]
    launcher = launch(args, sweep)
    subprocess.run(["scancel", job_training(sweep, launcher)], check=True)
    out, _ = launcher.communicate(timeout=180)
    s = summary(sweep / "0")
    assert s["status"] == "preempted" and s["exit_code"] == 143, out[-3000:]
    ckpt = torch.load(s["checkpoint"], weights_only=True)
    assert ckpt["state"]["step"] == s["steps"]
    assert "a second signal" not in (sweep / "0" / "train.log").read_text()


def test_two_nodes_train_as_one_data_parallel_job(tmp_path):
    """hydra.launcher.nodes=2 (one task per node), a sweep over DDP and FSDP2: two jobs on the
    same two nodes at once. In each, only global rank 0 writes the run dir, and the losses equal
    one process with the same global batch."""
    sweep, single = tmp_path / "sweep", tmp_path / "single"
    common = [
        "model=digits_mlp",
        "trainer.max_steps=6",
        "trainer.log_every=1",
        "hardware=cpu",
        "scheduler=constant",
        "logger=none",
        "accum=2",
    ]
    one = start_train([*common, "batch=32", f"hydra.run.dir={single}"], env_extra=ONE_THREAD)
    proc = run_train(
        [
            "-m",
            *LAUNCH,
            "hydra.launcher.nodes=2",
            "hydra.launcher.timeout_min=5",
            *common,
            "batch=16",
            "parallel=ddp,fsdp",
            f"hydra.sweep.dir={sweep}",
        ],
        env_extra=ONE_THREAD,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    one = completed(one, 600)
    assert one.returncode == 0, one.stderr[-3000:]

    strategies = []
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in jobs] == ["0_parallel=ddp", "1_parallel=fsdp"]  # named in the job
    for run in jobs:
        s = summary(run)
        assert (s["world_size"], s["effective_batch"]) == (2, 64)
        strategy = (
            "fsdp" if "parallel=fsdp" in (run / ".hydra" / "overrides.yaml").read_text() else "ddp"
        )
        sharded = "the root sharded (FSDP2)" in (run / "train.log").read_text()
        assert sharded == (strategy == "fsdp"), strategy
        torch.testing.assert_close(train_losses(run), train_losses(single), rtol=1e-5, atol=1e-6)
        strategies.append(strategy)
    assert sorted(strategies) == ["ddp", "fsdp"]

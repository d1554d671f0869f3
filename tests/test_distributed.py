"""Data parallel on the CPU (gloo): 2 processes under torchrun match 1 process with the same
effective batch; accumulation all-reduces once per optimizer step; rank 0 alone writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import zygote
from torch import nn

from mixprec.optim import optimizers as optim
from mixprec.parallel import ddp, distributed
from mixprec.precision import base as precision
from mixprec.training import loop

import wandb_log
from conftest import (
    LM_CPU,
    ROOT,
    finish,
    group,
    run_torchrun,
    run_train,
    start_session,
    train_losses,
)

COMMON = [
    "model=digits_mlp",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "hardware=cpu",
    "scheduler=constant",
]


losses = train_losses


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("single")
    single = run_train(
        [*COMMON, "batch=32", "accum=2", "logger=none", f"hydra.run.dir={d}"],
        env_extra={"OMP_NUM_THREADS": "1"},
    )
    assert single.returncode == 0, single.stderr[-3000:]
    return d


def torchrun(launcher: list[str], run_dir: Path) -> subprocess.Popen:
    """One torchrun agent training batch 16 x accum 2 per process into run_dir."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env.update(zygote.relay_env())  # the agent and its ranks forked where they can be
    return start_session(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *launcher,
            str(ROOT / "train.py"),
            *COMMON,
            "batch=16",
            "accum=2",
            f"hydra.run.dir={run_dir}",
        ],
        ROOT,
        env,
        merge=True,
        forked=True,
    )


def finished(proc: subprocess.Popen) -> str:
    out = finish(proc, 600)[0]
    assert proc.returncode == 0, out[-4000:]
    return out


def assert_matches_one_process(ddp_dir: Path, single_dir: Path) -> None:
    s = json.loads((ddp_dir / "summary.json").read_text())
    assert (s["world_size"], s["batch"], s["accum"], s["effective_batch"]) == (2, 16, 2, 64)
    torch.testing.assert_close(losses(ddp_dir), losses(single_dir), rtol=1e-5, atol=1e-6)
    w_ddp = torch.load(ddp_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    w_one = torch.load(single_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    for k in w_one:
        torch.testing.assert_close(w_ddp[k], w_one[k], rtol=1e-5, atol=1e-6)
    (run,) = wandb_log.runs_under(ddp_dir)  # exactly one W&B run: global rank 0's
    assert run.config["world_size"] == 2 and run.config["effective_batch"] == 64
    assert run.summary["world_size"] == 2


@pytest.mark.slow
def test_torchrun_two_processes_match_one_process(tmp_path, one_process):
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("mixprec-rank*"))
    finished(torchrun(["--standalone", "--nproc_per_node=2"], tmp_path))
    assert_matches_one_process(tmp_path, one_process)
    assert set(temp.glob("mixprec-rank*")) == before  # rank 1 made no run dir of its own


@pytest.mark.slow
def test_two_torchrun_agents_act_as_two_nodes(tmp_path, one_process):
    """Two torchrun agents (--nnodes=2, one process each) meeting through a c10d rendezvous on
    localhost, as two machines would: global rank 0 alone writes the run dir and opens the W&B
    run, and the losses equal one process with the same global batch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv = [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=mixprec-test",
    ]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"  # each machine names its own run dir
    agents = [torchrun(rdzv, node0), torchrun(rdzv, node1)]
    for agent in agents:
        finished(agent)
    written = [d for d in (node0, node1) if (d / "summary.json").exists()]
    assert len(written) == 1  # one writer: the node that holds global rank 0
    assert_matches_one_process(written[0], one_process)


def test_accumulation_all_reduces_once_per_optimizer_step(gloo_world_of_one):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    )
    calls = []

    def count(state, bucket):
        calls.append(1)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, count)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = precision.build(group("precision", "fp32"), group("scaler"), torch.device("cpu"))
    learner = loop.Learner(model, opt, optim.build_scheduler(group("scheduler"), opt, 2), prec)
    micro = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(4)]
    loop.train_step(learner, micro, no_sync=ddp.Strategy(group("parallel", "ddp")).no_sync)
    assert len(calls) == 1  # the last micro-batch only (one bucket for this small model)
    calls.clear()
    loop.train_step(learner, micro)
    assert len(calls) == 4  # without no_sync every micro-batch would all-reduce


def test_batch_auto_agreement_takes_the_minimum(gloo_world_of_one):
    assert distributed.all_min(37) == 37
    assert distributed.all_reduce(torch.tensor(3.0)).item() == 3.0


def test_slurm_environment_is_read(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert distributed._env_world() == (3, 1, 4)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed._env_world() is None


def test_stop_signals_hand_over_to_the_previous_handler():
    import signal

    from mixprec.training.safety import StopSignals

    seen = []
    old = signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))  # e.g. submitit's requeue
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop.received == signal.SIGUSR2 and not seen  # only a flag, nothing else
        stop.forward()
        assert seen == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, old)


@pytest.mark.slow
def test_torchrun_trains_the_language_model_as_one_process_does(tmp_path):
    """The Llama decoder on text under torchrun (2 processes x batch 4) logs the losses of one
    process with batch 8: each rank takes its share of the shuffled windows and of validation."""
    lm = [*LM_CPU, "data.max_mb=2", "trainer.max_steps=6"]
    one = tmp_path / "one"
    single = run_train([*lm, "batch=8", f"hydra.run.dir={one}"], env_extra={"OMP_NUM_THREADS": "1"})
    assert single.returncode == 0, single.stderr[-3000:]
    two = tmp_path / "two"
    p = run_torchrun([str(ROOT / "train.py"), *lm, "batch=4", f"hydra.run.dir={two}"])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    torch.testing.assert_close(losses(two), losses(one), rtol=1e-5, atol=1e-5)
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert s2["world_size"] == 2 and s2["effective_batch"] == 8
    assert s2["val_loss"] == pytest.approx(s1["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_the_two_gpu_runs_of_issue_44_run_end_to_end_on_gloo(tmp_path):
    """benchmarks/two_gpu.sh --dry-run: every command the 2-GPU machine will run (DDP and FSDP2,
    FSDP2's two reduce dtypes, a model sharded with DCP checkpoints and resumed), on the CPU over
    gloo with two processes, each completing in a world of 2."""
    # its python processes forked from the zygote where they can be (zygote.relay)
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, **zygote.relay_env()}
    env["PYTHON"] = env.get("PYTHON_EXEC", sys.executable)
    p = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "two_gpu.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    summaries = {
        s.parent.name: json.loads(s.read_text())
        for s in (tmp_path / "two_gpu").glob("*/summary.json")
    }
    assert set(summaries) == {
        "1-ddp-bf16",
        "1-fsdp-bf16",
        "2-fsdp-reduce-float32",
        "2-fsdp-reduce-bfloat16",
        "3-big-sharded",
        "3-big-resumed",
    }
    assert all(s["status"] == "completed" and s["world_size"] == 2 for s in summaries.values())
    assert summaries["3-big-resumed"]["steps"] == summaries["3-big-sharded"]["steps"] + 2
    assert (tmp_path / "two_gpu" / "3-big-sharded" / "checkpoints" / "last.dcp").exists()

"""Exact resume, preemption, loud divergence and safe checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mixprec.checkpoint import store as checkpoint
from mixprec.core.errors import CheckpointError
from mixprec.optim import optimizers as optim
from mixprec.precision import base as precision
from mixprec.run import session as run
from mixprec.training import ledger, loop

from conftest import ROOT, group, last_weights, run_train, threads_as_here

# Deterministic on the CPU: digits, a fixed seed, dropout's RNG restored from the checkpoint.
BASE = ["hardware=cpu", "trainer.max_steps=150", "ckpt.every_steps=10", "trainer.log_every=5"]


weights = last_weights


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = threads_as_here({**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *BASE, *extra, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, min_step: int) -> int:
    deadline = time.time() + 120
    while time.time() < deadline:
        steps = [int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.pt")]
        if steps and max(steps) >= min_step:
            return max(steps)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    raise AssertionError("no checkpoint appeared")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("reference")
    proc = run_train([*BASE, "logger=none", f"hydra.run.dir={d}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d


def train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


@pytest.mark.slow
def test_sigkill_then_resume_auto_is_bit_identical(tmp_path, reference):
    proc = start(tmp_path, "logger=wandb")
    wait_for_checkpoint(tmp_path, proc, 20)
    proc.kill()
    proc.wait()
    done = run_train([*BASE, "logger=wandb", "resume=auto", f"hydra.run.dir={tmp_path}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout + done.stderr
    assert_identical(weights(tmp_path), weights(reference))
    steps = [r["step"] for r in train_rows(tmp_path)]
    assert steps == sorted(set(steps)) and steps[-1] == 150  # continues, no duplicates
    ref_rows = {r["step"]: r["train/loss"] for r in train_rows(reference)}
    assert all(r["train/loss"] == ref_rows[r["step"]] for r in train_rows(tmp_path))
    ids = {p.stem for p in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")}
    assert len(ids) == 1 and len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_a_stop_signal_checkpoints_marks_preempted_and_resumes(tmp_path, reference, sig):
    """A signal to the trainer alone (`kill PID`): checkpoint at the next step boundary,
    `preempted`, exit 128 + signal, and a resume ends bit-identical to an uninterrupted run.
    (SIGINT and SIGTERM to the whole process group, with workers: test_signals.py.)"""
    proc = start(tmp_path, "logger=none")
    wait_for_checkpoint(tmp_path, proc, 10)
    t0 = time.time()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert time.time() - t0 < 30
    assert proc.returncode == 128 + sig, out[-3000:]
    assert "continue with: python train.py" in out and "resume=auto" in out
    assert "Traceback" not in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    ckpt = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert summary["status"] == "preempted" and summary["steps"] == ckpt["state"]["step"]
    assert 10 <= summary["steps"] < 150
    done = run_train([*BASE, "logger=none", "resume=auto", f"hydra.run.dir={tmp_path}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    assert_identical(weights(tmp_path), weights(reference))


@pytest.mark.slow
def test_exploding_lr_stops_loudly_and_keeps_the_last_good_checkpoint(tmp_path):
    proc = run_train(
        [
            "hardware=cpu",
            "logger=none",
            "precision=fp32",
            "optimizer.lr=1e12",
            "ckpt.every_steps=1",
            "trainer.log_every=5",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert proc.returncode == 3
    out = proc.stdout + proc.stderr
    assert "non-finite loss" in out and "clip_grad_norm" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] < 20
    saved = weights(tmp_path)
    assert all(torch.isfinite(t).all() for t in saved.values() if t.is_floating_point())


def test_resume_auto_without_a_checkpoint_starts_fresh(cfg_factory):
    cfg = cfg_factory("resume=auto", "trainer.max_steps=2")
    run.run(cfg)
    assert json.loads((Path(cfg.run_dir) / "summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_fault_during_checkpoint_write_leaves_the_previous_one(cfg_factory, monkeypatch):
    cfg = cfg_factory("trainer.max_steps=2")
    run.run(cfg)
    last = Path(cfg.run_dir) / "checkpoints" / "last.pt"
    blob = checkpoint.load(last)

    def broken_save(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    state = loop.TrainState(**{**blob["state"], "step": 99})
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1)
    prec = precision.build(group("precision", "fp32"), group("scaler"), torch.device("cpu"))
    learner = loop.Learner(model, opt, optim.build_scheduler(group("scheduler"), opt, 2), prec)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(last, learner, state, config={})
    again = checkpoint.load(last)
    assert again["state"]["step"] == 2
    assert not list(last.parent.glob("*.tmp"))


def test_truncated_checkpoint_names_the_file(cfg_factory, tmp_path):
    cfg = cfg_factory("trainer.max_steps=2")
    run.run(cfg)
    last = Path(cfg.run_dir) / "checkpoints" / "last.pt"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"bad\.pt.*truncated"):
        checkpoint.load(bad)


def test_checkpoint_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format": 1, "payload": Path("/etc/passwd")}, path)  # any non-plain object
    with pytest.raises(CheckpointError, match="evil.pt"):
        checkpoint.load(path)


@pytest.mark.slow
def test_checkpoint_from_another_model_is_a_clear_error(cfg_factory, tmp_path):
    first = cfg_factory("trainer.max_steps=1")
    run.run(first)
    other = cfg_factory(
        "model=resnet18",
        "trainer.max_steps=1",
        f"resume={Path(first.run_dir)}",
        f"run_dir={tmp_path / 'other'}",
    )
    with pytest.raises(CheckpointError, match="model does not fit this run's model"):
        run.run(other)


@pytest.mark.slow
def test_fp32_checkpoint_resumed_with_amp_gets_a_fresh_scaler(cfg_factory, tmp_path, caplog):
    first = cfg_factory("trainer.max_steps=2")
    run.run(first)
    cfg = cfg_factory(
        "precision=amp",
        "trainer.max_steps=4",
        f"resume={Path(first.run_dir)}",
        f"run_dir={tmp_path / 'amp'}",
    )
    run.run(cfg)
    summary = json.loads((tmp_path / "amp" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert "starts a fresh scaler" in caplog.text


def test_no_checkpoint_over_nan_batchnorm_statistics():
    """Finite weights are not enough: NaN running statistics (e.g. from an overflowing forward
    with scaler.guard_bn_stats=false) would make every evaluation of the checkpoint NaN."""
    from torch import nn

    from mixprec.training.safety import DivergenceGuard

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    guard, saved = DivergenceGuard(torch.device("cpu"), 3, 1.0), []
    ledger.save_if_healthy(saved.append, loop.TrainState(step=1), guard, model)
    model[1].running_var[0] = float("nan")
    ledger.save_if_healthy(saved.append, loop.TrainState(step=2), guard, model)
    assert [s.step for s in saved] == [1]

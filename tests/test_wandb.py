"""What the W&B dashboard receives, read from the offline transaction logs that `wandb sync`
uploads: the config that ran, history without nulls, a summary equal to summary.json, dated
groups, the sweep's report run beside its jobs, new ids for runs started from another run, one
run per DDP job; and W&B never prompts and never stops training."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from test_run import check_run_dir

import wandb_log
from conftest import ROOT, run_module, run_train

QUICK = ["trainer.max_steps=12", "trainer.log_every=4", "trainer.perf_warmup_steps=1"]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_summary_matches(run: wandb_log.WandbRun, run_dir: Path) -> None:
    local = summary_of(run_dir)
    shown = {k: v for k, v in run.summary.items() if not k.startswith("_")}
    assert shown == local  # the runs table's columns are summary.json, exactly


@pytest.mark.slow
def test_a_single_run_shows_what_ran(tmp_path):
    proc = run_train(
        [
            "precision=bf16",
            "batch=32",
            *QUICK,
            "logger.project=mixprec-test",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = wandb_log.runs_under(tmp_path)
    today = datetime.date.today().isoformat()
    assert (run.project, run.group) == ("mixprec-test", f"default-{today}")
    cfg = run.config
    assert cfg["precision"] == "bf16" and cfg["autocast"] == "bfloat16"  # plain, groupable
    assert (cfg["batch"], cfg["accum"], cfg["world_size"], cfg["effective_batch"]) == (32, 1, 1, 32)
    assert cfg["lr"] == pytest.approx(1e-3 * (32 / 256) ** 0.5)  # the lr that ran, not the base
    assert cfg["optimizer"]["lr"] == 1e-3 and cfg["optimizer"]["name"] == "adamw"
    assert (cfg["hardware"], cfg["gpu"]) == ("cpu", "CPU")  # resolved, not `auto`
    assert "scaler" not in cfg  # no GradScaler under bf16: its settings do not apply
    assert set(cfg["data"]) == {"name", "val_fraction", "data_seed"}  # digits' keys only
    assert "momentum" not in cfg["optimizer"] and "compile_mode" not in cfg["model"]
    assert cfg["scheduler"]["warmup_steps"] == 1  # 5 % of 12 steps, resolved
    train_rows = [r for r in run.history if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [4, 8, 12]
    assert all(v is not None for r in run.history for v in r.values())  # no empty charts
    assert not any("perf/mfu" in r for r in run.history)  # no peak known on a CPU: not logged
    assert_summary_matches(run, tmp_path)
    assert run.exit_code == 0


@pytest.mark.slow
def test_an_amp_run_logs_its_scaler_and_a_resume_from_elsewhere_is_a_new_run(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    proc = run_train(["precision=amp", "batch=64", *QUICK, f"hydra.run.dir={first}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = wandb_log.runs_under(first)
    assert run.config["scaler"]["init_scale"] == 65536.0 and run.config["autocast"] == "float16"
    more = [
        "precision=amp",
        "batch=64",
        "trainer.max_steps=16",
        "trainer.log_every=4",
        "trainer.perf_warmup_steps=1",
    ]
    proc = run_train([*more, f"resume={first}", f"hydra.run.dir={second}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (new,) = wandb_log.runs_under(second)
    assert new.run_id != run.run_id  # syncing it does not merge it into the first run
    assert summary_of(second)["steps"] == 16
    proc = run_train([*more, "trainer.max_steps=20", "resume=auto", f"hydra.run.dir={second}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = {r.run_id for r in wandb_log.runs_under(second)}
    assert ids == {new.run_id}  # resume=auto in its own run dir continues the same W&B run


@pytest.mark.slow
def test_a_sweep_and_its_report_run_share_project_mode_and_a_dated_group(tmp_path):
    sweep = tmp_path / "2026-11-30" / "12-00-00"
    proc = run_train(
        [
            "-m",
            "precision=fp32,bf16",
            *QUICK,
            "logger.project=mixprec-sweep",
            f"hydra.sweep.dir={sweep}",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = wandb_log.runs_under(sweep)
    jobs = [r for r in runs if r.job_type != "report"]
    (report,) = [r for r in runs if r.job_type == "report"]
    assert len(jobs) == 2 and {r.config["precision"] for r in jobs} == {"fp32", "bf16"}
    # each named by what the sweep varies, not by all its overrides (issue 93, item 2)
    assert {r.name for r in jobs} == {"precision=fp32", "precision=bf16"}
    assert {r.group for r in runs} == {"default-2026-11-30_12-00-00"}
    assert {r.project for r in runs} == {"mixprec-sweep"}
    for job in jobs:  # one run dir, meeting the run-dir contract, and one W&B run per job
        job_dir = sweep / f"{0 if job.config['precision'] == 'fp32' else 1}_{job.name}"
        assert check_run_dir(job_dir)["status"] == "completed"
        assert_summary_matches(job, job_dir)
    # the documented sync command covers the jobs and the report run
    listed = run_sync(sweep)
    assert len(listed) == 3 and all(Path(p).name.startswith("offline-run-") for p in listed)
    # rebuilding the report updates the same report run instead of adding another
    rebuilt = run_module("mixprec.report", [sweep], env_extra={"WANDB_MODE": "offline"})
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    reports = {r.run_id for r in wandb_log.runs_under(sweep) if r.job_type == "report"}
    assert reports == {report.run_id}


def run_sync(path: Path) -> list[str]:
    out = run_module("mixprec.sync", ["--print", path])
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


@pytest.mark.slow
def test_online_without_credentials_in_a_terminal_does_not_prompt(tmp_path):
    """WANDB_MODE=online, no API key, stdin a terminal that stays open: wandb's interactive
    login prompt would wait forever; mixprec asks wandb for credentials first and goes offline."""
    import pty
    import subprocess

    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="online", HOME=str(home), NETRC=str(home / ".netrc"))
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *QUICK, f"hydra.run.dir={tmp_path / 'run'}"],
            cwd=ROOT,
            env=env,
            stdin=terminal,
            stdout=terminal,
            stderr=terminal,
        )
        seen = _drain(controller, proc, timeout=240)
    finally:
        os.close(terminal)
    assert proc.returncode == 0, seen[-3000:]
    assert "Enter your choice" not in seen
    assert "no credentials" in seen and "logging offline" in seen
    assert summary_of(tmp_path / "run")["status"] == "completed"
    (run,) = wandb_log.runs_under(tmp_path / "run")  # the run is there, offline, to sync later


def _drain(fd: int, proc, timeout: float) -> str:
    """Read the terminal until the process ends (a blocked prompt would time out here)."""
    import select

    out, deadline = b"", time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                out += os.read(fd, 65536)
            except OSError:
                break
        elif proc.poll() is not None:
            break
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        raise AssertionError("train.py did not finish: " + out.decode(errors="replace")[-2000:])
    return out.decode(errors="replace")


@pytest.fixture
def silent_server():
    """A loopback TCP server that accepts connections and never answers (a hung W&B host)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(2)
    for c in held:
        c.close()
    srv.close()


@pytest.mark.slow
def test_a_hung_wandb_costs_bounded_time_and_training_goes_on(tmp_path, silent_server):
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "a" * 40, "WANDB_BASE_URL": silent_server}
    t0 = time.time()
    proc = run_train(
        [*QUICK, "logger.timeout_s=2", f"hydra.run.dir={tmp_path}"], env_extra=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary_of(tmp_path)["status"] == "completed"
    assert "W&B init failed" in proc.stderr
    assert time.time() - t0 < 120

"""End to end: presets run, `python train.py` meets the run-dir contract, multirun makes one run
dir and one W&B run per job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixprec.run import session as run

from conftest import group_options, run_train

METRIC_KEYS = {
    "step",
    "epoch",
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "amp/loss_scale",
    "amp/skipped_steps",
    "perf/samples_per_s",
    "perf/step_ms",
    "mem/allocated_gib",
    "mem/reserved_gib",
    "mem/peak_gib",
}
VAL_KEYS = {"step", "epoch", "val/loss", "val/acc1"}
SUMMARY_KEYS = {
    "status",
    "precision",
    "batch",
    "accum",
    "effective_batch",
    "world_size",
    "steps",
    "samples_per_s",
    "peak_mem_gib",
    "val_acc1",
    "skipped_steps",
    "loss_scale",
    "mfu",
    "wall_s",
}
# Shrinks any preset to a CPU-sized smoke run (GPU presets included: needs_gpu=false).
TINY = ["batch=2", "accum=1", "trainer.max_steps=2", "needs_gpu=false"]
TINY_SYNTHETIC = ["data.shape=[3,32,32]", "data.num_classes=10", "data.val_steps=1"]
# a language-model preset: its model at a CPU size (the sweep's own model choice is Hydra's)
TINY_LM = ["model=llama_tiny", "data.seq_len=32", "data.val_sequences=2", "data.max_mb=1"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_run_dir(d: Path, wandb: bool = True) -> dict:
    rows = read_jsonl(d / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss" in r]
    val_rows = [r for r in rows if "val/acc1" in r]
    assert train_rows and val_rows
    assert METRIC_KEYS <= set(train_rows[-1]), METRIC_KEYS - set(train_rows[-1])
    assert VAL_KEYS <= set(val_rows[-1])
    summary = json.loads((d / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary), SUMMARY_KEYS - set(summary)
    assert (d / ".hydra" / "config.yaml").exists()
    assert (d / "checkpoints" / "last.pt").exists()
    if wandb:
        runs = list((d / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(runs) == 1, runs
    return summary


@pytest.mark.parametrize("preset", group_options("experiment"))
@pytest.mark.slow
def test_every_experiment_preset_runs_two_steps(cfg_factory, preset):
    # experiment=fast and fp8_table compile: minutes on a 2-core CPU. Compile itself is tested on
    # a tiny model (test_speed.py); here the rest of the preset runs eagerly.
    eager = ["model.compile=false"]
    data = cfg_factory(f"experiment={preset}").data.name
    shrink = {"synthetic": TINY_SYNTHETIC, "text": TINY_LM}.get(data, [])
    cfg = cfg_factory(f"experiment={preset}", *TINY, *eager, *shrink)
    run.run(cfg)
    d = Path(cfg.run_dir)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2


@pytest.mark.slow
def test_default_run_meets_the_contract(tmp_path):
    """`python train.py` as a new user runs it: real data, W&B offline, val top-1 >= 0.95."""
    proc = run_train([f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = check_run_dir(tmp_path)
    assert summary["status"] == "completed" and summary["precision"] == "fp32"
    assert summary["val_acc1"] >= 0.95
    assert summary["samples_per_s"] > 0 and summary["peak_mem_gib"] > 0
    assert summary["effective_batch"] == summary["batch"] * summary["accum"]
    assert "precision=fp32: autocast off, GradScaler off, TF32 off" in proc.stdout + proc.stderr


def test_a_wandb_failure_never_stops_training(cfg_factory, monkeypatch):
    import wandb

    def broken_init(*a, **k):
        raise ConnectionError("W&B is down")

    monkeypatch.setattr(wandb, "init", broken_init)
    cfg = cfg_factory("logger=wandb", "trainer.max_steps=3")
    with pytest.warns(RuntimeWarning, match="W&B init failed .*W&B is down"):
        run.run(cfg)
    d = Path(cfg.run_dir)
    assert json.loads((d / "summary.json").read_text())["status"] == "completed"
    assert len(read_jsonl(d / "metrics.jsonl")) >= 3


def test_report_table_has_ratios_to_fp32(tmp_path):
    from mixprec.report import report

    runs = [
        {
            "precision": "fp32",
            "status": "completed",
            "samples_per_s": 100.0,
            "peak_mem_gib": 20.0,
            "max_batch": 288,
        },
        {
            "precision": "amp",
            "status": "completed",
            "samples_per_s": 250.0,
            "peak_mem_gib": 10.0,
            "max_batch": 560,
        },
        {"precision": "bf16", "status": "failed"},
    ]
    t = report.build_table(runs)
    assert t[1]["speedup_vs_fp32"] == 2.5 and t[1]["mem_saving_vs_fp32"] == 0.5
    assert t[1]["max_batch_vs_fp32"] == pytest.approx(560 / 288)
    assert t[2]["status"] == "failed" and t[2]["speedup_vs_fp32"] is None


@pytest.mark.slow
def test_mfu_is_reported_when_the_peak_is_known(cfg_factory):
    cfg = cfg_factory("+hardware.peak_tflops.fp32=0.5", "trainer.max_steps=12")
    summary = run.run(cfg)
    rows = [r for r in read_jsonl(Path(cfg.run_dir) / "metrics.jsonl") if "perf/mfu" in r]
    assert 0 < summary["mfu"] < 1 and rows and all(0 < r["perf/mfu"] < 1 for r in rows)
    assert (
        run.run(cfg_factory("trainer.max_steps=2", "run_dir=" + str(Path(cfg.run_dir) / "x")))[
            "mfu"
        ]
        is None
    )


def test_report_pools_seeds():
    from mixprec.report import report

    runs = [
        {
            "run": f"precision={p},seed={s}",
            "status": "completed",
            "val_acc1": a,
            "samples_per_s": 10.0 + s,
        }
        for p, accs in (("fp32", (0.9, 0.92, 0.94)), ("bf16", (0.8, 0.9, 1.0)))
        for s, a in enumerate(accs)
    ]
    pooled = {g["config"]: g for g in report.seed_groups(runs)}
    assert pooled["precision=fp32"]["n"] == 3
    assert pooled["precision=fp32"]["val_acc1"] == pytest.approx((0.92, 0.02))
    assert pooled["precision=bf16"]["val_acc1"] == pytest.approx((0.9, 0.1))


@pytest.mark.slow
def test_an_in_process_sweeps_next_job_builds_without_the_last_jobs_model(cfg_factory, monkeypatch):
    """A finished job's model and optimizer sit in reference cycles; the next job of the same
    process must not build and train beside them (on a GPU their memory was in its peak)."""
    import weakref

    from mixprec.run import build

    alive, made = [], []
    real = build.build

    def spy(*args, **kwargs):
        alive.append([r() is not None for r in made])  # the earlier jobs' objects, as this builds
        parts = real(*args, **kwargs)
        made.extend([weakref.ref(parts.learner.model), weakref.ref(parts.learner.optimizer)])
        return parts

    monkeypatch.setattr(build, "build", spy)
    for _ in range(2):
        run.run(cfg_factory("trainer.max_steps=2"))
    assert alive == [[], [False, False]]


def test_every_log_line_has_an_eta_so_a_log_without_a_terminal_has_one(cfg_factory, caplog):
    """Issue 93, item 7: the progress bar (and its ETA) shows only in a terminal; a log file
    or a scheduler's output had none. Each step line says the time left at its window's pace."""
    from mixprec.training.ledger import eta

    assert eta(100, 1234.0) == " eta 2m03s" and eta(10_000, 900.0) == " eta 2h30m"
    assert eta(0, 50.0) == "" and eta(5, float("nan")) == ""
    caplog.set_level("INFO")
    run.run(cfg_factory("trainer.max_steps=8", "trainer.log_every=2"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines and all(" eta " in line for line in lines[:-1]), lines
    assert " eta " not in lines[-1]  # the last step: nothing left


def test_the_console_prefix_is_the_time_and_a_warning_says_so():
    """Issue 93, item 7: Hydra's prefix (date, the logger's dotted name, the level: about 50
    columns) wrapped every step line; the console keeps the time, and the level where it is a
    warning or an error (train.log keeps the full prefix)."""
    import logging

    from mixprec.core.launch import ConsoleFormatter

    f = ConsoleFormatter()

    def line(level: int, msg: str) -> str:
        record = logging.LogRecord("mixprec.training.ledger", level, __file__, 1, msg, None, None)
        return f.format(record)

    info, warn = line(logging.INFO, "step 2/4 loss 2.3"), line(logging.WARNING, "train longer")
    assert info.endswith("] step 2/4 loss 2.3") and len(info) == len("[21:19:55] step 2/4 loss 2.3")
    assert warn.endswith("] WARNING: train longer") and "mixprec.training" not in warn

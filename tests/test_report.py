"""The sweep report (table, CSV, plots; failed jobs included), the Optuna preset, and the seeds'
diagnostics."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.diagnostics import audit as diagnose
from mixprec.precision import base as precision
from mixprec.report import plots as report_plots
from mixprec.report import report

from conftest import group, run_module, run_train

CPU = torch.device("cpu")


def rows(sweep: Path) -> list[dict]:
    with open(sweep / "report.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_multirun_writes_the_report_and_the_cli_reproduces_it(tmp_path):
    proc = run_train(
        [
            "-m",
            "precision=fp32,bf16",
            "trainer.max_steps=12",
            "trainer.perf_warmup_steps=2",
            f"hydra.sweep.dir={tmp_path}",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = rows(tmp_path)
    assert [r["precision"] for r in table] == ["fp32", "bf16"]
    assert all(r["status"] == "completed" for r in table)
    assert float(table[0]["speedup_vs_fp32"]) == 1.0 and float(table[1]["speedup_vs_fp32"]) > 0
    assert (tmp_path / "report_bars.png").stat().st_size > 1000
    assert (tmp_path / "report_curves.png").stat().st_size > 1000
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # the wandb.Table run
    first = (tmp_path / "report.md").read_text()
    (tmp_path / "report.md").unlink()
    cli = run_module("mixprec.report", [str(tmp_path), "--no-wandb"])
    assert cli.returncode == 0, cli.stderr
    assert (tmp_path / "report.md").read_text() == first
    assert "precision=bf16" in cli.stdout


@pytest.mark.slow
def test_failed_jobs_are_failed_rows_and_the_sweep_goes_on(tmp_path):
    proc = run_train(
        ["-m", "batch=0,16", "trainer.max_steps=2", "logger=none", f"hydra.sweep.dir={tmp_path}"]
    )
    assert proc.returncode == 2  # the first failed job's exit code, once every job has run
    table = {r["run"]: r for r in rows(tmp_path)}
    assert table["batch=0"]["status"] == "failed"
    assert "batch=0 is not allowed" in table["batch=0"]["error"]
    assert table["batch=16"]["status"] == "completed"
    assert "batch=0 is not allowed" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_report_of_bare_dirs_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no run directories"):
        report.write([tmp_path], to_sinks=False)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)  # 5 output channels: not tensor-core aligned
        self.fc = nn.Linear(5 * 4 * 4, 16)

    def forward(self, x):
        return self.fc(torch.flatten(self.conv(x), 1))


def amp_of(name, dtype=None):
    return precision.build(group("precision", name), group("scaler"), CPU)


def test_dtype_audit_and_alignment_on_a_tiny_model():
    model, x = Tiny(), torch.randn(2, 3, 4, 4)
    res = diagnose.audit(model, x, amp_of("bf16", "bfloat16").autocast)
    dt = {m["module"]: m["dtype"] for m in res["modules"]}
    assert dt == {"conv": "bfloat16", "fc": "bfloat16"}
    conv_flops = 2 * 2 * 5 * 4 * 4 * 3 * 3 * 3  # 2*N*Cout*H*W*Cin*k*k (hand count)
    fc_flops = 2 * 2 * 80 * 16
    assert res["total_forward_flops"] == conv_flops + fc_flops
    assert res["low_precision_share"] == pytest.approx(1.0)
    (mis,) = res["misaligned"]  # conv: in 3 and out 5; fc is 80 -> 16, aligned
    assert mis["module"] == "conv" and mis["not_multiple_of_8"] == "in,out"
    assert mis["share"] == pytest.approx(conv_flops / (conv_flops + fc_flops))
    fp32 = diagnose.audit(model, x, amp_of("fp32").autocast)
    assert fp32["low_precision_share"] == 0.0
    assert "tensor-core alignment" in diagnose.markdown(res, "bf16")


def test_grad_histograms_see_true_not_scaled_gradients():
    from mixprec.training import loop

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    nn.functional.cross_entropy(model(x), y).backward()
    true_max = max(p.grad.abs().max().item() for p in model.parameters())
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amp = precision.build(group("precision", "amp"), group("scaler", init_scale=65536.0), CPU)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    out = loop.train_step(
        loop.Learner(model, opt, sched, amp), [(x, y)], want_grad_norm=True, want_grads=True
    )
    assert out.grads.abs().max().item() == pytest.approx(true_max, rel=0.05)  # unscaled
    assert out.grads.numel() == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_grad_histograms_are_taken_on_logged_steps_at_their_real_step(cfg_factory):
    """diagnose=true: one histogram per logged step, at that step's number (never a skipped
    step's inf/nan gradients), continuing from the checkpoint's step after a resume."""
    from mixprec.run import session as run

    args = [
        "hardware=cpu",
        "diagnose=true",
        "logger=none",
        "precision=amp",
        "trainer.log_every=4",
        "scaler.init_scale=1e12",
    ]  # the first steps overflow
    first = cfg_factory(*args, "trainer.max_steps=8", small=False)
    run.run(first)
    out = run.run(
        cfg_factory(
            *args, "trainer.max_steps=12", "resume=auto", f"run_dir={first.run_dir}", small=False
        )
    )
    rows = [json.loads(r) for r in (Path(first.run_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows if "train/loss" in r]
    hist = [r for r in rows if "grad/abs_max" in r]
    assert [r["step"] for r in hist] == logged == [4, 8, 12]
    assert all(math.isfinite(r["grad/abs_max"]) for r in hist)
    assert out["skipped_steps"] > 0


def test_loss_scale_plot(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "amp/loss_scale": 2.0 ** (16 - s)}) + "\n" for s in range(1, 5)
        )
    )
    assert report_plots.loss_scale_plot(tmp_path).stat().st_size > 1000


@pytest.mark.slow
def test_diagnose_cli_prints_the_audit():
    proc = run_module("mixprec.diagnose", ["precision=bf16", "hardware=cpu"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "## dtype audit (bf16)" in proc.stdout and "features.0" in proc.stdout


@pytest.mark.slow
def test_a_sweep_rerun_into_its_own_dir_fails_rather_than_reports_old_results(tmp_path):
    args = [
        "-m",
        "precision=fp32",
        "trainer.max_steps=2",
        "logger=none",
        f"hydra.sweep.dir={tmp_path}",
    ]
    assert run_train(args).returncode == 0
    again = run_train(args)
    assert again.returncode == 2, again.stderr[-2000:]  # refused: the dir holds a run
    assert "already holds a run" in again.stdout + again.stderr


def test_a_job_that_wrote_no_summary_is_a_failed_row(tmp_path):
    from mixprec.sinks import local

    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / ".hydra" / "config.yaml").write_text("precision: {name: bf16}\nbatch: 4\n")
    s = local.read(tmp_path / "0")
    assert (s["status"], s["precision"], s["batch"]) == ("failed", "bf16", 4)
    assert "no summary.json" in s["error"]


def test_the_report_stacks_each_runs_measured_peak_into_its_parts(tmp_path):
    """Runs with debug.memory's breakdown get a table and report_memory.png (a stacked bar per
    run); the parts in the table are the summaries' own numbers."""
    import json

    from mixprec.report import report
    from mixprec.sinks import local

    parts = {"weights": 3.26, "optimizer_state": 6.52, "inputs_and_buffers": 0.07}
    parts |= {"activations": 6.57, "autocast_copies": 0.0, "gradients": 0.26, "temporaries": 0.0}
    for i, (prec, act) in enumerate((("bf16", 6.57), ("fp32", 25.51))):
        run = tmp_path / str(i)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(f"- precision={prec}\n")
        b = {**parts, "activations": act, "reserve": 0.7, "phase": "backward", "step": 3}
        b["peak"] = sum(v for k, v in b.items() if k in parts)
        summary = local.make(status="completed", precision=prec, memory_breakdown=b)
        (run / "summary.json").write_text(json.dumps(summary))
    out = report.write([tmp_path], tmp_path / "report", to_sinks=False, echo=False)
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Where the peak goes" in text
    assert "| precision=fp32 | 35.62 | 3.26 | 6.52 | 0.07 | 25.51 |" in text
    assert tmp_path / "report" / "report_memory.png" in out["files"]


def test_the_curves_draw_only_what_some_run_logged():
    """A language model's sweep (no GradScaler, no top-1): train and validation loss, no empty
    panel; a classifier's amp sweep: its loss scale and top-1 too."""
    from mixprec.report.plots import curve_panels

    def run(precision, scale=None, **logged):
        rows = [
            {"step": s, "train/loss": 2.0 / s, **{k: v / s for k, v in logged.items()}}
            for s in (10, 20)
        ]
        if scale:
            rows = [{**r, "amp/loss_scale": scale} for r in rows]
        return {"run": precision, "precision": precision, "loss_scale": scale, "curves": rows}

    lm = [run("fp32", **{"val/loss": 3.0}), run("bf16", **{"val/loss": 3.0})]
    assert [k for k, _ in curve_panels(lm)] == ["train/loss", "val/loss"]
    vision = [run("fp32", **{"val/acc1": 0.5}), run("amp", 65536.0, **{"val/acc1": 0.5})]
    assert [k for k, _ in curve_panels(vision)] == ["train/loss", "amp/loss_scale", "val/acc1"]


def test_the_sweep_plots_tell_runs_apart_keep_bars_above_0_and_draw_loss_against_time():
    """Issue 93, item 3: one colour per precision hid a precision's seeds and batch sizes
    behind each other; report_bars.png's error bar went below 0 samples/s; there was no loss
    against time outside studies."""
    from mixprec.report.plots import bar_errors, curve_panels, styles

    runs = [{"run": f"{p},seed={s}", "precision": p} for p in ("fp32", "bf16") for s in range(3)]
    got = styles(runs)
    assert len(set(got)) == 6  # no two runs drawn alike
    assert len({c for c, _, _ in got[:3]}) == 1 and len({c for c, _, _ in got[3:]}) == 1
    assert len({(line, mark) for _, line, mark in got[:3]}) == 3
    below, above = bar_errors([100.0, 50.0], [1.5, 0.1])  # a spread of 150 %: not to -50
    assert below == [100.0, 5.0] and above == [150.0, 5.0]
    timed = [
        {
            "run": "bf16",
            "precision": "bf16",
            "loss_scale": None,
            "curves": [
                {"step": s, "train/loss": 1.0 / s, "val/loss": 2.0 / s, "time/train_s": 0.5 * s}
                for s in (10, 20)
            ],
        }
    ]
    assert curve_panels(timed)[-1] == ("val/loss@time", "val loss against training seconds")

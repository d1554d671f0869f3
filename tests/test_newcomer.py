"""What a newcomer meets on a machine without a GPU, driven as they would drive it (train.py and
make in subprocesses): a refused run writes nothing, a GPU-sized sweep stops once before any
job, an Optuna study whose trials fail ends with a message rather than a traceback, and the GPU
make targets say at once that they need a GPU."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_module, run_train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "bad", ["batch=0", "+trainer.max_step=3", "needs_gpu=true model=resnet18 data=synthetic"]
)
def test_a_refused_run_writes_nothing(tmp_path, bad):
    run_dir = tmp_path / "run"
    proc = run_train([*bad.split(), "logger=none", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "config error" in proc.stdout + proc.stderr
    assert not run_dir.exists()  # no .hydra/, train.log or .lock left behind


def test_a_run_refused_from_a_finished_dir_leaves_its_files_as_they_were(tmp_path):
    args = ["logger=none", "trainer.max_steps=3", f"hydra.run.dir={tmp_path}"]
    assert run_train(args).returncode == 0
    before = {p: (tmp_path / p).read_text() for p in (".hydra/overrides.yaml", "train.log")}
    refused = run_train([*args, "batch=32"])  # a new run into a dir that holds one
    assert refused.returncode == 2 and "already holds a run" in refused.stdout + refused.stderr
    after = {p: (tmp_path / p).read_text() for p in before}
    assert after == before  # the report still labels the run that ran, with its own log
    assert "batch=32" not in after[".hydra/overrides.yaml"]


def test_a_gpu_sized_sweep_on_a_cpu_stops_once_before_any_job(tmp_path):
    t0 = time.monotonic()
    proc = run_train(["experiment=seed_table", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and out.count("config error") == 1, out[-3000:]
    assert "needs_gpu=false hardware=cpu" in out  # what to try instead
    assert not (tmp_path / "sweep").exists() and time.monotonic() - t0 < 60


def test_an_optuna_study_whose_trials_all_fail_ends_with_a_message(tmp_path):
    """Each trial is refused (too few steps to time samples/s): failed trials, then one clear
    line and the trials' exit code; no Optuna traceback."""
    sweep = tmp_path / "sweep"
    proc = run_train(
        [
            "experiment=optuna_throughput",
            "trainer.max_steps=12",
            "hydra.sweeper.n_trials=2",
            "logger=none",
            f"hydra.sweep.dir={sweep}",
        ]
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "no trial of the study completed" in out
    assert "leaves 2 timed steps; it needs at least 10" in out
    assert (sweep / "report.md").exists()
    jobs = sorted(d for d in sweep.iterdir() if (d / "summary.json").exists())
    assert [json.loads((d / "summary.json").read_text())["exit_code"] for d in jobs] == [2, 2]


GPU_TARGETS = [
    "bench",
    "bench-memory",
    "bench-loader",
    "bench-profile",
    "bench-fast",
    "bench-scaling",
    "bench-prepared",
    "test-gpu",
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
@pytest.mark.parametrize(
    "target, nodes, why",
    [
        *[(t, None, None) for t in GPU_TARGETS],
        ("test-gpu", "/dev/null", "torch.cuda.is_available() is False"),  # a node: torch decides
    ],
)
def test_the_gpu_make_targets_say_at_once_that_they_need_a_gpu(target, nodes, why):
    if why is None:  # the Makefile's own nodes: without one it stops before importing torch
        own = re.search(r"^GPU_NODES \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)
        node = any(Path(n).exists() for n in own.group(1).split())
        why = "torch.cuda.is_available() is False" if node else f"none of {own.group(1)}"
    t0 = time.monotonic()
    proc = subprocess.run(
        ["make", "-s", target, *([f"GPU_NODES={nodes}"] if nodes else [])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "needs a CUDA GPU" in out and why in out, out[-2000:]
    assert "Traceback" not in out and time.monotonic() - t0 < 60
    assert not list(Path("/tmp").glob("mixprec-prepared-*"))  # nothing left behind


def test_a_step_schedule_that_never_steps_says_so(cfg_factory, caplog):
    from mixprec.run import session as run

    caplog.set_level("WARNING")
    run.run(cfg_factory("scheduler=step", "trainer.max_steps=20"))  # step_size 1000 > 20 steps
    assert "the learning rate never steps down" in caplog.text


def test_a_resumed_runs_wall_time_counts_its_earlier_part(cfg_factory):
    from mixprec.run import session as run

    first = cfg_factory("trainer.max_steps=40", "trainer.log_every=10")
    run.run(first)
    earlier = torch.load(Path(first.run_dir) / "checkpoints" / "last.pt", weights_only=True)[
        "state"
    ]["elapsed_s"]
    resumed = run.run(
        cfg_factory("trainer.max_steps=42", "resume=auto", f"run_dir={first.run_dir}")
    )
    assert earlier > 0 and resumed["wall_s"] > earlier


def test_report_cells_are_escaped_and_several_run_dirs_get_a_report_dir_of_their_own(tmp_path):
    from mixprec.report import report

    cell = report.markdown(
        [
            {
                **{c: None for c in report.COLUMNS},
                "run": "a|b",
                "status": "failed",
                "error": "<b>bad</b> | worse",
            }
        ]
    )
    assert "a\\|b" in cell and "&lt;b&gt;bad&lt;/b&gt; \\| worse" in cell
    runs = []
    for name in ("one", "two"):
        d = tmp_path / name
        assert (
            run_train(["trainer.max_steps=2", "logger=none", f"hydra.run.dir={d}"]).returncode == 0
        )
        runs.append(str(d))
    proc = run_module("mixprec.report", [*runs, "--no-wandb"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.glob("outputs/reports/*/report.md"))
    assert not any((tmp_path / n / "report.md").exists() for n in ("one", "two"))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["precision=fp8", "model=vit_small", "data=synthetic"], "float8 tensor cores"),
        (["precision=fp16"], "Could not find 'precision/fp16'"),
    ],
)
def test_the_diagnose_cli_gives_config_errors_as_train_py_does(args, needle):
    if torch.cuda.is_available() and "fp8" in args[0]:
        pytest.skip("a GPU may run fp8")
    proc = run_module("mixprec.diagnose", args)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_help_shows_the_defaults_the_config_has():
    proc = run_train(["--help"])
    assert "trainer.clip_grad_norm=None (null: off)" in proc.stdout  # not an example value
    assert "batch=64" in proc.stdout and "logger=wandb|tensorboard|none" in proc.stdout


def test_the_report_says_how_much_each_rate_moved_and_when_a_ratio_is_noise():
    from mixprec.report import report
    from mixprec.report.runs import spread

    def run_row(name: str, precision: str, windows: list[float]) -> dict:
        curves = [{"step": i, "perf/samples_per_s": w} for i, w in enumerate([1.0, *windows])]
        return {
            "run": name,
            "precision": precision,
            "status": "completed",
            "batch": 64,
            "samples_per_s": sum(windows) / len(windows),
            "curves": curves,
            "samples_per_s_spread": spread(curves),
            "device": "cpu",
            "memory": "process RSS",
            "overrides": [f"precision={precision}"],
        }

    steady = run_row("fp32", "fp32", [100.0, 101.0, 99.0, 100.0])
    noisy = run_row("bf16", "bf16", [60.0, 180.0, 90.0, 150.0])  # 1.2x, but it moves by ±50 %
    table = report.build_table([steady, noisy])
    assert spread(steady["curves"]) < 0.01  # the first (warm-up) window is left out
    assert table[1]["speedup_vs_fp32"] == pytest.approx(1.2)
    assert table[1]["speedup_resolved"] is None  # one run each: not yet resolved
    assert table[0]["speedup_resolved"] is None  # the baseline is not compared with itself
    text = report.notes([{**r, **t} for r, t in zip([steady, noisy], table)]) + report.markdown(
        table
    )
    assert "ran on a CPU" in text and "process RSS" in text
    assert "1.2 (unresolved)" in text and "seed=0,1,2" in text  # said in its own cell
    assert "mfu" not in text.split("\n|")[1]  # a column empty in every row is not shown


def test_a_sweep_prints_its_table_once_and_ends_with_its_result(tmp_path):
    proc = run_train(
        [
            "-m",
            "precision=fp32,bf16",
            "trainer.max_steps=2",
            "logger=wandb",
            f"hydra.sweep.dir={tmp_path}",
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = proc.stdout + proc.stderr
    header = [line for line in out.splitlines() if line.startswith("run ") and "status" in line]
    assert len(header) == 1  # the table once, when the sweep ends (not after every job)
    assert not any(line.startswith("wandb:") for line in out.splitlines())  # W&B is quiet
    last = out.strip().splitlines()[-1]
    assert last.startswith("wrote "), out[-3000:]  # the report is the last word


def test_a_speedup_is_resolved_against_how_much_repeated_runs_differ():
    """Three seeds of each: tf32 on a CPU (a no-op) at fp32's rate within the runs' spread is
    `no`, bf16 at twice it `yes`; a configuration run once stays not yet resolved, however
    steady its own windows."""
    from mixprec.report import report

    def run_row(precision: str, seed: int, rate: float) -> dict:
        return {
            "run": f"precision={precision},seed={seed}",
            "precision": precision,
            "status": "completed",
            "batch": 64,
            "samples_per_s": rate,
            "samples_per_s_spread": 0.001,  # steady windows: they do not decide
            "overrides": [f"precision={precision}", f"seed={seed}"],
        }

    runs = [run_row("fp32", k, r) for k, r in enumerate((100.0, 112.0, 95.0))]
    runs += [run_row("tf32", k, r) for k, r in enumerate((118.0, 101.0, 108.0))]
    runs += [run_row("bf16", k, r) for k, r in enumerate((205.0, 198.0, 210.0))]
    runs += [run_row("amp", 0, 150.0)]
    table = {(t["precision"], t["run"][-1]): t for t in report.build_table(runs)}
    assert table[("tf32", "0")]["speedup_resolved"] is False
    assert table[("bf16", "1")]["speedup_resolved"] is True
    assert table[("amp", "0")]["speedup_resolved"] is None
    assert table[("fp32", "0")]["speedup_resolved"] is None
    # report.md says it in the speed-up's own cell (issue 93, item 3): bold, or marked
    text = report.markdown(list(table.values()))
    assert "speedup_resolved" not in text.splitlines()[0]
    cells = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()[2:]}
    assert (
        "**" in cells["precision=bf16,seed=1"]
        and "(no difference)" in cells["precision=tf32,seed=0"]
    )
    assert (
        "(unresolved)" in cells["precision=amp,seed=0"]
        and "(unresolved)" not in cells["precision=fp32,seed=0"]
    )


def test_every_key_has_its_meaning_one_command_away_without_torch():
    """Issue 93, item 6: `python train.py --help` took 6-12 s and showed a dozen keys; what each
    meant lived in config.py. `python -m mixprec.keys` reads the YAML files' own comments."""
    import subprocess
    import sys

    code = (
        "import sys, mixprec.keys as k; print(k.show(['trainer'])); "
        "print(k.show(['data=text'])); print('torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = p.stdout.splitlines()
    assert lines[-1] == "False", p.stdout  # nothing composed, torch not imported
    said = {line.split()[0]: line for line in lines[:-1]}
    assert "run exactly this many optimizer steps" in said["trainer.max_steps=null"]
    assert said["trainer:"] and "data.seq_len=128" in said
    bad = subprocess.run(
        [sys.executable, "-m", "mixprec.keys", "data=nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "the options of data: cifar10" in bad.stderr


@pytest.mark.slow
def test_smoke_on_runs_two_steps_of_any_preset_and_keeps_nothing_beside_its_dir(tmp_path):
    """Issue 93, item 6: a one-flag smoke run (as lightning-hydra-template's debug=fdr), after a
    preset: two steps, no logger, no checkpoint, in a dir of its own."""
    run_dir = tmp_path / "smoke"
    p = run_train(
        ["model=resnet18", "data.shape=[3,32,32]", "data=synthetic", "hardware=cpu"]
        + ["smoke=on", f"hydra.run.dir={run_dir}"]
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "wandb").exists()

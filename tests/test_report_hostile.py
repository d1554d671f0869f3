"""The study and the report as a hostile round met them (issue 66, items 5-10): every file
written whole or not at all and named when it cannot be; a job that raises still leaves a study
and plots; copied or foreign runs are left out, named; broken files are named, not tracebacks;
bad flags are exit 2; names from runs are escaped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mixprec.report import quality, report
from mixprec.sinks import local

from conftest import ROOT, fill, run_module, run_train


def fake_run(run: Path, precision: str, seed: int, speed: float = 1.0) -> Path:
    """A finished job as a study sweep leaves it: its config, overrides, summary and metrics
    (val loss 1 + 4 / sqrt(step): `speed` the steps per training second)."""
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(
        f"precision: {{name: {json.dumps(precision)}}}\nseed: {seed}\nbatch: 8\n"
    )
    (run / ".hydra" / "overrides.yaml").write_text(
        f"- precision={json.dumps(precision)}\n- seed={seed}\n"
    )
    summary = local.make(status="completed", precision=precision, seed=seed, tokens_per_s=1e3)
    (run / "summary.json").write_text(json.dumps(summary))
    rows = [
        {"step": s, "time/train_s": s / speed, "val/loss": 1 + 4 / s**0.5 + 0.001 * seed}
        for s in range(10, 101, 10)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def fake_sweep(d: Path, precisions=("fp32", "bf16"), seeds=(0, 1, 2)) -> Path:
    jobs = [(p, s) for p in precisions for s in seeds]
    for i, (p, s) in enumerate(jobs):
        fake_run(d / str(i), p, s, speed=1.0 if p == precisions[0] else 1.5)
    return d


def test_a_copied_job_and_a_foreign_summary_are_left_out_and_named(tmp_path):
    sweep = fake_sweep(tmp_path / "sweep")
    seeds = {r.precision: r.seeds for r in quality.write(sweep, "fp32")["rows"]}
    assert seeds == {"fp32": 3, "bf16": 3}
    shutil.copytree(sweep / "1", sweep / "9")  # a copied job dir
    shutil.copy(sweep / "0" / "summary.json", sweep / "5" / "summary.json")  # bf16 seed 2's
    result = quality.write(sweep, "fp32")
    assert {r.precision: r.seeds for r in result["rows"]} == {"fp32": 3, "bf16": 2}
    text = (sweep / "study.md").read_text()
    assert "9: fp32 seed 1 again (read from 1: a copy?)" in text
    assert "5: its summary.json is another run's (precision fp32, seed 0" in text
    assert json.loads((sweep / "study.json").read_text())["left_out"] == result["left_out"]


def test_files_that_are_not_what_a_run_writes_are_named_not_tracebacks(tmp_path):
    sweep = fake_sweep(tmp_path / "sweep")
    (sweep / "0" / "summary.json").write_text("[1, 2]")  # a summary that is a list
    (sweep / "1" / ".hydra" / "config.yaml").write_text("{{{: not yaml")
    (sweep / "2" / ".hydra" / "config.yaml").unlink()
    with (sweep / "3" / "metrics.jsonl").open("a") as f:
        f.write('[1, 2]\n{"val/loss": 0.5}\n{"step": "x", "val/loss": 0.4}\n')
    done = run_module("mixprec.study", [sweep, "--reference", "fp32"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    text = (sweep / "study.md").read_text()
    assert "1: its .hydra/config.yaml is missing or not a config" in text
    assert "2: its .hydra/config.yaml is missing or not a config" in text
    assert "not a row with a step" in done.stderr  # job 3's odd rows, skipped
    reported = run_module("mixprec.report", [sweep, "--no-wandb"])
    assert reported.returncode == 0 and "Traceback" not in reported.stderr, reported.stderr
    assert "holds a list, not a summary" in (sweep / "report.md").read_text()
    listed = run_module("mixprec.diagnose", [sweep / "0"])
    assert listed.returncode == 2 and "not a mixprec summary" in listed.stderr


def test_diagnose_shows_what_it_can_of_old_or_partial_rows(tmp_path):
    from mixprec.diagnose import shown_run

    run = fake_run(tmp_path / "run", "amp", 0)
    s = json.loads((run / "summary.json").read_text())
    s["dtype_plan"] = {"weights": "float32"}  # an older, partial plan
    s["doctor"] = [{"step": 3, "max_abs_in": "big"}]
    (run / "summary.json").write_text(json.dumps(s))
    whole = {"layer": "fc", "type": "Linear", "format": "float16", "tensor": "input"}
    whole |= {"amax": 2.0, "underflow": 0.1, "subnormal": 0.0, "saturated": 0.0, "sqnr_db": 40}
    rows = [{"step": 2, "layer": "fc"}, {"step": 2, **whole}, {"step": 4, **whole, "amax": None}]
    (run / "numerics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shown = shown_run(run)
    assert "The dtype plan in summary.json cannot be shown" in shown
    assert "The doctor findings in summary.json cannot be shown" in shown
    assert "The worst of 1 casts at step 2" in shown


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--budget", "0"], "--budget"),
        (["--budget", "-5"], "--budget"),
        (["--fit-from", "0"], "--fit-from"),
        (["--target", "-1"], "--target"),
        (["--target", "nan"], "--target"),
    ],
)
def test_the_study_refuses_a_bad_flag_naming_it(tmp_path, args, flag):
    sweep = fake_sweep(tmp_path / "sweep", seeds=(0,))
    p = run_module("mixprec.study", [sweep, *args])
    assert p.returncode == 2 and f"argument {flag}" in p.stderr, p.stderr
    assert not (sweep / "study.md").exists()


def test_a_missing_dir_is_exit_2_for_the_study_and_the_report(tmp_path):
    for module in ("mixprec.study", "mixprec.report"):
        p = run_module(module, [tmp_path / "nope"])
        assert p.returncode == 2 and "nope" in p.stderr, (module, p.stderr)


def test_names_holding_html_or_a_pipe_are_escaped_in_both_tables(tmp_path):
    sweep = fake_sweep(tmp_path / "sweep", precisions=("fp32", "bf16|<b>x</b>"), seeds=(0, 1))
    quality.write(sweep, "fp32")
    report.write([sweep], to_sinks=False, plots=False, echo=False)
    for name in ("study.md", "report.md"):
        text = (sweep / name).read_text()
        assert "<b>" not in text, name
        assert "bf16\\|&lt;b&gt;x&lt;/b&gt;" in text, name
        for table in text.split("\n\n"):  # each table's rows have its header's columns
            rows = [line for line in table.splitlines() if line.startswith("| ")]
            assert len({r.count(" | ") for r in rows}) <= 1, table


def test_a_full_disk_keeps_the_previous_study_and_report_whole_and_names_the_file(small_disk):
    sweep = fake_sweep(small_disk / "sweep")
    assert run_module("mixprec.study", [sweep, "--reference", "fp32"]).returncode == 0
    assert run_module("mixprec.report", [sweep, "--no-wandb"]).returncode == 0
    names = ["study.md", "study.json", "study.png", "report.md", "report.csv", "report_bars.png"]
    before = {n: (sweep / n).read_bytes() for n in names}
    fill(small_disk, 4_000)  # room for a markdown file, not for the three of a study
    p = run_module("mixprec.study", [sweep, "--reference", "fp32", "--target", "1.5"])
    assert p.returncode == 8 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "no space left to write" in p.stderr and "/_ " not in p.stderr
    assert any(f"sweep/{n}" in p.stderr for n in names[:3]), p.stderr
    p = run_module("mixprec.report", [sweep, "--no-wandb"])
    assert p.returncode == 8 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert {n: (sweep / n).read_bytes() for n in names} == before
    assert not [f.name for f in sweep.iterdir() if f.name.endswith(".tmp")]


def test_a_study_json_that_cannot_be_replaced_leaves_the_pair_as_it_was(tmp_path, read_only):
    sweep = fake_sweep(tmp_path / "sweep")
    quality.write(sweep, "fp32")
    before = {n: (sweep / n).read_bytes() for n in ("study.md", "study.json", "study.png")}
    read_only(sweep / "study.json")
    p = run_module("mixprec.study", [sweep, "--reference", "fp32", "--target", "1.5"])
    assert p.returncode == 9 and "study.json" in p.stderr, p.stderr[-2000:]
    assert {n: (sweep / n).read_bytes() for n in before} == before
    assert not [f.name for f in sweep.iterdir() if f.name.endswith(".tmp")]


def test_ctrl_c_while_the_sweep_writes_its_study_is_one_line_and_exit_130(
    tmp_path, monkeypatch, caplog
):
    from mixprec.report import sweep as sweep_cb

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_cb.quality, "write", interrupted)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "study": {}})
    config.study.reference = "fp32"
    with pytest.raises(SystemExit) as e:
        sweep_cb.ReportCallback().on_multirun_end(config)
    assert e.value.code == 130
    assert f"python -m mixprec.study {tmp_path}" in caplog.text


@pytest.mark.slow
def test_a_job_that_raises_leaves_the_others_the_study_and_the_plots(tmp_path):
    p = run_train(
        [
            "experiment=quality_cpu",
            "seed=0,1",
            "model=own",
            "model.target=own_models:CrashingLM",
            f"model.path={ROOT / 'tests' / 'plugins'}",
            "trainer.max_steps=10",
            "trainer.val_every=5",
            "study.budget=5",
            "batch=4",
            "data.seq_len=16",
            "data.val_sequences=8",
            "logger=none",
            f"hydra.sweep.dir={tmp_path}",
        ]
    )
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]
    assert "a bug in the user's model" in out
    assert (tmp_path / "study.json").is_file() and (tmp_path / "report_bars.png").is_file()
    jobs = sorted(d for d in tmp_path.iterdir() if (d / ".hydra").is_dir())
    failed = [r for r in report.read_runs(jobs) if r["status"] != "completed"]
    assert len(failed) == 2  # seed 1 of each precision
    assert all("RuntimeError: a bug in the user's model" in r["error"] for r in failed)


def rewrite_rows(run: Path, change) -> None:
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    change(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize(
    "damage,counted,said",
    [
        ("nan-mid-curve", 3, None),
        ("negative-time", 2, "1: its time/train_s goes below 0 or backwards"),
        ("metrics-a-folder", 2, "1: its metrics.jsonl is not a file"),
        ("metrics-to-dev-zero", 2, "1: its metrics.jsonl is not a file"),
    ],
)
def test_a_damaged_run_is_left_out_and_named_or_read_around_never_a_traceback(
    tmp_path, damage, counted, said
):
    """Issue 90, item 12: a NaN val/loss mid-curve (math.fsum's AttributeError), a negative
    time/train_s (a math domain error), metrics.jsonl a folder (IsADirectoryError) or a link to
    /dev/zero (a read without end): each was a traceback or a hang."""
    sweep = fake_sweep(tmp_path / "sweep")
    run = sweep / "1"  # fp32 seed 1
    if damage == "nan-mid-curve":
        rewrite_rows(run, lambda rows: rows[4].__setitem__("val/loss", float("nan")))
    elif damage == "negative-time":
        rewrite_rows(run, lambda rows: rows[4].__setitem__("time/train_s", -5.0))
    else:
        (run / "metrics.jsonl").unlink()
        if damage == "metrics-a-folder":
            (run / "metrics.jsonl").mkdir()
        else:
            (run / "metrics.jsonl").symlink_to("/dev/zero")
    p = run_module("mixprec.study", [sweep, "--reference", "fp32"], timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    study = json.loads((sweep / "study.json").read_text())
    assert {r["precision"]: r["seeds"] for r in study["rows"]}["fp32"] == counted
    if said:
        assert any(said in why for why in study["left_out"]), study["left_out"]


def test_an_evaluation_at_step_0_and_a_true_loss_are_no_points_of_the_curve(tmp_path):
    """Issue 90, items 8 and 12: `"val/loss": true` was read as a loss of 1.0, and an
    evaluation before any step (time 0) as the curve's first point."""
    sweep = fake_sweep(tmp_path / "sweep")
    before = quality.write(sweep, "fp32")

    def damage(rows):
        rows.insert(0, {"step": 0, "time/train_s": 0.0, "val/loss": 0.5})  # below the target
        rows[3]["val/loss"] = True

    for job in ("1", "4"):
        rewrite_rows(sweep / job, damage)
    after = quality.write(sweep, "fp32")
    assert [s.curve for s in after["seeds"]] != [] and all(
        p.step > 0 and p.loss != 1.0 for s in after["seeds"] for p in s.curve
    )
    assert after["target"] == pytest.approx(before["target"])


@pytest.mark.parametrize(
    "key,value,said",
    [
        ("target", "'abc'", "study.target: 'abc': a finite validation loss > 0"),
        ("target", ".nan", "study.target: 'nan': a finite validation loss > 0"),
        ("budget", "'abc'", "study.budget: 'abc': an optimizer step >= 1"),
        ("fit_from", "'x'", "study.fit_from: 'x': an optimizer step >= 1"),
    ],
)
def test_a_study_setting_a_runs_config_holds_is_checked_as_the_command_lines(
    tmp_path, key, value, said
):
    """Issue 90, items 8 and 12: a string or NaN study.target/budget/fit_from in a run's
    config was taken (a NaN target) or a traceback; it is exit 2 naming the file and the key."""
    sweep = fake_sweep(tmp_path / "sweep")
    for run in sweep.iterdir():
        cfg = run / ".hydra" / "config.yaml"
        cfg.write_text(cfg.read_text() + f"study: {{reference: fp32, {key}: {value}}}\n")
    p = run_module("mixprec.study", [sweep])
    assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (sweep / "study.md").exists()


def test_study_md_says_a_given_target_is_given(tmp_path):
    """Issue 90, item 8: with --target the heading said "its seeds' worst final evaluation"."""
    sweep = fake_sweep(tmp_path / "sweep")
    quality.write(sweep, "fp32", target=1.6)
    heading = (sweep / "study.md").read_text().splitlines()[0]
    assert "target val loss 1.6000: as given" in heading and "worst" not in heading, heading

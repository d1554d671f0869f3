"""docs/failures.md's table of exit codes stays true: every row that names an exit code is driven
here (through run.main, which train.py calls, or train.py itself where Hydra is involved) or by
the named test that drives it end to end, and the code it ends with is the code the row states."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_data import make_folder

from mixprec.core import errors
from mixprec.run import rundir
from mixprec.run import session as run

from conftest import ROOT, run_train

TABLE = ROOT / "docs" / "failures.md"


def rows() -> dict[str, str]:
    """First cell -> exit cell, for every row of the table."""
    out = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("fault", "---"):
            out[cells[0]] = cells[2]
    return out


def code_of(row_start: str) -> int:
    (cell,) = [code for fault, code in rows().items() if fault.startswith(row_start)]
    return int(re.match(r"\d+", cell).group())


def exit_code(cfg) -> int:
    """What train.py exits with for this config (run.main raises SystemExit for a refusal)."""
    try:
        run.main(cfg)
    except SystemExit as e:
        return int(e.code)
    return 0


def finished(cfg_factory, *extra: str):
    cfg = cfg_factory("trainer.max_steps=4", "ckpt.every_steps=2", *extra)
    assert exit_code(cfg) == 0
    return cfg


def bad_value(cfg_factory, tmp_path):
    return exit_code(cfg_factory("batch=0"))


def busy(cfg_factory, tmp_path):
    cfg = cfg_factory("trainer.max_steps=2")
    with rundir.RunDirLock(Path(cfg.run_dir)):
        return exit_code(cfg)


def holds_a_run(cfg_factory, tmp_path):
    cfg = finished(cfg_factory)
    return exit_code(cfg_factory("trainer.max_steps=4", f"run_dir={cfg.run_dir}"))


def non_finite_loss(cfg_factory, tmp_path):
    return exit_code(cfg_factory("optimizer.lr=1e12", "trainer.max_steps=30"))


def non_finite_at_the_end(cfg_factory, tmp_path):
    lr = ("optimizer=sgd", "optimizer.lr=1e6", "trainer.max_steps=5", "trainer.log_every=10")
    return exit_code(cfg_factory(*lr))


def unreadable_image(cfg_factory, tmp_path):
    images = make_folder(tmp_path / "images", n=6)
    (images / "train" / "cat" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    data = ("data=imagenet", f"data.root={images}", "data.image_size=32", "model=digits_cnn")
    return exit_code(cfg_factory(*data, "batch=4", "trainer.max_steps=6"))


def broken_checkpoint(cfg_factory, tmp_path):
    cfg = finished(cfg_factory)
    last = Path(cfg.run_dir) / "checkpoints" / "last.pt"
    last.unlink()
    last.write_bytes(last.parent.joinpath("step_00000004.pt").read_bytes()[:1000])  # truncated
    return exit_code(cfg_factory("trainer.max_steps=8", "resume=auto", f"run_dir={cfg.run_dir}"))


def resume_into_other_data(cfg_factory, tmp_path):
    cfg = finished(cfg_factory)
    again = ("trainer.max_steps=8", "resume=auto", "data.val_fraction=0.3")
    return exit_code(cfg_factory(*again, f"run_dir={cfg.run_dir}"))


def resume_here_with_overwrite(cfg_factory, tmp_path):
    cfg = finished(cfg_factory)
    again = ("trainer.max_steps=8", f"resume={cfg.run_dir}", "overwrite=true")
    return exit_code(cfg_factory(*again, f"run_dir={cfg.run_dir}"))


class Payload:
    def __reduce__(self):
        return (print, ("this ran while loading",))


def code_in_a_checkpoint(cfg_factory, tmp_path):
    evil = tmp_path / "evil.pt"
    evil.write_bytes(b"")
    torch.save({"format": 1, "model": Payload()}, evil)
    return exit_code(cfg_factory("trainer.max_steps=2", f"resume={evil}"))


def resume_auto_on_a_finished_run(cfg_factory, tmp_path):
    cfg = finished(cfg_factory)
    return exit_code(cfg_factory("trainer.max_steps=4", "resume=auto", f"run_dir={cfg.run_dir}"))


def a_bug(cfg_factory, tmp_path):
    """An unexpected exception inside the run: Hydra prints it and the process exits 1."""
    code = (
        "import runpy, sys, mixprec.training.loop as loop\n"
        "def boom(*a, **k): raise RuntimeError('a bug')\n"
        "loop.train = boom\n"
        f"sys.argv = ['train.py', 'logger=none', 'hydra.run.dir={tmp_path / 'bug'}']\n"
        f"runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert "RuntimeError: a bug" in p.stderr
    return p.returncode


DRIVEN_HERE = {
    "a bad value": bad_value,
    "another live process": busy,
    "a run dir that already holds a run": holds_a_run,
    "non-finite loss `debug.max_bad_steps`": non_finite_loss,
    "non-finite weights, BatchNorm statistics or loss at the end": non_finite_at_the_end,
    "an unreadable image mid-epoch": unreadable_image,
    "a checkpoint that is empty, truncated": broken_checkpoint,
    "a resume into other data": resume_into_other_data,
    "`resume=<this run dir>` with `overwrite=true`": resume_here_with_overwrite,
    "a checkpoint that would run code": code_in_a_checkpoint,
    "`resume=auto` on a finished run": resume_auto_on_a_finished_run,
    "a bug": a_bug,
}
# rows whose fault takes a subprocess signalled mid-run, a full disk or a GPU: the test that
# drives it end to end, and the code it asserts there
DRIVEN_ELSEWHERE = {
    "a stop signal (Ctrl-C) during a multirun sweep": (
        "test_signals.py::test_ctrl_c_in_a_sweep_writes_its_report_and_one_printed_command_finishes_it"
    ),
    "`python -m mixprec.study run ...` into a sweep dir whose runs another config": (
        "test_yours_untouched.py::"
        "test_a_study_into_a_sweep_of_another_config_is_refused_naming_the_keys"
    ),
    "a `.lock` that is not a plain file": (
        "test_yours_untouched.py::"
        "test_a_planted_lock_is_one_named_line_and_its_target_is_never_written"
    ),
    "a `study.target`, `study.budget` or `study.fit_from` in a run's config": (
        "test_report_hostile.py::"
        "test_a_study_setting_a_runs_config_holds_is_checked_as_the_command_lines"
    ),
    "`benchmarks/profile_step.py` or `benchmarks/peers.py` with a bad argument": (
        "test_profile_step.py::test_a_bad_command_is_one_line_and_exit_2"
    ),
    "`python -m mixprec.study run` with a typo": (
        "test_yours_untouched.py::test_the_study_driver_refuses_a_bad_command_in_one_line"
    ),
    "a dict sample past the first": (
        "test_own_code_errors.py::test_a_dict_sample_past_the_first_without_its_target_is_named_by_its_index"
    ),
    "your dataset's `collate_fn` raising": (
        "test_own_code_errors.py::test_your_collate_fn_raising_mid_run_is_one_line_and_the_last_checkpoint_stays"
    ),
    "the disk fills up": (
        "test_disk_full.py::test_a_checkpoint_that_fills_the_disk_fails_clearly_and_resumes"
    ),
    "out of GPU memory": "test_gpu.py::test_oom_marks_the_run_failed_with_advice",
    "SIGTERM, SIGUSR1, SIGUSR2": (
        "test_signals.py::test_a_schedulers_signal_to_the_group_checkpoints_once"
    ),
    "such workers' dataset": (
        "test_own_model.py::"
        "test_a_dataset_that_does_not_pickle_is_refused_where_workers_start_from_a_forkserver"
    ),
    "the same under `torchrun`": (
        "test_signals.py::test_torchrun_with_workers_signalled_as_a_group_stops_every_rank_once"
    ),
    "a stop signal while a step never ends": (
        "test_faults.py::test_a_stop_signal_during_a_step_that_never_ends_exits_within_the_grace"
    ),
    "a second Ctrl-C": "test_faults.py::test_a_second_ctrl_c_exits_at_once",
    "a stop signal during an evaluation": (
        "test_hostile.py::test_a_stop_during_a_long_evaluation_checkpoints_the_last_step"
    ),
    "`resume=auto` where `checkpoints/` holds checkpoint files": (
        "test_hostile.py::test_a_resume_that_finds_no_whole_checkpoint_refuses_and_changes_nothing"
    ),
    "a second run into a dir whose first run is still building": (
        "test_hostile.py::test_a_refused_run_leaves_a_live_runs_lock_and_dir"
    ),
    "a finished run that kept no checkpoint": (
        "test_hostile.py::test_resume_auto_on_a_finished_run_without_a_checkpoint_does_nothing"
    ),
    "low-bit optimizer state in a checkpoint": (
        "test_hostile.py::test_low_bit_state_checkpoints_export_and_name_the_setting_in_a_fresh_process"
    ),
    "`data=text` or `data=tokens` whose validation split": (
        "test_hostile.py::test_a_text_split_too_short_to_validate_is_refused_before_training"
    ),
    "`data=tokens` with an empty": (
        "test_hostile.py::test_token_files_that_cannot_be_read_are_named"
    ),
    "`python -m mixprec.diagnose RUN_DIR`": (
        "test_hostile.py::test_diagnose_on_a_summary_it_cannot_read_says_so"
    ),
    "a sharded checkpoint (`ckpt.sharded=true`) with a shard": (
        "test_hostile.py::test_a_damaged_sharded_checkpoint_is_exit_5_naming_it_at_resume_and_export"
    ),
    "SIGKILL to torchrun's process group": (
        "test_signals.py::test_sigkill_to_torchruns_group_takes_its_ranks_down_with_a_checkpoint"
    ),
    "a precision that does not do what its config promises": (
        "test_dtype_plan.py::test_a_precision_that_silently_does_not_cast_stops_the_run_naming_both"
    ),
    "a run dir or sweep dir that cannot be written": (
        "test_hostile.py::test_a_run_dir_that_cannot_be_written_is_exit_9_in_one_line"
    ),
    "the checkpoints folder stops being writable": (
        "test_hostile.py::test_a_checkpoint_folder_that_turns_read_only_is_exit_9_and_recorded"
    ),
    "`python -m mixprec.report` or `python -m mixprec.study` into a folder": (
        "test_hostile.py::test_a_run_dir_that_cannot_be_written_is_exit_9_in_one_line"
    ),
    "a rank stopped by torchrun as it records its failure": (
        "test_hostile.py::test_a_rank_stopped_as_it_records_its_failure_still_records_it"
    ),
    "the disk fills, or a file cannot be replaced, while the study": (
        "test_report_hostile.py::"
        "test_a_full_disk_keeps_the_previous_study_and_report_whole_and_names_the_file"
    ),
    "a job of a multirun raises": (
        "test_report_hostile.py::test_a_job_that_raises_leaves_the_others_the_study_and_the_plots"
    ),
    "Ctrl-C while a sweep writes its study": (
        "test_report_hostile.py::test_ctrl_c_while_the_sweep_writes_its_study_is_one_line_and_exit_130"
    ),
    "`python -m mixprec.study` with `--budget`": (
        "test_report_hostile.py::test_the_study_refuses_a_bad_flag_naming_it"
    ),
    "a model too large for the device's or the host's memory": (
        "test_own_code_errors.py::"
        "test_a_model_too_large_for_this_machine_is_refused_before_it_is_allocated"
    ),
    "a model or data callable of yours": (
        "test_own_model.py::test_a_target_that_cannot_be_imported_exits_2_through_train_py"
    ),
}


@pytest.mark.parametrize("row", sorted(DRIVEN_HERE))
@pytest.mark.slow
def test_the_row_ends_with_its_exit_code(row, cfg_factory, tmp_path):
    assert DRIVEN_HERE[row](cfg_factory, tmp_path) == code_of(row)


@pytest.mark.slow
def test_hydras_own_type_error_is_a_config_error_too():
    p = run_train(["seed=1.5", "logger=none"])
    assert p.returncode == code_of("a bad value") and "seed" in p.stderr


def test_every_row_with_an_exit_code_is_driven_by_a_test():
    coded = {f for f, code in rows().items() if code != "—"}
    assert len(coded) >= 15
    driven = set(DRIVEN_HERE) | set(DRIVEN_ELSEWHERE)
    undriven = [f for f in coded if not any(f.startswith(k) for k in driven)]
    assert not undriven, f"rows with an exit code and no test: {undriven}"
    for start, node in DRIVEN_ELSEWHERE.items():
        module, name = node.split("::")
        tree = ast.parse((ROOT / "tests" / module).read_text())
        assert name in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, node
        assert any(f.startswith(start) for f in coded), start


def test_every_error_kind_has_its_row():
    kinds = [
        e
        for e in vars(errors).values()
        if isinstance(e, type) and issubclass(e, errors.MixprecError)
    ]
    codes = {e.exit_code for e in kinds if e not in (errors.MixprecError, errors.Preempted)}
    stated = {int(m) for c in rows().values() for m in re.findall(r"\b(\d+)\b", c)}
    assert codes <= stated, f"exit codes with no row: {codes - stated}"

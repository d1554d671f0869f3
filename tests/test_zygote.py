"""The tests' train.py runs start from tests/zygote.py (a fork of a process that has imported
what train.py imports): it must write what `python train.py` writes."""

from __future__ import annotations

import json

import pytest
import zygote

from conftest import run_module, run_train, train_losses

QUICK = ["hardware=cpu", "logger=none", "trainer.max_steps=4", "trainer.log_every=1"]


@pytest.mark.slow  # (train.py runs: the full suite's)
def test_a_run_from_the_zygote_writes_what_a_new_process_writes(tmp_path, monkeypatch):
    runs = {}
    for how in ("zygote", "process"):
        monkeypatch.setenv("MIXPREC_TEST_ZYGOTE", "1" if how == "zygote" else "0")
        d = tmp_path / how
        proc = run_train([*QUICK, f"hydra.run.dir={d}"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        summary = json.loads((d / "summary.json").read_text())
        runs[how] = (train_losses(d), summary["val_loss"], summary["status"], proc.stdout)
    assert runs["zygote"][:3] == runs["process"][:3]
    for how in runs:  # the same log lines (less their times)
        assert "completed in" in runs[how][3] and "first step took" in runs[how][3]


@pytest.mark.slow
def test_a_config_error_from_the_zygote_exits_2_with_the_same_message(tmp_path, monkeypatch):
    got = {}
    for how in ("zygote", "process"):
        monkeypatch.setenv("MIXPREC_TEST_ZYGOTE", "1" if how == "zygote" else "0")
        proc = run_train([*QUICK, "optimizer.lr=-1", f"hydra.run.dir={tmp_path / how}"])
        said = (proc.stdout + proc.stderr).strip().splitlines()[-1]
        got[how] = (proc.returncode, said.split(" - ", 1)[-1])  # (less the time it was said)
    assert got["zygote"] == got["process"]
    assert got["zygote"][0] == 2 and "optimizer.lr" in got["zygote"][1]


def test_a_run_that_needs_an_import_time_variable_starts_a_new_process(monkeypatch):
    monkeypatch.setenv("MIXPREC_TEST_ZYGOTE", "1")
    assert zygote.eligible({**zygote.os.environ, "OMP_NUM_THREADS": "1"})
    assert not zygote.eligible({**zygote.os.environ, "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"})
    monkeypatch.setenv("MIXPREC_TEST_ZYGOTE", "0")
    assert not zygote.eligible(dict(zygote.os.environ))


@pytest.mark.slow
def test_a_fork_that_exits_leaves_the_next_its_wandb_media_directory(tmp_path):
    """wandb's media directory (where a W&B table is written before it is logged) is made when
    wandb is imported, in the zygote; a child that ends through the interpreter's exit (a
    `python -m mixprec.diagnose`; train.py ends through os._exit) deleted it under the next
    child, which logged "W&B table failed (FileNotFoundError ...)" and dropped W&B."""
    assert run_module("mixprec.diagnose", ["--help"]).returncode == 0
    proc = run_train(["trainer.max_steps=2", "logger=wandb", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "W&B table failed" not in proc.stderr, proc.stderr[-3000:]
    assert list((tmp_path / "wandb").rglob("*.table.json")), "the run logged no W&B table"

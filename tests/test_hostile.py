"""What a hostile round found (issue 43), each as a user or a scheduler meets it: a refused run
must not delete a live run's lock; a resume uses the newest whole checkpoint there is or
refuses, never starts over a run's dir; a finished run is not trained again; a stop during an
evaluation checkpoints; dead writers' temp files go; clear errors for the rest."""

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
from mixprec.run import rundir
from mixprec.run import session as run

from conftest import (
    ROOT,
    SHARDED,
    finish,
    last_weights,
    run_module,
    run_train,
    start_session,
    start_train,
)

PLUGINS = ROOT / "tests" / "plugins"
SMALL = ["hardware=cpu", "logger=none", "trainer.log_every=2", "trainer.perf_warmup_steps=0"]
CONST = [*SMALL, "scheduler=constant", "batch=32"]  # a constant lr: a run cut short resumes exact


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_refused_run_leaves_a_live_runs_lock_and_dir(tmp_path):
    """The first run is still building (its dir holds its lock alone); a second one is refused
    (exit 6) and must leave that lock, or a third would take the dir beside the first."""
    live = tmp_path / "live"
    with rundir.RunDirLock(live):
        inode = (live / ".lock").stat().st_ino
        p = run_train([*SMALL, "resume=auto", f"hydra.run.dir={live}"])
        assert p.returncode == 6, (p.stdout + p.stderr)[-2000:]
        assert (live / ".lock").stat().st_ino == inode  # the same lock file, still there
        third = run_train([*SMALL, "resume=auto", f"hydra.run.dir={live}"])
        assert third.returncode == 6 and "is in use by pid" in third.stdout + third.stderr
    # once no one holds it, a refused run (a config error) still leaves no trace of itself
    refused = tmp_path / "refused"
    bad = run_train([*SMALL, "batch=0", f"hydra.run.dir={refused}"])
    assert bad.returncode == 2 and not refused.exists()


@pytest.mark.slow
def test_resume_auto_without_last_pt_continues_from_the_newest_whole_step(
    tmp_path, cfg_factory, caplog
):
    ref = tmp_path / "ref"
    run.run(cfg_factory(*CONST, "trainer.max_steps=6", f"run_dir={ref}"))
    cut = tmp_path / "cut"
    keep = ["ckpt.every_steps=2", "ckpt.keep=3"]
    run.run(cfg_factory(*CONST, *keep, "trainer.max_steps=4", f"run_dir={cut}"))
    (cut / "checkpoints" / "last.pt").unlink()  # step_2 and step_4 remain
    before = [r for r in rows(cut) if r["step"] <= 4]
    with caplog.at_level("WARNING"):
        s = run.run(
            cfg_factory(*CONST, *keep, "trainer.max_steps=6", "resume=auto", f"run_dir={cut}")
        )
    assert s["status"] == "completed" and "resuming from" in caplog.text
    assert "step_00000004.pt, the newest whole one" in caplog.text
    assert [r for r in rows(cut) if r["step"] <= 4] == before  # its rows kept, not started over
    a, b = last_weights(ref), last_weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_that_finds_no_whole_checkpoint_refuses_and_changes_nothing(cfg_factory):
    cfg = cfg_factory(*CONST, "trainer.max_steps=4", "ckpt.sharded=false")
    run.run(cfg)
    d = Path(cfg.run_dir)
    ckpts = d / "checkpoints"
    for p in ckpts.iterdir():
        p.unlink()
    os.symlink("step_00000004.dcp", ckpts / "last.dcp")  # dangling: the rewrite's window
    before = {n: (d / n).read_bytes() for n in ("metrics.jsonl", "summary.json")}
    with pytest.raises(CheckpointError, match="holds last.dcp but no whole checkpoint"):
        run.run(cfg_factory(*CONST, "trainer.max_steps=8", "resume=auto", f"run_dir={d}"))
    assert {n: (d / n).read_bytes() for n in before} == before


def fake_dcp(path: Path, step: int) -> None:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    torch.save({"step": step}, path / "meta.pt")


def test_a_sharded_rewrite_cut_between_its_renames_still_has_a_whole_checkpoint(tmp_path):
    """checkpoint_dcp.write moves the old step_N.dcp aside before renaming the new one in: at
    every moment a whole copy is there, and latest() finds it without last.dcp."""
    d = tmp_path / "checkpoints"
    fake_dcp(d / "step_00000002.dcp", 2)
    fake_dcp(d / ".step_00000004.dcp.stale", 4)  # moved aside, the new one not yet renamed
    (d / ".step_00000004.dcp.partial").mkdir()  # an unfinished write: no meta.pt
    os.symlink("step_00000004.dcp", d / "last.dcp")
    assert checkpoint.latest(d) == d / ".step_00000004.dcp.stale"
    rundir.clean_stale(tmp_path)
    assert not (d / ".step_00000004.dcp.partial").exists()  # cleaned once the lock is taken
    assert (d / ".step_00000004.dcp.stale").exists()


@pytest.mark.slow
def test_resume_auto_on_a_finished_run_without_a_checkpoint_does_nothing(tmp_path):
    """ckpt.at_end=false (the table presets): its completed summary is the proof it finished."""
    d = tmp_path / "done"
    args = [*SMALL, "trainer.max_steps=4", "ckpt.at_end=false", f"hydra.run.dir={d}"]
    assert run_train(args).returncode == 0
    before = {n: (d / n).read_bytes() for n in ("metrics.jsonl", "summary.json")}
    again = run_train([*args, "resume=auto"])
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr
    assert {n: (d / n).read_bytes() for n in before} == before


@pytest.mark.slow
def test_a_stop_during_a_long_evaluation_checkpoints_the_last_step(tmp_path):
    """The grace (1 s) runs out long before the evaluation (about 6 s) would end: the run stops
    at the evaluation's next batch with the step it evaluated checkpointed, and resumes."""
    d, marker = tmp_path / "run", tmp_path / "evaluating"
    args = [
        *SMALL,
        "model.target=own_models:TinyConvNet",
        f"model.path={PLUGINS}",
        "data=custom",
        f"data.path={PLUGINS}",
        "data.target=own_data:slow_val",
        f"+data.kwargs.marker={marker}",
        "batch=16",
        "trainer.val_every=4",
        "trainer.max_steps=8",
        "trainer.stop_grace_s=1",
        f"hydra.run.dir={d}",
    ]
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = start_session([sys.executable, str(ROOT / "train.py"), *args], ROOT, env, merge=True)
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), finish(proc, 30)[0][-3000:]
    os.killpg(proc.pid, signal.SIGTERM)
    out = finish(proc, 120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "without a checkpoint" not in out
    summary = json.loads((d / "summary.json").read_text())
    state = torch.load(d / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert summary["status"] == "preempted" and state["step"] == 4
    marker.unlink()
    marker.with_name(marker.name + ".quick").touch()  # the resume's two evaluations: 13 s less
    done = run_train([*args, "resume=auto"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    assert [r["step"] for r in rows(d) if "val/loss" in r] == [4, 8]


@pytest.mark.slow
def test_temp_files_of_dead_writers_are_removed_when_the_lock_is_taken(cfg_factory):
    cfg = cfg_factory("trainer.max_steps=2")
    run.run(cfg)
    d = Path(cfg.run_dir)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    junk = [
        d / "checkpoints" / f".step_00000002.pt.{dead.pid}.tmp",
        d / f".summary.json.{dead.pid}.tmp",
    ]
    for j in junk:
        j.write_bytes(b"\0" * 1000)
    mine = d / "checkpoints" / f".step_00000002.pt.{os.getppid()}.tmp"  # a live writer's
    mine.write_bytes(b"\0")
    run.run(cfg_factory("trainer.max_steps=2", "overwrite=true", f"run_dir={d}"))
    assert not any(j.exists() for j in junk) and mine.exists()


@pytest.mark.slow
def test_low_bit_state_checkpoints_export_and_name_the_setting_in_a_fresh_process(tmp_path):
    """A fresh process has not imported torchao, whose classes torch.load then refused: the
    export said "corrupted", and a resume into fp32 state did not name optimizer.state."""
    d = tmp_path / "8bit"
    args = [*SMALL, "optimizer.state=8bit", "trainer.max_steps=3", f"hydra.run.dir={d}"]
    assert run_train(args).returncode == 0
    exported = run_module("mixprec.export", [str(d), "--out", str(tmp_path / "new" / "w.pt")])
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert torch.load(tmp_path / "new" / "w.pt", weights_only=True)  # into a folder made for it
    other = run_train(
        [*SMALL, "trainer.max_steps=6", f"resume={d}", f"hydra.run.dir={tmp_path / 'o'}"]
    )
    assert other.returncode == 5 and "optimizer.state=8bit; this run has optimizer.state=fp32" in (
        other.stdout + other.stderr
    )


@pytest.mark.slow
def test_token_files_that_cannot_be_read_are_named(tmp_path, cfg_factory):
    from mixprec.core.errors import ConfigError

    root = tmp_path / "tok"
    root.mkdir()
    import numpy as np

    ids = np.arange(4096, dtype=np.uint32) % 200
    ids.tofile(root / "train.bin")  # uint32 ids read as uint16: each second one 0
    ids[:512].tofile(root / "val.bin")
    base = [
        "model=llama_tiny",
        "data=tokens",
        f"data.root={root}",
        "data.vocab_size=256",
        "data.seq_len=16",
    ]
    with pytest.raises(ConfigError, match="looks like uint32 token ids.*data.dtype=uint32"):
        run.run(cfg_factory(*base))
    (root / "val.bin").unlink()
    (root / "val.bin").mkdir()
    with pytest.raises(ConfigError, match="val.bin is a directory"):
        run.run(cfg_factory(*base, "data.dtype=uint32"))
    (root / "val.bin").rmdir()
    (root / "val.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="val.bin is empty"):
        run.run(cfg_factory(*base, "data.dtype=uint32"))
    (root / "val.bin").unlink()
    os.symlink("val.bin", root / "val.bin")  # a loop
    with pytest.raises(ConfigError, match="val.bin is a link that leads nowhere"):
        run.run(cfg_factory(*base, "data.dtype=uint32"))
    (root / "val.bin").unlink()
    os.mkfifo(root / "val.bin")
    with pytest.raises(ConfigError, match="val.bin is not a regular file"):
        run.run(cfg_factory(*base, "data.dtype=uint32"))


def test_a_text_split_too_short_to_validate_is_refused_before_training(cfg_factory):
    from mixprec.core.errors import ConfigError

    cfg = cfg_factory("model=llama_tiny", "data=text", "data.max_mb=0.2", "data.seq_len=64")
    with pytest.raises(ConfigError, match=r"data=text \(val\).*no validation window"):
        run.run(cfg)
    assert not (Path(cfg.run_dir) / "metrics.jsonl").exists()


@pytest.mark.slow
def test_no_logger_chosen_is_logger_none(tmp_path):
    p = run_train(
        [*SMALL[:1], "logger=[]", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'r'}"]
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    assert not (tmp_path / "r" / "wandb").exists()


@pytest.mark.parametrize(
    "content, needle",
    [
        (b'{"status": "compl', "not whole JSON"),
        (b"", "not whole JSON"),
        (b"\x80\x81\xfe", "not text"),
        (b'["a", "list"]', "not a mixprec summary"),
        (b'{"doctor": 5}', "not a mixprec summary"),
    ],
)
@pytest.mark.slow
def test_diagnose_on_a_summary_it_cannot_read_says_so(tmp_path, content, needle):
    (tmp_path / "summary.json").write_bytes(content)
    p = run_module("mixprec.diagnose", [str(tmp_path)])
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_diagnose_names_a_missing_run_dir_and_answers_help(tmp_path):
    run_diag = lambda *a: run_module("mixprec.diagnose", a)  # noqa: E731
    missing = run_diag(str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    helped = run_diag("--help")
    assert helped.returncode == 0 and "usage: python -m mixprec.diagnose" in helped.stdout


@pytest.mark.parametrize("damage", ["shard missing", "shard truncated", "metadata garbage"])
@pytest.mark.slow
def test_a_damaged_sharded_checkpoint_is_exit_5_naming_it_at_resume_and_export(
    sharded_run, tmp_path, damage
):
    import shutil

    d = tmp_path / "run"
    shutil.copytree(sharded_run, d, symlinks=True)
    ckpt = d / "checkpoints" / "step_00000002.dcp"
    shard = next(ckpt.glob("*.distcp"))
    if damage == "shard missing":
        shard.unlink()
    elif damage == "shard truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
    else:
        (ckpt / ".metadata").write_bytes(b"garbage" * 100)
    p = run_train([*SHARDED, "trainer.max_steps=4", "resume=auto", f"hydra.run.dir={d}"])
    out = p.stdout + p.stderr
    assert p.returncode == 5, out[-3000:]
    # (torch's own logger may warn with a traceback of its fallback; mixprec's is one line)
    mine = out[out.index("checkpoint error:") :]
    assert "step_00000002.dcp" in mine and "Traceback" not in mine
    exported = run_module("mixprec.export", [str(d)])
    last = exported.stderr.strip().splitlines()[-1]
    assert exported.returncode == 5 and last.startswith("checkpoint error:"), exported.stderr
    assert "step_00000002.dcp" in last


def one_line(p: subprocess.CompletedProcess) -> str:
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out[-3000:]
    return out


@pytest.mark.slow
def test_a_run_dir_that_cannot_be_written_is_exit_9_in_one_line(tmp_path, read_only):
    """A file where the run dir should be; a new run on a read-only filesystem; resume=auto of a
    finished run there: Hydra would make the dir, write .hydra/ and train.log, and fail with a
    traceback (exit 1). Each is one line naming the dir, exit 9."""
    file = tmp_path / "a_file"
    file.write_text("not a folder")
    p = run_train([*SMALL, "trainer.max_steps=2", f"hydra.run.dir={file}/run"])
    assert p.returncode == 9 and f"{file} is a file, not a folder" in one_line(p)
    done = tmp_path / "fs" / "done"
    assert run_train([*SMALL, "trainer.max_steps=2", f"hydra.run.dir={done}"]).returncode == 0
    before = (done / "summary.json").read_bytes()
    read_only(tmp_path / "fs")
    for args in (
        [f"hydra.run.dir={tmp_path / 'fs' / 'new'}"],
        [f"hydra.run.dir={done}", "resume=auto"],
    ):
        p = run_train([*SMALL, "trainer.max_steps=2", *args])
        assert p.returncode == 9 and "read-only filesystem" in one_line(p)
    assert (done / "summary.json").read_bytes() == before
    multi = run_train(["-m", *SMALL, f"hydra.sweep.dir={tmp_path / 'fs' / 'sweep'}", "seed=0,1"])
    assert multi.returncode == 9 and "hydra.sweep.dir=" in one_line(multi)
    report = run_module("mixprec.report", [str(done), "--no-wandb"])
    assert report.returncode == 9 and "cannot write" in one_line(report)


@pytest.mark.slow
def test_a_checkpoint_folder_that_turns_read_only_is_exit_9_and_recorded(tmp_path, read_only):
    """The checkpoints folder is not writable when the first checkpoint is due (a read-only
    mount; as root, permissions would not stop the write): the run stops with exit 9 naming the
    file, and its summary says failed with that error (it said nothing: error null, exit 1)."""
    d = tmp_path / "run"
    read_only(d / "checkpoints")
    p = run_train([*SMALL, "trainer.max_steps=6", "ckpt.every_steps=2", f"hydra.run.dir={d}"])
    out = one_line(p)
    assert p.returncode == 9 and "cannot write" in out and "checkpoints" in out
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "failed" and s["exit_code"] == 9 and "read-only" in s["error"].lower()


@pytest.mark.slow
def test_tensorboard_that_cannot_write_mid_run_warns_once_and_training_goes_on(tmp_path, read_only):
    """TensorBoard's writer thread opens its event file again at each write; once the folder is
    read-only it fails there. The sink is dropped with one warning (as a failing W&B is), no
    thread traceback, the run completes and metrics.jsonl keeps every row."""
    d = tmp_path / "run"
    args = [*SMALL, "logger=tensorboard", "logger.flush_s=0.1", "trainer.max_steps=60"]
    proc = start_train([*args, f"hydra.run.dir={d}"], merge=True)
    deadline = time.time() + 120
    while not (d / "metrics.jsonl").exists() or len(rows(d)) < 3:
        assert proc.poll() is None and time.time() < deadline, finish(proc, 30)[0][-3000:]
        time.sleep(0.05)
    read_only(d / "tensorboard")
    out, _ = finish(proc, 300)
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "Exception in thread" not in out, out[-3000:]
    assert out.count("TensorBoard") >= 1 and "logging is off for the rest of this run" in out
    steps = [r["step"] for r in rows(d) if "train/loss" in r]
    assert steps[-1] == 60


KILLED_AS_IT_RECORDS = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from conftest import compose_cfg
from mixprec.core import files
from mixprec.run import session
from mixprec.training import loop

def peer_died(*a, **k):  # what a rank meets when its peer is gone: gloo's error
    raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")

write = files.write_atomic
def stopped_while_writing(path, data):  # torchrun's SIGTERM, as the summary is being written
    if path.name == "summary.json":
        os.kill(os.getpid(), signal.SIGTERM)
    return write(path, data)

loop.train_step = peer_died
files.write_atomic = stopped_while_writing
session.run(compose_cfg({args!r}, {run_dir!r}))
"""


@pytest.mark.slow
def test_a_rank_stopped_as_it_records_its_failure_still_records_it(tmp_path):
    """A rank whose peer died fails in a collective; torchrun then stops it with SIGTERM, which
    arrived while the summary was being written (the stop handlers already gone): it left
    .summary.json.PID.tmp and no summary. The stop now waits for the record, which names the
    error; then the signal ends the process."""
    d = tmp_path / "run"
    args = [*SMALL, "trainer.max_steps=4"]
    code = KILLED_AS_IT_RECORDS.format(tests=str(ROOT / "tests"), args=args, run_dir=str(d))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == -signal.SIGTERM, p.stderr[-3000:]  # the stop still ends it
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "failed" and s["exit_code"] == 1
    assert s["error"] == "RuntimeError: Connection closed by peer [127.0.0.1]:29500"
    assert not list(d.glob(".summary.json.*.tmp"))


def test_uint16_ids_that_look_like_uint32_are_asked_about_and_read_when_said(tmp_path):
    """A vocabulary of 2 stored as uint16 (1, 0, 1, 0, ...) reads exactly as uint32 ids would:
    the heuristic cannot tell them apart, so it asks instead of refusing what data.dtype says."""
    import numpy as np

    from mixprec.core.errors import ConfigError
    from mixprec.data import tokens

    from conftest import group

    np.tile(np.array([1, 0], dtype=np.uint16), 2048).tofile(tmp_path / "train.bin")
    said = group("data", "tokens", root=str(tmp_path), vocab_size=2, seq_len=8)
    with pytest.raises(ConfigError, match="data.dtype=uint32, or data.dtype=uint16"):
        tokens.read(said, "train")
    said.dtype = "uint16"
    assert tokens.read(said, "train")[:4].tolist() == [1, 0, 1, 0]


def test_a_completed_run_with_only_an_older_checkpoint_is_not_trained_again(cfg_factory):
    """A run checkpointed at step 2 (a stop signal mid-run) and then completed at step 6 with
    no checkpoint of its end (ckpt.at_end=false, the study presets): resume=auto again resumed
    from step 2 and trained steps 3-6 again over its finished results; now it is done."""
    cfg = cfg_factory(*CONST, "trainer.max_steps=2", "ckpt.every_steps=2")
    run.run(cfg)
    d = Path(cfg.run_dir)
    done = cfg_factory(
        *CONST, "trainer.max_steps=6", "ckpt.at_end=false", "resume=auto", f"run_dir={d}"
    )
    assert run.run(done)["steps"] == 6
    before = {n: (d / n).read_bytes() for n in ("metrics.jsonl", "summary.json")}
    assert sorted(p.name for p in (d / "checkpoints").glob("step_*")) == ["step_00000002.pt"]
    again = run.run(
        cfg_factory(
            *CONST, "trainer.max_steps=6", "ckpt.at_end=false", "resume=auto", f"run_dir={d}"
        )
    )
    assert again["steps"] == 6 and {n: (d / n).read_bytes() for n in before} == before

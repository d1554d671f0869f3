"""Faults a real user meets: two writers in one run dir, a run that diverges in its last steps,
torn metrics files, resumes that do not fit, re-running into a finished run dir, typos added
with `+`, and stop signals during a step that never ends."""

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

from mixprec.core.errors import CheckpointError, ConfigError, Diverged, RunDirBusy
from mixprec.report import report
from mixprec.run import rundir
from mixprec.run import session as run
from mixprec.sinks import local

from conftest import ROOT, finish, run_train, start_session, start_train


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_second_writer_is_refused_while_the_first_lives(cfg_factory, tmp_path):
    cfg = cfg_factory("trainer.max_steps=2")
    with rundir.RunDirLock(Path(cfg.run_dir)):  # another process's run, alive
        with pytest.raises(RunDirBusy, match=f"in use by pid {os.getpid()}"):
            run.run(cfg)
    assert not (Path(cfg.run_dir) / "metrics.jsonl").exists()  # it wrote nothing


def test_a_lock_left_by_a_dead_process_is_taken_over(cfg_factory, caplog):
    caplog.set_level("INFO")
    cfg = cfg_factory("trainer.max_steps=2")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = Path(cfg.run_dir) / ".lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({"pid": dead.pid, "host": "h", "since": "then"}))
    assert run.run(cfg)["status"] == "completed"
    assert f"took over the lock left by pid {dead.pid}" in caplog.text


@pytest.mark.slow
def test_two_runs_started_together_in_one_run_dir(tmp_path):
    """Seed 0 and seed 1 started at once into one run dir (a SLURM requeue while the old job
    lives): one trains, the other stops at once with exit 6 and writes nothing."""
    args = ["logger=none", "trainer.max_steps=60", f"hydra.run.dir={tmp_path}"]
    # forked from the zygote: both start within milliseconds and race for the run dir's lock
    procs = [start_train([*args, f"seed={s}"], merge=True) for s in (0, 1)]
    outs = [finish(p, 300)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 6], outs
    assert "run dir in use" in "".join(outs)
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)  # one writer: no interleaved rows
    assert summary(tmp_path)["steps"] == 60


def test_divergence_in_the_last_steps_is_not_completed(cfg_factory):
    """lr=1e6: the weights blow up between two divergence checks; the run must not end as
    `completed` with non-finite weights (sweeps and Optuna would count it a success)."""
    cfg = cfg_factory(
        "optimizer=sgd", "optimizer.lr=1e6", "trainer.max_steps=5", "trainer.log_every=10"
    )
    with pytest.raises(Diverged, match="non-finite"):
        run.run(cfg)
    s = summary(Path(cfg.run_dir))
    assert s["status"] == "failed" and s["exit_code"] == 3
    assert s["checkpoint"] is None  # no checkpoint of the broken weights


@pytest.mark.slow
def test_the_divergence_message_promises_no_checkpoint(tmp_path):
    proc = run_train(
        [
            "hardware=cpu",
            "logger=none",
            "optimizer=sgd",
            "optimizer.lr=1e12",
            "trainer.log_every=5",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3 and "checkpoint is kept" not in out
    assert "last checkpoint: none written" in out


@pytest.mark.slow
def test_a_torn_metrics_line_blocks_neither_resume_nor_report(cfg_factory, tmp_path):
    cfg = cfg_factory("trainer.max_steps=20", "ckpt.every_steps=10")
    run.run(cfg)
    d = Path(cfg.run_dir)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "train/lo')  # the power went out mid-write
    again = cfg_factory("trainer.max_steps=30", "resume=auto", f"run_dir={d}")
    assert run.run(again)["steps"] == 30
    rows = local.read_jsonl(d / "metrics.jsonl")
    assert rows[-1]["step"] == 30 and all("step" in r for r in rows)
    with open(d / "metrics.jsonl", "a") as f:
        f.write("\x00\x00garbage")
    (d / ".hydra").mkdir(exist_ok=True)
    assert report.write([d], out_dir=tmp_path, to_sinks=False)["table"][0]["status"] == "completed"


def test_drop_rows_after_keeps_what_a_resume_repeats(tmp_path):
    """The rows a killed run logged after its last checkpoint (step 5) go; the evaluation at
    step 5 goes too (the resumed run evaluates again); a torn line goes."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "train/loss": 1.0} for s in range(1, 9)] + [{"step": 5, "val/acc1": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "tr')
    local.drop_rows_after(path, 5)
    assert [(r["step"], "val/acc1" in r) for r in local.read_jsonl(path)] == [
        (s, False) for s in range(1, 6)
    ]


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda p: p.write_bytes(b""), "cannot be loaded"),
        (lambda p: torch.save({"format": 1}, p), "incomplete: it has no model"),
    ],
)
@pytest.mark.slow
def test_a_broken_last_checkpoint_is_named(cfg_factory, damage, needle):
    cfg = cfg_factory("trainer.max_steps=2")
    run.run(cfg)
    last = Path(cfg.run_dir) / "checkpoints" / "last.pt"
    last.unlink()  # a hard link to step_N.pt: replace it, not the step file
    damage(last)
    with pytest.raises(CheckpointError, match=f"{last}.*{needle}"):
        run.run(cfg_factory("trainer.max_steps=4", "resume=auto", f"run_dir={cfg.run_dir}"))


def test_a_resume_with_another_optimizer_is_a_clear_error(cfg_factory):
    cfg = cfg_factory("trainer.max_steps=2")
    run.run(cfg)
    with pytest.raises(CheckpointError, match="another optimizer"):
        run.run(
            cfg_factory(
                "optimizer=sgd", "trainer.max_steps=4", "resume=auto", f"run_dir={cfg.run_dir}"
            )
        )


@pytest.mark.slow
def test_a_resume_with_another_batch_is_refused_and_leaves_the_run_as_it_was(cfg_factory):
    """A refused resume writes nothing: the finished run keeps its summary, and the correct
    resume afterwards continues it."""
    cfg = cfg_factory("batch=32", "trainer.max_steps=2")
    assert run.run(cfg)["status"] == "completed"
    before = (Path(cfg.run_dir) / "summary.json").read_text()
    with pytest.raises(CheckpointError, match="batch 32 -> 64"):
        run.run(
            cfg_factory("batch=64", "trainer.max_steps=4", "resume=auto", f"run_dir={cfg.run_dir}")
        )
    assert (Path(cfg.run_dir) / "summary.json").read_text() == before
    again = run.run(
        cfg_factory("batch=32", "trainer.max_steps=4", "resume=auto", f"run_dir={cfg.run_dir}")
    )
    assert again["status"] == "completed" and again["steps"] == 4


@pytest.mark.slow
def test_a_finished_run_dir_is_refused_without_resume_and_started_over_with_overwrite(cfg_factory):
    cfg = cfg_factory("trainer.max_steps=3")
    run.run(cfg)
    d = Path(cfg.run_dir)
    before = (d / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run.*resume=auto.*overwrite=true"):
        run.run(cfg_factory("trainer.max_steps=3", f"run_dir={d}"))
    assert (d / "metrics.jsonl").read_text() == before  # untouched
    run.run(cfg_factory("trainer.max_steps=2", "overwrite=true", f"run_dir={d}"))
    steps = [r["step"] for r in local.read_jsonl(d / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2] and summary(d)["steps"] == 2


@pytest.mark.slow
def test_resume_auto_on_a_finished_run_changes_nothing(cfg_factory, caplog):
    caplog.set_level("INFO")
    cfg = cfg_factory("trainer.max_steps=12", "trainer.perf_warmup_steps=1")
    first = run.run(cfg)
    again = run.run(
        cfg_factory(
            "trainer.max_steps=12",
            "trainer.perf_warmup_steps=1",
            "resume=auto",
            f"run_dir={cfg.run_dir}",
        )
    )
    assert again == json.loads(json.dumps(first))
    assert again["samples_per_s"] is not None and "nothing left to train" in caplog.text


@pytest.mark.parametrize(
    "override,needle",
    [
        ("+trainer.max_step=5", "trainer.max_step is not a config key; did you mean max_steps"),
        ("+foo=1", "foo is not a config key"),
        ("+data.sahpe=[1,2,3]", "data.sahpe is not a key of data=digits"),
    ],
)
def test_a_typo_added_with_plus_is_a_config_error(cfg_factory, override, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        run.run(cfg_factory(override))


def test_a_batch_larger_than_the_dataset_says_so(cfg_factory):
    with pytest.raises(
        ConfigError, match="fewer training samples per process than one micro-batch of 2000"
    ):
        run.run(cfg_factory("batch=2000"))


def stuck_run(tmp_path: Path, grace: int) -> subprocess.Popen:
    """train.py stuck in one blocking call inside its first step: reading an image that never
    arrives (a FIFO), with trainer.stop_grace_s=grace."""
    from PIL import Image

    root = tmp_path / "imgs"
    for split in ("train", "val"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (40, 40), (i * 40, 0, 0)).save(root / split / c / f"{i}.jpg")
    os.mkfifo(root / "train" / "a" / "stuck.jpg")  # opening it blocks until a writer comes
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = start_session(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "data=imagenet",
            f"data.root={root}",
            "model=resnet18",
            "data.image_size=32",
            "data.eval_resize=32",
            "batch=7",
            "logger=none",
            "hardware=cpu",
            f"trainer.stop_grace_s={grace}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        ROOT,
        env,
        merge=True,
    )
    deadline = time.time() + 120
    while not (tmp_path / "run" / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)  # training has started (the loaders are built, a batch is being read)
    time.sleep(2)
    return proc


@pytest.mark.slow
def test_a_stop_signal_during_a_step_that_never_ends_exits_within_the_grace(tmp_path):
    """SIGTERM while the loop is stuck in one blocking call cannot wait for a step boundary:
    after trainer.stop_grace_s the run exits 128 + 15 without a checkpoint, its summary says
    preempted, well before SLURM's SIGKILL (KillWait, 30 s by default)."""
    proc = stuck_run(tmp_path, grace=3)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out = finish(proc, 60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert time.time() - t0 < 15
    assert "no step boundary within 3 s" in out
    s = summary(tmp_path / "run")
    assert s["status"] == "preempted" and s["checkpoint"] is None


@pytest.mark.slow
def test_a_stop_signal_ends_the_run_when_no_one_reads_its_output(tmp_path):
    """The terminal closed, or the reader of a pipe (`| tee`) killed first: the line the run
    writes as it gives up waiting fails (EPIPE), and the run must still exit, not live on with
    its watcher thread dead."""
    proc = stuck_run(tmp_path, grace=3)
    proc.stdout.close()  # no one reads the run's output any more
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert summary(tmp_path / "run")["status"] == "preempted"


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once(tmp_path):
    proc = stuck_run(tmp_path, grace=60)
    proc.send_signal(signal.SIGINT)
    time.sleep(1)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    out = finish(proc, 30)[0]
    assert proc.returncode == 130 and time.time() - t0 < 10, out[-3000:]
    assert "a second signal" in out and summary(tmp_path / "run")["status"] == "preempted"


@pytest.mark.slow
def test_resume_auto_on_a_finished_run_without_its_summary_still_answers(cfg_factory):
    cfg = cfg_factory("trainer.max_steps=3")
    run.run(cfg)
    (Path(cfg.run_dir) / "summary.json").unlink()
    value = run.main(cfg_factory("trainer.max_steps=3", "resume=auto", f"run_dir={cfg.run_dir}"))
    assert isinstance(value, float) and 0 <= value <= 1  # val_acc1 from the checkpoint's state


@pytest.mark.slow
def test_a_new_lr_on_resume_is_the_lr_that_trains(cfg_factory):
    """After a divergence a user resumes with a lower lr: the schedule goes on at that base, as
    a run started with it would be at the same step (not at the checkpoint's old lr)."""
    first = cfg_factory("trainer.max_steps=4", "trainer.log_every=4")
    run.run(first)
    run.run(
        cfg_factory(
            "trainer.max_steps=8",
            "trainer.log_every=4",
            "optimizer.lr=5e-4",
            "resume=auto",
            f"run_dir={first.run_dir}",
        )
    )
    fresh = cfg_factory("trainer.max_steps=8", "trainer.log_every=4", "optimizer.lr=5e-4")
    run.run(fresh)

    def lr_at(d, step):
        return next(
            r["train/lr"]
            for r in local.read_jsonl(Path(d) / "metrics.jsonl")
            if r.get("step") == step and "train/lr" in r
        )

    assert lr_at(first.run_dir, 8) == pytest.approx(lr_at(fresh.run_dir, 8), rel=1e-9)


def test_resume_from_this_run_dir_with_overwrite_is_refused_and_deletes_nothing(cfg_factory):
    cfg = cfg_factory("trainer.max_steps=2")
    run.run(cfg)
    last = Path(cfg.run_dir) / "checkpoints" / "last.pt"
    with pytest.raises(ConfigError, match="overwrite would delete the checkpoint"):
        run.run(
            cfg_factory(
                "trainer.max_steps=4",
                f"resume={cfg.run_dir}",
                "overwrite=true",
                f"run_dir={cfg.run_dir}",
            )
        )
    assert last.exists()


def test_overwrite_leaves_what_no_run_made(cfg_factory, tmp_path):
    d = tmp_path / "mine"
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "my_model.pt").write_text("not mixprec's")
    (d / "wandb").mkdir()
    (d / "wandb" / "notes.txt").write_text("mine")
    run.run(cfg_factory("trainer.max_steps=2", "overwrite=true", f"run_dir={d}"))
    assert (d / "checkpoints" / "my_model.pt").exists() and (d / "wandb" / "notes.txt").exists()


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_restarts_without_duplicate_rows(cfg_factory):
    cfg = cfg_factory("trainer.max_steps=4")
    d = Path(cfg.run_dir)
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.3}\n')  # what it had logged
    run.run(cfg_factory("trainer.max_steps=4", "resume=auto", f"run_dir={d}"))
    steps = [r["step"] for r in local.read_jsonl(d / "metrics.jsonl") if "train/loss" in r]
    assert steps == sorted(set(steps)) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "change,needle",
    [
        ("data.val_fraction=0.3", r"other data \(data.val_fraction 0.2 -> 0.3\)"),
        (
            "scheduler=constant",
            r"another scheduler \(scheduler=cosine; this run has scheduler=constant\)",
        ),
    ],
)
def test_a_resume_into_other_data_or_another_schedule_is_named(cfg_factory, change, needle):
    cfg = cfg_factory("trainer.max_steps=2")
    run.run(cfg)
    with pytest.raises(CheckpointError, match=needle):
        run.run(cfg_factory("trainer.max_steps=4", change, "resume=auto", f"run_dir={cfg.run_dir}"))


def test_a_checkpoint_with_another_loop_state_is_a_checkpoint_error(cfg_factory):
    cfg = cfg_factory("trainer.max_steps=2")
    run.run(cfg)
    last = Path(cfg.run_dir) / "checkpoints" / "last.pt"
    blob = torch.load(last, weights_only=True)
    blob["state"]["renamed_in_another_version"] = blob["state"].pop("attempts")
    torch.save(blob, last)
    with pytest.raises(CheckpointError, match="loop state does not fit"):
        run.run(cfg_factory("trainer.max_steps=4", "resume=auto", f"run_dir={cfg.run_dir}"))


@pytest.mark.parametrize("name", ["with space", "ünïcode"])
def test_the_continue_command_survives_odd_run_dirs(tmp_path, name):
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from mixprec.run import messages

    d = tmp_path / name
    args = shlex.split(messages.resume_command(d))[2:]  # as the shell hands them to train.py
    parsed = OverridesParser.create().parse_overrides(args)
    assert {o.key_or_group: o.value() for o in parsed}["hydra.run.dir"] == str(d)

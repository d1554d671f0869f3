"""Nothing of yours is touched (issue 90, items 1-6): a run refused at its first step takes back
only the paths it created, puts back what it found, never deletes or writes through a link,
does so while it still holds the run dir's lock; a planted `.lock` is one named line; a crafted
compile cache writes nothing. Each run is train.py's, started as users start it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from mixprec.core.errors import ConfigError, RunDirBusy
from mixprec.run import rundir
from mixprec.run import session as run

from conftest import CPU_SMALL, ROOT, compose_cfg, run_module, run_train

BROKEN_LOSS = """
import torch.nn.functional as F

def per_sample(logits, targets):
    return F.cross_entropy(logits, targets, reduction="none")
"""


def loss_module(tmp_path: Path) -> tuple[str, dict]:
    """A loss that is refused at its first call (a loss per sample): model.loss=NAME, env."""
    name = f"users_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(BROKEN_LOSS))
    return f"model.loss={name}:per_sample", {"PYTHONPATH": str(tmp_path)}


def tree(root: Path) -> dict[str, str | bytes]:
    """Every path under root, never through a link: a file's bytes, a link's target, a dir."""
    out: dict[str, str | bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes()
    return out


def users_files(d: Path) -> None:
    """What a user may keep in a folder a run writes into: each name a run also writes."""
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "step_3.pt").write_bytes(b"my own checkpoint")
    (d / "wandb" / "offline-run-mine").mkdir(parents=True)
    (d / "wandb" / "offline-run-mine" / "run-mine.wandb").write_bytes(b"my W&B run")
    os.symlink("offline-run-mine", d / "wandb" / "latest-run")
    (d / "tensorboard").mkdir()
    (d / "tensorboard" / "events.out.mine").write_bytes(b"my events")
    (d / ".hydra").mkdir()
    (d / ".hydra" / "config.yaml").write_text("mine: true\n")
    for name in ("train.log", "diagnose.md", "precision_plan.json", "numerics.jsonl"):
        (d / name).write_text(f"my own {name}\n")
    (d / "notes.txt").write_text("not a name a run writes\n")


@pytest.mark.slow
def test_a_run_refused_at_its_first_step_leaves_every_file_it_found_as_it_was(tmp_path):
    """Item 1: the refused run wrote train.log, .hydra/, W&B's files and the metrics into a dir
    that held the user's files under the same names; afterwards the dir is byte for byte what
    it was (the old withdraw deleted train.log, wandb/, tensorboard/, step_3.pt, ...)."""
    run_dir = tmp_path / "run"
    users_files(run_dir)
    before = tree(run_dir)
    loss, env = loss_module(tmp_path)
    args = ["hardware=cpu", "logger=wandb", "trainer.max_steps=3", f"hydra.run.dir={run_dir}"]
    bad = run_train([*args, loss], env_extra=env)
    out = bad.stdout + bad.stderr
    assert bad.returncode == 2 and "returned torch.float32 (64,)" in out, out[-2000:]
    assert "Traceback" not in out
    assert tree(run_dir) == before


@pytest.mark.slow
def test_a_refused_run_in_a_project_folder_keeps_the_projects_wandb(tmp_path):
    """Item 1, hydra.run.dir=. in a project folder that has its own ./wandb: kept whole."""
    project = tmp_path / "project"
    (project / "wandb" / "run-20260101_000000-abc").mkdir(parents=True)
    (project / "wandb" / "run-20260101_000000-abc" / "files.txt").write_text("the project's")
    (project / "wandb" / "debug.log").write_text("the project's log")
    before = tree(project)
    loss, env = loss_module(tmp_path)
    proc = run_train(
        ["hardware=cpu", "logger=wandb", "trainer.max_steps=3", "hydra.run.dir=.", loss],
        cwd=project,
        env_extra=env,
    )
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-2000:]
    assert tree(project) == before


@pytest.mark.slow
def test_a_refused_run_never_deletes_through_a_linked_checkpoints_dir(tmp_path):
    """Item 2: checkpoints/ is a link to another disk holding the user's checkpoints: the link
    and every file behind it stay, and the refusal is one line (was: the files behind the link
    deleted, then a NotADirectoryError traceback)."""
    other = tmp_path / "other_disk"
    other.mkdir()
    (other / "step_00000003.pt").write_bytes(b"a checkpoint on the other disk")
    (other / "README").write_text("keep")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(other, run_dir / "checkpoints")
    before, behind = tree(run_dir), tree(other)
    loss, env = loss_module(tmp_path)
    bad = run_train(
        ["hardware=cpu", "logger=none", "trainer.max_steps=3", f"hydra.run.dir={run_dir}", loss],
        env_extra=env,
    )
    out = bad.stdout + bad.stderr
    assert bad.returncode == 2 and "Traceback" not in out, out[-2000:]
    assert tree(run_dir) == before and tree(other) == behind


def test_overwrite_keeps_a_linked_checkpoints_dir_and_what_is_not_the_runs_behind_it(tmp_path):
    """overwrite=true removes the previous run's own checkpoints, wherever checkpoints/ points,
    and nothing else: the link and the user's other files behind it stay, with no traceback."""
    other = tmp_path / "other_disk"
    other.mkdir()
    for name in ("last.pt", "step_00000002.pt", "README"):
        (other / name).write_text(name)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(other, run_dir / "checkpoints")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    rundir.prepare(run_dir, None, overwrite=True)
    assert (run_dir / "checkpoints").is_symlink()
    assert sorted(p.name for p in other.iterdir()) == ["README"]
    assert not (run_dir / "metrics.jsonl").exists()


def test_the_withdraw_happens_while_the_run_still_holds_its_lock(tmp_path, monkeypatch):
    """Item 3: a second run that takes the dir the moment the refused run lets go of its lock
    (here: right after the release, as overwrite=true or resume=auto would) completes, and
    what it wrote stays; the old withdraw ran after the release and wiped it."""
    run_dir = tmp_path / "run"
    release = rundir.RunDirLock.__exit__
    second: dict = {}
    another = compose_cfg([*CPU_SMALL, "trainer.max_steps=2"], run_dir)

    def release_then_another_run_takes_the_dir(self, *exc):
        release(self, *exc)
        if not second:  # (the second run's own lock is released by it)
            second["started"] = True  # (its own lock's release comes back here)
            second["summary"] = run.run(another)

    monkeypatch.setattr(rundir.RunDirLock, "__exit__", release_then_another_run_takes_the_dir)
    loss, _ = loss_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        run.run(compose_cfg([*CPU_SMALL, "trainer.max_steps=2", loss], run_dir))
    assert getattr(refused.value, "withdrawn", False), refused.value
    assert second["summary"]["status"] == "completed"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and (run_dir / "metrics.jsonl").is_file()
    assert (run_dir / "checkpoints" / "last.pt").is_file()


@pytest.mark.parametrize("planted", ["link", "dir", "fifo"])
def test_a_planted_lock_is_one_named_line_and_its_target_is_never_written(tmp_path, planted):
    """Item 4: `.lock` a link (its target was truncated and overwritten), a folder or a FIFO
    (tracebacks; a FIFO could block): RunDirBusy (exit 6) naming it; nothing is written."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("the user's file\n")
    lock = run_dir / ".lock"
    {"link": lambda: os.symlink(target, lock), "dir": lock.mkdir, "fifo": lambda: os.mkfifo(lock)}[
        planted
    ]()
    with pytest.raises(RunDirBusy) as e:
        run.run(compose_cfg([*CPU_SMALL, "trainer.max_steps=1"], run_dir))
    assert str(e.value).startswith(f"{lock} is not a run's lock file"), e.value
    assert target.read_text() == "the user's file\n"
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]
    assert not rundir.busy(run_dir)  # the glance at a planted lock neither blocks nor follows


@pytest.mark.slow
def test_resume_auto_refused_at_its_first_step_leaves_the_finished_run_as_it_was(tmp_path):
    """Item 5: a finished run, then resume=auto with more steps and a broken loss: refused at
    its first step (exit 2); the finished run's summary.json, .hydra/config.yaml, metrics and
    train.log are as they were (were: summary `failed`, the config the refused one)."""
    run_dir = tmp_path / "run"
    args = ["hardware=cpu", "logger=none", f"hydra.run.dir={run_dir}", "ckpt.every_steps=1"]
    done = run_train([*args, "trainer.max_steps=2"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    before = tree(run_dir)
    loss, env = loss_module(tmp_path)
    bad = run_train([*args, "trainer.max_steps=4", "resume=auto", loss], env_extra=env)
    out = bad.stdout + bad.stderr
    assert bad.returncode == 2 and "returned torch.float32 (64,)" in out, out[-2000:]
    assert tree(run_dir) == before
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def crafted_cache(key: str) -> bytes:
    """A compile-cache file as torch writes one, with one entry whose key is `key` (made with
    torch's own writer; a torch whose writer is laid out otherwise skips the test)."""
    try:
        from torch.compiler._cache import (
            AppendingByteSerializer,
            CacheArtifactFactory,
            CacheArtifactManager,
            _serialize_single_cache,
        )

        CacheArtifactManager._ensure_cache_artifacts_registered()
        entry = CacheArtifactFactory.create("inductor", key, b"attacker's content")
        serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
        serializer.extend([("inductor", [entry])])
        return serializer.to_bytes()
    except (ImportError, AttributeError, TypeError) as e:
        pytest.skip(f"torch {torch.__version__} writes its cache files otherwise ({e})")


def test_a_crafted_compile_cache_writes_nothing_outside_torchs_cache(tmp_path, monkeypatch, caplog):
    """Item 6: a cache file whose entry names an absolute path (or climbs with '..') made torch
    write that path before anything compiled; it is refused whole with one line. An entry
    with a plain key still loads (the file format is read as torch reads it)."""
    from mixprec.compile import compiling

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    victim = tmp_path / "elsewhere" / "victim"
    for key in (str(victim), f"ab/../../../{victim.relative_to(tmp_path)}"):
        crafted = tmp_path / "fast.bin"
        crafted.write_bytes(crafted_cache(key))
        caplog.clear()
        with caplog.at_level("WARNING", logger=compiling.log.name):
            compiling.load_cache(str(crafted))
        said = [r.getMessage() for r in caplog.records]
        assert not (tmp_path / "elsewhere").exists(), key
        assert len(said) == 1 and "is refused, nothing of it loaded" in said[0], said
        assert repr(key) in said[0]
    plain = tmp_path / "plain.bin"
    plain.write_bytes(crafted_cache("fplainkey"))
    compiling.load_cache(str(plain))
    assert any((tmp_path / "inductor").rglob("*")), "a plain entry is loaded as before"


@pytest.mark.slow
def test_a_bool_key_given_a_number_is_refused_naming_it(tmp_path):
    """Issue 90, item 11: `debug.memory=2` was read as true; a true/false key takes only
    true or false (exit 2, nothing written)."""
    run_dir = tmp_path / "run"
    p = run_train(["hardware=cpu", "logger=none", "debug.memory=2", f"hydra.run.dir={run_dir}"])
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "debug.memory=2: a key that is true or false" in out, out[-2000:]
    assert not run_dir.exists()


def test_resume_auto_with_another_model_target_is_refused_naming_it(tmp_path, monkeypatch):
    """Issue 90, item 11: a resume whose model.target names another callable (here one that
    builds the same shapes, so its weights load) was not noticed; it is a CheckpointError
    naming model.target's two values, and the run dir is left as it was."""
    from mixprec.core.errors import CheckpointError

    module = tmp_path / f"users_{uuid.uuid4().hex[:8]}.py"
    module.write_text(
        "from own_models import plain_mlp\n\ndef renamed(num_classes, input_shape):\n"
        "    return plain_mlp(num_classes, input_shape)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    run_dir = tmp_path / "run"
    base = [*CPU_SMALL, "model=own", "ckpt.every_steps=1", "trainer.max_steps=2"]
    done = run.run(compose_cfg([*base, "model.target=own_models:plain_mlp"], run_dir))
    assert done["status"] == "completed"
    before = tree(run_dir)
    again = [*base, f"model.target={module.stem}:renamed", "resume=auto", "trainer.max_steps=4"]
    with pytest.raises(CheckpointError, match="model.target=own_models:plain_mlp; this run has"):
        run.run(compose_cfg(again, run_dir))
    assert tree(run_dir) == before


def job_like_the_preset(sweep: Path, name: str, *overrides: str) -> Path:
    """A finished job of `experiment=quality_cpu` as its sweep leaves it (config.yaml only:
    the config check reads nothing else), with `overrides` on the preset."""
    from omegaconf import OmegaConf

    from mixprec.run.config import compose_config

    run = sweep / name
    (run / ".hydra").mkdir(parents=True)
    cfg = compose_config(["experiment=quality_cpu", "seed=0", *overrides])
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return run


def test_a_study_into_a_sweep_of_another_config_is_refused_naming_the_keys(tmp_path, monkeypatch):
    """Issue 90, item 7: `python -m mixprec.study run` into a sweep dir whose runs another
    optimizer.lr made trained nothing (resume=auto skips finished runs) and answered for the
    old runs. Refused (exit 2) naming the key; runs of this config (another seed, another
    precision) are continued."""
    from mixprec import study

    swept: list = []
    monkeypatch.setattr(study, "_sweep", lambda overrides, sweep, seeds: swept.append(seeds) or 0)
    sweep = tmp_path / "sweep"
    job_like_the_preset(sweep, "0", "precision=fp32", "seed=3")  # the same config, swept keys
    args = ["experiment=quality_cpu", "study.width=0.05", f"hydra.sweep.dir={sweep}"]
    assert study.run(args) == 1 and swept  # (its fake job holds no study: nothing to read)
    job_like_the_preset(sweep, "1", "optimizer.lr=0.123")
    swept.clear()
    with pytest.raises(ConfigError, match=r"holds runs of another config \(1: optimizer.lr"):
        study.run(args)
    assert swept == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,code,said",
    [
        (["study.width=abc"], 2, "config error: Error merging override study.width=abc"),
        (["study.widht=0.1"], 2, "config error: Could not override 'study.widht'"),
        (["study.width=0.05", "hydra.sweep.dir=/proc/mixprec"], 9, "/proc takes no new folders"),
    ],
    ids=["width-abc", "typo", "proc-sweep-dir"],
)
def test_the_study_driver_refuses_a_bad_command_in_one_line(args, code, said):
    """Issue 90, item 13: each was a traceback (exit 1)."""
    p = run_module("mixprec.study", ["run", "experiment=quality_cpu", *args], timeout=120)
    assert p.returncode == code and said in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("where", ["/proc/mixprec-run", "/sys/mixprec-run"])
def test_a_run_dir_under_proc_or_sys_is_exit_9_in_one_line(where):
    """Issue 90, item 13: Hydra's mkdir traceback (exit 1) where any unwritable dir is exit 9."""
    p = run_train(["hardware=cpu", "logger=none", f"hydra.run.dir={where}"])
    out = p.stdout + p.stderr
    assert p.returncode == 9 and "takes no new folders" in out and "Traceback" not in out, out


@pytest.mark.slow
def test_a_checkpoint_over_the_file_size_limit_is_exit_8_and_loses_nothing(tmp_path):
    """Issue 90, item 13: `ulimit -f` below a checkpoint's size (EFBIG, which torch.save
    reports as "unexpected pos"): exit 8 naming the limit; the earlier checkpoint stays whole."""
    import resource

    run_dir = tmp_path / "run"
    args = ["hardware=cpu", "logger=none", "ckpt.every_steps=2", f"hydra.run.dir={run_dir}"]
    first = run_train([*args, "trainer.max_steps=2"])
    assert first.returncode == 0, (first.stdout + first.stderr)[-2000:]
    kept = (run_dir / "checkpoints" / "last.pt").read_bytes()
    limit = len(kept) // 2
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, "trainer.max_steps=4", "resume=auto"],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    out = p.stdout + p.stderr
    assert p.returncode == 8 and "file size limit" in out and "Traceback" not in out, out[-2000:]
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == kept


def test_overwrite_refused_at_its_first_step_puts_the_previous_run_back(tmp_path, monkeypatch):
    """The done criterion of issue 90 for overwrite=true: the previous run was removed before
    the build, so a refusal at the first step lost it. It is set aside (renamed) and put back
    byte for byte; a run that goes on removes it at its first checkpoint."""
    run_dir = tmp_path / "run"
    base = [*CPU_SMALL, "ckpt.every_steps=1", "trainer.max_steps=2"]
    assert run.run(compose_cfg(base, run_dir))["status"] == "completed"
    before = tree(run_dir)
    loss, _ = loss_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError):
        run.run(compose_cfg([*base, "overwrite=true", loss], run_dir))
    assert tree(run_dir) == before
    with pytest.raises(ConfigError):  # refused in the build: nothing of it was ever written
        run.run(compose_cfg([*base, "overwrite=true", "+model.kwargs.nonsense=1"], run_dir))
    assert tree(run_dir) == before
    again = run.run(compose_cfg([*base, "overwrite=true", "seed=5"], run_dir))
    assert again["status"] == "completed" and not list(run_dir.glob(".overwritten*"))
    assert json.loads((run_dir / "summary.json").read_text())["seed"] == 5

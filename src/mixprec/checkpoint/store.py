"""Checkpoints that resume exactly and load safely.

Everything saved is plain data (tensors, numbers, strings, lists, dicts), so loading uses
torch.load(weights_only=True), and a sharded checkpoint's DCP files go through the safe reader
of checkpoint/dcp.py: a checkpoint from elsewhere cannot run code. Writes are atomic
(files.write_atomic): a crash mid-write leaves the previous one intact. Model keys are those of
the plain module (models.unwrap): never `module.` or `_orig_mod.`, however the run was wrapped.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING

from mixprec.checkpoint import dcp as checkpoint_dcp
from mixprec.checkpoint import rng
from mixprec.core import files
from mixprec.core.errors import CheckpointError, ConfigError, check
from mixprec.models import unwrap
from mixprec.parallel import distributed, sharding

log = logging.getLogger(__name__)
FORMAT = 1
KEYS = ("model", "optimizer", "scaler", "scheduler", "state", "rng", "config")


@dataclass
class CkptConfig:
    """ckpt.* in conf/train.yaml"""

    every_steps: Optional[int] = (
        MISSING  # write checkpoints/last.pt every N optimizer steps; null = end only
    )
    keep: int = MISSING  # how many step-numbered checkpoints to keep beside last.pt
    at_end: bool = MISSING  # write one when the run completes (benchmark tables may not)
    sharded: bool = MISSING  # DCP's format: each rank writes its own shard (checkpoint_dcp)

    def __post_init__(self) -> None:
        check(
            self.every_steps is None or self.every_steps >= 1,
            "ckpt.every_steps",
            self.every_steps,
            "null or an int >= 1",
        )
        check(self.keep >= 1, "ckpt.keep", self.keep, "an int >= 1")


def gather(learner, by_name: bool = False) -> tuple[list, tuple | None]:
    """What every rank joins in before rank 0 writes (collectives): each rank's RNG state, and
    for a sharded model, or `by_name` (parallel=fsdp: the optimizer's state keyed by parameter
    name on any world size), the full model and optimizer state; otherwise None (save() reads
    them on rank 0 alone)."""
    model = unwrap(learner.model)
    if not (by_name or sharding.is_sharded(model)):
        return rng.rng_states(), None
    return rng.rng_states(), sharding.states(model, learner.optimizer, by_name)


def write(path: Path, learner, state, config: dict, keep: int, by_name: bool, sharded: bool):
    """Every rank calls this at a checkpoint: one file written by rank 0 (save, after every
    rank joined in gathering what it needs), or, `sharded`, DCP's directory, each rank its
    own shard (checkpoint_dcp)."""
    if sharded:
        meta = _entries(learner, state, config, rng.rng_states(), ("dcp", "dcp"))
        return checkpoint_dcp.write(path.parent, learner, meta, state.step, keep)
    gathered = gather(learner, by_name)
    if distributed.rank() == 0:  # one writer
        return save(path, learner, state, config, keep, *gathered)
    return None


def save(path: Path, learner, state, config: dict, keep: int = 1, rngs=None, states=None) -> Path:
    """last.pt (a hard link to the newest step_N.pt) for the learner (model, optimizer, scaler,
    scheduler) and the loop state, plus every rank's RNG state (`rngs`, from rng_states(); this
    process's alone without it) and the config that ran. (Loggers keep their own resume ids in
    the run dir: sinks/.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = states or sharding.states(unwrap(learner.model), learner.optimizer)
    # `states`: gathered by every rank beforehand (a sharded model's full state)
    blob = _entries(learner, state, config, rngs or [rng.rng_state()], tensors)
    step_path = path.parent / f"step_{state.step:08d}.pt"
    files.write_atomic(step_path, lambda f: torch.save(blob, f))
    files.link_atomic(step_path, path)  # last.pt is the newest step file under a stable name
    for old in sorted(path.parent.glob("step_*.pt"))[:-keep]:
        old.unlink()
    return path


def _entries(learner, state, config: dict, rngs: list, tensors: tuple) -> dict:
    """A checkpoint's entries (KEYS); `tensors`: the model's and optimizer's state, or where
    DCP holds them ("dcp")."""
    return {
        "format": FORMAT,
        "model": tensors[0],
        "optimizer": tensors[1],
        "scaler": learner.precision.scaler.state_dict(),
        "precision": learner.precision.state_dict(),  # a recipe's own state (absent: older)
        "scheduler": learner.scheduler.state_dict(),
        "state": dataclasses.asdict(state),
        "rng": rngs,
        "config": config,
        "callbacks": learner.callbacks.state_dict(),  # (absent from older checkpoints)
    }


def find(resume: str, run_dir: Path) -> Path | None:
    """`auto`: this run dir's last.pt if present (else None: start fresh); or a dir / file path."""
    if resume == "auto":
        return latest(run_dir / "checkpoints")
    p = Path(resume).expanduser()
    if p.is_dir() and not checkpoint_dcp.is_dcp(p):
        p = latest(p / "checkpoints" if (p / "checkpoints").is_dir() else p) or p / "last.pt"
    if not (p.is_file() or checkpoint_dcp.is_dcp(p)):
        raise ConfigError(
            f"resume={resume!r}: no checkpoint at {p} (allowed: null, auto, a run "
            "dir, a .pt file or a .dcp directory)"
        )
    return p


def latest(directory: Path) -> Path | None:
    """A checkpoints dir's last.pt or last.dcp (ckpt.sharded), whichever was written last;
    without either (a kill between a rewrite's two renames, or last.pt deleted), the newest
    whole checkpoint there is; None if there is none."""
    last = [directory / "last.pt", directory / checkpoint_dcp.LAST]
    there = [p for p in last if p.is_file() or checkpoint_dcp.is_dcp(p)]
    if there:
        return max(there, key=lambda p: p.stat().st_mtime_ns)
    whole = [p for p in directory.glob("step_*.pt") if p.is_file()]
    whole += [p for p in directory.glob("*step_*.dcp*") if checkpoint_dcp.is_dcp(p)]
    if whole:
        newest = max(whole, key=lambda p: (checkpoint_dcp.step_of(p), p.stat().st_mtime_ns))
        log.warning(
            "%s: no last.pt / last.dcp; resuming from %s, the newest whole one", directory, newest
        )
        return newest
    return None


def leftovers(directory: Path) -> list[str]:
    """What a checkpoints dir holds that looks like a checkpoint (for a resume that found no
    whole one: refused, not started over)."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if "step_" in p.name or "last" in p.name)


def load(path: Path) -> dict[str, Any]:
    """The checkpoint's contents, or a CheckpointError naming the file and what is wrong."""
    low_bit = _allow_torchao()
    if checkpoint_dcp.is_dcp(path):  # refused here, before a run or an export is built on it
        checkpoint_dcp.metadata(path)
    try:
        where = path / checkpoint_dcp.META if checkpoint_dcp.is_dcp(path) else path
        blob = torch.load(where, map_location="cpu", weights_only=True)
    except Exception as e:  # empty, truncated, corrupted, or holding objects that would run code
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
        if "torchao" in str(e) and not low_bit:
            raise CheckpointError(
                f"checkpoint {path} holds torchao's low-bit optimizer state "
                "(optimizer.state=8bit/4bit/fp8) and torchao is not installed: "
                "pip install -e '.[fp8]' to read it"
            ) from None
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded ({why}); it is empty, "
            "truncated, corrupted or not a mixprec checkpoint"
        ) from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        got = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
        raise CheckpointError(
            f"checkpoint {path} is not a mixprec checkpoint (format {got!r}, expected {FORMAT})"
        )
    missing = [k for k in KEYS if k not in blob]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no {', '.join(missing)}")
    return blob


def _allow_torchao() -> bool:
    """torchao's tensor classes (optimizer.state=8bit/4bit/fp8 moments) are allowed by
    torch.load(weights_only=True) once torchao.optim is imported: a fresh process (export, a
    resume into another optimizer.state) must import it before reading. False without torchao."""
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        return False
    return True


def _same_global_batch(saved: dict, run: dict) -> bool:
    """Another world size with the same batch x world and accum: each optimizer step takes the
    same samples (the data is split by rank within each global micro-batch)."""
    keys = ("batch", "accum", "world")
    if not all(k in saved for k in keys):
        return False
    return saved["accum"] == run["accum"] and saved["batch"] * saved["world"] == (
        run["batch"] * run["world"]
    )


def check_fits(blob: dict, path: Path, run: dict) -> None:
    """A resumed run must continue with the batch layout the checkpoint was written with: its
    LR schedule and its position in the data are counted in those units."""
    saved = blob["state"].get("layout") or {}
    differ = {k: (saved[k], run[k]) for k in run if k in saved and saved[k] != run[k]}
    if differ and _same_global_batch(saved, run):
        log.warning(
            "resume on %d processes (written on %d) with batch %d (was %d): the same global "
            "micro-batch, so the same position in the data; the state is spread anew, so the "
            "run is not bit-identical to an uninterrupted one",
            run["world"],
            saved["world"],
            run["batch"],
            saved["batch"],
        )
        return
    if differ:
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in differ.items())
        raise CheckpointError(
            f"checkpoint {path} was written with another batch layout ({what}); the restored LR "
            "schedule and data position would not match. Resume with the same batch, accum and "
            "world size (another world size works with the same batch x world and accum), or "
            "start a new run (no resume) from scratch"
        )


# what a resume must keep: the state's layout depends on them
_SAME = [("optimizer", "name"), ("optimizer", "state"), ("optimizer", "offload")]
_SAME += [("scheduler", "name"), ("parallel", "strategy")]
_SAME += [("model", "target")]  # your model's callable: another one may fit the weights by chance


def check_config(blob: dict, path: Path, run: dict) -> None:
    """The resumed run must train what the checkpoint trained: the same optimizer and schedule
    (named as such, not as a mismatch of their states) and the same data (a moved `data.root`
    is fine; another split or shape would continue from a position in other data)."""
    saved = blob.get("config") or {}
    for group, key in _SAME:
        was, now = (saved.get(group) or {}).get(key), (run.get(group) or {}).get(key)
        name = group if key == "name" else f"{group}.{key}"
        if was and now and was != now:
            raise CheckpointError(
                f"checkpoint {path} was written with another {group} ({name}={was}; this run "
                f"has {name}={now}); resume with {name}={was}, or start a new run without "
                "resume"
            )
    was, now = saved.get("data") or {}, run.get("data") or {}
    differ = sorted(k for k in set(was) | set(now) if k != "root" and was.get(k) != now.get(k))
    if was and differ:
        what = ", ".join(f"data.{k} {was.get(k)!r} -> {now.get(k)!r}" for k in differ)
        raise CheckpointError(
            f"checkpoint {path} was written for other data ({what}); the restored position "
            "in the data would not match. Resume with the same data, or start a new run"
        )


def restore(blob: dict, path: Path, learner) -> dict:
    """Load every piece back into the learner; returns the saved loop state (a dict)."""
    model_name = (blob["config"].get("model") or {}).get("name", "?")
    fits = f"does not fit this run's model (it was written for {model_name})"
    if blob["model"] == "dcp":  # every rank reads its own part (checkpoint_dcp)
        _load(path, "model and optimizer state", lambda: checkpoint_dcp.read(path, learner), fits)
    else:
        model = unwrap(learner.model)
        _load(path, "model", lambda: sharding.load_model(model, blob["model"]), fits)
        _load(
            path,
            "optimizer",
            lambda: _load_optimizer(learner, blob["optimizer"]),
            "holds another optimizer's state (optimizer=... differs from the run that wrote it)",
        )
    _load(
        path,
        "scheduler",
        lambda: learner.scheduler.load_state_dict(blob["scheduler"]),
        "holds another LR schedule's state",
    )
    scaler = learner.precision.scaler
    if scaler.is_enabled() and not blob["scaler"]:
        log.warning(
            "checkpoint %s was written without a GradScaler (precision=%s); this run "
            "starts a fresh scaler at init_scale=%g",
            path,
            (blob["config"].get("precision") or {}).get("name", "?"),
            scaler.get_scale(),  # (a fresh one: its initial scale)
        )
    elif scaler.is_enabled():
        _load(path, "scaler", lambda: scaler.load_state_dict(blob["scaler"]), "bad scaler state")
    _load(path, "rng", lambda: rng.restore_rng(blob["rng"]), "is not the RNG state mixprec writes")
    prec = learner.precision
    if blob.get("precision"):
        _load(
            path,
            "precision",
            lambda: prec.load_state_dict(blob["precision"]),
            f"holds a precision state that precision={prec.name} does not take",
        )
    elif prec.state_dict():
        log.warning(
            "checkpoint %s holds no state of precision=%s; it goes on as built", path, prec.name
        )
    callbacks = learner.callbacks
    _load(
        path,
        "callbacks",
        lambda: callbacks.load_state_dict(blob.get("callbacks"), f"checkpoint {path}"),
        "holds a callback state its callback does not take",
    )
    return blob["state"]


def _group_keys(state: dict) -> set:
    """The param groups' keys (CPUOffloadOptimizer: its inner optimizers' groups)."""
    inner = [*state.get("offloaded", []), *([state["on-device"]] if "on-device" in state else [])]
    groups = [g for s in [state, *inner] for g in s.get("param_groups", [])]
    return {k for g in groups for k in g if k != "params"}


def _load_optimizer(learner, saved: dict) -> None:
    model, optimizer = unwrap(learner.model), learner.optimizer
    if sharding.by_name(saved) or sharding.is_sharded(model):  # parallel=fsdp's full state
        return sharding.load_optimizer(model, optimizer, saved)
    keys, saved_keys = _group_keys(optimizer.state_dict()), _group_keys(saved)
    if keys != saved_keys:  # torch loads a foreign optimizer's state silently, then fails later
        raise ValueError(f"param group keys {sorted(saved_keys ^ keys)} differ")
    optimizer.load_state_dict(saved)


def _load(path: Path, part: str, load_it, meaning: str) -> None:
    try:
        load_it()
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CheckpointError(f"checkpoint {path}: its {part} {meaning} ({first})") from None

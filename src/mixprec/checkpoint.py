"""Checkpoints that resume exactly and load safely.

Everything saved is plain data (tensors, numbers, strings, lists, dicts), so loading uses
torch.load(weights_only=True): a checkpoint from elsewhere cannot run code. Writes are atomic
(temp file in the same dir, fsync, os.replace): a crash mid-write leaves the previous one intact.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ConfigError

log = logging.getLogger(__name__)
FORMAT = 1


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": list(random.getstate()[1]), "python_version": random.getstate()[0],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(s: dict[str, Any]) -> None:
    random.setstate((s["python_version"], tuple(s["python"]), None))
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP and torch.compile wrappers (stable state_dict keys)."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def save(path: Path, *, model, optimizer, scaler, scheduler, state, config: dict,
         wandb_id: str | None, keep: int = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"format": FORMAT, "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
            "scheduler": scheduler.state_dict(), "state": dataclasses.asdict(state),
            "rng": rng_state(), "wandb_id": wandb_id, "config": config}
    step_path = path.parent / f"step_{state.step:08d}.pt"
    _atomic_save(blob, step_path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    os.link(step_path, tmp)  # last.pt is the newest step file under a stable name
    os.replace(tmp, path)
    for old in sorted(path.parent.glob("step_*.pt"))[:-keep]:
        old.unlink()
    return path


def _atomic_save(blob: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(blob, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # the previous checkpoint stays as it was
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def find(resume: str, run_dir: Path) -> Path | None:
    """`auto`: this run dir's last.pt if present (else None: start fresh); or a dir / file path."""
    if resume == "auto":
        p = run_dir / "checkpoints" / "last.pt"
        return p if p.exists() else None
    p = Path(resume)
    if p.is_dir():
        p = p / "checkpoints" / "last.pt" if (p / "checkpoints").is_dir() else p / "last.pt"
    if not p.is_file():
        raise ConfigError(f"resume={resume!r}: no checkpoint at {p} (allowed: null, auto, a run "
                          "dir, or a .pt file)")
    return p


def load(path: Path) -> dict[str, Any]:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupted, or holding objects that would run code
        raise ConfigError(f"checkpoint {path} cannot be loaded ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}); it is truncated, corrupted or not "
                          "a mixprec checkpoint") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path} is not a mixprec checkpoint (format "
                          f"{blob.get('format') if isinstance(blob, dict) else type(blob).__name__})")
    return blob


def restore(blob: dict, path: Path, *, model, optimizer, scaler, scheduler, state_cls):
    """Load every piece back; returns the TrainState to continue from."""
    try:
        unwrap(model).load_state_dict(blob["model"])
    except RuntimeError as e:
        raise ConfigError(f"checkpoint {path} does not fit model "
                          f"{blob['config'].get('model', {}).get('name', '?')} -> this run's "
                          f"model: {str(e).splitlines()[0][:300]}") from None
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    if scaler.is_enabled() and not blob["scaler"]:
        log.warning("checkpoint %s was written without a GradScaler (precision=%s); this run "
                    "starts a fresh scaler at init_scale=%g", path,
                    blob["config"].get("precision", {}).get("name", "?"), scaler._init_scale)
    elif scaler.is_enabled():
        scaler.load_state_dict(blob["scaler"])
    set_rng_state(blob["rng"])
    return state_cls(**blob["state"])

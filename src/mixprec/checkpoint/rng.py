"""Every rank's random-number state, for checkpoints: Python's, NumPy's, torch's CPU and CUDA
generators, as plain data (tensors, numbers, lists) that torch.load(weights_only=True) reads."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mixprec.parallel import distributed

log = logging.getLogger("mixprec.checkpoint.store")


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG state, by rank (rank r's dropout draws are its own): a collective that
    every rank calls, so that a resume restores each rank's own state."""
    mine = rng_state()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def restore_rng(saved: dict | list) -> None:
    """This rank's state (checkpoints before per-rank states held rank 0's alone)."""
    rank = distributed.rank()
    if isinstance(saved, dict):
        return set_rng_state(saved)
    if len(saved) <= rank:  # resumed on more ranks than wrote it (check_fits allowed it)
        log.warning("resume: no RNG state for rank %d; it keeps its fresh seed", rank)
        return None
    set_rng_state(saved[rank])


def set_rng_state(s: dict[str, Any]) -> None:
    random.setstate((s["python_version"], tuple(s["python"]), None))
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])

"""batch=auto: the largest micro-batch that really trains here, found by real training steps.

The seeds' progressive search ("start at the fp32 maximum, grow 50 % until OOM, step back") made
exact: grow by `growth` until a probe runs out of memory, then bisect between the last batch that
trained and the first that did not, down to `resolution`. Each probe builds fresh model, optimizer
and scaler state and runs a few full steps (forward, backward, optimizer step), so it sees the same
memory as training; after an OOM everything is released before the next probe. The answer, less a
safety margin and rounded down to a multiple of 8 (tensor-core friendly), is cached per
(model, input, precision, memory options, GPU, cap, torch version).
"""
from __future__ import annotations

import gc
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)


@dataclass
class SearchSettings:
    start: int = 16  # first probe
    growth: float = 1.5  # the seeds' "+50 % until OOM"
    resolution: int = 8  # bisect until the bracket is this narrow
    margin: float = 0.05  # keep this fraction of the found maximum free
    max_batch: int = 65536
    cache: Path | None = None  # JSON file; None = no cache


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def search(probe: Callable[[int], None], s: SearchSettings,
           agree: Callable[[int], int] = lambda b: b,
           free: Callable[[], None] = release) -> tuple[int, list[dict]]:
    """(largest batch that trained, the probes). `probe(b)` raises an OOM error if b does not fit;
    `agree` makes every rank use the same value (the minimum) under DDP; `free` releases memory
    between probes."""
    probes: list[dict] = []

    def fits(b: int) -> bool:
        t0 = time.perf_counter()
        try:
            probe(b)
            ok = True
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
            ok = False
        free()
        ok = bool(agree(int(ok)))  # one rank out of memory means the batch does not fit
        probes.append({"batch": b, "fits": ok, "s": round(time.perf_counter() - t0, 2)})
        log.info("batch=auto probe %4d: %s (%.1fs)", b, "fits" if ok else "out of memory",
                 probes[-1]["s"])
        return ok

    lo, hi = 0, None  # lo trains, hi does not
    b = s.start
    while hi is None:
        if fits(b):
            lo = b
            if b >= s.max_batch:
                break
            b = min(s.max_batch, max(b + 1, int(b * s.growth)))
        else:
            hi = b
            if lo == 0:  # even the first probe failed: walk down
                if b == 1:
                    raise torch.OutOfMemoryError("batch=auto: not even batch 1 fits in memory")
                hi, b = None, max(1, b // 2)
    while hi is not None and hi - lo > s.resolution:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, probes


def with_margin(found: int, margin: float) -> int:
    b = max(1, math.floor(found * (1 - margin)))
    return b - b % 8 if b >= 8 else b


def cached(key: dict, s: SearchSettings, compute: Callable[[], tuple[int, list]]) -> tuple[int, bool]:
    """(batch, came from the cache)."""
    k = json.dumps(key, sort_keys=True)
    table = _read(s.cache)
    if k in table:
        return table[k]["batch"], True
    found, probes = compute()
    if s.cache is not None:
        table = _read(s.cache)
        table[k] = {"batch": found, "probes": probes, "date": time.strftime("%Y-%m-%d %H:%M")}
        s.cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = s.cache.with_name(s.cache.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, s.cache)
    return found, False


def _read(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        log.warning("batch=auto cache %s is unreadable; ignoring it", path)
        return {}


def split_effective(target: int, max_micro: int, world: int) -> tuple[int, int, str | None]:
    """(micro-batch, accum) with micro * accum * world == target and micro <= max_micro, the fewest
    accumulation steps first; if no exact split exists, the nearest effective batch and a note."""
    for accum in range(1, target + 1):
        per_rank, rest = divmod(target, accum * world)
        if rest == 0 and 1 <= per_rank <= max_micro:
            return per_rank, accum, None
        if per_rank < 1:
            break
    accum = max(1, math.ceil(target / (max_micro * world)))
    micro = max(1, min(max_micro, round(target / (accum * world))))
    got = micro * accum * world
    return micro, accum, (f"effective_batch={target} cannot be split exactly over world size "
                          f"{world} with a micro-batch <= {max_micro}; using {micro} x {accum} x "
                          f"{world} = {got}")

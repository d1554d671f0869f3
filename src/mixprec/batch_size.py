"""batch=auto: the largest micro-batch that really trains here, found by real training steps.

The seeds' progressive search ("start at the fp32 maximum, grow 50 % until OOM, step back") made
exact and fast: grow until a probe runs out of memory, then bisect between the last batch that
trained and the first that did not, down to `resolution`. Where probes report their peak memory
and the memory limit is known, growth is guided: peak memory is close to linear in the batch, so
two fitting probes predict the largest batch and the search jumps to just below it (then creeps up
in small steps) instead of growing x1.5 twelve times; an out-of-memory jump backs off by 10 %
before bisecting. Without peak memory (tests, odd devices) it is the seeds' plain x`growth`.
Each probe builds fresh model, optimizer
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
    aim: float = 0.97  # guided growth jumps to this fraction of the predicted maximum
    max_batch: int = 65536
    cache: Path | None = None  # JSON file; None = no cache


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def search(probe: Callable[[int], int | None], s: SearchSettings,
           agree: Callable[[int], int] = lambda b: b,
           free: Callable[[], None] = release, limit: int | None = None) -> tuple[int, list[dict]]:
    """(largest batch that trained, the probes). `probe(b)` raises an OOM error if b does not fit
    and may return the peak memory it used (bytes); `limit` is the memory the process may use
    (bytes; None = unguided growth); `agree` makes every rank use the same value (the minimum)
    under DDP; `free` releases memory between probes."""
    probes: list[dict] = []
    fitted: list[tuple[int, int]] = []  # (batch, peak bytes) of probes that trained

    def fits(b: int) -> bool:
        t0 = time.perf_counter()
        peak = None
        try:
            peak = probe(b)
            ok = True
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
            ok = False
        free()
        ok = bool(agree(int(ok)))  # one rank out of memory means the batch does not fit
        peak = -agree(-int(peak or 0)) if ok else 0  # the largest peak over ranks
        if ok and peak > 0:
            fitted.append((b, peak))
        probes.append({"batch": b, "fits": ok, "s": round(time.perf_counter() - t0, 2),
                       "peak_gib": round(peak / 1024**3, 3) if peak else None})
        log.info("batch=auto probe %4d: %s (%.1fs%s)", b, "fits" if ok else "out of memory",
                 probes[-1]["s"], f", peak {peak / 1024**3:.2f} GiB" if peak else "")
        return ok

    def grow(b: int) -> tuple[int, bool]:
        """The next batch to try after b fitted, and whether a prediction chose it."""
        plain = min(s.max_batch, max(b + 1, int(b * s.growth)))
        guess = predict(fitted, limit)
        if guess is None:
            return plain, False
        creep = b + max(s.resolution, b // 32)  # at the predicted edge: small steps up
        return min(s.max_batch, max(int(guess * s.aim), creep), b * 8), True

    free()  # start from a clean allocator: each probe's peak is its own
    lo, hi, guided = 0, None, False  # lo trains, hi does not
    b = s.start
    while hi is None:
        if fits(b):
            lo = b
            if b >= s.max_batch:
                break
            b, guided = grow(b)
        else:
            hi = b
            if lo == 0:  # even the first probe failed: walk down
                if b == 1:
                    raise torch.OutOfMemoryError("batch=auto: not even batch 1 fits in memory")
                hi, b = None, max(1, b // 2)
    while hi is not None and hi - lo > s.resolution:
        # after an overshooting predicted jump, back off 10 % rather than halve the bracket
        mid = int(hi * 0.9) if guided and hi > 1.25 * lo else (lo + hi) // 2
        mid = min(max(mid, lo + 1), hi - 1)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, probes


def predict(fitted: list[tuple[int, int]], limit: int | None) -> int | None:
    """The batch at which peak memory reaches `limit`, by a line through the last two probes
    that trained; None without a limit, two points, or a positive slope."""
    if limit is None or len(fitted) < 2:
        return None
    (b1, p1), (b2, p2) = sorted(fitted[-2:])
    if b2 == b1 or p2 <= p1:
        return None
    per_sample = (p2 - p1) / (b2 - b1)
    return int(b2 + (limit - p2) / per_sample)


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

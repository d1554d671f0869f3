"""batch=auto: the largest micro-batch that really trains here, found by real training steps.

The progressive search of the usual mixed-precision guides ("start at the fp32 maximum, grow 50 %
until OOM, step back") made exact and fast: grow until a probe runs out of memory, then bisect
between the last batch that trained and the first that did not, down to `resolution`. Where probes
report their peak memory and the memory limit is known, growth is guided: peak memory is close to
linear in the batch, so two fitting probes predict the largest batch and the search jumps to just
below it (then creeps up in small steps) instead of growing x1.5 twelve times; an out-of-memory
jump backs off by 10 % before bisecting. Without peak memory (tests, odd devices) it is the plain
x`growth`. Each probe builds fresh model, optimizer and scaler state and runs a few full steps
(forward, backward, optimizer step), so it sees the same memory as training; after an OOM
everything is released before the next probe. The answer, less a safety margin and rounded down to
a multiple of 8 (tensor-core friendly), is cached per (model, input, precision, memory options,
GPU, cap, torch version)."""

from __future__ import annotations

import gc
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import MISSING

from mixprec.core import files, hardware
from mixprec.core.errors import check
from mixprec.parallel import distributed
from mixprec.training import loop

log = logging.getLogger(__name__)
MAX_BATCH = 65536


@dataclass
class BatchSearchConfig:
    """batch_search.* in conf/train.yaml (batch=auto)"""

    start: int = MISSING  # first probe
    growth: float = MISSING  # grow by this factor when no memory reading guides it (+50 %)
    aim: float = (
        MISSING  # guided growth jumps to this fraction of the batch predicted to fill memory
    )
    resolution: int = MISSING  # then bisect until the bracket is this narrow
    margin: float = MISSING  # use (1 - margin) of the largest batch that trained
    probe_steps: int = MISSING  # full training steps per probe
    cache: Optional[str] = MISSING  # JSON cache of results; null = no cache

    def __post_init__(self) -> None:
        check(self.start >= 1, "batch_search.start", self.start, ">= 1")
        check(self.growth > 1, "batch_search.growth", self.growth, "> 1")
        check(0 < self.aim <= 1, "batch_search.aim", self.aim, "in (0, 1]")
        check(self.resolution >= 1, "batch_search.resolution", self.resolution, ">= 1")
        check(0 <= self.margin < 1, "batch_search.margin", self.margin, "in [0, 1)")
        check(self.probe_steps >= 1, "batch_search.probe_steps", self.probe_steps, ">= 1")

    @property
    def cache_path(self) -> Path | None:
        return Path(self.cache).expanduser() if self.cache else None


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def search(
    probe: Callable[[int], int | None],
    s: BatchSearchConfig,
    agree: Callable[[int], int] = lambda b: b,
    free: Callable[[], None] = release,
    limit: int | None = None,
) -> tuple[int, list[dict]]:
    """(largest batch that trained, the probes). `probe(b)` raises an OOM error if b does not fit
    and may return the peak memory it used (bytes); `limit` is the memory the process may use
    (bytes; None = unguided growth); `agree` makes every rank use the same value (the minimum)
    under DDP; `free` releases memory between probes."""
    probes = _Probes(probe, agree, free)

    def grow(b: int) -> tuple[int, bool]:
        """The next batch to try after b fitted, and whether a prediction chose it."""
        plain = min(MAX_BATCH, max(b + 1, int(b * s.growth)))
        guess = predict(probes.fitted, limit)
        if guess is None:
            return plain, False
        creep = b + max(s.resolution, b // 32)  # at the predicted edge: small steps up
        return min(MAX_BATCH, max(int(guess * s.aim), creep), b * 8), True

    free()  # start from a clean allocator: each probe's peak is its own
    lo, hi, guided = 0, None, False  # lo trains, hi does not
    b = s.start
    while hi is None:
        if probes.fits(b):
            lo = b
            if b >= MAX_BATCH:
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
        lo, hi = (mid, hi) if probes.fits(mid) else (lo, mid)
    return lo, probes.log


class _Probes:
    """One search's probes: which batches trained (with their peak memory), logged as they go."""

    def __init__(
        self,
        probe: Callable[[int], int | None],
        agree: Callable[[int], int],
        free: Callable[[], None],
    ) -> None:
        self.probe, self.agree, self.free = probe, agree, free
        self.log: list[dict] = []
        self.fitted: list[tuple[int, int]] = []  # (batch, peak bytes) of probes that trained

    def fits(self, b: int) -> bool:
        t0, peak = time.perf_counter(), None
        try:
            peak, ok = self.probe(b), True
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
            ok = False
        self.free()
        ok = bool(self.agree(int(ok)))  # one rank out of memory means the batch does not fit
        peak = -self.agree(-int(peak or 0)) if ok else 0  # the largest peak over ranks
        if ok and peak > 0:
            self.fitted.append((b, peak))
        self.log.append(
            {
                "batch": b,
                "fits": ok,
                "s": round(time.perf_counter() - t0, 2),
                "peak_gib": round(peak / 1024**3, 3) if peak else None,
            }
        )
        log.info(
            "batch=auto probe %4d: %s (%.1fs%s)",
            b,
            "fits" if ok else "out of memory",
            self.log[-1]["s"],
            f", peak {peak / 1024**3:.2f} GiB" if peak else "",
        )
        return ok


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


def cached(
    key: dict, path: Path | None, compute: Callable[[], tuple[int, list]]
) -> tuple[int, bool]:
    """(batch, came from the cache). The cache only saves time: one that cannot be read is
    ignored and one that cannot be written is skipped, each with a warning."""
    k = json.dumps(key, sort_keys=True)
    table = _read(path)
    if k in table:
        return table[k]["batch"], True
    found, probes = compute()
    if path is not None:
        table = _read(path)
        table[k] = {"batch": found, "probes": probes, "date": time.strftime("%Y-%m-%d %H:%M")}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            files.write_atomic(path, json.dumps(table, indent=1))
        except OSError as e:
            log.warning(
                "batch=auto: could not write the cache %s (%s); the result is used but not "
                "cached (batch_search.cache=<writable path> or null)",
                path,
                e,
            )
    return found, False


def _read(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        table = json.loads(path.read_text())
        if isinstance(table, dict) and all(
            isinstance(v, dict) and isinstance(v.get("batch"), int) for v in table.values()
        ):
            return table
        raise ValueError("not a table of batch sizes")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, UnicodeDecodeError) as e:
        log.warning("batch=auto cache %s is unreadable (%s); ignoring it", path, e)
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
    return (
        micro,
        accum,
        (
            f"effective_batch={target} cannot be split exactly over world size "
            f"{world} with a micro-batch <= {max_micro}; using {micro} x {accum} x "
            f"{world} = {got}"
        ),
    )


def probe_with(
    new_learner: Callable[[int], loop.Learner],
    inputs: Callable[[int], tuple],
    steps: int,
    clip_grad_norm: float | None,
) -> Callable[[int], int]:
    """A probe for search(): real training steps at batch b with fresh model, optimizer and
    scaler state, so it sees the memory training will need; returns the peak (bytes)."""

    def probe(b: int) -> int:
        learner = new_learner(b)
        x, y = inputs(b)
        # training holds a second input batch too (the prefetched next one, or synthetic
        # data's validation batch): a probe without it finds a batch that OOMs in training
        second = (  # noqa: F841  (an input as keyword arguments: each of its tensors)
            {k: torch.empty_like(v) for k, v in x.items()}
            if isinstance(x, Mapping)
            else torch.empty_like(x)
        )
        stepped = 0
        for _ in range(3 * steps):  # skipped fp16 steps allocate no optimizer state
            stepped += loop.train_step(learner, [(x, y)], clip_grad_norm).stepped
            if stepped >= steps:
                break
        torch.cuda.synchronize(y.device)
        return torch.cuda.max_memory_allocated(y.device)

    return probe


def find(
    probe: Callable[[int], int], s: BatchSearchConfig, key: dict, limit: int
) -> tuple[int, int, dict | None]:
    """(micro-batch to use, the largest that trained, why: explain()): the cached answer for
    `key`, or a search (every rank agrees on the smallest), less the margin, rounded down to a
    multiple of 8."""
    t0 = time.perf_counter()
    searched: list[dict] = []

    def compute() -> tuple[int, list]:
        found, probes = search(probe, s, agree=distributed.all_min, limit=limit)
        searched.extend(probes)
        return found, probes

    with hardware.cudnn_benchmark(False):  # probes: heuristics, no per-shape algorithm timing
        found, hit = cached(key, s.cache_path, compute)
    found = distributed.all_min(found)  # a rank that read a different cache still agrees
    batch = with_margin(found, s.margin)
    log.info(
        "batch=auto: largest micro-batch that trains is %d (%s, %.1fs); using %d (margin "
        "%.0f%%, rounded to a multiple of 8)",
        found,
        "cached" if hit else "searched",
        time.perf_counter() - t0,
        batch,
        100 * s.margin,
    )
    if hit:  # the probes of the search that filled the cache
        entry = _read(s.cache_path).get(json.dumps(key, sort_keys=True), {})
        searched = entry.get("probes") or []
    why = explain(searched, batch, limit)
    if why is not None:
        log.info(
            "batch=auto: each sample adds %.1f MiB (what the forward keeps for the backward, "
            "and its temporaries); %.2f GiB does not grow with the batch (weights, gradients, "
            "optimizer state, buffers, workspaces); at batch %d the peak is %.2f GiB of the "
            "%s the process may use (a line through the two largest probes that trained)",
            why["per_sample_mib"],
            why["fixed_gib"],
            batch,
            why["peak_at_batch_gib"],
            f"{why['limit_gib']:.2f} GiB" if why["limit_gib"] else "memory",
        )
    return batch, found, why


def explain(probes: list[dict], batch: int, limit: int | None) -> dict | None:
    """What grows with the batch and what does not, from the probes that trained: a line
    through the two largest (peak = fixed + per_sample x batch); None with fewer than two."""
    fitted = sorted(
        (p["batch"], p["peak_gib"]) for p in probes if p.get("fits") and p.get("peak_gib")
    )
    if len(fitted) < 2 or fitted[-1][0] == fitted[-2][0]:
        return None
    (b1, p1), (b2, p2) = fitted[-2:]
    per = (p2 - p1) / (b2 - b1)
    fixed = p2 - per * b2
    return {
        "batch": batch,
        "per_sample_mib": per * 1024,
        "fixed_gib": fixed,
        "peak_at_batch_gib": fixed + per * batch,
        "limit_gib": limit / 1024**3 if limit else None,
        "probes": [list(f) for f in fitted],
    }

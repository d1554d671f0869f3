"""Which kernels inductor's coordinate-descent tuner walks at all (tuning_ahead.py applies it).

- A kernel whose starting config runs in under min_ms() keeps it (MIXPREC_TUNING_MIN_MS, 0.05
  ms by default: in three traces of experiment=fast on an H200, tuning the kernels under 0.05
  ms bought 0.20-0.35 ms of a ~64 ms step, for 15-19 s of a cold start; a 0.1 ms line saved
  nothing more, benchmarks/RESULTS.md).
- A kernel first launched inside untuned() keeps its starting config; compiling.py enters it
  around the forward of a compiled model in eval mode. A later launch outside tunes it.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

log = logging.getLogger("mixprec.models")
MIN_MS_ENV, MIN_MS = "MIXPREC_TUNING_MIN_MS", 0.05  # faster at its starting config: untuned
_untuned = [0]  # > 0: inside untuned() (a model evaluating), no kernel walks


def begin_untuned() -> None:
    """From now until end_untuned(), a kernel launched for the first time keeps inductor's
    starting config; its walk is skipped, and a later launch outside tunes it. compiling.py
    calls these around the forward of a compiled model in eval mode: on an H200 the first
    evaluation of experiment=fast spent ~14 s of a cold start tuning kernels that run for
    well under a second per evaluation (benchmarks/RESULTS.md)."""
    _untuned[0] += 1


def end_untuned() -> None:
    _untuned[0] = max(0, _untuned[0] - 1)


@contextmanager
def untuned():
    """begin_untuned() ... end_untuned() as a with-block."""
    begin_untuned()
    try:
        yield
    finally:
        end_untuned()


def min_ms() -> float:
    """A kernel faster than this (ms) at its starting config keeps it, untuned."""
    raw = os.environ.get(MIN_MS_ENV, "").strip()
    try:
        value = float(raw) if raw else MIN_MS
        if value >= 0:
            return value
    except ValueError:
        pass
    log.warning("%s=%r is not a number >= 0: %g ms", MIN_MS_ENV, raw, MIN_MS)
    return MIN_MS


def untuned_now() -> bool:
    return _untuned[0] > 0

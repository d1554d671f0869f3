"""The Tracker: one per run, writing each event to a list of sinks (sinks/: the local files
always, then W&B, TensorBoard, ... as logger= chose). A sink that is not essential (every one
but the local files) never stops training: its first failure warns once and drops it, and the
others go on. Rank 0 alone writes; other ranks hold a Tracker without sinks."""

from __future__ import annotations

import logging
import warnings
from typing import Any

log = logging.getLogger(__name__)


def dropped(label: str, what: str, e: Exception) -> None:
    warnings.warn(
        f"{label} {what} failed ({type(e).__name__}: {e}); {label} logging is off for "
        "the rest of this run, local metrics.jsonl/summary.json go on",
        RuntimeWarning,
        stacklevel=4,
    )


class Tracker:
    """`log()` per event, `summary()` at the end, `close()` always (in finally)."""

    def __init__(self, sinks: list | None = None, clock=lambda: {}) -> None:
        self.sinks = list(sinks or [])
        self.clock = clock  # the time/* keys every row carries (Session.clock)

    def _each(self, what: str, call) -> None:
        for sink in list(self.sinks):
            if getattr(sink, "essential", False):
                call(sink)
                continue
            try:
                call(sink)
            except Exception as e:  # never let a dashboard kill a training run
                dropped(sink.label, what, e)
                self.sinks.remove(sink)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One event; keys whose value is None (not measured) are left out of the row."""
        row = {"step": step, **{k: v for k, v in metrics.items() if v is not None}, **self.clock()}
        self._each("log", lambda s: s.log(row))

    def table(self, name: str, rows: list[dict]) -> None:
        if rows:
            self._each("table", lambda s: s.table(name, rows))

    def histograms(self, values: dict[str, Any], step: int) -> None:
        """Tensors become histograms; plain numbers also go to metrics.jsonl."""
        self._each("histogram", lambda s: s.histograms(values, step))

    def summary(self, summary: dict[str, Any]) -> None:
        """summary.json, and the same values as each dashboard's run summary."""
        self._each("summary", lambda s: s.summary(summary))

    def close(self, status: str) -> None:
        self._each("finish", lambda s: s.close(status))

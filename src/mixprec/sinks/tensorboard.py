"""logger=tensorboard: TensorBoard event files in `<run dir>/tensorboard/`, written by torch's
own SummaryWriter (needs the `tensorboard` package: pip install -e '.[tensorboard]').
`tensorboard --logdir outputs/` shows every run; a multirun's jobs appear side by side. Scalars
use the metric names of metrics.jsonl (train/loss, amp/loss_scale, ...) at the optimizer step;
a resumed run drops the events its predecessor logged past the checkpoint (purge_step)."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass

from omegaconf import MISSING

from mixprec.core.errors import ConfigError, check

FILES = ("tensorboard",)


@dataclass
class Config:
    """conf/logger/tensorboard.yaml"""

    flush_s: float = MISSING  # write buffered events to disk at least this often

    def __post_init__(self) -> None:
        check(self.flush_s > 0, "logger.flush_s", self.flush_s, "> 0 (seconds)")


class Sink:
    label = "TensorBoard"
    essential = False  # a failure warns and drops TensorBoard; the local files go on

    def __init__(self, cfg: Config, ctx) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "logger=tensorboard needs the tensorboard package: pip install -e "
                "'.[tensorboard]' (make installs it)"
            ) from None
        before = set(threading.enumerate())
        self.writer = SummaryWriter(
            log_dir=str(ctx.run_dir / "tensorboard"),
            # events from the checkpoint's step on are logged again (its evaluation too, unless
            # the checkpoint holds it)
            purge_step=None if ctx.resume_step is None else ctx.resume_step + ctx.resume_evaluated,
            flush_secs=cfg.flush_s,
        )
        # its writer thread opens the event file again at each write: a folder that stops being
        # writable fails there. That failure is this sink's (the next call raises it, and the
        # tracker drops TensorBoard with one warning), not a traceback on the console.
        self.failure: BaseException | None = None
        self._threads = set(threading.enumerate()) - before
        self._hook, threading.excepthook = threading.excepthook, self._thread_failed
        self.writer.add_text("config", "```\n" + json.dumps(ctx.config, indent=1) + "\n```")

    def _thread_failed(self, args) -> None:
        if args.thread in self._threads:
            self.failure = args.exc_value
        else:
            self._hook(args)

    def _check(self) -> None:
        if self.failure is not None:  # the tracker drops this sink: nothing more will call it
            threading.excepthook = self._hook
            raise self.failure

    def log(self, row: dict) -> None:
        self._check()
        step = row["step"]
        for key, value in row.items():
            if (
                key != "step"
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                self.writer.add_scalar(key, value, step)

    def histograms(self, values: dict, step: int) -> None:
        for key, value in values.items():
            if hasattr(value, "numpy"):
                self.writer.add_histogram(key, value.float(), step)
            else:
                self.writer.add_scalar(key, value, step)

    def table(self, name: str, rows: list[dict]) -> None:
        cols = list(rows[0])
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
        self.writer.add_text(name, "\n".join(lines))

    def summary(self, summary: dict) -> None:
        self.writer.add_text(
            "summary", "```\n" + json.dumps(summary, indent=1, default=str) + "\n```"
        )
        self.writer.flush()

    def close(self, status: str) -> None:
        try:
            self._check()
            self.writer.close()
        finally:
            threading.excepthook = self._hook

"""Loud stops: divergence (a non-finite loss, or a collapsed loss scale, N steps in a row) and
stop signals (SIGTERM / SIGUSR1 / SIGUSR2 / SIGINT / SIGHUP acted on at the next step boundary,
never inside the handler, within a bounded grace)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from omegaconf import MISSING

from mixprec.core.errors import Diverged, check, one_of
from mixprec.parallel.sharding import local

log = logging.getLogger(__name__)


@dataclass
class DebugConfig:
    """debug.* in conf/train.yaml"""

    detect_anomaly: bool = MISSING  # autograd anomaly mode: names the op that made a NaN (slow)
    max_bad_steps: int = MISSING  # stop after this many consecutive non-finite losses
    min_loss_scale: float = MISSING  # stop when the fp16 loss scale collapses below this
    max_skipped_steps: int = MISSING  # stop after this many steps in a row GradScaler skipped
    locate: bool = False  # the doctor names the layer of the first overflowing steps (doctor.py)
    numerics: bool = False  # per-layer cast numerics on logged steps (diagnostics/numerics.py)
    memory: bool = False  # the peak's parts on step 3 (diagnostics/memory.py)
    dtype_plan: str = "check"  # the dtype plan after step 1: check (a mismatch stops), log, off

    def __post_init__(self) -> None:
        one_of("debug.dtype_plan", self.dtype_plan, ("check", "log", "off"))
        check(self.max_bad_steps >= 1, "debug.max_bad_steps", self.max_bad_steps, ">= 1")
        check(self.min_loss_scale > 0, "debug.min_loss_scale", self.min_loss_scale, "> 0")
        check(
            self.max_skipped_steps >= 1, "debug.max_skipped_steps", self.max_skipped_steps, ">= 1"
        )


def by_design(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{buffer name: where it is non-finite} for the float buffers that are non-finite before
    training: an additive causal mask's -inf is the model's design, not a divergence. Taken
    once, when the guard is made (after a resume: a checkpoint only ever holds healthy ones)."""
    return {
        name: ~torch.isfinite(b)
        for name, b in model.named_buffers()
        if b.is_floating_point() and not bool(torch.isfinite(b).all())
    }


def watched(model: torch.nn.Module, design: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Weights and float buffers whose non-finite values mean divergence (a sharded model's:
    this rank's shards; healthy() reduces its verdict over the ranks); a buffer's positions
    that were non-finite by design count as 0, so a NaN anywhere else still counts."""
    params = [local(p) for p in model.parameters()]
    buffers = [
        torch.where(design[name], 0, b) if name in design else b
        for name, b in model.named_buffers()
        if b.is_floating_point()
    ]
    return [*params, *buffers]


class DivergenceGuard:
    """Counts consecutive steps whose loss is non-finite, on the device (no sync per step).

    An fp16 *gradient* overflow with a finite loss is the GradScaler's business (it skips the step
    and backs off); only a non-finite loss itself, a scale below `min_scale`, or `max_skipped`
    steps skipped in a row (a static scale that overflows every step never backs off: the run
    would take batches for ever) count here. `check()` is called where the loop syncs anyway
    (log steps) and before every checkpoint.
    """

    def __init__(
        self,
        device: torch.device,
        max_bad_steps: int,
        min_scale: float,
        reduce=lambda t, op="max": t,
        advice: str = "a lower optimizer.lr or trainer.clip_grad_norm=1.0",
        model: torch.nn.Module | None = None,
        max_skipped: int = 100,
    ) -> None:
        self.bad = torch.zeros((), dtype=torch.int64, device=device)
        self.max_skipped, self.skipped_in_a_row = max_skipped, 0
        self.max_bad_steps, self.min_scale, self.advice = max_bad_steps, min_scale, advice
        self.reduce = reduce  # DDP: every rank decides on the worst rank's count
        self.design = by_design(model) if model is not None else {}

    def update(self, loss: torch.Tensor) -> None:
        self.bad = torch.where(torch.isfinite(loss), 0, self.bad + 1)

    def stepped(self, taken: bool) -> None:
        """Whether GradScaler took the step just settled (every rank's answer is the same)."""
        self.skipped_in_a_row = 0 if taken else self.skipped_in_a_row + 1

    def healthy(self, model: torch.nn.Module) -> bool:
        """The latest loss, every weight and every float buffer are finite (one sync): only then
        write a checkpoint. The loss is computed before the update, so the weights are checked
        too. What a buffer held non-finite before training (`self.design`) is left out."""
        total = torch.nn.utils.get_total_norm([t.detach() for t in watched(model, self.design)])
        bad = self.bad + (~torch.isfinite(total)).long()
        return int(self.reduce(bad, "max")) == 0

    def check(self, step: int, loss: float, scale: float | None, lr: float) -> None:
        bad = int(self.reduce(self.bad, "max"))
        if bad >= self.max_bad_steps:
            raise Diverged(
                f"non-finite loss ({loss}) for {bad} steps in a row at step {step} "
                f"(loss scale {scale}, lr {lr:.4g}). The weights are no longer usable. Try: "
                f"{self.advice}. debug.detect_anomaly=true finds the op that produced it."
            )
        if self.skipped_in_a_row >= self.max_skipped:
            raise Diverged(
                f"GradScaler skipped the last {self.skipped_in_a_row} steps in a row at step "
                f"{step} (loss {loss}, loss scale {scale}, lr {lr:.4g}): the fp16 gradients "
                "overflow at this scale every step, and a static scale never backs off. Try: "
                "a lower scaler.init_scale, scaler=dynamic, or precision=bf16 "
                "(debug.max_skipped_steps sets how many in a row stop the run)."
            )
        if scale is not None and scale < self.min_scale:
            raise Diverged(
                f"the loss scale collapsed to {scale:g} "
                f"(< debug.min_loss_scale={self.min_scale:g}) "
                f"at step {step} (loss {loss}, lr {lr:.4g}): fp16 gradients overflow even barely "
                "scaled, so every step is skipped. Try: trainer.clip_grad_norm=1.0, a lower "
                "optimizer.lr, or precision=bf16."
            )


class StopSignals:
    """A stop signal sets a flag that the loop acts on at the next step boundary (checkpoint,
    `preempted`, exit 128 + signal): SIGTERM/SIGUSR1/SIGUSR2 (a scheduler's preemption or
    time-limit notice: SLURM's --signal, submitit's USR2) and SIGINT (Ctrl-C).

    A step may never end (a CPU stuck compiling a large model): if the loop has not reached a
    boundary `grace_s` seconds after the signal, the process exits 128 + signal without a
    checkpoint, after `on_forced()` (which writes the summary). A second signal exits at once the
    same way. The grace is timed by a watcher thread that learns of the signal from Python's
    wakeup fd, which the C-level handler writes even while the main thread sits in one long
    native call. After the run has stopped, `forward()` hands the signal to the handler that was
    there before (submitit's, which requeues the job)."""

    # SIGHUP: the terminal closed (an ssh session dropped): a stop like the others
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)
    SAME_STOP_S = 0.5  # a copy of the first signal this soon is the same stop, not a second

    def __init__(self, grace_s: float = 25.0, on_forced: Callable[[int], None] = lambda s: None):
        self.grace_s, self.on_forced = grace_s, on_forced
        self.received: int | None = None
        self._previous: dict = {}
        self._acked = threading.Event()
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._old_fd = -1
        self._held = 0  # inside holding(): an evaluation
        self._expired: tuple[int, str] | None = None  # a grace that ran out while held

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return (
                self  # signals reach the main thread only; a launcher's worker thread stays as is
            )
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        self._wake = socket.socketpair()
        self._wake[1].setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._wake[1].fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="mixprec-stop-watch", daemon=True).start()
        return self

    def _handle(self, signum, _frame) -> None:
        self.received = self.received or signum  # the loop acts at the next step boundary

    def _watch(self) -> None:
        """Runs beside training: the first signal starts the grace, a second one ends it. One
        stop can arrive twice at once: GNU `timeout` signals its child and then the child's
        whole process group, so a copy of the first signal within SAME_STOP_S is the same stop."""
        first: tuple[int, float] | None = None
        while True:
            try:
                data = self._wake[0].recv(64)
            except OSError:
                return
            if not data:  # closed by __exit__
                return
            for signum in (s for s in data if s in self.SIGNALS):
                now = time.monotonic()
                if first is not None:
                    if signum == first[0] and now - first[1] < self.SAME_STOP_S:
                        continue
                    self._force(signum, "a second signal")
                first = (signum, now)
                self._start_grace(signum, f"no step boundary within {self.grace_s:g} s")

    def _force_unless_acked(self, signum: int, why: str) -> None:
        if self._held:  # an evaluation: the loop stops right after it
            self._expired = (signum, why)
        elif not self._acked.is_set():
            self._force(signum, why)

    def _force(self, signum: int, why: str) -> None:
        try:
            sys.stderr.write(
                f"\nmixprec: {signal.Signals(signum).name}: {why}; exiting now without "
                f"a checkpoint (exit {128 + signum})\n"
            )
        except (OSError, ValueError):  # no one reads stderr any more (a closed terminal, a
            pass  # killed `| tee`): the run must end all the same
        try:
            self.on_forced(signum)
        finally:
            os._exit(128 + signum)

    @contextmanager
    def holding(self):
        """The grace does not run out inside the block (an evaluation: the loop acts on the
        signal right after it); a grace that ended meanwhile starts again when it ends."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            expired, self._expired = self._expired, None
            if expired is not None and not self._acked.is_set():
                self._start_grace(*expired)

    def _start_grace(self, signum: int, why: str) -> None:
        grace = threading.Timer(self.grace_s, self._force_unless_acked, (signum, why))
        grace.daemon = True
        grace.start()

    def acknowledge(self) -> None:
        """The loop reached a boundary and is stopping in order: the grace no longer applies."""
        self._acked.set()

    def __exit__(self, *exc) -> None:
        self._acked.set()
        for s, handler in self._previous.items():
            # the signal that stopped the run: a late copy of it (GNU timeout sends two) must
            # not raise KeyboardInterrupt in the exit path; forward() still hands it on
            signal.signal(s, signal.SIG_IGN if s == self.received else handler)
        if self._wake is not None:
            signal.set_wakeup_fd(self._old_fd)
            self._wake[0].shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv: it returns
            for sock in self._wake:
                sock.close()

    def forward(self) -> None:
        handler = self._previous.get(self.received)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(self.received, None)


@contextmanager
def signals_held() -> Iterator[None]:
    """The stop signals wait until this block is done, then act as they would have (their
    handler, or their default action): a run's last record is written whole even when a launcher
    stops the process as it writes it (torchrun stops the other ranks when one dies). A handler,
    not a signal mask: a signal sent to the process reaches any thread that does not block it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, _frame: got.append(signum)) for s in StopSignals.SIGNALS
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(got):
            signal.raise_signal(s)

"""Loud stops: divergence (a non-finite loss, or a collapsed loss scale, N steps in a row) and
preemption (SIGTERM / SIGUSR1 handled at the next step boundary, never inside the handler)."""
from __future__ import annotations

import signal
import threading

import torch


class Diverged(RuntimeError):
    """Training cannot recover; the message says what happened and what to try."""


class Preempted(Exception):
    """A stop signal arrived; the run checkpointed and should exit with `exit_code`."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


class DivergenceGuard:
    """Counts consecutive steps whose loss is non-finite, on the device (no sync per step).

    An fp16 *gradient* overflow with a finite loss is the GradScaler's business (it skips the step
    and backs off); only a non-finite loss itself, or a scale below `min_scale`, counts here.
    `check()` is called where the loop syncs anyway (log steps) and before every checkpoint.
    """

    def __init__(self, device: torch.device, max_bad_steps: int, min_scale: float,
                 reduce=lambda t, op="max": t) -> None:
        self.bad = torch.zeros((), dtype=torch.int64, device=device)
        self.max_bad_steps, self.min_scale = max_bad_steps, min_scale
        self.reduce = reduce  # DDP: every rank decides on the worst rank's count

    def update(self, loss: torch.Tensor) -> None:
        self.bad = torch.where(torch.isfinite(loss), 0, self.bad + 1)

    def healthy(self, tensors: list[torch.Tensor]) -> bool:
        """The latest loss and every given tensor (weights, float buffers) are finite (one
        sync): only then write a checkpoint. The loss is computed before the update, so the
        weights are checked too."""
        norms = torch._foreach_norm([t.detach() for t in tensors])
        bad = self.bad + (~torch.isfinite(torch.stack(norms)).all()).long()
        return int(self.reduce(bad, "max")) == 0

    def check(self, step: int, loss: float, scale: float | None, lr: float) -> None:
        bad = int(self.reduce(self.bad, "max"))
        if bad >= self.max_bad_steps:
            raise Diverged(
                f"non-finite loss ({loss}) for {bad} steps in a row at step {step} "
                f"(loss scale {scale}, lr {lr:.4g}). The weights are no longer usable; the last "
                "good checkpoint is kept. Try: a lower optimizer.lr, trainer.clip_grad_norm=1.0, "
                "scaler=conservative (init_scale 4096), or precision=bf16 (fp32's range). "
                "debug.detect_anomaly=true finds the op that produced it.")
        if scale is not None and scale < self.min_scale:
            raise Diverged(
                f"the loss scale collapsed to {scale:g} (< debug.min_loss_scale={self.min_scale:g}) "
                f"at step {step} (loss {loss}, lr {lr:.4g}): fp16 gradients overflow even barely "
                "scaled, so every step is skipped. Try: trainer.clip_grad_norm=1.0, a lower "
                "optimizer.lr, or precision=bf16.")


class StopSignals:
    """Sets a flag on SIGTERM/SIGUSR1/SIGUSR2 (a scheduler's preemption or time-limit notice:
    SLURM's --signal, submitit's USR2). After the run has checkpointed, `forward()` hands the
    signal to the handler that was there before (submitit's, which requeues the job)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        self.received = signum  # nothing else here: the loop acts at the next step boundary

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def forward(self) -> None:
        handler = self._previous.get(self.received)
        if callable(handler):
            handler(self.received, None)

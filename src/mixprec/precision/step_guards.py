"""What the fp16 recipe needs around each step beside autocast and the scaler: whether the
optimizer step really ran (StepWatch), and BatchNorm statistics kept out of an overflowing
forward (BatchNormGuard). Both are objects that do nothing when their precision needs nothing."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from mixprec.core import norms
from mixprec.internals import torch_private


class StepWatch:
    """Tells whether optimizer.step() really ran (GradScaler skips it on inf/nan gradients).

    Uses the optimizer's public step hooks. For most optimizers GradScaler syncs once per step to
    decide whether to call step() at all, so the post-step hook firing means it ran, at no extra
    cost. Fused optimizers (`fused=True`, the default on CUDA) are different: GradScaler calls
    their step() every time and hands them `found_inf`, and the kernel skips the update on the
    GPU without a sync. For those the flag is copied to the host asynchronously behind an event:
    pop() returns a callable that answers when asked, waiting only for that step's kernels (the
    loop asks while the GPU already runs the next step's forward and backward).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._ran, self._found_inf = False, None
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._hook)

    def _pre(self, optimizer, *_args) -> None:
        self._found_inf = getattr(optimizer, "found_inf", None)  # set by GradScaler.step

    def _hook(self, *_args) -> None:
        self._ran = True

    def pop(self) -> Callable[[], bool]:
        ran, found_inf = self._ran, self._found_inf
        self._ran, self._found_inf = False, None
        if not ran or found_inf is None:
            return lambda: ran
        if found_inf.device.type != "cuda":
            return lambda: not bool(found_inf.item())
        flag = found_inf.to("cpu", non_blocking=True)  # pinned: the copy queues behind the step
        copied = torch.cuda.Event()
        copied.record()
        return lambda: not (copied.synchronize() or bool(flag.item()))


class BatchNormGuard:
    """Keeps an overflowing fp16 forward out of BatchNorm's running statistics.

    BatchNorm updates its running mean and variance inside the forward pass, before GradScaler
    can skip the step: one forward that overflows in fp16 turns them NaN for good. Training then
    carries on (train mode normalises with the batch's own statistics), while every evaluation
    and checkpoint after it is NaN. The guard snapshots them before each forward and puts them
    back when that forward's loss is not finite, on the device with no host sync: one
    concatenation before, and a concatenation, a `where` and one foreach copy after the backward.
    Always an object: off (no work at all) without a GradScaler, with
    `scaler.guard_bn_stats=false`, or without BatchNorm layers.
    """

    def __init__(self, model: nn.Module, enabled: bool) -> None:
        self.stats = [
            t
            for m in model.modules()
            if isinstance(m, norms.BATCH_NORMS) and m.running_mean is not None
            for t in (m.running_mean, m.running_var)
        ]
        self.sizes = [t.numel() for t in self.stats]
        self.enabled = enabled and bool(self.stats)

    def snapshot(self) -> torch.Tensor | None:
        return torch.cat(self.stats) if self.enabled else None

    def keep_if_finite(self, loss: torch.Tensor, saved: torch.Tensor | None) -> None:
        if saved is None:
            return
        kept = torch.where(torch.isfinite(loss.detach()), torch.cat(self.stats), saved)
        torch_private.copy_all_(self.stats, list(kept.split(self.sizes)))

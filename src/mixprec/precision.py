"""THE place that knows fp32 / tf32 / fp16 / bf16: autocast, TF32 switches and the GradScaler.

Everything that is off is still an object (autocast with enabled=False, GradScaler with
enabled=False), so the training step never branches on precision.
"""
from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from omegaconf import MISSING
from torch import nn
from torch.amp import GradScaler

from . import fp8
from .errors import ConfigError, check, one_of

log = logging.getLogger(__name__)


@dataclass
class PrecisionConfig:
    """conf/precision/*.yaml"""

    name: str = MISSING  # the group option that chose this (fp32, tf32, amp, amp_accum, bf16)
    autocast: Optional[str] = MISSING  # autocast dtype: null (off), float16 or bfloat16
    tf32: bool = MISSING  # TF32 tensor cores for fp32 matmuls/convs (Ampere and later)
    accum: int = MISSING  # default micro-batches per optimizer step (the top-level `accum` reads it)
    fp8_recipe: Optional[str] = None  # fp8 only: torchao's scaling (tensorwise, rowwise, ...)
    fp8_head: Optional[bool] = None  # fp8 only: convert the classifier head too

    def __post_init__(self) -> None:
        check(self.autocast in (None, *_DTYPES), "precision.autocast", self.autocast,
              "null, float16 or bfloat16")
        check(self.accum >= 1, "precision.accum", self.accum, "an int >= 1")
        if self.fp8_recipe is not None:
            one_of("precision.fp8_recipe", self.fp8_recipe, fp8.RECIPES)
            check(self.autocast == "bfloat16", "precision.autocast", self.autocast,
                  "bfloat16 with precision.fp8_recipe (what float8 does not take runs in bf16)")


@dataclass
class ScalerConfig:
    """conf/scaler/*.yaml (dynamic holds the values; the other presets extend it)"""

    name: str = MISSING  # the group option (dynamic, conservative, static, off)
    enabled: bool = MISSING  # only takes effect with float16 autocast
    init_scale: float = MISSING  # first loss scale (2^16 is torch's default; 2^12 the cautious start)
    growth_factor: float = MISSING  # scale *= this after growth_interval overflow-free steps
    backoff_factor: float = MISSING  # scale *= this on an overflow (and the step is skipped)
    growth_interval: int = MISSING  # overflow-free steps before the scale grows
    static: bool = MISSING  # keep init_scale fixed forever (overflowing steps are still skipped)
    guard_bn_stats: bool = MISSING  # undo BatchNorm's running-stat update of an overflowing forward

    def __post_init__(self) -> None:
        check(self.init_scale > 0, "scaler.init_scale", self.init_scale, "> 0")
        check(self.growth_factor > 1.0, "scaler.growth_factor", self.growth_factor, "> 1.0")
        check(0.0 < self.backoff_factor < 1.0, "scaler.backoff_factor", self.backoff_factor,
              "in (0, 1)")
        check(self.growth_interval >= 1, "scaler.growth_interval", self.growth_interval, ">= 1")


_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class StaticGradScaler(GradScaler):
    """A fixed loss scale: overflowing steps are still skipped, but the scale never moves."""

    def update(self, new_scale=None) -> None:
        super().update(self._init_scale if new_scale is None else new_scale)


@dataclass
class Precision:
    name: str
    device_type: str
    dtype: torch.dtype | None  # autocast dtype; None = autocast off
    tf32: bool
    scaler: GradScaler  # enabled only for float16 autocast with a scaler configured
    guard_bn_stats: bool  # with an active scaler: BatchNormGuard puts overflowed stats back
    linears: fp8.KeepLinears | fp8.Float8Training = field(default_factory=fp8.KeepLinears)
    cache: bool = True  # autocast's weight-cast cache (off under CUDA graphs, as torch requires)

    def autocast(self) -> AbstractContextManager:
        dtype = self.dtype or torch.get_autocast_dtype(self.device_type)
        return torch.autocast(self.device_type, dtype=dtype, enabled=self.dtype is not None,
                              cache_enabled=self.cache)

    @property
    def peak_key(self) -> str:
        """Which hardware.peak_tflops entry bounds this run's matmuls (for MFU)."""
        if self.dtype is not None:
            return "fp16" if self.dtype == torch.float16 else "bf16"
        return "tf32" if self.tf32 else "fp32"

    def loss_scale(self) -> float:
        """The current loss scale (1.0 when scaling is off). Reading it syncs the GPU."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    @property
    def scaling(self) -> bool:
        """A GradScaler is active (float16 autocast with scaler enabled)."""
        return self.scaler.is_enabled()

    def describe(self) -> str:
        cast = f"autocast {str(self.dtype).replace('torch.', '')}" if self.dtype else "autocast off"
        s = self.scaler
        scale = (f"GradScaler init_scale={s._init_scale:g} growth={s._growth_factor:g} "
                 f"backoff={s._backoff_factor:g} interval={s._growth_interval}"
                 + (" (static)" if isinstance(s, StaticGradScaler) else "")
                 if s.is_enabled() else "GradScaler off")
        return f"precision={self.name}: {cast}, {scale}, TF32 {'on' if self.tf32 else 'off'}"


def set_tf32(enabled: bool) -> None:
    """TF32 for fp32 matmuls and convolutions; explicit both ways (cuDNN defaults to on)."""
    mode = "tf32" if enabled else "ieee"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9: the new API only
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
        torch.backends.cudnn.rnn.fp32_precision = mode
    else:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def build(pcfg: PrecisionConfig, scfg: ScalerConfig, device: torch.device) -> Precision:
    dtype = _DTYPES.get(pcfg.autocast) if pcfg.autocast else None
    if dtype is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"precision={pcfg.name}: {torch.cuda.get_device_name(device)} has no "
                          "bfloat16 support; use one of fp32, tf32, amp, amp_accum")
    use_scaler = dtype is torch.float16 and scfg.enabled
    if dtype is torch.float16 and not scfg.enabled:
        log.warning("precision=%s with scaler=off: fp16 gradients below 2^-24 flush to zero and "
                    "overflows are not skipped; use scaler=dynamic unless you mean it", pcfg.name)
    cls = StaticGradScaler if scfg.static else GradScaler
    scaler = cls(device.type, init_scale=scfg.init_scale, growth_factor=scfg.growth_factor,
                 backoff_factor=scfg.backoff_factor, growth_interval=scfg.growth_interval,
                 enabled=use_scaler)
    set_tf32(pcfg.tf32)
    linears = fp8.KeepLinears()
    if pcfg.fp8_recipe is not None:
        fp8.check_device(device)
        linears = fp8.Float8Training(pcfg.fp8_recipe, bool(pcfg.fp8_head))
    return Precision(pcfg.name, device.type, dtype, pcfg.tf32, scaler,
                     guard_bn_stats=use_scaler and scfg.guard_bn_stats, linears=linears)


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
        self.stats = [t for m in model.modules()
                      if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
                      for t in (m.running_mean, m.running_var)]
        self.sizes = [t.numel() for t in self.stats]
        self.enabled = enabled and bool(self.stats)

    def snapshot(self) -> torch.Tensor | None:
        return torch.cat(self.stats) if self.enabled else None

    def keep_if_finite(self, loss: torch.Tensor, saved: torch.Tensor | None) -> None:
        if saved is None:
            return
        kept = torch.where(torch.isfinite(loss.detach()), torch.cat(self.stats), saved)
        torch._foreach_copy_(self.stats, list(kept.split(self.sizes)))

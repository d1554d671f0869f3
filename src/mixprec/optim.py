"""Optimizer (timm's factory: no weight decay on biases/norms) with the LR scaling rule, and the
LR schedules. Schedules count real optimizer steps: the loop steps them only after a step that
GradScaler did not skip."""
from __future__ import annotations

import logging
import math

import torch
from timm.optim import create_optimizer_v2
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

from .config import OptimizerConfig, SchedulerConfig

log = logging.getLogger(__name__)


def scaled_lr(ocfg: OptimizerConfig, effective_batch: int) -> float:
    """The seeds' linear scaling rule: lr = base_lr * effective_batch / base_batch (or sqrt)."""
    ratio = effective_batch / ocfg.base_batch
    factor = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[ocfg.scale_lr]
    return ocfg.lr * factor


def use_fused(ocfg: OptimizerConfig, device_type: str) -> bool:
    """Fused kernels (one multi-tensor launch per step) by default on CUDA."""
    if ocfg.fused is not None:
        return ocfg.fused
    return device_type == "cuda" and ocfg.foreach is None


def zero_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Give fused SGD its momentum buffers up front, as zeros. torch's fused SGD creates them with
    empty_like at its first step; when GradScaler skips that step (fp16's usual overflow at the
    start) the kernel returns before writing them and training continues from uninitialised
    memory (on the CPU a conv once ended 5e37 away from foreach SGD). With dampening 0, zeros are
    exact: the first real step's momentum * 0 + g is g, which is what torch sets on a first step,
    and a skipped step leaves them untouched (the kernel returns on found_inf)."""
    for group in optimizer.param_groups:
        if group.get("fused") and group.get("momentum") and group.get("dampening") == 0:
            for p in group["params"]:
                optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))


def build_optimizer(ocfg: OptimizerConfig, model: torch.nn.Module, lr: float,
                    device: torch.device) -> torch.optim.Optimizer:
    fused = use_fused(ocfg, device.type)
    kwargs = dict(fused=True) if fused else dict(foreach=ocfg.foreach)
    if ocfg.name == "sgd":
        kwargs.update(momentum=ocfg.momentum, nesterov=ocfg.nesterov)
    else:
        kwargs.update(betas=tuple(ocfg.betas), eps=ocfg.eps)
    log.info("optimizer=%s: %s", ocfg.name, "fused kernels" if fused else
             {True: "foreach kernels", False: "per-tensor kernels"}.get(
                 ocfg.foreach, "torch's default kernels (foreach on a GPU)"))
    optimizer = create_optimizer_v2(model, ocfg.name, lr=lr, weight_decay=ocfg.weight_decay,
                                    **kwargs)
    zero_momentum(optimizer)
    return optimizer


def build_scheduler(scfg: SchedulerConfig, optimizer: torch.optim.Optimizer,
                    total_steps: int) -> LRScheduler:
    total_steps = max(1, total_steps)
    if scfg.name == "onecycle":
        max_lr = [g["lr"] for g in optimizer.param_groups]
        return OneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps,
                          pct_start=scfg.pct_start)
    warm = min(scfg.warmup_steps, total_steps)

    def factor(step: int) -> float:
        if step < warm:
            return scfg.warmup_start + (1 - scfg.warmup_start) * step / warm
        if scfg.name == "cosine":
            t = (step - warm) / max(1, total_steps - warm)
            return scfg.min_lr_ratio + (1 - scfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
        if scfg.name == "step":
            return scfg.gamma ** ((step - warm) // scfg.step_size)
        return 1.0  # constant

    return LambdaLR(optimizer, factor)

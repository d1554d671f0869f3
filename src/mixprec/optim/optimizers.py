"""Optimizer (timm's factory: no weight decay on biases/norms) with the LR scaling rule, and the
LR schedules. Schedules count real optimizer steps: the loop steps them only after a step that
GradScaler did not skip. Which keys each optimizer and schedule reads is the registry below:
a key set for an option that does not read it is a config error, not silently ignored."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional

import torch
from omegaconf import MISSING
from timm.optim import create_optimizer_v2
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

from mixprec.core import targets
from mixprec.core.errors import CheckpointError, ConfigError, check, one_of
from mixprec.optim import states as optim_states

log = logging.getLogger(__name__)

# the keys each option reads beside name/lr/... (conf/optimizer/*.yaml, conf/scheduler/*.yaml)
OPTIMIZER_KEYS = {
    "sgd": ("momentum", "nesterov"),
    "adamw": ("betas", "eps"),
    "own": ("target", "path", "kwargs"),  # your optimizer: optimizer.target=pkg.module:callable
}
SCHEDULE_KEYS = {
    "cosine": ("warmup_steps", "warmup_fraction", "warmup_start", "min_lr_ratio"),
    "step": ("warmup_steps", "warmup_fraction", "warmup_start", "step_size", "gamma"),
    "onecycle": ("pct_start",),
    "constant": ("warmup_steps", "warmup_fraction", "warmup_start"),
    "wsd": ("warmup_steps", "warmup_fraction", "warmup_start", "decay_fraction", "min_lr_ratio"),
}
LR_SCALING = ("linear", "sqrt", "none")


def _only_its_keys(group: str, cfg, registry: dict) -> None:
    """The option is known, and the option-specific keys it does not read are unset (null)."""
    one_of(group, cfg.name, registry)
    optional = {k for keys in registry.values() for k in keys}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in optional and f.name not in registry[cfg.name] and value is not None:
            raise ConfigError(
                f"{group}.{f.name}={value!r} is not read by {group}={cfg.name} "
                f"(its keys: {', '.join(registry[cfg.name])})"
            )


@dataclass
class OptimizerConfig:
    """conf/optimizer/*.yaml; keys another optimizer reads stay null."""

    name: str = MISSING  # sgd or adamw
    lr: float = MISSING  # base learning rate at base_batch; scaled by scale_lr
    base_batch: int = MISSING  # the effective batch that `lr` was tuned for
    scale_lr: str = MISSING  # linear: lr*eff/base (Goyal et al.), sqrt (Adam-type), or none
    weight_decay: float = MISSING  # not applied to biases and norm layers (timm's filter)
    fused: Optional[bool] = MISSING  # null = fused kernels on CUDA where torch has them
    foreach: Optional[bool] = MISSING  # null = torch's choice
    momentum: Optional[float] = None  # sgd
    nesterov: Optional[bool] = None  # sgd
    betas: Optional[List[float]] = None  # adamw
    eps: Optional[float] = None  # adamw
    state: str = "fp32"  # adamw: fp32, 8bit, 4bit, fp8 moments; bf16 weights+moments (torchao)
    offload: str = "none"  # cpu: the state in host memory, the step on the CPU (torchao)
    target: Optional[str] = None  # own: 'pkg.module:callable' (torch.optim:RMSprop, yours)
    path: Optional[str] = None  # own: a folder put first on the module path for the target
    kwargs: Optional[Dict[str, Any]] = None  # own: the target's own arguments

    def __post_init__(self) -> None:
        _only_its_keys("optimizer", self, OPTIMIZER_KEYS)
        if self.name == "own":
            if self.target is None:
                raise ConfigError(
                    "optimizer=own: optimizer.target=None is not allowed; it names your "
                    "optimizer as 'package.module:callable' (e.g. torch.optim:RMSprop)"
                )
            targets.check_target("optimizer.target", self.target)
        optim_states.check_config(self)
        check(math.isfinite(self.lr) and self.lr > 0, "optimizer.lr", self.lr, "finite and > 0")
        check(self.base_batch >= 1, "optimizer.base_batch", self.base_batch, "an int >= 1")
        one_of("optimizer.scale_lr", self.scale_lr, LR_SCALING)
        check(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, ">= 0")
        check(
            self.betas is None or (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)),
            "optimizer.betas",
            self.betas,
            "a list of two floats in [0, 1)",
        )
        check(self.eps is None or self.eps > 0, "optimizer.eps", self.eps, "> 0")
        check(
            self.momentum is None or 0 <= self.momentum < 1,
            "optimizer.momentum",
            self.momentum,
            "in [0, 1)",
        )
        check(
            not (self.fused and self.foreach),
            "optimizer.fused",
            self.fused,
            "false or null when optimizer.foreach=true (torch allows only one)",
        )


@dataclass
class SchedulerConfig:
    """conf/scheduler/*.yaml; counts real optimizer steps. Keys another schedule reads stay null."""

    name: str = MISSING  # cosine, step, onecycle, constant or wsd
    warmup_fraction: Optional[float] = None  # linear warm-up over this fraction of the run's steps
    warmup_steps: Optional[int] = None  # ... or over this many steps, when set
    warmup_start: Optional[float] = None  # lr factor at step 0 of the warm-up
    min_lr_ratio: Optional[float] = None  # cosine: floor as a fraction of the lr
    step_size: Optional[int] = None  # step: multiply by gamma every step_size optimizer steps
    gamma: Optional[float] = None  # step: decay factor
    pct_start: Optional[float] = None  # onecycle: fraction of steps spent increasing the lr
    decay_fraction: Optional[float] = None  # wsd: the last fraction of the run, decayed linearly

    def __post_init__(self) -> None:
        _only_its_keys("scheduler", self, SCHEDULE_KEYS)
        ranges = {  # the interval each message states is the one checked
            "warmup_fraction": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "warmup_start": (lambda v: 0 < v <= 1, "in (0, 1]"),
            "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
            "gamma": (lambda v: 0 < v <= 1, "in (0, 1]"),
            "pct_start": (lambda v: 0 < v < 1, "in (0, 1)"),
            "decay_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
        }
        for key, (ok, text) in ranges.items():
            v = getattr(self, key)
            check(v is None or ok(v), f"scheduler.{key}", v, text)
        check(
            self.warmup_steps is None or self.warmup_steps >= 0,
            "scheduler.warmup_steps",
            self.warmup_steps,
            "null (use warmup_fraction) or an int >= 0",
        )
        check(
            self.step_size is None or self.step_size >= 1,
            "scheduler.step_size",
            self.step_size,
            ">= 1",
        )

    def warmup(self, total_steps: int) -> int:
        """Warm-up length in optimizer steps: warmup_steps if given, else the fraction."""
        if self.warmup_steps is not None:
            return min(self.warmup_steps, total_steps)
        return int(round((self.warmup_fraction or 0.0) * total_steps))


def scaled_lr(ocfg: OptimizerConfig, effective_batch: int) -> float:
    """lr = base lr x (effective_batch / base_batch) for `linear` (Goyal et al.), its square root
    for `sqrt` (the rule that holds for Adam-type optimizers), or unchanged for `none`."""
    ratio = effective_batch / ocfg.base_batch
    factor = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[ocfg.scale_lr]
    return ocfg.lr * factor


def use_fused(ocfg: OptimizerConfig, device_type: str) -> bool:
    """Fused kernels (one multi-tensor launch per step) by default on CUDA (not torchao's)."""
    if optim_states.used(ocfg):
        return False
    if ocfg.fused is not None:
        return ocfg.fused
    return device_type == "cuda" and ocfg.foreach is None


def zero_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Give fused SGD its momentum buffers up front, as zeros. torch's fused SGD creates them with
    empty_like at its first step; when GradScaler skips that step (fp16's usual overflow at the
    start) the kernel returns before writing them and training would continue from uninitialised
    memory. With dampening 0, zeros are exact: the first real step's momentum * 0 + g is g, which
    is what torch sets on a first step, and a skipped step leaves them untouched."""
    for group in optimizer.param_groups:
        if group.get("fused") and group.get("momentum") and group.get("dampening") == 0:
            for p in group["params"]:
                optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))


def build_optimizer(
    ocfg: OptimizerConfig, model: torch.nn.Module, lr: float, device: torch.device
) -> torch.optim.Optimizer:
    if optim_states.used(ocfg):  # low-bit states or CPU offload: torchao's optimizers
        return optim_states.build(ocfg, model, lr)
    if ocfg.name == "own":
        return own_optimizer(ocfg, model, lr)
    fused = use_fused(ocfg, device.type)
    kwargs = dict(fused=True) if fused else dict(foreach=ocfg.foreach)
    kwargs.update(
        {
            k: tuple(v) if isinstance(v, list) else v
            for k in OPTIMIZER_KEYS[ocfg.name]
            for v in [getattr(ocfg, k)]
        }
    )
    log.info(
        "optimizer=%s: %s",
        ocfg.name,
        "fused kernels"
        if fused
        else {True: "foreach kernels", False: "per-tensor kernels"}.get(
            ocfg.foreach, "torch's default kernels"
        ),
    )
    optimizer = create_optimizer_v2(
        model, ocfg.name, lr=lr, weight_decay=ocfg.weight_decay, **kwargs
    )
    zero_momentum(optimizer)
    return optimizer


def own_optimizer(ocfg: OptimizerConfig, model: torch.nn.Module, lr: float):
    """optimizer=own: the callable optimizer.target names, called with optimizer.kwargs and,
    where its signature names them, `params` (timm's groups: no weight decay on biases and
    norms), `lr` (the scaled learning rate), `weight_decay` and `model`."""
    from timm.optim import param_groups_weight_decay

    fn = targets.load("optimizer.target", ocfg.target, ocfg.path)
    groups = param_groups_weight_decay(model, ocfg.weight_decay)
    facts = {"params": groups, "lr": lr, "weight_decay": ocfg.weight_decay, "model": model}
    optimizer = targets.call("optimizer.target", ocfg.target, fn, dict(ocfg.kwargs or {}), facts)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer.target={ocfg.target!r} returned {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer"
        )
    log.info("optimizer=own: %s from %s", type(optimizer).__name__, ocfg.target)
    return optimizer


def build_scheduler(
    scfg: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> LRScheduler:
    total_steps = max(1, total_steps)
    if scfg.name == "onecycle":
        max_lr = [g["lr"] for g in optimizer.param_groups]
        return OneCycleLR(
            optimizer, max_lr=max_lr, total_steps=total_steps, pct_start=scfg.pct_start
        )
    warm, decay = scfg.warmup(total_steps), _DECAYS[scfg.name]
    if scfg.name == "step" and scfg.step_size >= total_steps - warm:
        log.warning(
            "scheduler=step: scheduler.step_size=%d is not below this run's %d steps after "
            "warm-up, so the learning rate never steps down; lower scheduler.step_size",
            scfg.step_size,
            total_steps - warm,
        )

    def factor(step: int) -> float:
        if step < warm:
            return scfg.warmup_start + (1 - scfg.warmup_start) * step / warm
        return decay(scfg, step - warm, max(1, total_steps - warm))

    return LambdaLR(optimizer, factor)


def _cosine(scfg: SchedulerConfig, step: int, steps: int) -> float:
    t = min(step / steps, 1.0)
    return scfg.min_lr_ratio + (1 - scfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def _wsd(scfg: SchedulerConfig, step: int, steps: int) -> float:
    """Warm-up, stable, decay: the full lr until the last decay_fraction of the steps after
    warm-up, then linear to min_lr_ratio (a loss read inside the stable phase does not move
    with the run's length)."""
    stable = steps - scfg.decay_fraction * steps
    if step <= stable:
        return 1.0
    t = min((step - stable) / (steps - stable), 1.0)
    return 1.0 - (1 - scfg.min_lr_ratio) * t


_DECAYS = {
    "cosine": _cosine,
    "wsd": _wsd,
    "step": lambda scfg, step, steps: scfg.gamma ** (step // scfg.step_size),
    "constant": lambda scfg, step, steps: 1.0,
}


def rebase_lr(scheduler: LRScheduler, optimizer: torch.optim.Optimizer, lr: float) -> bool:
    """A resumed run whose lr differs from the checkpoint's: the schedule goes on from its step
    with `lr` as its base, so what trains is what the log, summary and W&B say. Returns whether
    it changed anything; a schedule that cannot take a new base (onecycle) is refused."""
    if all(math.isclose(b, lr, rel_tol=1e-6) for b in scheduler.base_lrs):  # fp32 tensors too
        return False
    if not isinstance(scheduler, LambdaLR):
        raise ValueError("scheduler=onecycle plans its lr from the start; it cannot take a new lr")
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], now = lr, lr * factor(scheduler.last_epoch)
        if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep it as a tensor
            group["lr"].fill_(now)
        else:
            group["lr"] = now
    return True


def continue_at_lr(learner, lr: float, checkpoint, step: int) -> None:
    """A resumed run with a new lr (after a divergence, say): the restored schedule continues at
    that base, and says so; a schedule that cannot is a checkpoint error naming the file."""
    try:
        changed = rebase_lr(learner.scheduler, learner.optimizer, lr)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {checkpoint}: {e}; resume with its lr") from None
    if changed:
        log.warning(
            "resume: the lr is now %.4g; the schedule goes on from step %d at that base", lr, step
        )

"""precision.keep_fp32: chosen layers compute in fp32 while the rest of the model runs in the
precision's dtype (the seeds' 分层精度分配: "force specific layers to FP32, such as the softmax of
attention; keep BatchNorm in FP32"). A kept module runs with autocast off, its floating inputs
cast up to fp32 and its floating outputs cast back to the dtype its first input came in, so the
layers around it see what they saw before. Its weights must be fp32 (every shipped precision
keeps fp32 weights). Patterns are module names (fnmatch globs: `layers.*.attention`, `output`),
class names (`LayerNorm`), or presets: `norms` (every normalisation layer), `head` (the
output layer the model declares, or its source names: models/parts.py), `attention`
(modules whose class name says so)."""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch import nn

from mixprec.core.errors import ConfigError
from mixprec.models.parts import head_of

log = logging.getLogger("mixprec.precision.base")
NORMS = ("BatchNorm", "SyncBatchNorm", "LayerNorm", "GroupNorm", "RMSNorm", "InstanceNorm")
PRESETS = ("norms", "head", "attention")


def matches(name: str, module: nn.Module, pattern: str, head: str | None) -> bool:
    cls = type(module).__name__
    if pattern == "norms":
        return cls.startswith(NORMS)
    if pattern == "head":
        return head is not None and name == head
    if pattern == "attention":
        return "Attention" in cls
    return fnmatch.fnmatchcase(name, pattern) or cls == pattern


def select(model: nn.Module, patterns: list[str]) -> list[str]:
    """The outermost modules a pattern matches (a kept module's children run inside it); a
    pattern that matches no module is a config error."""
    head = head_of(model)
    named = [(n, m) for n, m in model.named_modules() if n]
    for p in patterns:
        if not any(matches(n, m, p, head) for n, m in named):
            raise ConfigError(
                f"precision.keep_fp32: {p!r} matches no module of this model (a module name "
                f"glob, a class name, or one of {', '.join(PRESETS)})"
            )
    chosen: list[str] = []
    for name, module in named:
        if any(name.startswith(c + ".") for c in chosen):
            continue
        if any(matches(name, module, p, head) for p in patterns):
            chosen.append(name)
    return chosen


def keep(model: nn.Module, patterns: list[str], device_type: str, owned: set[str]) -> list[str]:
    """Run the modules `patterns` select in fp32; returns their names. A module the precision
    converted (a float8 layer) is a config error: it runs in one format or the other."""
    if not patterns:
        return []
    chosen = select(model, patterns)
    modules = dict(model.named_modules())
    for name in chosen:
        if name in owned or any(o.startswith(name + ".") for o in owned):
            raise ConfigError(
                f"precision.keep_fp32: {name} is converted by the precision (e.g. to float8); "
                "a layer runs in fp32 or in the precision's format, not both"
            )
        module = modules[name]
        low = [n for n, p in module.named_parameters() if p.dtype != torch.float32]
        if low:
            raise ConfigError(
                f"precision.keep_fp32: {name}'s weights are not fp32 ({low[0]}); keep_fp32 "
                "needs a precision that keeps fp32 weights"
            )
        module.forward = _in_fp32(module.forward, device_type)
    log.info(
        "precision.keep_fp32 %s: %d modules compute in fp32 (%s)",
        list(patterns),
        len(chosen),
        ", ".join(chosen[:6]) + (" ..." if len(chosen) > 6 else ""),
    )
    return chosen


def _floating(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _in_fp32(forward, device_type: str):
    def fp32_forward(*args, **kwargs):
        first = next((a for a in args if _floating(a)), None)
        up = lambda v: v.float() if _floating(v) else v  # noqa: E731
        with torch.autocast(device_type, enabled=False):
            out = forward(*map(up, args), **{k: up(v) for k, v in kwargs.items()})
        if first is None or first.dtype == torch.float32:
            return out
        back = lambda v: v.to(first.dtype) if _floating(v) else v  # noqa: E731
        return tuple(map(back, out)) if isinstance(out, tuple) else back(out)

    return fp32_forward

"""Reads of torch's private state that no public API gives, all in one place (nothing here
changes torch: the patches are the other modules of internals/). Each reader says what it needs
and falls back where another torch lacks it; the rest of mixprec reaches torch's underscore
names only through here (tests/test_internals.py greps every other module for them).

- compiled modules: torch.compile's OptimizedModule and the module under it;
- compile and tuning seconds: dynamo's own counters (summary.json's compile_s, tune_s);
- dynamo's recompile limit (compile_scope=blocks compiles each block's shapes once);
- inductor's options for a compile mode (model.compile_options on top of a mode), and its
  import ahead of timing (fp8_auto's timing processes);
- the foreach copy that puts BatchNorm statistics back in one kernel per dtype each step;
- the entries of a compile-cache file (model.compile_cache), read before torch writes them.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn


def compiled_module(model: nn.Module) -> nn.Module | None:
    """The module torch.compile wrapped, if `model` is torch.compile's wrapper; else None."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else None


def compile_seconds() -> float | None:
    """Wall seconds torch.compile has spent in this process (dynamo's counter); None where
    another torch lacks it."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return calculate_time_spent().get("total_wall_time", 0.0)
    except Exception:  # noqa: BLE001  (a private counter: absent in another torch)
        return None


def tuning_seconds() -> float | None:
    """Seconds Triton kernel tuning (autotune, coordinate descent) has taken in this process."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except Exception:  # noqa: BLE001
        return None
    keys = [k for k in compilation_time_metrics if "coordinate_descent" in k or "autotune" in k]
    return sum(sum(compilation_time_metrics[k]) for k in keys)


def raise_recompile_limit(limit: int) -> None:
    """Dynamo's recompile limit at least `limit` (its name changed from cache_size_limit)."""
    config = torch._dynamo.config
    key = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, key, max(getattr(config, key), limit))


def inductor_mode_options(mode: str) -> dict:
    """The inductor options a torch.compile mode stands for."""
    from torch import _inductor

    return dict(_inductor.list_mode_options(mode))


def import_inductor() -> None:
    """Inductor's compiler imported now (seconds of imports a timing process does ahead)."""
    importlib.import_module("torch._inductor.compile_fx")


def copy_all_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i].copy_(sources[i]) for all, as one foreach kernel (a loop is a launch each)."""
    torch._foreach_copy_(targets, sources)


def cache_artifact_keys(blob: bytes) -> list[tuple[str, str]] | None:
    """(type, key) of each entry of a torch.compiler.save_cache_artifacts file, read without
    writing anything (torch's loader joins each key to its cache's dir and writes there, so a
    key that is an absolute path or climbs with '..' writes anywhere). None where this torch
    cannot read the file, or has no such reader."""
    try:
        from torch.compiler._cache import CacheArtifactManager

        artifacts = CacheArtifactManager.deserialize(blob)  # (no unpickling: strings and bytes)
        if artifacts is None:
            return None
        return [(kind, str(a.key)) for kind, entries in artifacts.items() for a in entries]
    except (ImportError, AttributeError, TypeError):  # another torch's layout: no reader
        return None

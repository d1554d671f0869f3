"""Datasets, one module each: `Config` (its keys, validated), `spec(cfg)` -> (num_classes, input
shape) without loading anything, and `build(cfg, ctx)` -> Data. `conf/data/<name>.yaml` names
its module as `plugin` (mixprec.data.<name>, or yours outside src/, found as precision.plugin
is): adding a dataset is those two files.

Every training loader has the same small interface: `len()` micro-batches per epoch,
`set_epoch(epoch, skip)` to fix the epoch's order and resume part-way through it, and iteration
yielding (inputs, targets) already on the training device in the model's memory format.

May import: core.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

from mixprec.core import targets
from mixprec.core.errors import ConfigError
from mixprec.data.base import Context, Data, DataConfig, Workers

__all__ = ["Context", "Data", "DataConfig", "Workers", "names", "parse", "spec", "task", "build"]


def names() -> list[str]:
    """The datasets: the modules of this package that define a Config and build()."""
    return sorted(
        m.name
        for m in pkgutil.iter_modules(__path__)
        if hasattr(_module(m.name), "build") and hasattr(_module(m.name), "Config")
    )


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def module_for(cfg: Any) -> ModuleType:
    return plugin_module(cfg.plugin)


def plugin_module(path: str) -> ModuleType:
    """The module that implements a dataset (`data.plugin`), checked."""
    return targets.plugin(
        "data.plugin",
        path,
        ("Config", "spec", "build"),
        "dataset",
        "Config (a DataConfig), spec(cfg) and build(cfg, ctx)",
        f", e.g. mixprec.data.digits (mixprec's own: {', '.join(names())})",
    )


def parse(node: dict) -> Any:
    """The dataset's own Config from the composed `data` node: unknown keys and bad values are
    ConfigErrors naming the key."""
    name = node.get("name")
    if "target" in node and name != "custom":
        raise ConfigError(
            f"data.target is not a key of data={name}: your own datasets are "
            f"data=custom data.target={node['target']} (src/mixprec/data/custom.py)"
        )
    return targets.parse_plugin("data", node, "name", plugin_module)


def spec(cfg: Any) -> tuple[int, tuple[int, ...]]:
    """(num_classes, input shape C,H,W) without loading anything (for batch=auto's probes)."""
    return module_for(cfg).spec(cfg)


def task(cfg: Any):
    """What a model learns from this dataset (tasks.py): its module's task(cfg) or TASK, else
    classification."""
    from mixprec.core.tasks import CLASSIFY

    module = module_for(cfg)
    return module.task(cfg) if hasattr(module, "task") else getattr(module, "TASK", CLASSIFY)


def build(cfg: Any, ctx: Context) -> Data:
    return module_for(cfg).build(cfg, ctx)

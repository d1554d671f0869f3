"""Parallel strategies are plugins, found the way precisions are; this module is the interface.

`conf/parallel/<name>.yaml` names its `plugin`: a module with a `Config` (this module's
ParallelConfig plus the strategy's own keys) and a `Strategy` (a subclass of Strategy below).
DDP (mixprec.parallel.ddp) and FSDP2 (mixprec.parallel.fsdp) are two such modules; yours may
live outside `src/` (tests/plugins/ddp_fp16.py: DDP with a gradient-compression hook). Nothing
else in mixprec names a strategy: the run asks the object.

What a strategy decides, and where the run asks it:
- `group_of_one`: does it need a process group even alone (FSDP2's code path on one GPU)?
- `shards`: does each rank keep only a shard of weights, gradients and optimizer state (the
  precision may prepare for it; checkpoints may be written a shard per rank; batch=auto probes
  each rank alone; the memory estimate divides by the world)?
- `checkpoints_by_name`: is the optimizer state saved keyed by parameter name (fits any world)?
- `check(prec, model_cfg, optimizer_cfg)`: what it cannot run with, named before anything is
  built (ConfigError);
- `wrap(model, prec, blocks, dd, device)`: the model made parallel, after the precision's
  conversion and before compile; the optimizer is built over what it returns;
- `no_sync(model)`: a context in which backward does not synchronise gradients (all but the
  last micro-batch of an accumulation);
- `data_parallel(dd)`: this rank's place among the ranks that see different samples, and how
  many there are: the layout's effective batch and the data's dealing use it, not the world.
  A strategy that splits the model across ranks (tensor parallel: ranks of one group see the
  same samples) says so here. MFU still divides by the world;
- `promised(prec)`: the dtypes it adds to what the dtype plan checks after step 1 (FSDP2: the
  weights gathered for the forward, the gradients' reduce dtype).
Adding one is its module and its YAML.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from types import ModuleType

from omegaconf import MISSING
from torch import nn

from mixprec.core import targets
from mixprec.core.errors import ConfigError


@dataclass
class ParallelConfig:
    """conf/parallel/*.yaml: the keys every strategy has (a plugin's Config adds its own)."""

    strategy: str = MISSING  # the group option that chose it (ddp, fsdp, yours)
    plugin: str = MISSING  # the module that implements it (mixprec.parallel.ddp, .fsdp, yours)


class Strategy:
    """The interface, with what most strategies share: the whole model on every rank, each
    rank its own samples, no process group alone."""

    group_of_one = False
    shards = False
    checkpoints_by_name = False

    def __init__(self, cfg: ParallelConfig) -> None:
        self.cfg = cfg

    @property
    def name(self) -> str:
        return self.cfg.strategy

    def check(self, prec, mcfg, ocfg) -> None:
        """Refuse what it cannot run with (ConfigError), before anything is built."""

    def wrap(self, model: nn.Module, prec, blocks: list, dd, device) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module):
        return nullcontext()

    def data_parallel(self, dd) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size)."""
        return dd.rank, dd.world

    def promised(self, prec) -> dict:
        """{"forward_weights": dtype name, "reduce": dtype name}, where it decides them."""
        return {}


def plugin_module(path: str) -> ModuleType:
    """The module that implements a strategy (`parallel.plugin`), checked."""
    return targets.plugin(
        "parallel.plugin",
        path,
        ("Config", "Strategy"),
        "parallel strategy",
        "Config (a ParallelConfig) and Strategy (a mixprec.parallel.strategy.Strategy)",
        ", e.g. mixprec.parallel.ddp or mixprec.parallel.fsdp",
    )


def parse(node: dict) -> ParallelConfig:
    """The plugin's own Config from the composed `parallel` node."""
    return targets.parse_plugin("parallel", node, "strategy", plugin_module)


def of(pcfg: ParallelConfig) -> Strategy:
    """The strategy `parallel.plugin` implements, built once per config: every part of the run
    that asks (the layout, the build, the checkpoint) gets the same object, so a strategy that
    holds state (a device mesh, a process group) holds it once."""
    built = pcfg.__dict__.get("_built")
    if built is not None:
        return built
    found = plugin_module(pcfg.plugin).Strategy(pcfg)
    if not isinstance(found, Strategy):
        raise ConfigError(
            f"parallel.plugin={pcfg.plugin!r}: its Strategy must subclass "
            "mixprec.parallel.strategy.Strategy"
        )
    object.__setattr__(pcfg, "_built", found)  # (not a field: no copy or compare sees it)
    return found

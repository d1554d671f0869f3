"""A parallel strategy as one object: what the run asks of it, instead of testing its name.

`of(parallel_config)` gives the strategy `parallel.strategy` names. The run asks it:
- `group_of_one`: does it need a process group even alone (FSDP2's code path on one GPU)?
- `shards`: does each rank keep only a shard of weights, gradients and optimizer state (the
  precision may prepare for it; checkpoints may be written a shard per rank; batch=auto probes
  each rank alone)?
- `checkpoints_by_name`: is the optimizer state saved keyed by parameter name (fits any world)?
- `check(...)`: what it cannot run with, named before anything is built (ConfigError);
- `wrap(model, ...)`: the model made parallel, after the precision's conversion and before
  compile; the optimizer is built over what it returns;
- `data_parallel(dd)`: this rank's place among the ranks that see different samples, and how
  many there are: the layout's effective batch and the data's dealing use it (build.py), not
  the world. Both strategies here are data-parallel over the whole world; one that splits the
  model across ranks (tensor parallel: ranks of one group see the same samples) says otherwise
  here. MFU still divides by the world: every GPU shares each sample's FLOPs.
Adding one is a class here, a YAML in conf/parallel/, and its test.
"""

from __future__ import annotations

from torch import nn

from mixprec.parallel import distributed, sharding


class Strategy:
    """What every strategy here shares: each rank its own samples."""

    def data_parallel(self, dd) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size)."""
        return dd.rank, dd.world


class DDP(Strategy):
    """parallel=ddp: the whole model on every rank, gradients all-reduced (torch's DDP)."""

    name = "ddp"
    group_of_one = False
    shards = False
    checkpoints_by_name = False

    def check(self, pcfg, prec, mcfg, ocfg) -> None:
        pass

    def wrap(self, model: nn.Module, pcfg, prec, blocks, dd, device) -> nn.Module:
        return distributed.wrap(model, dd, device)


class FSDP2(Strategy):
    """parallel=fsdp: each block and the root sharded (sharding.py), a world of one too."""

    name = "fsdp"
    group_of_one = True
    shards = True
    checkpoints_by_name = True

    def check(self, pcfg, prec, mcfg, ocfg) -> None:
        sharding.check(pcfg, prec, mcfg, ocfg)

    def wrap(self, model: nn.Module, pcfg, prec, blocks, dd, device) -> nn.Module:
        if not dd.grouped:  # no process group to shard over (a run always has one: init)
            return model
        return sharding.shard(model, pcfg, prec, blocks, dd.mesh)  # it replaces the parameters


STRATEGIES = {s.name: s for s in (DDP(), FSDP2())}


def of(pcfg) -> Strategy:
    """The strategy `parallel.strategy` names (ParallelConfig validated the name)."""
    return STRATEGIES[pcfg.strategy]

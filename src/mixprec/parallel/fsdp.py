"""parallel=fsdp: each block and the root sharded with FSDP2 (sharding.py), a world of one too
(a strategy plugin: strategy.py says what the run asks of it)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING
from torch import nn

from mixprec.core.errors import one_of
from mixprec.parallel import sharding, strategy
from mixprec.parallel.strategy import ParallelConfig

REDUCE_DTYPES = ("float32", "bfloat16")


@dataclass
class Config(ParallelConfig):
    reduce_dtype: Optional[str] = MISSING  # the dtype gradients are reduced in across ranks
    reshard_after_forward: Optional[bool] = MISSING  # free gathered weights after forward

    def __post_init__(self) -> None:
        one_of("parallel.reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)


class Strategy(strategy.Strategy):
    group_of_one = True  # FSDP2 needs a process group, a group of one on one GPU
    shards = True
    checkpoints_by_name = True

    def check(self, prec, mcfg, ocfg) -> None:
        sharding.check(prec, mcfg, ocfg)

    def wrap(self, model: nn.Module, prec, blocks: list, dd, device) -> nn.Module:
        if not dd.grouped:  # no process group to shard over (a run always has one: init)
            return model
        return sharding.shard(model, self.cfg, prec, blocks, dd.mesh)  # replaces the parameters

    def no_sync(self, model: nn.Module):
        return sharding.no_sync(model) if sharding.is_sharded(model) else nullcontext()

    def promised(self, prec) -> dict:
        gathered = sharding.param_dtype(prec)
        return {
            "forward_weights": str(gathered).replace("torch.", "") if gathered else None,
            "reduce": self.cfg.reduce_dtype,
        }

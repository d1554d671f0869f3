"""parallel=ddp: the whole model on every rank, gradients averaged by torch's
DistributedDataParallel (a strategy plugin: strategy.py says what the run asks of it). A variant
(a communication hook, bucket sizes, static graph) subclasses Strategy here and overrides
`wrap` (tests/plugins/ddp_fp16.py)."""

from __future__ import annotations

from contextlib import nullcontext

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec.parallel import strategy
from mixprec.parallel.strategy import ParallelConfig

Config = ParallelConfig  # DDP has no keys of its own


class Strategy(strategy.Strategy):
    def wrap(self, model: nn.Module, prec, blocks: list, dd, device) -> nn.Module:
        if not dd.enabled:  # a world of one: nothing to average
            return model
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    def no_sync(self, model: nn.Module):
        return model.no_sync() if isinstance(model, DistributedDataParallel) else nullcontext()

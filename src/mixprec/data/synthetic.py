"""Synthetic data generated once on the training device: a benchmark then measures the GPU, not
the input pipeline (the same fixed batch every step, as the usual ResNet-50 benchmarks do)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from omegaconf import MISSING

from mixprec.core.errors import check
from mixprec.data.base import Context, Data, DataConfig


@dataclass
class Config(DataConfig):
    """conf/data/synthetic.yaml"""

    shape: List[int] = MISSING  # C, H, W
    num_classes: int = MISSING  # label range
    steps_per_epoch: int = MISSING  # micro-batches per epoch
    val_steps: int = MISSING  # evaluation micro-batches

    def __post_init__(self) -> None:
        check(
            len(self.shape) == 3 and min(self.shape) >= 1,
            "data.shape",
            self.shape,
            "[C, H, W] with every size >= 1",
        )
        check(self.num_classes >= 2, "data.num_classes", self.num_classes, ">= 2")
        check(self.steps_per_epoch >= 1, "data.steps_per_epoch", self.steps_per_epoch, ">= 1")
        check(self.val_steps >= 1, "data.val_steps", self.val_steps, ">= 1")


class SyntheticLoader:
    def __init__(self, shape, num_classes: int, steps: int, ctx: Context, seed: int) -> None:
        g = torch.Generator(device=ctx.device).manual_seed(seed)
        self.x = torch.randn(ctx.batch, *shape, device=ctx.device, generator=g).contiguous(
            memory_format=ctx.fmt
        )
        self.y = torch.randint(0, num_classes, (ctx.batch,), device=ctx.device, generator=g)
        self.steps, self.skip = steps, 0

    def __len__(self) -> int:
        return self.steps

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.skip = skip

    def __iter__(self):
        for _ in range(self.steps - self.skip):
            yield self.x, self.y

    def close(self) -> None:  # no workers to stop
        pass


def spec(cfg: Config) -> tuple[int, tuple[int, ...]]:
    return cfg.num_classes, tuple(cfg.shape)


def build(cfg: Config, ctx: Context) -> Data:
    shape, seed = tuple(cfg.shape), ctx.seed + ctx.rank
    train = SyntheticLoader(shape, cfg.num_classes, cfg.steps_per_epoch, ctx, seed)
    val = SyntheticLoader(shape, cfg.num_classes, cfg.val_steps, ctx, seed + 1)
    return Data(train=train, val=val, num_classes=cfg.num_classes, input_shape=shape)

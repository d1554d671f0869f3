"""Synthetic data generated once on the training device: a benchmark then measures the GPU, not
the input pipeline (the same fixed batch every step, as the usual ResNet-50 benchmarks do)."""
from __future__ import annotations

import torch

from ..config import DataConfig


class SyntheticLoader:
    def __init__(self, shape, num_classes: int, batch: int, steps: int, device: torch.device,
                 fmt: torch.memory_format, seed: int) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        self.x = torch.randn(batch, *shape, device=device, generator=g).contiguous(memory_format=fmt)
        self.y = torch.randint(0, num_classes, (batch,), device=device, generator=g)
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


def build(dcfg: DataConfig, batch: int, device, fmt, seed: int):
    from . import Data

    shape = tuple(dcfg.shape)
    train = SyntheticLoader(shape, dcfg.num_classes, batch, dcfg.steps_per_epoch, device, fmt, seed)
    val = SyntheticLoader(shape, dcfg.num_classes, batch, dcfg.val_steps, device, fmt, seed + 1)
    return Data(train=train, val=val, num_classes=dcfg.num_classes, input_shape=shape)

"""Datasets: `digits` (real, bundled with scikit-learn) and `synthetic` (generated on the device).

Every training loader has the same small interface: `len()` micro-batches per epoch,
`set_epoch(epoch, skip)` to fix the epoch's order and resume part-way through it, and iteration
yielding (inputs, targets) already on the training device in the model's memory format.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import DataConfig, HardwareConfig
from . import digits, images, synthetic


class TrainLoader(Protocol):
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int, skip: int = 0) -> None: ...
    def __iter__(self): ...
    def close(self) -> None: ...


@dataclass
class Data:
    train: TrainLoader
    val: TrainLoader  # iterated whole, in order (no set_epoch)
    num_classes: int
    input_shape: tuple[int, int, int]  # C, H, W

    def close(self) -> None:
        """Stop the loaders' worker processes (see EpochLoader.close)."""
        self.train.close()
        self.val.close()


def spec(dcfg: DataConfig) -> tuple[int, tuple[int, int, int]]:
    """(num_classes, input shape C,H,W) without loading anything (for batch=auto's probes)."""
    if dcfg.name == "synthetic":
        return dcfg.num_classes, tuple(dcfg.shape)
    if dcfg.name == "imagenet":
        return images.folder_spec(dcfg)
    if dcfg.name == "cifar10":
        return 10, (3, 32, 32)
    return digits.NUM_CLASSES, digits.INPUT_SHAPE


def build(dcfg: DataConfig, hw: HardwareConfig, batch: int, device: torch.device, seed: int,
          channels_last: bool = False, rank: int = 0, world: int = 1) -> Data:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if dcfg.name == "synthetic":
        return synthetic.build(dcfg, batch, device, fmt, seed + rank)
    if dcfg.name == "imagenet":
        return images.build_folder(dcfg, hw, batch, device, fmt, seed, rank, world)
    if dcfg.name == "cifar10":
        return images.build_cifar10(dcfg, hw, batch, device, fmt, seed, rank, world)
    return digits.build(dcfg, hw, batch, device, fmt, seed, rank, world)

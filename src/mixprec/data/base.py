"""What every dataset gives the loop (Data) and gets from the run (Context)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from omegaconf import MISSING

from mixprec.core.tasks import CLASSIFY, Task


class TrainLoader(Protocol):
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int, skip: int = 0) -> None: ...
    def __iter__(self): ...
    def close(self) -> None: ...


@dataclass
class Data:
    train: TrainLoader  # len() micro-batches per epoch; set_epoch(epoch, skip) resumes part-way
    val: TrainLoader  # iterated whole, in order (no set_epoch)
    num_classes: int  # classes, or a language model's vocabulary
    input_shape: tuple[int, ...]  # C, H, W; or (sequence length,) for token data
    task: Task = CLASSIFY  # what the model learns from it (tasks.py)

    def close(self) -> None:
        """Stop the loaders' worker processes (see EpochLoader.close)."""
        self.train.close()
        self.val.close()


@dataclass(frozen=True)
class Workers:
    """DataLoader worker settings (from the hardware profile); the defaults load in-process."""

    num_workers: int = 0
    pin_memory: bool = False
    persistent: bool = False


@dataclass
class DataConfig:
    """conf/data/*.yaml: the keys every dataset has (its module's Config adds its own)."""

    name: str = MISSING  # the group option that chose it (digits, text, custom, yours)
    plugin: str = MISSING  # the module that implements it (mixprec.data.digits, yours)


@dataclass(frozen=True)
class Context:
    """What a dataset builder needs to know about the run."""

    batch: int  # micro-batch per process
    device: torch.device
    seed: int
    channels_last: bool = False
    rank: int = 0
    world: int = 1
    workers: Workers = field(default_factory=Workers)
    # the precision's input conversion (Precision.convert_input: float64 -> float32 by default),
    # applied in the same copy that moves a batch to its device
    convert: Callable = lambda x: x.float() if x.dtype == torch.float64 else x

    @property
    def fmt(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

"""scikit-learn's handwritten digits (1,797 real 8x8 scans, 10 classes): ships inside the
package, so the default run needs no download."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import MISSING
from torch.utils.data import TensorDataset

from mixprec.core.errors import check
from mixprec.data.base import Context, Data, DataConfig
from mixprec.data.loaders import EpochLoader

NUM_CLASSES, INPUT_SHAPE = 10, (1, 8, 8)


@dataclass
class Config(DataConfig):
    """conf/data/digits.yaml"""

    val_fraction: float = MISSING  # held-out share (stratified, fixed by data_seed)
    data_seed: int = MISSING  # the split does not move with `seed`

    def __post_init__(self) -> None:
        check(
            0.01 <= self.val_fraction <= 0.9,
            "data.val_fraction",
            self.val_fraction,
            "in [0.01, 0.9] (a stratified split needs every class on both sides)",
        )
        check(self.data_seed >= 0, "data.data_seed", self.data_seed, "an int >= 0")


def spec(cfg: Config) -> tuple[int, tuple[int, ...]]:
    return NUM_CLASSES, INPUT_SHAPE


def tensors(cfg: Config):
    """(x_train, y_train, x_val, y_val): a stratified split, standardised by train statistics."""
    # imported here: every run lists the datasets (data.names()), and scikit-learn's import took
    # 1.4-1.7 s of a GPU run's start that never reads the digits (benchmarks/RESULTS.md)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_va, y_tr, y_va = train_test_split(
        x, y, test_size=cfg.val_fraction, random_state=cfg.data_seed, stratify=y
    )
    x_tr, x_va = (torch.tensor(a, dtype=torch.float32).view(-1, 1, 8, 8) for a in (x_tr, x_va))
    mean, std = x_tr.mean(), x_tr.std()
    return ((x_tr - mean) / std, torch.tensor(y_tr), (x_va - mean) / std, torch.tensor(y_va))


def build(cfg: Config, ctx: Context) -> Data:
    x_tr, y_tr, x_va, y_va = tensors(cfg)
    train = EpochLoader(TensorDataset(x_tr, y_tr), ctx)  # in memory: no workers
    val = EpochLoader(TensorDataset(x_va, y_va), ctx, shuffle=False, drop_last=False)
    return Data(train=train, val=val, num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE)

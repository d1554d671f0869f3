"""scikit-learn's handwritten digits (1,797 real 8x8 scans, 10 classes): ships inside the
package, so the default run needs no download."""
from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

from ..config import DataConfig, HardwareConfig
from .loaders import EpochLoader

NUM_CLASSES, INPUT_SHAPE = 10, (1, 8, 8)


def tensors(dcfg: DataConfig):
    """(x_train, y_train, x_val, y_val): a stratified split, standardised by train statistics."""
    x, y = load_digits(return_X_y=True)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=dcfg.val_fraction,
                                              random_state=dcfg.data_seed, stratify=y)
    x_tr, x_va = (torch.tensor(a, dtype=torch.float32).view(-1, 1, 8, 8) for a in (x_tr, x_va))
    mean, std = x_tr.mean(), x_tr.std()
    return ((x_tr - mean) / std, torch.tensor(y_tr), (x_va - mean) / std, torch.tensor(y_va))


def build(dcfg: DataConfig, hw: HardwareConfig, batch: int, device, fmt, seed: int, rank: int,
          world: int):
    from . import Data  # avoid a cycle at import time

    x_tr, y_tr, x_va, y_va = tensors(dcfg)
    common = dict(device=device, fmt=fmt, seed=seed, rank=rank, world=world)  # in memory: no workers
    train = EpochLoader(TensorDataset(x_tr, y_tr), batch, **common)
    val = EpochLoader(TensorDataset(x_va, y_va), batch, shuffle=False, drop_last=False, **common)
    return Data(train=train, val=val, num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE)

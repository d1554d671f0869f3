"""A dataset plugin from outside mixprec (conf/data/stripes.yaml names this module as `plugin`):
8x8 images of horizontal or vertical stripes, the class their direction. Its module and its
YAML are all it takes:
  PYTHONPATH=tests/plugins python train.py \\
      'hydra.searchpath=[file://tests/plugins/conf]' data=stripes model=digits_mlp"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import MISSING
from torch.utils.data import TensorDataset

from mixprec.core.errors import check
from mixprec.data.base import Context, Data, DataConfig
from mixprec.data.loaders import EpochLoader


@dataclass
class Config(DataConfig):
    samples: int = MISSING  # training images (a quarter as many for validation)

    def __post_init__(self) -> None:
        check(self.samples >= 8, "data.samples", self.samples, "an int >= 8")


def spec(cfg: Config) -> tuple[int, tuple[int, ...]]:
    return 2, (1, 8, 8)


def _images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    rows = (torch.arange(8) % 2).float().view(1, 8, 1).expand(1, 8, 8)
    x = torch.where(y.view(n, 1, 1, 1) == 0, rows, rows.transpose(1, 2))
    return TensorDataset(x + 0.3 * torch.randn(n, 1, 8, 8, generator=g), y)


def build(cfg: Config, ctx: Context) -> Data:
    train = EpochLoader(_images(cfg.samples, ctx.seed), ctx)
    val = EpochLoader(_images(cfg.samples // 4, 10_000 + ctx.seed), ctx, shuffle=False)
    return Data(train, val, 2, (1, 8, 8))

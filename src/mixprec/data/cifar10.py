"""torchvision's CIFAR-10 from `data.root` (its cifar-10-batches-py/); downloads only with
`data.download=true` (needs a network)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING
from torchvision import datasets
from torchvision import transforms as T

from mixprec.core.errors import ConfigError, DataError, check
from mixprec.data.base import Context, Data, DataConfig
from mixprec.data.images import loaders, subset

STATS = ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616])


@dataclass
class Config(DataConfig):
    """conf/data/cifar10.yaml"""

    root: Optional[str] = MISSING  # the directory holding cifar-10-batches-py/
    download: bool = MISSING  # download when missing (needs a network)
    subset: Optional[int] = MISSING  # use this many images per split (a fixed random subset)

    def __post_init__(self) -> None:
        check(bool(self.root), "data.root", self.root, "a directory for data=cifar10")
        check(self.subset is None or self.subset >= 1, "data.subset", self.subset, "null or >= 1")


def spec(cfg: Config) -> tuple[int, tuple[int, ...]]:
    return 10, (3, 32, 32)


def build(cfg: Config, ctx: Context) -> Data:
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.PILToTensor()])
    try:
        train_ds = datasets.CIFAR10(cfg.root, train=True, transform=train_tf, download=cfg.download)
        val_ds = datasets.CIFAR10(cfg.root, train=False, transform=T.PILToTensor())
    except RuntimeError as e:
        raise ConfigError(
            f"data.root={cfg.root!r}: {e} (data=cifar10 reads torchvision's "
            "cifar-10-batches-py there; data.download=true fetches it)"
        ) from None
    except OSError as e:  # data.download=true without a network (URLError is an OSError)
        raise DataError(
            f"data=cifar10 data.download=true: the download failed ({type(e).__name__}: "
            f"{getattr(e, 'reason', e)}); without a network, put cifar-10-batches-py under "
            f"data.root={cfg.root!r} by hand"
        ) from None
    train, val = loaders(subset(train_ds, cfg.subset, 0), subset(val_ds, cfg.subset, 1), ctx, STATS)
    return Data(train, val, 10, (3, 32, 32))

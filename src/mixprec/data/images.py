"""Real image datasets: ImageNet-style folders (`data=imagenet`) and CIFAR-10 (`data=cifar10`).

Folders: `root/train/<class>/*` and `root/val/<class>/*` (torchvision's ImageFolder), RandomResizedCrop
+ flip for training, resize + centre crop for evaluation. An unreadable image either stops the run
with its path (`data.bad_images=fail`, the default) or is skipped and counted (`skip`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.utils.data import Subset, default_collate
from torchvision import datasets, transforms as T

from ..config import ConfigError, DataConfig, HardwareConfig
from .loaders import EpochLoader

log = logging.getLogger(__name__)
IMAGENET_STATS = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
CIFAR_STATS = ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616])


class CheckedImageFolder(datasets.ImageFolder):
    """ImageFolder whose unreadable files fail with their path, or come back as None (skip)."""

    def __init__(self, root, transform, skip_bad: bool) -> None:
        super().__init__(root, transform=transform)
        self.skip_bad = skip_bad

    def __getitem__(self, index):
        try:
            return super().__getitem__(index)
        except (OSError, ValueError) as e:  # PIL: UnidentifiedImageError is an OSError
            path = self.samples[index][0]
            if not self.skip_bad:
                raise ConfigError(f"unreadable image {path} ({type(e).__name__}: {e}); fix or "
                                  "remove it, or set data.bad_images=skip") from None
            log.warning("skipping unreadable image %s (%s)", path, type(e).__name__)
            return None


def collate_skipping(batch):
    return default_collate([b for b in batch if b is not None])


def _classes(split_dir: Path) -> list[str]:
    if not split_dir.is_dir():
        raise ConfigError(f"data.root: {split_dir} does not exist (data=imagenet wants "
                          "root/train/<class>/* and root/val/<class>/*)")
    classes = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
    if not classes:
        raise ConfigError(f"data.root: {split_dir} has no class folders")
    empty = [c for c in classes if not any((split_dir / c).iterdir())]
    if empty:
        raise ConfigError(f"data.root: empty class folder(s) in {split_dir}: {', '.join(empty)}")
    return classes


def folder_spec(dcfg: DataConfig) -> tuple[int, tuple[int, int, int]]:
    return len(_classes(Path(dcfg.root or "") / "train")), (3, dcfg.image_size, dcfg.image_size)


def _subset(ds, n: int | None, seed: int):
    if n is None or n >= len(ds):
        return ds
    g = torch.Generator().manual_seed(seed)
    return Subset(ds, torch.randperm(len(ds), generator=g)[:n].tolist())


def _loaders(train_ds, val_ds, dcfg, hw, batch, device, fmt, seed, rank, world, collate=None):
    kw = dict(device=device, fmt=fmt, seed=seed, rank=rank, world=world,
              num_workers=hw.num_workers, pin_memory=hw.pin_memory, collate_fn=collate)
    train = EpochLoader(_subset(train_ds, dcfg.subset, dcfg.data_seed), batch, **kw)
    val = EpochLoader(_subset(val_ds, dcfg.subset, dcfg.data_seed + 1), batch, shuffle=False,
                      drop_last=False, **kw)
    return train, val


def build_folder(dcfg: DataConfig, hw: HardwareConfig, batch, device, fmt, seed, rank, world):
    from . import Data
    root = Path(dcfg.root or "")
    classes = _classes(root / "train")
    if _classes(root / "val") != classes:
        raise ConfigError(f"data.root: {root}/train and {root}/val have different class folders")
    norm = T.Normalize(*IMAGENET_STATS)
    train_tf = T.Compose([T.RandomResizedCrop(dcfg.image_size), T.RandomHorizontalFlip(),
                          T.ToTensor(), norm])
    val_tf = T.Compose([T.Resize(dcfg.eval_resize), T.CenterCrop(dcfg.image_size), T.ToTensor(),
                        norm])
    skip = dcfg.bad_images == "skip"
    train_ds = CheckedImageFolder(root / "train", train_tf, skip)
    val_ds = CheckedImageFolder(root / "val", val_tf, skip)
    train, val = _loaders(train_ds, val_ds, dcfg, hw, batch, device, fmt, seed, rank, world,
                          collate_skipping if skip else None)
    return Data(train, val, len(classes), (3, dcfg.image_size, dcfg.image_size))


def build_cifar10(dcfg: DataConfig, hw: HardwareConfig, batch, device, fmt, seed, rank, world):
    from . import Data
    norm = T.Normalize(*CIFAR_STATS)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    val_tf = T.Compose([T.ToTensor(), norm])
    try:
        train_ds = datasets.CIFAR10(dcfg.root or "", train=True, transform=train_tf,
                                    download=dcfg.download)
        val_ds = datasets.CIFAR10(dcfg.root or "", train=False, transform=val_tf)
    except RuntimeError as e:
        raise ConfigError(f"data.root={dcfg.root!r}: {e} (data=cifar10 reads torchvision's "
                          "cifar-10-batches-py there; data.download=true fetches it)") from None
    train, val = _loaders(train_ds, val_ds, dcfg, hw, batch, device, fmt, seed, rank, world)
    return Data(train, val, 10, (3, 32, 32))

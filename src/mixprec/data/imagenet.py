"""ImageNet-style folders: `root/train/<class>/*` and `root/val/<class>/*` (torchvision's
ImageFolder), RandomResizedCrop + flip for training, resize + centre crop for evaluation,
decoded by loader workers or on the device (images.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import MISSING
from torchvision.transforms import v2

from mixprec.core.errors import ConfigError, check, one_of
from mixprec.data.base import Context, Data, DataConfig
from mixprec.data.images import (
    CheckedImageFolder,
    DeviceDecode,
    JpegCrops,
    classes,
    collate_jpegs,
    collate_skipping,
    loaders,
    subset,
)
from mixprec.data.loaders import Normalize

STATS = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


@dataclass
class Config(DataConfig):
    """conf/data/imagenet.yaml"""

    root: Optional[str] = MISSING  # holds train/<class>/ and val/<class>/
    image_size: int = MISSING  # training crop and evaluation centre crop
    eval_resize: int = MISSING  # resize before the evaluation centre crop
    subset: Optional[int] = MISSING  # use this many images per split (a fixed random subset)
    bad_images: str = MISSING  # an unreadable image stops the run (fail) or is skipped
    decode: str = MISSING  # JPEGs decoded by loader workers, or on the device (nvJPEG)

    def __post_init__(self) -> None:
        check(bool(self.root), "data.root", self.root, "a directory for data=imagenet")
        check(self.image_size >= 8, "data.image_size", self.image_size, ">= 8")
        check(
            self.eval_resize >= self.image_size,
            "data.eval_resize",
            self.eval_resize,
            f">= data.image_size ({self.image_size})",
        )
        check(self.subset is None or self.subset >= 1, "data.subset", self.subset, "null or >= 1")
        one_of("data.bad_images", self.bad_images, ("fail", "skip"))
        one_of("data.decode", self.decode, ("workers", "device"))


def train_transform(size: int) -> v2.Compose:
    """What a worker does to each training image after decoding (uint8 tensors)."""
    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])


def spec(cfg: Config) -> tuple[int, tuple[int, ...]]:
    return len(classes(Path(cfg.root) / "train")), (3, cfg.image_size, cfg.image_size)


def build(cfg: Config, ctx: Context) -> Data:
    root = Path(cfg.root)
    names = classes(root / "train")
    if classes(root / "val") != names:
        raise ConfigError(f"data.root: {root}/train and {root}/val have different class folders")
    skip = cfg.bad_images == "skip"
    if cfg.decode == "device":
        train_ds, val_ds = (
            JpegCrops(root / split, split == "train", cfg.image_size, cfg.eval_resize, skip)
            for split in ("train", "val")
        )
        stage = DeviceDecode(cfg.image_size, Normalize(*STATS, ctx.device, ctx.fmt))
        collate = collate_jpegs
    else:  # on uint8 tensors: torch's antialiased bilinear resize, made to match PIL's
        train_ds = CheckedImageFolder(root / "train", train_transform(cfg.image_size), skip)
        val_ds = CheckedImageFolder(
            root / "val",
            v2.Compose([v2.Resize(cfg.eval_resize, antialias=True), v2.CenterCrop(cfg.image_size)]),
            skip,
        )
        stage, collate = None, collate_skipping if skip else None
    train, val = loaders(
        subset(train_ds, cfg.subset, 0), subset(val_ds, cfg.subset, 1), ctx, STATS, collate, stage
    )
    return Data(train, val, len(names), (3, cfg.image_size, cfg.image_size))

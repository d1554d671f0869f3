"""What the image datasets (imagenet.py, cifar10.py) share: decoding, checked folders, the
device-decode path and the loaders.

An unreadable image either stops the run with its path (`data.bad_images=fail`, the default) or is
skipped with a warning (`skip`). Workers decode with torchvision's decoders (PIL for formats they
do not read), crop, resize and flip uint8 tensors (transforms.v2) and ship them as uint8 (a
quarter of float32's bytes); the normalisation runs on the training device, one batch ahead on a
side stream (loaders.prefetch). With `data.decode=device` the workers only read the JPEG bytes and
draw the crop; decoding (nvJPEG on a GPU, through torchvision.io.decode_jpeg), crop, resize, flip
and normalisation run on the device (images.py: DeviceDecode), staged by a background thread a
couple of batches ahead — the path for when the CPU cores cannot decode as fast as the GPU
trains."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Subset, default_collate
from torchvision import datasets, io
from torchvision import transforms as T
from torchvision.transforms import v2

from mixprec.core.errors import ConfigError, DataError
from mixprec.data.base import Context
from mixprec.data.loaders import EpochLoader, Normalize

log = logging.getLogger(__name__)


def read_image(path: str) -> torch.Tensor:
    """A file as a uint8 RGB tensor (C, H, W): torchvision's decoders (libjpeg-turbo, libpng, ...),
    about twice as fast as PIL's decode + crop (benchmarks/RESULTS.md); PIL reads the formats
    they do not (BMP, TIFF, ...)."""
    try:
        img = io.decode_image(io.read_file(path), mode=io.ImageReadMode.RGB)
    except RuntimeError:
        with Image.open(path) as im:  # an OSError here if PIL cannot read it either
            return T.functional.pil_to_tensor(im.convert("RGB"))
    return img if img.dtype == torch.uint8 else v2.functional.to_dtype(img, torch.uint8, scale=True)


class CheckedImageFolder(datasets.ImageFolder):
    """ImageFolder whose unreadable files fail with their path, or come back as None (skip)."""

    def __init__(self, root, transform, skip_bad: bool) -> None:
        super().__init__(root, transform=transform, loader=read_image)
        self.skip_bad = skip_bad

    def __getitem__(self, index):
        try:
            return super().__getitem__(index)
        except (OSError, ValueError) as e:  # read_image falls back to PIL: UnidentifiedImageError
            path = self.samples[index][0]
            if not self.skip_bad:
                raise DataError(
                    f"unreadable image {path} ({type(e).__name__}: {e}); fix or "
                    "remove it, or set data.bad_images=skip"
                ) from None
            log.warning("skipping unreadable image %s (%s)", path, type(e).__name__)
            return None


def collate_skipping(batch):
    return default_collate([b for b in batch if b is not None])


class JpegCrops(CheckedImageFolder):
    """For data.decode=device: each sample is (the file's bytes, crop box top/left/h/w, flip,
    label). The crop is drawn here from the JPEG header alone (no decode), so the worker's RNG
    decides the augmentation exactly as in the CPU path; train: RandomResizedCrop + flip,
    eval: the box that resize(eval_resize) + centre crop(image_size) would keep."""

    def __init__(self, root, train: bool, image_size: int, eval_resize: int, skip_bad: bool):
        super().__init__(root, transform=None, skip_bad=skip_bad)
        self.loader = self._crop  # ImageFolder calls loader(path), then transform
        self.train, self.size, self.resize = train, image_size, eval_resize
        self.rrc = T.RandomResizedCrop(image_size)

    def _crop(self, path: str):
        with Image.open(path) as im:
            if im.format != "JPEG":
                raise ValueError(
                    f"data.decode=device decodes JPEG only, this is {im.format}; "
                    "use data.decode=workers"
                )
            w, h = im.size
            if self.train:  # get_params reads only the size: the image is not decoded here
                top, left, ch, cw = self.rrc.get_params(im, self.rrc.scale, self.rrc.ratio)
                flip = bool(torch.rand(1) < 0.5)
        if not self.train:
            side = round(min(h, w) * self.size / self.resize)
            top, left, ch, cw, flip = (h - side) // 2, (w - side) // 2, side, side, False
        with open(path, "rb") as f:  # plain bytes: a tensor per file costs the workers an fd
            return f.read(), torch.tensor([top, left, ch, cw, int(flip)])


def collate_jpegs(batch):
    batch = [b for b in batch if b is not None]
    return (
        [b[0][0] for b in batch],
        torch.stack([b[0][1] for b in batch]),
        torch.tensor([b[1] for b in batch]),
    )


class DeviceDecode:
    """Stage a batch of JPEG bytes on the device: decode (nvJPEG on a GPU), crop, resize to
    size x size (bilinear, antialiased, as the workers' path), flip, normalise."""

    def __init__(self, size: int, norm: Normalize) -> None:
        self.size, self.norm = size, norm

    def __call__(self, batch):
        files, boxes, y = batch
        dev = self.norm.device
        files = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in files]
        images = io.decode_jpeg(files, mode=io.ImageReadMode.RGB, device=dev)
        out = torch.empty(len(files), 3, self.size, self.size, device=dev)
        for i, (img, (top, left, h, w, flip)) in enumerate(zip(images, boxes.tolist())):
            crop = img[None, :, top : top + h, left : left + w].float()
            crop = F.interpolate(
                crop,
                size=(self.size, self.size),
                mode="bilinear",
                antialias=True,
                align_corners=False,
            )
            out[i] = crop[0].flip(-1) if flip else crop[0]
        return self.norm((out.clamp_(0, 255), y))


def classes(split_dir: Path) -> list[str]:
    if not split_dir.is_dir():
        raise ConfigError(
            f"data.root: {split_dir} does not exist (data=imagenet wants "
            "root/train/<class>/* and root/val/<class>/*)"
        )
    names = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
    if not names:
        raise ConfigError(f"data.root: {split_dir} has no class folders")
    empty = [c for c in names if not any((split_dir / c).iterdir())]
    if empty:
        raise ConfigError(f"data.root: empty class folder(s) in {split_dir}: {', '.join(empty)}")
    return names


def subset(ds, n: int | None, seed: int):
    if n is None or n >= len(ds):
        return ds
    g = torch.Generator().manual_seed(seed)
    return Subset(ds, torch.randperm(len(ds), generator=g)[:n].tolist())


def loaders(train_ds, val_ds, ctx: Context, stats, collate=None, stage=None):
    """(train, val) EpochLoaders over uint8 datasets, normalised with `stats` on the device (or
    staged by `stage`, in a background thread: device decoding)."""
    kw = dict(
        collate_fn=collate,
        stage=stage or Normalize(*stats, ctx.device, ctx.fmt),
        stage_thread=stage is not None,
    )
    train = EpochLoader(train_ds, ctx, persistent=ctx.workers.persistent, **kw)
    val = EpochLoader(val_ds, ctx, shuffle=False, drop_last=False, **kw)
    return train, val

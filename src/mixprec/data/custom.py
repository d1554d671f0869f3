"""Your own data: `data=custom data.target=package.module:callable`. The callable (called with
`data.kwargs`) returns the train and validation datasets
and what they teach, as a dict or an object with these fields:

    {"train": Dataset, "val": Dataset, "num_classes": 10}    # classification: (x, label) pairs
    {"train": Dataset, "val": Dataset, "vocab_size": 256}     # language modelling: (tokens, next)

Map-style torch Datasets of (input, target) pairs: a float tensor and an int label, or two
equal-length int tensors of token ids (the targets shifted by one). They load through the
same EpochLoader as every built-in dataset: the same workers, rank dealing (DDP, FSDP2) and
exact resume part-way through an epoch. Shapes are checked before training."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from omegaconf import MISSING

from mixprec.core import targets
from mixprec.core.errors import ConfigError, check
from mixprec.core.tasks import CLASSIFY, LanguageModel
from mixprec.data.base import Context, Data
from mixprec.data.loaders import EpochLoader

log = logging.getLogger(__name__)


@dataclass
class Config:
    """conf/data/custom.yaml"""

    name: str = MISSING
    target: Optional[str] = MISSING  # package.module:callable returning the datasets
    path: Optional[str] = MISSING  # a folder put first on the module path for data.target
    kwargs: Dict[str, Any] = MISSING  # the callable's arguments

    def __post_init__(self) -> None:
        check(
            self.target is not None,
            "data.target",
            self.target,
            "package.module:callable returning {'train', 'val', 'num_classes' or 'vocab_size'}",
        )
        targets.check_target("data.target", self.target)


@dataclass(frozen=True)
class Loaded:
    train: Any
    val: Any
    num_classes: int
    input_shape: tuple[int, ...]
    lm: bool


def _field(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


@functools.lru_cache(maxsize=4)
def _load(target: str, path: str | None, kwargs_json: str) -> Loaded:
    key = "data.target"
    fn = targets.load(key, target, path)
    out = targets.call(key, target, fn, json.loads(kwargs_json), {})
    train, val = _field(out, "train"), _field(out, "val")
    classes, vocab = _field(out, "num_classes"), _field(out, "vocab_size")
    if train is None or val is None or (classes is None) == (vocab is None):
        raise ConfigError(
            f"{key}={target!r} returned {type(out).__name__}; it must give 'train' and 'val' "
            "datasets and one of 'num_classes' (classification) or 'vocab_size' (tokens)"
        )
    for split, ds in (("train", train), ("val", val)):
        if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__") or len(ds) == 0:
            raise ConfigError(
                f"{key}={target!r}: its {split!r} dataset must be a non-empty map-style "
                "Dataset (__len__ and __getitem__)"
            )
    lm = vocab is not None
    shape = _check_sample(target, "train", train[0], lm, int(vocab or classes))
    if _check_sample(target, "val", val[0], lm, int(vocab or classes)) != shape:
        raise ConfigError(f"{key}={target!r}: train and val samples differ in shape")
    return Loaded(train, val, int(vocab or classes), shape, lm)


def _check_sample(target: str, split: str, sample: Any, lm: bool, n: int) -> tuple[int, ...]:
    """The input shape of one (input, target) sample, checked against the task."""
    where = f"data.target={target!r}: {split}[0]"
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise ConfigError(f"{where} must be an (input, target) pair, not {type(sample).__name__}")
    x, y = (torch.as_tensor(v) for v in sample)
    if lm:
        ok = x.dim() == 1 and x.shape == y.shape and not x.is_floating_point()
        if not ok or not (0 <= int(x.min()) and int(x.max()) < n):
            raise ConfigError(
                f"{where} must be two int tensors of one length T holding token ids in "
                f"[0, vocab_size={n}) (got {tuple(x.shape)} {x.dtype} and {tuple(y.shape)})"
            )
    elif not x.is_floating_point() or y.dim() != 0 or y.is_floating_point():
        raise ConfigError(
            f"{where} must be a float input tensor and an int class label (got {x.dtype} "
            f"{tuple(x.shape)} and {y.dtype} {tuple(y.shape)})"
        )
    elif not 0 <= int(y) < n:
        raise ConfigError(f"{where}: label {int(y)} is outside [0, num_classes={n})")
    if x.dtype == torch.float64 and split == "train":
        log.info("%s is float64 (numpy's default): batches become float32 on the device", where)
    return tuple(x.shape)


def load(cfg: Config) -> Loaded:
    """The user's datasets, checked (called once per process for these settings)."""
    return _load(cfg.target, cfg.path, json.dumps(dict(cfg.kwargs), sort_keys=True))


def spec(cfg: Config) -> tuple[int, tuple[int, ...]]:
    got = load(cfg)
    return got.num_classes, got.input_shape


def task(cfg: Config):
    return LanguageModel() if load(cfg).lm else CLASSIFY


def build(cfg: Config, ctx: Context) -> Data:
    got = load(cfg)
    train = EpochLoader(got.train, ctx)
    val = EpochLoader(got.val, ctx, shuffle=False, drop_last=False)
    return Data(train, val, got.num_classes, got.input_shape, task(cfg))

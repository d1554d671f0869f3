"""Your own data: `data=custom data.target=package.module:callable`. The callable (called with
`data.kwargs`) returns the train and validation datasets
and what they teach, as a dict or an object with these fields:

    {"train": Dataset, "val": Dataset, "num_classes": 10}    # classification: (x, label) pairs
    {"train": Dataset, "val": Dataset, "vocab_size": 256}     # language modelling: (tokens, next)
    {"train": ..., "val": ..., "num_classes": 2, "vocab_size": 30522}  # sequence classification:
                                                              # (token ids, label): BERT-style

Map-style torch Datasets of (input, target) pairs: a float tensor and an int label, or two
equal-length int tensors of token ids (the targets shifted by one). A sample may also be a
dict, as Hugging Face datasets and many pipelines give them ({"pixel_values": x, "label": y},
{"input_ids": ..., "labels": ...}): `data.input_key` and `data.target_key` name the two entries
(null: the usual names, INPUT_KEYS and TARGET_KEYS below), and each sample becomes that pair
where it is read, in the loader's workers too. They load through the
same EpochLoader as every built-in dataset: the same workers, rank dealing (DDP, FSDP2) and
exact resume part-way through an epoch. Shapes are checked before training."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from omegaconf import MISSING

from mixprec.core import targets
from mixprec.core.errors import ConfigError, check
from mixprec.core.tasks import CLASSIFY, ClassifyTokens, LanguageModel
from mixprec.data.base import Context, Data, DataConfig
from mixprec.data.loaders import EpochLoader

log = logging.getLogger(__name__)


@dataclass
class Config(DataConfig):
    """conf/data/custom.yaml"""

    target: Optional[str] = MISSING  # package.module:callable returning the datasets
    path: Optional[str] = MISSING  # a folder put first on the module path for data.target
    kwargs: Dict[str, Any] = MISSING  # the callable's arguments
    input_key: Optional[str] = MISSING  # a dict sample's input entry (null: INPUT_KEYS)
    target_key: Optional[str] = MISSING  # a dict sample's target entry (null: TARGET_KEYS)

    def __post_init__(self) -> None:
        check(
            self.target is not None,
            "data.target",
            self.target,
            "package.module:callable returning {'train', 'val', 'num_classes' or 'vocab_size'}",
        )
        targets.check_target("data.target", self.target)


INPUT_KEYS = ("input_ids", "pixel_values", "inputs", "input", "image", "x")
TARGET_KEYS = ("labels", "label", "targets", "target", "y")


class Pairs:
    """A dataset of dict samples read as (input, target) pairs: the entries `keys` names
    (picklable: DataLoader workers read it too)."""

    def __init__(self, dataset, keys: tuple[str, str]) -> None:
        self.dataset, self.keys = dataset, keys

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        sample = self.dataset[i]
        return sample[self.keys[0]], sample[self.keys[1]]


def _keys(where: str, sample: Mapping, cfg_keys: tuple) -> tuple[str, str]:
    """The (input, target) entries of a dict sample: the configured ones, or the usual names."""
    found = []
    for key, given, usual in zip(("input_key", "target_key"), cfg_keys, (INPUT_KEYS, TARGET_KEYS)):
        name = given or next((k for k in usual if k in sample), None)
        if name is None or name not in sample:
            why = "is not one of them" if given else f"is null and none of the usual {usual} is"
            raise ConfigError(
                f"{where} is a dict with keys {sorted(map(str, sample))}: "
                f"data.{key}={given!r} {why}; set data.{key}=<one of its keys>"
            )
        found.append(name)
    return found[0], found[1]


def _as_pairs(target: str, split: str, ds, cfg_keys: tuple):
    sample = ds[0]
    if not isinstance(sample, Mapping):
        return ds
    keys = _keys(f"data.target={target!r}: {split}[0]", sample, cfg_keys)
    log.info(
        "data.target=%r: %s samples are dicts: (%s, %s) is the (input, target) pair",
        target,
        split,
        *keys,
    )
    return Pairs(ds, keys)


@dataclass(frozen=True)
class Loaded:
    train: Any
    val: Any
    num_classes: int
    input_shape: tuple[int, ...]
    lm: bool
    vocab: int | None = None  # sequence classification: the token ids' vocabulary


def _field(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


@functools.lru_cache(maxsize=4)
def _load(target: str, path: str | None, kwargs_json: str, keys: tuple = (None, None)) -> Loaded:
    key = "data.target"
    fn = targets.load(key, target, path)
    out = targets.call(key, target, fn, json.loads(kwargs_json), {})
    train, val = _field(out, "train"), _field(out, "val")
    classes, vocab = _field(out, "num_classes"), _field(out, "vocab_size")
    if train is None or val is None or (classes is None and vocab is None):
        raise ConfigError(
            f"{key}={target!r} returned {type(out).__name__}; it must give 'train' and 'val' "
            "datasets and 'num_classes' (classification), 'vocab_size' (tokens) or both "
            "(sequence classification: token ids in, a label out)"
        )
    for split, ds in (("train", train), ("val", val)):
        if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__") or len(ds) == 0:
            raise ConfigError(
                f"{key}={target!r}: its {split!r} dataset must be a non-empty map-style "
                "Dataset (__len__ and __getitem__)"
            )
    train, val = _as_pairs(target, "train", train, keys), _as_pairs(target, "val", val, keys)
    lm = classes is None
    tokens = None if lm or vocab is None else int(vocab)  # sequence classification
    n = int(vocab if lm else classes)
    shape = _check_sample(target, "train", train[0], lm, n, tokens)
    if _check_sample(target, "val", val[0], lm, n, tokens) != shape:
        raise ConfigError(f"{key}={target!r}: train and val samples differ in shape")
    return Loaded(train, val, n, shape, lm, tokens)


def _check_sample(
    target: str, split: str, sample: Any, lm: bool, n: int, vocab: int | None = None
) -> tuple[int, ...]:
    """The input shape of one (input, target) sample, checked against the task (`vocab`:
    sequence classification, token ids below it and a label)."""
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
    elif vocab is not None and (
        x.dim() != 1 or x.is_floating_point() or not 0 <= int(x.min()) <= int(x.max()) < vocab
    ):
        raise ConfigError(
            f"{where} must be a sequence of token ids in [0, vocab_size={vocab}) and a label "
            f"(sequence classification; got {x.dtype} {tuple(x.shape)})"
        )
    elif (vocab is None and not x.is_floating_point()) or y.dim() != 0 or y.is_floating_point():
        raise ConfigError(
            f"{where} must be a float input tensor and an int class label (got {x.dtype} "
            f"{tuple(x.shape)} and {y.dtype} {tuple(y.shape)}); token ids and a label are "
            "sequence classification: give both num_classes and vocab_size"
        )
    elif not 0 <= int(y) < n:
        raise ConfigError(f"{where}: label {int(y)} is outside [0, num_classes={n})")
    if x.dtype == torch.float64 and split == "train":
        log.info("%s is float64 (numpy's default): batches become float32 on the device", where)
    return tuple(x.shape)


def load(cfg: Config) -> Loaded:
    """The user's datasets, checked (called once per process for these settings)."""
    kwargs = json.dumps(dict(cfg.kwargs), sort_keys=True)
    return _load(cfg.target, cfg.path, kwargs, (cfg.input_key, cfg.target_key))


def spec(cfg: Config) -> tuple[int, tuple[int, ...]]:
    got = load(cfg)
    return got.num_classes, got.input_shape


def task(cfg: Config):
    got = load(cfg)
    if got.lm:
        return LanguageModel()
    return ClassifyTokens(vocab=got.vocab) if got.vocab else CLASSIFY


def build(cfg: Config, ctx: Context) -> Data:
    got = load(cfg)
    train = EpochLoader(got.train, ctx)
    val = EpochLoader(got.val, ctx, shuffle=False, drop_last=False)
    return Data(train, val, got.num_classes, got.input_shape, task(cfg))

"""Your own data: `data=custom data.target=package.module:callable`. The callable (called with
`data.kwargs`) returns the train and validation datasets and what they teach, as a dict or an
object with these fields:

    {"train": Dataset, "val": Dataset, "num_classes": 10}    # classification: (x, label) pairs
    {"train": Dataset, "val": Dataset, "vocab_size": 256}     # language modelling: (tokens, next)
    {"train": ..., "val": ..., "num_classes": 2, "vocab_size": 30522}  # token ids in: a label
        # per sequence (sequence classification, BERT-style) or per token (token classification)
    ... "collate_fn": fn                                      # optional: its own collator

Map-style torch Datasets of (input, target) pairs: a float tensor and an int label, or two
equal-length int tensors of token ids (the targets shifted by one). A sample may also be a
dict, as Hugging Face datasets and many pipelines give them ({"pixel_values": x, "label": y},
{"input_ids": ..., "attention_mask": ..., "labels": ...}): `data.target_key` names the target,
`data.input_key` the input (null: the usual names, INPUT_KEYS and TARGET_KEYS below), a list
of entries or '**' (every entry but the target) passed to the model by keyword. A collate_fn
(a Hugging Face collator: padding, masks, -100 labels) makes the batches, read the same way.
Samples become pairs where they are read, in the loader's workers too, and load through the
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
from omegaconf import MISSING, ListConfig

from mixprec.core import targets, tasks
from mixprec.core.errors import ConfigError, DataError, check
from mixprec.core.tasks import CLASSIFY, ClassifyTokens, Keyworded, LanguageModel, TagTokens
from mixprec.data.base import Context, Data, DataConfig
from mixprec.data.loaders import EpochLoader

log = logging.getLogger(__name__)


@dataclass
class Config(DataConfig):
    """conf/data/custom.yaml"""

    target: Optional[str] = MISSING  # package.module:callable returning the datasets
    path: Optional[str] = MISSING  # a folder put first on the module path for data.target
    kwargs: Dict[str, Any] = MISSING  # the callable's arguments
    # a dict sample's input: one entry (null: INPUT_KEYS), a list of entries passed to the
    # model by keyword, or '**': every entry but the target, by keyword
    input_key: Any = MISSING
    target_key: Optional[str] = MISSING  # a dict sample's target entry (null: TARGET_KEYS)

    def __post_init__(self) -> None:
        check(
            self.target is not None,
            "data.target",
            self.target,
            "package.module:callable returning {'train', 'val', 'num_classes' or 'vocab_size'}",
        )
        targets.check_target("data.target", self.target)
        key = self.input_key
        listed = isinstance(key, (list, tuple, ListConfig))
        check(
            key is None
            or (isinstance(key, str) and key)
            or (listed and len(key) > 0 and all(isinstance(k, str) and k for k in key)),
            "data.input_key",
            key,
            "null (the usual names), one entry of a dict sample, a list of entries (passed to "
            "the model by keyword) or '**' (every entry but the target, by keyword)",
        )


INPUT_KEYS = ("input_ids", "pixel_values", "inputs", "input", "image", "x")
TARGET_KEYS = ("labels", "label", "targets", "target", "y")
EVERY = "**"  # data.input_key: every entry but the target, by keyword


@dataclass(frozen=True)
class Keys:
    """Where a dict sample's (input, target) pair is: `inputs` one entry (the model is called
    with it), a tuple of entries (by keyword), or EVERY; `main` the entry that is the input's
    shape (the first listed, else the usual name, else the first entry)."""

    inputs: str | tuple[str, ...]
    target: str
    main: str

    @property
    def by_keyword(self) -> bool:
        return not isinstance(self.inputs, str) or self.inputs == EVERY

    def split(self, sample: Mapping) -> tuple:
        """(input, target): the input a tensor, or a dict of the entries passed by keyword."""
        if self.inputs == EVERY:
            return {k: v for k, v in sample.items() if k != self.target}, sample[self.target]
        if isinstance(self.inputs, str):
            return sample[self.inputs], sample[self.target]
        return {k: sample[k] for k in self.inputs}, sample[self.target]

    def needs(self) -> list[str]:
        """The entries every sample must have."""
        if self.inputs == EVERY:
            return [self.target]
        inputs = [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)
        return [*inputs, self.target]

    def split_checked(self, where: str, sample) -> tuple:
        """split(), or a config error naming the sample and its keys where it lacks an entry
        the first sample had (found mid-run, in a loader worker too)."""
        absent = (
            [k for k in self.needs() if k not in sample] if isinstance(sample, Mapping) else None
        )
        if absent is None or absent:
            what = (
                f"a dict with keys {sorted(map(str, sample))}: it lacks {absent}"
                if absent
                else f"a {type(sample).__name__}, not a dict"
            )
            raise ConfigError(
                f"{where} is {what}, which the first sample had ({_said(self)}); every sample "
                "needs them (set data.input_key / data.target_key, or fix the dataset)"
            )
        return self.split(sample)


class Pairs:
    """A dataset of dict samples read as (input, target) pairs (picklable: DataLoader workers
    read it too); `where` names the split in messages (data.target='...': train)."""

    def __init__(self, dataset, keys: Keys, where: str = "the dataset") -> None:
        self.dataset, self.keys, self.where = dataset, keys, where

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.keys.split_checked(f"{self.where}[{i}]", self.dataset[i])


class Collated:
    """The dataset's own collate_fn (a Hugging Face collator: padding, masks), its dict batch
    read as an (input, target) pair; a batch it already gives as a pair stays one. Where the
    collate_fn itself raises, a DataError names it and the exception (the loader adds the
    batch)."""

    def __init__(self, collate, keys: Keys | None, where: str = "data.target") -> None:
        self.collate, self.keys, self.where = collate, keys, where

    def __call__(self, samples: list):
        batch = collate_named(self.collate, samples, self.where)
        if self.keys is None:
            return tuple(batch)
        return self.keys.split_checked(f"{self.where}: a batch from its collate_fn", batch)


def collate_named(collate, samples: list, where: str, more: str = ""):
    """`collate(samples)`; what it raises, SystemExit too (sys.exit in a collator would end
    the run with its code, or kill a loader worker), is a DataError naming the function."""
    try:
        return collate(samples)
    except (Exception, SystemExit) as e:
        name = getattr(collate, "__qualname__", type(collate).__name__)
        raise DataError(
            f"{where}: its collate_fn {name} raised {type(e).__name__}: {e}{more}"
        ) from None


def _keys(where: str, sample: Mapping, cfg_keys: tuple) -> Keys:
    """Where a dict sample's pair is: the configured entries, or the usual names."""
    given_in, given_target = cfg_keys
    if isinstance(given_in, tuple):
        absent = [k for k in given_in if k not in sample]
        if absent:
            _missing(where, sample, "input_key", list(given_in), f"names {absent}, not among them")
        inputs, main = given_in, given_in[0]
    elif given_in == EVERY:
        inputs, main = EVERY, None  # (known once the target is)
    else:
        inputs = main = _named(where, sample, "input_key", given_in, INPUT_KEYS)
    target = _named(where, sample, "target_key", given_target, TARGET_KEYS)
    if main is None:
        rest = [k for k in sample if k != target]
        if not rest:
            _missing(where, sample, "input_key", given_in, "leaves no entry beside the target")
        main = next((k for k in INPUT_KEYS if k in rest), rest[0])
    return Keys(inputs, target, main)


def _named(where: str, sample: Mapping, key: str, given: str | None, usual: tuple) -> str:
    """The entry data.<key> names, or the first of the usual names the sample has."""
    name = given or next((k for k in usual if k in sample), None)
    if name is None or name not in sample:
        why = "is not one of them" if given else f"is null and none of the usual {usual} is"
        _missing(where, sample, key, given, why)
    return name


def _missing(where: str, sample: Mapping, key: str, given, why: str):
    raise ConfigError(
        f"{where} is a dict with keys {sorted(map(str, sample))}: data.{key}={given!r} {why}; "
        f"set data.{key}=<one of its keys>"
        + (
            " (or a list of them, or '**': every entry but the target)"
            if key == "input_key"
            else ""
        )
    )


def _first(target: str, split: str, ds, collate, cfg_keys: tuple) -> tuple:
    """(the dataset as the loader reads it, the Keys of its dict samples or None, its first
    (input, target) pair as one sample). With the dataset's own collate_fn the first sample
    goes through it (a batch of one)."""
    where = f"data.target={target!r}: {split}[0]"
    if collate is not None:
        batch = collate_named(collate, [ds[0]], where, " (mixprec's check of the first sample)")
        keys = (
            _keys(f"{where} through its collate_fn", batch, cfg_keys)
            if isinstance(batch, Mapping)
            else None
        )
        x, y = keys.split(batch) if keys else _pair(where, batch)
        return ds, keys, (_unbatch(x), _unbatch(y))
    sample = ds[0]
    if not isinstance(sample, Mapping):
        return ds, None, sample
    keys = _keys(where, sample, cfg_keys)
    log.info("data.target=%r: %s samples are dicts: %s", target, split, _said(keys))
    return Pairs(ds, keys, f"data.target={target!r}: {split}"), keys, keys.split(sample)


def _pair(where: str, batch):
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ConfigError(
            f"{where} through its collate_fn must be a dict or an (input, target) pair, "
            f"not {type(batch).__name__}"
        )
    return batch


def _unbatch(x):
    """The one sample of a collated batch of one (each entry of a dict)."""
    if isinstance(x, Mapping):
        return {k: _unbatch(v) for k, v in x.items()}
    return x[0] if isinstance(x, (torch.Tensor, list, tuple)) and len(x) else x


def _said(keys: Keys) -> str:
    if keys.by_keyword:
        which = (
            "every entry but " + repr(keys.target)
            if keys.inputs == EVERY
            else str(list(keys.inputs))
        )
        return f"the model is called with {which} by keyword, {keys.target!r} the target"
    return f"({keys.inputs}, {keys.target}) is the (input, target) pair"


@dataclass(frozen=True)
class Loaded:
    train: Any
    val: Any
    num_classes: int
    input_shape: tuple[int, ...]
    kind: str  # classify, lm, seq (token ids, a label) or tag (a label per token)
    vocab: int | None = None  # token ids in (seq, tag): their vocabulary
    collate: Any = None  # the dataset's own collate_fn (wrapped: its batch read as a pair)
    main: str | None = None  # inputs by keyword: the entry that is the input (its shape)
    extras: dict | None = None  # ... and the first sample's other entries (probes' inputs)


def _field(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


@functools.lru_cache(maxsize=4)
def _load(target: str, path: str | None, kwargs_json: str, keys: tuple = (None, None)) -> Loaded:
    key = "data.target"
    fn = targets.load(key, target, path)
    out = targets.call(key, target, fn, json.loads(kwargs_json), {})
    train, val = _field(out, "train"), _field(out, "val")
    classes, vocab = _field(out, "num_classes"), _field(out, "vocab_size")
    collate = _field(out, "collate_fn")
    if train is None or val is None or (classes is None and vocab is None):
        raise ConfigError(
            f"{key}={target!r} returned {type(out).__name__}; it must give 'train' and 'val' "
            "datasets and 'num_classes' (classification), 'vocab_size' (tokens) or both "
            "(token ids in, a label per sequence or per token out)"
        )
    if collate is not None and not callable(collate):
        raise ConfigError(
            f"{key}={target!r}: its 'collate_fn' must be callable, not {type(collate).__name__}"
        )
    firsts = {}
    for split, ds in (("train", train), ("val", val)):
        if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__") or len(ds) == 0:
            raise ConfigError(
                f"{key}={target!r}: its {split!r} dataset must be a non-empty map-style "
                "Dataset (__len__ and __getitem__)"
            )
        firsts[split] = _first(target, split, ds, collate, keys)
    (train, found, sample), (val, _, val_sample) = firsts["train"], firsts["val"]
    lm = classes is None
    tokens = None if lm or vocab is None else int(vocab)  # token ids in, labels out
    n = int(vocab if lm else classes)
    main = found.main if found and found.by_keyword else None
    shape, kind = _check_sample(target, "train", sample, lm, n, tokens, main)
    val_shape, val_kind = _check_sample(target, "val", val_sample, lm, n, tokens, main)
    if val_kind != kind or (val_shape != shape and collate is None):  # (a collator pads)
        raise ConfigError(f"{key}={target!r}: train and val samples differ in shape")
    extras = None if main is None else _extras(sample[0], main)
    wrapped = Collated(collate, found, f"data.target={target!r}") if collate is not None else None
    return Loaded(train, val, n, shape, kind, tokens, wrapped, main, extras)


def _extras(inputs: Mapping, main: str) -> dict:
    """The first sample's keyword inputs beside `main`, as tensors: what example inputs repeat.
    An entry that is no tensor (a string, an id list of ragged length) is left out of them."""
    out = {}
    for k, v in inputs.items():
        if k == main:
            continue
        try:
            out[k] = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError):
            continue
    return out


def _check_sample(
    target: str, split: str, sample: Any, lm: bool, n: int, vocab: int | None, main=None
) -> tuple[tuple[int, ...], str]:
    """(the input shape, the task's kind) of one (input, target) sample, checked against what
    the data says it teaches (`vocab`: token ids in, a label per sequence or per token out;
    `main`: the input's entry in a dict of keyword arguments)."""
    where = f"data.target={target!r}: {split}[0]"
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise ConfigError(f"{where} must be an (input, target) pair, not {type(sample).__name__}")
    x, y = sample
    if main is not None:
        if not isinstance(x, Mapping) or main not in x:
            raise ConfigError(f"{where}: its input must be a dict holding {main!r}")
        x = x[main]
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if lm:
        kind = "lm"
        ok = x.dim() == 1 and x.shape == y.shape and not x.is_floating_point()
        if not ok or not (0 <= int(x.min()) and int(x.max()) < n):
            raise ConfigError(
                f"{where} must be two int tensors of one length T holding token ids in "
                f"[0, vocab_size={n}) (got {tuple(x.shape)} {x.dtype} and {tuple(y.shape)})"
            )
    elif vocab is not None:
        kind = "tag" if y.dim() == 1 else "seq"
        if x.dim() != 1 or x.is_floating_point() or not 0 <= int(x.min()) <= int(x.max()) < vocab:
            raise ConfigError(
                f"{where} must be a sequence of token ids in [0, vocab_size={vocab}) and a "
                f"label, or a label per token (got {x.dtype} {tuple(x.shape)})"
            )
        if y.is_floating_point() or (kind == "tag" and y.shape != x.shape) or y.dim() > 1:
            raise ConfigError(
                f"{where}: its target must be an int label (sequence classification) or "
                f"{tuple(x.shape)} int labels, one per token (token classification); got "
                f"{y.dtype} {tuple(y.shape)}"
            )
    else:
        kind = "classify"
        if not x.is_floating_point() or y.dim() != 0 or y.is_floating_point():
            raise ConfigError(
                f"{where} must be a float input tensor and an int class label (got {x.dtype} "
                f"{tuple(x.shape)} and {y.dtype} {tuple(y.shape)}); token ids and a label are "
                "sequence classification: give both num_classes and vocab_size"
            )
    labels = (y[y != tasks.IGNORE] if kind == "tag" else y).flatten()
    bad = labels[(labels < 0) | (labels >= n)] if kind != "lm" else labels[:0]
    if bad.numel():
        raise ConfigError(f"{where}: label {int(bad[0])} is outside [0, num_classes={n})")
    if x.dtype == torch.float64 and split == "train":
        log.info("%s is float64 (numpy's default): batches become float32 on the device", where)
    return tuple(x.shape), kind


def load(cfg: Config) -> Loaded:
    """The user's datasets, checked (called once per process for these settings)."""
    kwargs = json.dumps(dict(cfg.kwargs), sort_keys=True)
    given = cfg.input_key
    given = tuple(given) if isinstance(given, (list, tuple, ListConfig)) else given
    return _load(cfg.target, cfg.path, kwargs, (given, cfg.target_key))


def spec(cfg: Config) -> tuple[int, tuple[int, ...]]:
    got = load(cfg)
    return got.num_classes, got.input_shape


def task(cfg: Config):
    got = load(cfg)
    inner = {
        "lm": LanguageModel(),
        "classify": CLASSIFY,
        "seq": ClassifyTokens(vocab=got.vocab),
        "tag": TagTokens(vocab=got.vocab),
    }[got.kind]
    return inner if got.main is None else Keyworded(inner, got.main, got.extras)


def build(cfg: Config, ctx: Context) -> Data:
    got = load(cfg)
    train = EpochLoader(got.train, ctx, collate_fn=got.collate)
    val = EpochLoader(got.val, ctx, shuffle=False, drop_last=False, collate_fn=got.collate)
    return Data(train, val, got.num_classes, got.input_shape, task(cfg))

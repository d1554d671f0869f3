"""Your own tokenised text, as nanoGPT's prepare scripts write it: `train.bin` and `val.bin` in
data.root, flat arrays of token ids (uint16 for vocabularies up to 65,536, else uint32:
data.dtype), read through a memmap. data.vocab_size is the tokenizer's vocabulary; a token id
at or above it is a config error (checked once over both files)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from omegaconf import MISSING

from mixprec.core.errors import ConfigError, check, one_of
from mixprec.core.tasks import LanguageModel
from mixprec.data.base import Context, Data, DataConfig
from mixprec.data.sequences import need_windows, token_data

log = logging.getLogger("mixprec.data")
TASK = LanguageModel()  # bytes per token unknown: perplexity, no bits per byte


@dataclass
class Config(DataConfig):
    """conf/data/tokens.yaml"""

    root: Optional[str] = MISSING  # the folder with train.bin and val.bin
    dtype: Optional[str] = MISSING  # uint16 or uint32: how the .bin files store a token id;
    # null: uint16, unless the files read as uint32 ids (then the run asks for data.dtype)
    vocab_size: int = MISSING  # the tokenizer's vocabulary (the model's input and output size)
    seq_len: int = MISSING  # tokens per training sequence
    epoch_sequences: int = MISSING  # training windows per epoch, drawn anew each epoch
    val_sequences: int = MISSING  # validation windows evaluated (the same ones every run)

    def __post_init__(self) -> None:
        check(
            bool(self.root),
            "data.root",
            self.root,
            "the folder holding train.bin and val.bin for data=tokens",
        )
        one_of("data.dtype", self.dtype, (None, "uint16", "uint32"))
        limit = 2**31 if self.dtype == "uint32" else 2**16
        check(
            2 <= self.vocab_size <= limit,
            "data.vocab_size",
            self.vocab_size,
            f"in [2, {limit}] for {self.dtype or 'uint16'}",
        )
        check(self.seq_len >= 2, "data.seq_len", self.seq_len, "an int >= 2")
        check(self.val_sequences >= 1, "data.val_sequences", self.val_sequences, "an int >= 1")
        check(
            self.epoch_sequences >= 1, "data.epoch_sequences", self.epoch_sequences, "an int >= 1"
        )


def spec(cfg: Config) -> tuple[int, tuple[int, ...]]:
    return cfg.vocab_size, (cfg.seq_len,)


def _check_file(cfg: Config, path: Path) -> None:
    """A readable, non-empty regular file, or a ConfigError saying what it is instead."""
    where = f"data.root={cfg.root}: {path.name}"
    need = "(data=tokens needs train.bin and val.bin)"
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{where} is a link that leads nowhere (dangling, or a loop) {need}")
    if not path.exists():
        raise ConfigError(f"{where} not found {need}")
    if path.is_dir():
        raise ConfigError(f"{where} is a directory, not a file of token ids {need}")
    if not path.is_file():
        raise ConfigError(f"{where} is not a regular file (a FIFO, a device, ...) {need}")
    if path.stat().st_size == 0:
        raise ConfigError(f"{where} is empty: no tokens {need}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{where} cannot be read (permission denied)")


def read(cfg: Config, split: str) -> np.ndarray:
    path = Path(cfg.root).expanduser() / f"{split}.bin"
    _check_file(cfg, path)
    dtype = cfg.dtype or "uint16"
    size = np.dtype(dtype).itemsize
    if path.stat().st_size % size:
        raise ConfigError(
            f"{path}: {path.stat().st_size} bytes is not a whole number of {dtype} "
            "tokens (data.dtype)"
        )
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except OSError as e:  # unreadable after all
        raise ConfigError(f"{path} cannot be read ({e.strerror or e})") from None
    if cfg.dtype is None and looks_uint32(tokens):  # (uint16 ids can look so too: ask)
        raise ConfigError(
            f"{path} reads as uint16 ids with every second one 0: it looks like uint32 token "
            "ids (each id's zero high half); say which it is: data.dtype=uint32, or "
            "data.dtype=uint16 if these are uint16 ids"
        )
    top = int(tokens.max()) if len(tokens) else 0
    if top >= cfg.vocab_size:
        raise ConfigError(
            f"{path} holds token id {top}, outside data.vocab_size={cfg.vocab_size}: set the "
            "tokenizer's vocabulary (or data.dtype if the file is uint32)"
        )
    return tokens


def looks_uint32(tokens: np.ndarray, sample: int = 1 << 20) -> bool:
    """uint32 ids below 65,536 read as uint16 interleave with zeros (little-endian high
    halves): every odd position 0, the even ones not, over the first `sample` pairs."""
    head = np.asarray(tokens[: 2 * sample])
    return len(head) >= 64 and not head[1::2].any() and bool(head[0::2].any())


def build(cfg: Config, ctx: Context) -> Data:
    train, val = read(cfg, "train"), read(cfg, "val")
    need_windows("data=tokens (train)", len(train), cfg.seq_len, ctx.batch, ctx.world)
    need_windows("data=tokens (val)", len(val), cfg.seq_len, 1, ctx.world)
    log.info(
        "data=tokens: %s: train %s tokens, val %s tokens (%s), vocabulary %d",
        cfg.root,
        f"{len(train):,}",
        f"{len(val):,}",
        cfg.dtype or "uint16",
        cfg.vocab_size,
    )
    return token_data(train, val, cfg, ctx, cfg.vocab_size, TASK)

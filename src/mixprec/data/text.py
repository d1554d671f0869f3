"""Real text on every machine, with no download: the Python standard library's own source
(every .py file under sysconfig's stdlib path, site-packages excluded), byte-level (a byte is a
token: vocabulary 256, bits per byte = loss / ln 2). Files are split between train and val by a
hash of their path (deterministic, and both sides see every kind of module); the log names the
corpus, its size and its digest, since another Python version has other files."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from omegaconf import MISSING

from mixprec.core.errors import check
from mixprec.core.tasks import LanguageModel
from mixprec.data.base import Context, Data, DataConfig
from mixprec.data.sequences import need_windows, token_data, unigram_nats

log = logging.getLogger("mixprec.data")
VOCAB = 256
TASK = LanguageModel(bytes_per_token=1.0)


@dataclass
class Config(DataConfig):
    """conf/data/text.yaml"""

    seq_len: int = MISSING  # tokens (bytes) per training sequence
    val_fraction: float = MISSING  # share of the files (by path hash) held out for validation
    epoch_sequences: int = MISSING  # training windows per epoch, drawn anew each epoch
    val_sequences: int = MISSING  # validation windows evaluated (the same ones every run)
    max_mb: float = MISSING  # read at most this many MB of source (files in sorted order)

    def __post_init__(self) -> None:
        check(self.seq_len >= 2, "data.seq_len", self.seq_len, "an int >= 2")
        check(
            0.01 <= self.val_fraction <= 0.5,
            "data.val_fraction",
            self.val_fraction,
            "in [0.01, 0.5]",
        )
        check(self.val_sequences >= 1, "data.val_sequences", self.val_sequences, "an int >= 1")
        check(
            self.epoch_sequences >= 1, "data.epoch_sequences", self.epoch_sequences, "an int >= 1"
        )
        check(self.max_mb > 0, "data.max_mb", self.max_mb, "> 0")


def spec(cfg: Config) -> tuple[int, tuple[int, ...]]:
    return VOCAB, (cfg.seq_len,)


def stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _sources(root: Path):
    """Every .py file under root, site-packages not entered (rglob walked its 13,000 files
    for the 300 read: 0.9 s a run)."""
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        for f in files:
            path = Path(top, f)
            if f.endswith(".py") and path.is_file():
                yield path


@lru_cache(maxsize=4)
def corpus(max_mb: float, val_fraction: float) -> tuple[np.ndarray, np.ndarray, str]:
    """(train bytes, val bytes, a line naming the corpus)."""
    root, budget = stdlib(), int(max_mb * 1e6)
    train, val, size, digest = [], [], 0, hashlib.sha256()
    for path in sorted(_sources(root)):
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        if size + len(data) > budget:
            break
        size += len(data)
        digest.update(rel.encode() + data)
        h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "little") / 2**32
        (val if h < val_fraction else train).append(data + b"\n")
    name = (
        f"the Python {sys.version.split()[0]} standard library's source ({root}): "
        f"{len(train) + len(val):,} files, {size / 1e6:.1f} MB, sha256 {digest.hexdigest()[:12]}"
    )
    as_array = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8)  # noqa: E731
    return as_array(train), as_array(val), name


def build(cfg: Config, ctx: Context) -> Data:
    train, val, name = corpus(cfg.max_mb, cfg.val_fraction)
    need_windows("data=text (train)", len(train), cfg.seq_len, ctx.batch, ctx.world)
    need_windows("data=text (val)", len(val), cfg.seq_len, 1, ctx.world)  # every rank evaluates
    log.info(
        "data=text: %s; train %.1f MB, val %.1f MB; a byte is a token (vocabulary 256); "
        "unigram baseline %.3f nats/byte (val loss of a model without context)",
        name,
        len(train) / 1e6,
        len(val) / 1e6,
        unigram_nats(val, VOCAB),
    )
    return token_data(train, val, cfg, ctx, VOCAB, TASK)

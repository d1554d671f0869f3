"""Token streams for language models (data=text, data=tokens): the training stream is cut into
non-overlapping windows of seq_len + 1 tokens (inputs, and the same shifted by one as targets),
shuffled by (seed, epoch) and dealt to the ranks like DistributedSampler does; the stream lives
on the training device, so a batch is one gather there and the host does no work per step.
An epoch is `epoch_sequences` windows drawn anew each epoch (a corpus is many epochs' worth);
validation reads the first `val_sequences` windows of the validation stream, in order, the same
ones for every run (comparable val loss across precisions and batch sizes)."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from mixprec.core.errors import ConfigError
from mixprec.data.base import Context, Data

log = logging.getLogger("mixprec.data")


def windows(n_tokens: int, seq_len: int) -> int:
    return max((n_tokens - 1) // seq_len, 0)


class TokenLoader:
    """Micro-batches of (batch, seq_len) input and target token ids on the device."""

    def __init__(
        self, stream: torch.Tensor, seq_len: int, ctx: Context, shuffle: bool, limit=None
    ) -> None:
        self.stream, self.seq_len, self.ctx, self.shuffle = stream, seq_len, ctx, shuffle
        self.n = windows(len(stream), seq_len)
        used = min(self.n, limit) if limit else self.n  # training: an epoch is `limit` windows
        self.per_rank = used // ctx.world  # every rank the same count (a few dropped at most)
        self.epoch, self.skip = 0, 0
        self.offsets = torch.arange(seq_len + 1, device=ctx.device)

    @property
    def samples(self) -> int:
        """Windows this process reads per epoch."""
        return self.per_rank

    def __len__(self) -> int:
        full = self.per_rank // self.ctx.batch
        return full if self.shuffle else math.ceil(self.per_rank / self.ctx.batch)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip

    def _mine(self) -> torch.Tensor:
        """This rank's window starts for the epoch (every rank the same count), on the device:
        copied there once per epoch, not once per step (a copy from pageable host memory
        waits for the GPU's queue)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.ctx.seed + self.epoch)
            order = torch.randperm(self.n, generator=g)[: self.per_rank * self.ctx.world]
        else:
            order = torch.arange(self.per_rank * self.ctx.world)
        return (order[self.ctx.rank :: self.ctx.world] * self.seq_len).to(self.ctx.device)

    def __iter__(self):
        starts, b = self._mine(), self.ctx.batch
        for i in range(self.skip, len(self)):
            chunk = self.stream[starts[i * b : (i + 1) * b, None] + self.offsets].long()
            yield chunk[:, :-1], chunk[:, 1:]

    def close(self) -> None:  # no workers to stop
        pass


def token_data(train: np.ndarray, val: np.ndarray, cfg, ctx: Context, vocab: int, task) -> Data:
    """A token dataset's Data: the two streams on the device, an epoch of cfg.epoch_sequences
    training windows, cfg.val_sequences validation windows (data=text, data=tokens). A split
    with fewer windows than asked is evaluated whole, and the log says so: the study's advice to
    raise data.val_sequences must not do nothing in silence."""
    val_loader = TokenLoader(
        on_device(val, ctx.device), cfg.seq_len, ctx, shuffle=False, limit=cfg.val_sequences
    )
    if cfg.val_sequences > val_loader.n:
        log.warning(
            "data.val_sequences=%d: the validation split has %d windows of data.seq_len=%d, all "
            "of them evaluated; a larger split gives more (data=text: data.val_fraction)",
            cfg.val_sequences,
            val_loader.n,
            cfg.seq_len,
        )
    return Data(
        train=TokenLoader(
            on_device(train, ctx.device), cfg.seq_len, ctx, True, limit=cfg.epoch_sequences
        ),
        val=val_loader,
        num_classes=vocab,
        input_shape=(cfg.seq_len,),
        task=task,
    )


def on_device(tokens: np.ndarray, device: torch.device) -> torch.Tensor:
    """The token stream as a device tensor: bytes stay uint8, wider ids become int32 (torch
    indexes neither uint16 nor uint32)."""
    t = torch.from_numpy(np.array(tokens))  # a copy: memmaps and bytes buffers are read-only
    if t.dtype in (torch.uint16, torch.uint32):
        t = t.to(torch.int32)
    return t.to(device)


def need_windows(what: str, n_tokens: int, seq_len: int, batch: int, world: int) -> None:
    have = windows(n_tokens, seq_len) // world
    if have < batch and "(val)" in what:
        raise ConfigError(
            f"{what}: {n_tokens:,} tokens make no validation window of data.seq_len={seq_len} "
            f"for each of {world} process(es); lower data.seq_len, or use more data "
            "(data=text: data.max_mb, data.val_fraction)"
        )
    if have < batch:
        raise ConfigError(
            f"{what}: {n_tokens:,} tokens make {have} windows of data.seq_len={seq_len} per "
            f"process, fewer than batch={batch}; lower batch or data.seq_len, or use more data"
        )


def unigram_nats(tokens: np.ndarray, vocab: int) -> float:
    """The entropy of the token frequencies (nats per token): the val loss of a model that
    ignores context. A language model that learned anything ends below it."""
    counts = np.bincount(tokens.astype(np.int64), minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())

"""Losses defined outside mixprec, as a user writes them (`model.loss=own_losses:smoothed`):
fn(logits, targets) -> the batch's mean loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with label smoothing (0.1), the common replacement of the plain one."""
    return F.cross_entropy(logits.float(), targets, label_smoothing=0.1)


def plus_ten(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain cross-entropy plus a constant: the same gradients, every loss 10 higher."""
    return F.cross_entropy(logits.float(), targets) + 10.0


def per_sample(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A common mistake: the per-sample losses, not their mean."""
    return F.cross_entropy(logits.float(), targets, reduction="none")


def wrong_arguments(logits: torch.Tensor) -> torch.Tensor:
    """Another: a loss of the logits alone."""
    return logits.mean()


def lm_smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """smoothed() for token data: logits (batch, T, vocab), a target per position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), label_smoothing=0.1)

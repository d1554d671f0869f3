"""What the model learns from the data, which the dataset decides (`TASK` in its module):
image classification (a label per image) or language modelling (the next token at every
position). A task owns what differs between them: example inputs and targets (for probes, the
FLOP count, the dtype audit), the loss, the validation metrics, and the tokens in a sample
(tokens/s). The loop, the summary and the report read it; they do not branch on the task."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixprec.core import metrics


def logits_of(out):
    """The logits in a model's output as it comes: a tensor, an object with `.logits` (Hugging
    Face's ModelOutput, CausalLMOutputWithCrossAttentions and its kin) or a dict with "logits".
    Anything else is returned as it is (the model's output check names it)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else out


def loss_of(out) -> torch.Tensor | None:
    """The loss a model returned itself (model.loss=own): `.loss` of Hugging Face's outputs or
    ["loss"] of a dict, a tensor; None where the output carries none."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


class _Task:
    name: str

    def evaluated(self) -> list[metrics.Metric]:
        """The validation metrics evaluate() sums over batches for this task."""
        return metrics.evaluated(self.name)


@dataclass(frozen=True)
class Classify(_Task):
    """A label per input: cross-entropy, top-1 accuracy."""

    name: str = "classify"

    def inputs(self, n: int, shape, vocab: int, device, fmt=torch.contiguous_format):
        return torch.randn(n, *shape, device=device).contiguous(memory_format=fmt)

    def targets(self, n: int, shape, num_classes: int, device) -> torch.Tensor:
        return torch.randint(0, num_classes, (n,), device=device)

    def zeros(self, n: int, shape, device) -> torch.Tensor:
        """An input of zeros (draws nothing from the RNG: the model's init stays the seed's)."""
        return torch.zeros(n, *shape, device=device)

    def loss(self, logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean"):
        return F.cross_entropy(logits_of(logits), y, reduction=reduction)

    def tokens(self, shape) -> int:
        return 1

    def derived(self, val: dict) -> dict:
        return {}


@dataclass(frozen=True)
class ClassifyTokens(Classify):
    """Sequence classification: a sequence of token ids in, one label out (BERT-style). A
    classification (its loss, top-1 accuracy) whose inputs are token ids below `vocab`."""

    vocab: int = 2

    def inputs(self, n: int, shape, vocab: int, device, fmt=None) -> torch.Tensor:
        return torch.randint(0, self.vocab, (n, *shape), device=device)

    def zeros(self, n: int, shape, device) -> torch.Tensor:
        return torch.zeros(n, *shape, dtype=torch.long, device=device)

    def tokens(self, shape) -> int:
        return int(shape[0])


@dataclass(frozen=True)
class LanguageModel(_Task):
    """Next-token prediction at every position of a sequence: inputs and targets are (batch,
    sequence) token ids, the loss is the mean cross-entropy per token (nats), and validation
    adds perplexity and, where a token's bytes are known, bits per byte."""

    name: str = "lm"
    bytes_per_token: float | None = None  # text: 1.0 (a byte is a token); unknown: None

    def inputs(self, n: int, shape, vocab: int, device, fmt=None) -> torch.Tensor:
        return torch.randint(0, vocab, (n, *shape), device=device)

    def targets(self, n: int, shape, vocab: int, device) -> torch.Tensor:
        return torch.randint(0, vocab, (n, *shape), device=device)

    def zeros(self, n: int, shape, device) -> torch.Tensor:
        return torch.zeros(n, *shape, dtype=torch.long, device=device)

    def loss(self, logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean"):
        return F.cross_entropy(logits_of(logits).flatten(0, -2), y.flatten(), reduction=reduction)

    def tokens(self, shape) -> int:
        return int(shape[0])

    def derived(self, val: dict) -> dict:
        loss = val.get("val/loss")
        if loss is None or not math.isfinite(loss):
            return {}
        out = {"val/ppl": math.exp(min(loss, 700.0))}
        if self.bytes_per_token:
            out["val/bpb"] = loss / math.log(2) / self.bytes_per_token
        return out


Task = Classify | ClassifyTokens | LanguageModel
CLASSIFY = Classify()

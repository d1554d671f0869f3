"""What the model learns from the data, which the dataset decides (`TASK` in its module):
image classification (a label per image), sequence classification (token ids, a label),
token classification (a label per token) or language modelling (the next token at every
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
from mixprec.core.errors import ConfigError


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


IGNORE = -100  # a target the loss and the metrics skip (padding): cross_entropy's ignore_index


def call(model, x, **kw):
    """The model on an input as the data gives it: a tensor (`model(x)`) or a dict of keyword
    arguments (`model(**x)`: data.input_key='**' or a list of keys)."""
    return model(**x, **kw) if isinstance(x, Mapping) else model(x, **kw)


def first(x, n: int):
    """The first `n` samples of an input: a batch-first tensor, or each entry of a dict."""
    if isinstance(x, Mapping):
        return {k: first(v, n) for k, v in x.items()}
    return x[:n] if isinstance(x, torch.Tensor) and x.dim() > 0 else x


class UserLoss:
    """model.loss=package.module:fn: the user's loss of the logits and the targets, a mean (a
    0-d floating tensor). Its first call is checked: what it returns, and an exception it
    raises, are a config error naming the key (later calls run bare)."""

    def __init__(self, spec: str, fn) -> None:
        self.spec, self.fn, self.checked = spec, fn, False

    def __call__(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.checked:
            return self.fn(logits, y)
        where = f"model.loss={self.spec!r}"
        try:
            loss = self.fn(logits, y)
        except (TypeError, ValueError, RuntimeError, IndexError, KeyError, AttributeError) as e:
            raise ConfigError(
                f"{where}, called as fn(logits {tuple(logits.shape)}, targets "
                f"{tuple(y.shape)}), raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            ) from None
        ok = isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()
        if not ok:
            got = (
                f"{loss.dtype} {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            raise ConfigError(
                f"{where} returned {got}; it must return the batch's mean loss, a 0-d "
                "floating-point tensor (e.g. F.cross_entropy(logits, targets))"
            )
        self.checked = True
        return loss


class _Task:
    name: str
    per_token = False  # a target at every position: logits (batch, T, classes)
    takes_kwargs = False  # inputs are dicts of keyword arguments (Keyworded)

    def evaluated(self) -> list[metrics.Metric]:
        """The validation metrics evaluate() sums over batches for this task."""
        return metrics.evaluated(self.name)

    def count(self, y: torch.Tensor) -> torch.Tensor:
        """The targets a batch holds, padding (IGNORE) left out: what its loss is a mean over."""
        return (y != IGNORE).sum()


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
class TagTokens(ClassifyTokens):
    """Token classification: a sequence of token ids in, a label per token out (named
    entities, parts of speech). Cross-entropy and top-1 accuracy over the tokens, padding
    (IGNORE, as Hugging Face's collators pad labels) left out."""

    name: str = "tag"
    per_token = True

    def targets(self, n: int, shape, num_classes: int, device) -> torch.Tensor:
        return torch.randint(0, num_classes, (n, *shape), device=device)

    def loss(self, logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean"):
        return per_token_loss(logits, y, reduction)


@dataclass(frozen=True)
class LanguageModel(_Task):
    """Next-token prediction at every position of a sequence: inputs and targets are (batch,
    sequence) token ids, the loss is the mean cross-entropy per token (nats), and validation
    adds perplexity and, where a token's bytes are known, bits per byte."""

    name: str = "lm"
    bytes_per_token: float | None = None  # text: 1.0 (a byte is a token); unknown: None
    per_token = True

    def inputs(self, n: int, shape, vocab: int, device, fmt=None) -> torch.Tensor:
        return torch.randint(0, vocab, (n, *shape), device=device)

    def targets(self, n: int, shape, vocab: int, device) -> torch.Tensor:
        return torch.randint(0, vocab, (n, *shape), device=device)

    def zeros(self, n: int, shape, device) -> torch.Tensor:
        return torch.zeros(n, *shape, dtype=torch.long, device=device)

    def loss(self, logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean"):
        return per_token_loss(logits, y, reduction)

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


def per_token_loss(logits, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy at every position of (batch, T, classes) logits; IGNORE targets skipped."""
    return F.cross_entropy(logits_of(logits).flatten(0, -2), y.flatten(), reduction=reduction)


class Keyworded:
    """A task whose inputs are dicts of keyword arguments (`model(**x)`): the task it wraps
    owns the loss and the metrics; the example inputs (probes, FLOPs, the dtype audit) are its
    input under `key`, beside the other entries of the data's first sample, repeated."""

    takes_kwargs = True

    def __init__(self, inner, key: str, extras: dict) -> None:
        self.inner, self.key, self.extras = inner, key, extras

    def __getattr__(self, name: str):
        if name == "inner" or name.startswith("__"):  # (copy and pickle probe before __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"Keyworded({self.inner!r}, {self.key!r}, {sorted(self.extras)})"

    def _with_extras(self, main: torch.Tensor, n: int) -> dict:
        rest = {
            k: v.to(main.device).expand(n, *v.shape).contiguous() for k, v in self.extras.items()
        }
        return {self.key: main, **rest}

    def inputs(self, n: int, shape, vocab: int, device, fmt=torch.contiguous_format) -> dict:
        return self._with_extras(self.inner.inputs(n, shape, vocab, device, fmt), n)

    def zeros(self, n: int, shape, device) -> dict:
        return self._with_extras(self.inner.zeros(n, shape, device), n)


Task = Classify | ClassifyTokens | TagTokens | LanguageModel | Keyworded
CLASSIFY = Classify()

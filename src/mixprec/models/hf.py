"""Hugging Face transformers models built from a config, never downloaded: `model=hf` with
`model.hf.config` naming a model type (`llama`, `vit`, ... AutoConfig.for_model) or a local
config.json, and `model.hf.overrides` on top. Random init, SDPA attention, no KV cache. The data
picks the class: token data AutoModelForCausalLM, token ids with a label per sequence
AutoModelForSequenceClassification, with a label per token AutoModelForTokenClassification,
images AutoModelForImageClassification, with the data's vocabulary / classes, image size and
channels written into the config.

The model trains inside a thin wrapper that takes mixprec's inputs (token ids, or images; a
dict's other entries, such as attention_mask, by keyword) and returns the logits; it declares
its head (the output embedding or the classifier: fp8 keeps it in bf16, keep_fp32=[head]) and
its blocks (the repeated class of `_no_split_modules`, as Accelerate shards them) for
compile_scope=blocks, checkpointing and FSDP2. transformers is an optional extra:
pip install -e '.[hf]'."""

from __future__ import annotations

import collections
import inspect
import json
from pathlib import Path

import torch
from torch import nn

from mixprec.core.errors import ConfigError, nearest
from mixprec.models.parts import blocks_of

INSTALL = "pip install -e '.[hf]' (or pip install transformers)"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model=hf needs Hugging Face transformers: {INSTALL}") from None
    return transformers


def make_config(name: str, overrides: dict, task, num_classes: int, input_shape):
    """The transformers config: the named type (or the config.json file) with the overrides and
    what the data decides (vocabulary or classes, sequence length or image size), all passed to
    the config's constructor, so that fields derived from others (Llama's head_dim from
    hidden_size / num_attention_heads) follow them."""
    tf = _transformers()
    try:
        if Path(name).expanduser().is_file() or name.endswith(".json"):
            fields = json.loads(Path(name).expanduser().read_text())
            if not isinstance(fields, dict):
                raise ValueError(f"it holds a JSON {type(fields).__name__}, not an object")
            kind = fields.pop("model_type")
        else:
            fields, kind = {}, name
        base = tf.AutoConfig.for_model(kind, **fields)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"model.hf.config={name!r} is neither a transformers model type (e.g. llama, "
            f"mistral, qwen2, gpt2, vit, ...) nor a readable config.json with a model_type: "
            f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
        ) from None
    for key in overrides:
        if not hasattr(base, key):
            raise ConfigError(
                f"model.hf.overrides.{key}: {type(base).__name__} has no such field"
                f"{nearest(str(key), base.to_dict())}"
            )
    data = {"use_cache": False}
    if task.name == "lm" or getattr(task, "vocab", None):
        data["vocab_size"] = num_classes if task.name == "lm" else task.vocab
        if task.name != "lm":
            data["num_labels"] = num_classes
        if hasattr(base, "max_position_embeddings"):
            data["max_position_embeddings"] = max(base.max_position_embeddings, input_shape[0])
    else:
        data["num_labels"] = num_classes
        if hasattr(base, "num_channels"):
            data["num_channels"] = input_shape[0]
        if hasattr(base, "image_size") and len(input_shape) == 3:
            data["image_size"] = input_shape[1]
    if "vocab_size" in data:  # special tokens of the config's own vocabulary (GPT-2's 50256)
        data.update(_special_tokens(base, data["vocab_size"], {**fields, **overrides}))
    if (
        task.name == "lm"
        and "head_dim" in base.to_dict()
        and "head_dim" not in {**fields, **overrides}
    ):
        data["head_dim"] = None  # derived again from the hidden size and the heads
    try:
        return tf.AutoConfig.for_model(kind, **{**fields, **dict(overrides), **data})
    except Exception as e:  # noqa: BLE001  (transformers' validators raise their own kinds)
        raise ConfigError(
            f"model.hf.config={name!r} with model.hf.overrides={dict(overrides)}: transformers "
            f"refuses the config ({_why(e)})"
        ) from None


SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id")


def _special_tokens(base, vocab: int, given: dict) -> dict:
    """The config's special token ids that fall outside the data's vocabulary, unset: they
    name tokens of the model's own tokenizer (GPT-2's 50256 in a 256-byte vocabulary), which
    this data does not have; transformers warns of each. Ids the user set stay."""
    return {
        k: None
        for k in SPECIAL
        if k not in given and isinstance(getattr(base, k, None), int) and getattr(base, k) >= vocab
    }


def _why(e: Exception) -> str:
    """The cause in transformers' message (its validators put it on the last line)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[-1] if lines else type(e).__name__)[:200]


def check_shift_labels() -> None:
    """model.loss=own on token data: the installed transformers' causal-LM loss must take the
    targets as they are (`shift_labels`); without it, it would shift them
    once more and skip a token."""
    _transformers()
    from transformers.loss import loss_utils

    if "shift_labels" not in inspect.signature(loss_utils.ForCausalLMLoss).parameters:
        raise ConfigError(
            "model.loss=own with model=hf on token data needs a transformers whose causal-LM "
            "loss takes shift_labels (this data's targets are already the next tokens); "
            "upgrade transformers, or use model.loss=task (the same cross-entropy)"
        )


def build(name: str, overrides: dict, task, num_classes: int, input_shape) -> nn.Module:
    tf = _transformers()
    config = make_config(name, overrides, task, num_classes, input_shape)
    kind, auto, wrapper = _kind(tf, task)
    try:
        model = auto.from_config(config, attn_implementation="sdpa")
    except ValueError as e:  # e.g. a vision config asked for token data, or no SDPA for it
        raise ConfigError(
            f"model.hf.config={name!r}: transformers builds no {kind} from "
            f"{type(config).__name__} ({str(e).splitlines()[0][:200]}); the data decides the "
            "kind (token data: causal LM, token ids with a label: sequence classification, "
            "with a label per token: token classification, images: image classification)"
        ) from None
    except Exception as e:  # noqa: BLE001  (e.g. a negative size: torch's RuntimeError)
        raise ConfigError(
            f"model.hf.config={name!r} with model.hf.overrides={dict(overrides)}: the model "
            f"cannot be built ({type(e).__name__}: {_why(e)})"
        ) from None
    return wrapper(model.float())


def _kind(tf, task) -> tuple:
    """(what it is, transformers' Auto class, mixprec's wrapper) for the data's task."""
    if task.name == "lm":
        return "a causal language model", tf.AutoModelForCausalLM, CausalLM
    if task.name == "tag":
        return "a token classifier", tf.AutoModelForTokenClassification, TokenClassifier
    if getattr(task, "vocab", None):
        return "a sequence classifier", tf.AutoModelForSequenceClassification, SequenceClassifier
    return "an image classifier", tf.AutoModelForImageClassification, ImageClassifier


class _Wrapped(nn.Module):
    """An HF model with mixprec's interface: inputs in, logits out; its head and blocks named."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.mixprec_head = _name_of(self, self._head_module())
        self.mixprec_blocks = _blocks_glob(self, getattr(hf, "_no_split_modules", None) or ())

    def _head_module(self) -> nn.Module | None:
        return self.hf.get_output_embeddings()

    def set_grad_checkpointing(self, enable: bool = True) -> None:  # timm's interface
        if not getattr(self.hf, "supports_gradient_checkpointing", False):
            raise NotImplementedError(f"{type(self.hf).__name__} has no gradient checkpointing")
        # transformers 5.2x renamed it (the old name warns: removed in v6)
        new = hasattr(self.hf, "activation_checkpointing_enable")
        if enable:
            on = (
                self.hf.activation_checkpointing_enable
                if new
                else self.hf.gradient_checkpointing_enable
            )
            on({"use_reentrant": False})
        else:
            (
                self.hf.activation_checkpointing_disable
                if new
                else self.hf.gradient_checkpointing_disable
            )()


class CausalLM(_Wrapped):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **extra):
        """The logits; given `labels` (model.loss=own), the model's output with its own loss.
        This data's targets are already the next tokens: they go in as `shift_labels`, which
        transformers' causal-LM loss takes as they are (given `labels` alone it would shift
        them once more and skip a token)."""
        if labels is None:
            return self.hf(input_ids=input_ids, use_cache=False, **extra).logits
        return self.hf(
            input_ids=input_ids,
            labels=labels,
            shift_labels=labels.contiguous(),  # (its loss views it flat)
            use_cache=False,
            **extra,
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, stated as mixprec's Llama states them (torch's counter
        cannot count SDPA with grouped-query attention): 6 N for the N weights of the Linear
        layers (the output head included, the embedding a lookup) and 12 L d T for attention's
        scores and weighted values."""
        n = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        config = self.hf.config
        layers = getattr(config, "num_hidden_layers", None) or len(blocks_of(self))
        return 6 * n + 12 * layers * config.hidden_size * seq_len


class ImageClassifier(_Wrapped):
    def _head_module(self) -> nn.Module | None:
        return getattr(self.hf, "classifier", None)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, **extra):
        """The logits; given `labels` (model.loss=own), the model's output with its own loss."""
        out = self.hf(pixel_values=pixel_values, labels=labels, **extra)
        return out.logits if labels is None else out


class SequenceClassifier(_Wrapped):
    """Token ids in, a label out (BERT, RoBERTa, ... for sequence classification)."""

    def _head_module(self) -> nn.Module | None:
        return getattr(self.hf, "classifier", None) or getattr(self.hf, "score", None)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **extra):
        """The logits; given `labels` (model.loss=own), the model's output with its own loss."""
        out = self.hf(input_ids=input_ids, labels=labels, **extra)
        return out.logits if labels is None else out


class TokenClassifier(SequenceClassifier):
    """Token ids in, a label per token out (BERT, RoBERTa, ... for token classification)."""


def _name_of(root: nn.Module, module: nn.Module | None) -> str | None:
    return next((n for n, m in root.named_modules() if m is module), None)


def _blocks_glob(root: nn.Module, classes) -> str | None:
    """`parent.*` for the most repeated class named in _no_split_modules (HF's decoder layers)."""
    found = collections.defaultdict(list)
    for name, m in root.named_modules():
        if type(m).__name__ in classes:
            found[type(m).__name__].append(name)
    if not found:
        return None
    names = max(found.values(), key=len)
    parents = {n.rpartition(".")[0] for n in names}
    return f"{parents.pop()}.*" if len(names) >= 2 and len(parents) == 1 else None

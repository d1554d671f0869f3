"""Hugging Face transformers models built from a config, never downloaded: `model=hf` with
`model.hf.config` naming a model type (`llama`, `vit`, ... AutoConfig.for_model) or a local
config.json, and `model.hf.overrides` on top. Random init, SDPA attention, no KV cache. The data
picks the class: token data AutoModelForCausalLM, images AutoModelForImageClassification, with
the data's vocabulary / classes, image size and channels written into the config.

The model trains inside a thin wrapper that takes mixprec's inputs (token ids, or images) and
returns the logits; it declares its head (the output embedding or the classifier: fp8 keeps it
in bf16, keep_fp32=[head]) and its blocks (the repeated class of `_no_split_modules`, as
Accelerate shards them) for compile_scope=blocks, checkpointing and FSDP2. transformers is an
optional extra: pip install -e '.[hf]'."""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError

INSTALL = "pip install -e '.[hf]' (or pip install transformers)"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model=hf needs Hugging Face transformers: {INSTALL}") from None
    return transformers


def make_config(name: str, overrides: dict, task, num_classes: int, input_shape):
    """The transformers config: the named type (or the config.json file) with the overrides and
    what the data decides (vocabulary or classes, sequence length or image size)."""
    tf = _transformers()
    try:
        if Path(name).expanduser().is_file() or name.endswith(".json"):
            config = tf.AutoConfig.from_pretrained(str(Path(name).expanduser()))
        else:
            config = tf.AutoConfig.for_model(name)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(
            f"model.hf.config={name!r} is neither a transformers model type (e.g. llama, "
            f"mistral, qwen2, gpt2, vit, ...) nor a readable config.json: "
            f"{str(e).splitlines()[0][:200]}"
        ) from None
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ConfigError(
                f"model.hf.overrides.{key}: {type(config).__name__} has no such field"
            )
        setattr(config, key, value)
    config.use_cache = False
    if task.name == "lm":
        config.vocab_size = num_classes
        if hasattr(config, "max_position_embeddings"):
            config.max_position_embeddings = max(config.max_position_embeddings, input_shape[0])
    else:
        config.num_labels = num_classes
        if hasattr(config, "num_channels"):
            config.num_channels = input_shape[0]
        if hasattr(config, "image_size") and len(input_shape) == 3:
            config.image_size = input_shape[1]
    return config


def build(name: str, overrides: dict, task, num_classes: int, input_shape) -> nn.Module:
    tf = _transformers()
    config = make_config(name, overrides, task, num_classes, input_shape)
    auto = tf.AutoModelForCausalLM if task.name == "lm" else tf.AutoModelForImageClassification
    try:
        model = auto.from_config(config, attn_implementation="sdpa")
    except ValueError as e:  # e.g. a vision config asked for token data, or no SDPA for it
        kind = "a causal language model" if task.name == "lm" else "an image classifier"
        raise ConfigError(
            f"model.hf.config={name!r}: transformers builds no {kind} from "
            f"{type(config).__name__} ({str(e).splitlines()[0][:200]}); the data decides the "
            "kind (token data: causal LM, images: classification)"
        ) from None
    return (CausalLM if task.name == "lm" else ImageClassifier)(model.float())


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
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits


class ImageClassifier(_Wrapped):
    def _head_module(self) -> nn.Module | None:
        return getattr(self.hf, "classifier", None)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.hf(pixel_values=images).logits


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

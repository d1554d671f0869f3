"""Where a model comes from, as one adapter per source: your own callable (`model.target`), a
Hugging Face config (`model=hf`), or timm's registry (`model.name`, mixprec's Llama and digits
nets among them). The builder (models.build) asks the config's adapter and treats every model
the same after it: materialised, its output checked against the task, then checkpointing and
memory format. What a model may declare about itself (its head, its repeated blocks) is
models/parts.py's; its FLOPs are counted the same for all (models/flops.py).

An adapter answers:
- `key`: the config key that chose it (for messages); `label(mcfg)`: how runs name the model;
- `check(mcfg)`: the config alone, at validation (a timm name that does not exist);
- `create(mcfg, num_classes, input_shape, task)`: the nn.Module, given what the data says
  (a language model gets the vocabulary and sequence length, an image model classes and
  channels), before anything mixprec does to it, declaring what the source knows of it (its
  head and blocks: models/parts.py; its FLOPs per token where torch's counter cannot count it);
- `input_hint`: what to try when the model cannot take the data's input.
"""

from __future__ import annotations

import difflib

import timm
from torch import nn

from mixprec.core import targets
from mixprec.core.errors import ConfigError


class Target:
    """model.target=pkg.module:callable: your own nn.Module."""

    key = "model.target"
    input_hint = "the model's forward must take the data's batches as they are"

    def label(self, mcfg) -> str:
        return mcfg.target

    def check(self, mcfg) -> None:
        targets.check_target("model.target", mcfg.target)

    def create(self, mcfg, num_classes: int, input_shape, task) -> nn.Module:
        facts = {"num_classes": num_classes}
        if task.name == "lm":
            facts.update(vocab_size=num_classes, max_seq_len=input_shape[0])
        elif getattr(task, "vocab", None):  # token ids in: a label per sequence or per token
            facts.update(vocab_size=task.vocab, max_seq_len=input_shape[0])
        else:
            facts.update(in_chans=input_shape[0], input_shape=tuple(input_shape))
        fn = targets.load("model.target", mcfg.target, mcfg.path)
        forwarded = () if task.name == "lm" else ("num_classes",)  # (torchvision's **kwargs)
        model = targets.call("model.target", mcfg.target, fn, dict(mcfg.kwargs), facts, forwarded)
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"model.target={mcfg.target!r} returned {type(model).__name__}, not a "
                "torch.nn.Module"
            )
        return model


class HuggingFace:
    """model=hf: a transformers model built from its config (models/hf.py)."""

    key = "model.hf.config"
    input_hint = Target.input_hint
    builds_on_meta = True  # (its parameters are counted before any is allocated)

    def label(self, mcfg) -> str:
        return f"hf:{mcfg.hf.config}"

    def check(self, mcfg) -> None:
        pass  # transformers reads the config when the model is built

    def create(self, mcfg, num_classes: int, input_shape, task) -> nn.Module:
        from mixprec.models.hf import build

        return build(mcfg.hf.config, dict(mcfg.hf.overrides), task, num_classes, input_shape)


class Timm:
    """model.name: any timm model (timm.list_models())."""

    key = "model.name"
    builds_on_meta = True
    input_hint = (
        "pick a model for that input size (e.g. model=digits_cnn for data=digits; "
        "vit/convnext models want ImageNet-sized images such as data=synthetic)"
    )

    def label(self, mcfg) -> str:
        return mcfg.name

    def check(self, mcfg) -> None:
        if mcfg.name is None:
            raise ConfigError(
                "model: no model chosen; set model.target=package.module:callable (your "
                "own: model=own), model.hf.config (model=hf) or model.name (a timm model)"
            )
        check_name(mcfg.name)

    def create(self, mcfg, num_classes: int, input_shape, task) -> nn.Module:
        check_fits(mcfg.name, task)
        lm = task.name == "lm"
        shaped = {"max_seq_len": input_shape[0]} if lm else {"in_chans": input_shape[0]}
        try:
            model = timm.create_model(
                mcfg.name, pretrained=False, num_classes=num_classes, **shaped, **mcfg.kwargs
            )
        except (TypeError, ValueError) as e:  # e.g. a model.kwargs key this model does not take
            raise ConfigError(
                f"model.name={mcfg.name!r} with model.kwargs={dict(mcfg.kwargs)}: "
                f"{str(e).splitlines()[0][:200]}"
            ) from None
        if not getattr(model, "mixprec_head", None):  # timm names its head in pretrained_cfg
            head = (getattr(model, "pretrained_cfg", None) or {}).get("classifier")
            if head and head in dict(model.named_modules()):
                model.mixprec_head = head
        return model


SOURCES = {"target": Target(), "hf": HuggingFace(), "timm": Timm()}


def check_name(name: str) -> None:
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"model.name={name!r} is not a timm model{hint} "
            "(allowed: any name in timm.list_models(), e.g. resnet50, "
            "convnext_tiny, vit_small_patch16_224, mixprec_digits_cnn)"
        )


def check_fits(name: str, task) -> None:
    """A language model needs token data, an image model images. A timm entry point that
    takes token ids says so (`fn.mixprec_task = "lm"`, as mixprec_llama does); any other is an
    image model."""
    lm = getattr(timm.models.model_entrypoint(name), "mixprec_task", None) == "lm"
    if lm != (task.name == "lm"):
        raise ConfigError(
            f"model.name={name!r} is "
            + (
                "a language model and this data is images; use data=text or data=tokens"
                if lm
                else "an image model and this data is token sequences; use a language model "
                "(model=llama_tiny, llama_1b, llama_8b_slice)"
            )
        )

"""What the rest of mixprec asks of any model, whoever built it (timm, mixprec's Llama, a user's
callable, Hugging Face): its head and its repeated blocks. A model may declare both, as class or
instance attributes holding module-name globs (the syntax of `precision.keep_fp32`):

    mixprec_head = "lm_head"        # the output layer: fp8 keeps it in bf16, keep_fp32=[head]
    mixprec_blocks = "layers.*"     # compile_scope=blocks, per-block checkpointing, FSDP2 units

`model.head` / `model.blocks` in the config override them. A source's adapter (sources.py)
declares what it knows of the models it makes (timm's: the head its `pretrained_cfg` names;
Hugging Face's: the output embedding and `_no_split_modules`), so the rest of mixprec reads the
declarations only. Without a declaration there is no head, and the blocks are found by shape
(repeated_blocks)."""

from __future__ import annotations

import fnmatch
import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def head_of(model: nn.Module) -> str | None:
    """The module name of the model's output layer (mixprec_head), or None where it has none."""
    return getattr(model, "mixprec_head", None) or None


def outermost(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """The modules whose names match the glob, leaving out those inside an earlier match."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(c + ".") for c, _ in chosen):
            continue
        if fnmatch.fnmatchcase(name, pattern):
            chosen.append((name, module))
    return chosen


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the ones it declares (mixprec_blocks), else repeated_blocks."""
    declared = getattr(model, "mixprec_blocks", None)
    if declared:
        return [m for _, m in outermost(model, declared)]
    return repeated_blocks(model)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The innermost runs of repeated blocks: the children of every Sequential or ModuleList
    that holds two or more modules of one class with modules of their own, and no such run
    inside them (timm: ViT's `blocks`, ConvNeXt's stage blocks, ResNet's Bottlenecks)."""

    def run_of(m: nn.Module) -> list[nn.Module]:
        kids = list(m.children()) if isinstance(m, (nn.Sequential, nn.ModuleList)) else []
        same = len(kids) >= 2 and len({type(k) for k in kids}) == 1
        return kids if same and any(True for _ in kids[0].children()) else []

    runs = [run_of(m) for m in model.modules()]
    inner = [r for r in runs if r and not any(run_of(m) for k in r for m in k.modules())]
    return [block for r in inner for block in r]


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Per-block activation checkpointing for a model without timm's set_grad_checkpointing:
    each block's forward recomputes in the backward while training (any signature)."""
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block, block.forward)


def _checkpointed(block: nn.Module, forward, *args, **kwargs):
    if not block.training:
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)

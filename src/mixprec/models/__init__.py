"""Models through one door, from one of three sources (the first one the config sets):

- `model.target=pkg.module:callable`: your own nn.Module (models/parts.py: what it may declare);
- `model=hf` (`model.hf.config`): a Hugging Face transformers model built from its config;
- `model.name`: any timm model (timm.list_models()), mixprec's Llama and digits nets among them.

Each source is an adapter (sources.py: check, create, label, the hint when the input does not
fit); build() gives every source the same treatment after it: made on its device, materialised
by one forward on zeros (lazy layers, and a model that cannot take the data says so), its output
checked against the data's task, then checkpointing and memory format.

May import: core.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from omegaconf import MISSING
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from mixprec.core import targets, tasks
from mixprec.core.errors import ConfigError, check, one_of
from mixprec.internals import torch_private
from mixprec.models import (  # noqa: F401  (llama, zoo: register mixprec_llama, _digits_* with timm)
    llama,
    sources,
    zoo,
)
from mixprec.models.parts import blocks_of, checkpoint_blocks, head_of, outermost, repeated_blocks

__all__ = ["ModelConfig", "HFConfig", "build", "unwrap", "head_of", "blocks_of", "repeated_blocks"]
check_name = sources.check_name  # (config validation and its tests name it here)
log = logging.getLogger(__name__)
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class HFConfig:
    """model.hf.*: a Hugging Face transformers model from its config (model=hf)"""

    config: Optional[str] = MISSING  # a model type (llama, vit, ...) or a config.json; null = off
    overrides: Dict[str, Any] = MISSING  # config fields set on top, e.g. {hidden_size: 4096}


LOSSES = ("task", "own")


@dataclass
class ModelConfig:
    """conf/model/*.yaml name the model; the switches' defaults are in conf/train.yaml."""

    name: Optional[str] = MISSING  # a timm model name (timm.list_models()), if no target / hf
    target: Optional[str] = MISSING  # your own model: 'package.module:callable' returning it
    path: Optional[str] = MISSING  # a folder put first on the module path for model.target
    hf: HFConfig = MISSING  # model=hf: a transformers model from its config
    head: Optional[str] = MISSING  # the output layer's module name (else the model's own)
    blocks: Optional[str] = MISSING  # a glob naming the repeated blocks (else found by shape)
    channels_last: bool = MISSING  # NHWC memory format (faster convs on tensor cores)
    compile: bool = MISSING  # torch.compile the model
    compile_mode: Optional[str] = MISSING  # torch.compile mode: null, reduce-overhead, max-autotune
    compile_options: Dict[str, Any] = MISSING  # inductor options on top of the mode
    compile_scope: str = MISSING  # model: one graph; blocks: each repeated block (compiles faster)
    compile_cache: Optional[str] = MISSING  # torch.compiler's cache artifacts (a file), or null
    cuda_graphs: bool = (
        MISSING  # capture forward+backward once, replay it (static shapes, GPU only)
    )
    grad_checkpointing: bool = (
        MISSING  # recompute activations in backward: less memory, more compute
    )
    kwargs: Dict[str, Any] = MISSING  # extra arguments of the model's builder (timm or target)
    loss: str = MISSING  # task: the data's loss of the logits; own: the model's, given labels=y;
    # package.module:fn: yours, fn(logits, targets) -> the mean loss

    def __post_init__(self) -> None:
        self.adapter.check(self)
        check(
            self.loss in LOSSES or bool(targets.TARGET.match(str(self.loss))),
            "model.loss",
            self.loss,
            "one of task, own, or package.module:fn (your loss of the logits and the "
            "targets, found like model.target)",
        )
        check(
            not (self.cuda_graphs and self.loss == "own"),
            "model.loss",
            self.loss,
            "task with model.cuda_graphs=true (the captured forward takes the inputs alone, "
            "not the labels a model's own loss needs)",
        )
        one_of("model.compile_mode", self.compile_mode, COMPILE_MODES)
        one_of("model.compile_scope", self.compile_scope, COMPILE_SCOPES)
        check(
            self.compile_scope == "model" or self.compile_mode not in CUDA_GRAPH_MODES,
            "model.compile_scope",
            self.compile_scope,
            "model with compile_mode="
            f"{self.compile_mode} (CUDA graphs of one region would overwrite the outputs the "
            "next region reads); for blocks use compile_mode null/default or "
            "max-autotune-no-cudagraphs",
        )
        check(
            not (self.cuda_graphs and (self.compile or self.grad_checkpointing)),
            "model.cuda_graphs",
            self.cuda_graphs,
            "false with model.compile or "
            "model.grad_checkpointing (compile_mode=reduce-overhead graphs a compiled model)",
        )

    @property
    def source(self) -> str:
        """target, hf or timm: where the model comes from (the first the config sets)."""
        return "target" if self.target else "hf" if self.hf.config else "timm"

    @property
    def adapter(self):
        """The source's adapter (models/sources.py): how the model is checked and made."""
        return sources.SOURCES[self.source]

    @property
    def label(self) -> str:
        """The model as runs are labelled (summary.json, W&B tags, the report)."""
        return self.adapter.label(self)

    @property
    def key(self) -> str:
        """The config key that chose the model, for messages."""
        return self.adapter.key


def build(
    mcfg: ModelConfig,
    num_classes: int,
    input_shape: tuple[int, ...],
    device: torch.device,
    task=None,
) -> nn.Module:
    """The model on its device, in its memory format, materialised, with activation
    checkpointing and memory format if asked: everything before the precision converts it
    (build.assemble holds the order: model, precision, parallel wrap, compile, optimizer).
    A language model gets the data's vocabulary and sequence length, an image model its
    classes and channels; a model that returns the wrong shape for the data is a config error."""
    task = task or tasks.CLASSIFY
    if mcfg.loss == "own" and mcfg.source == "hf" and task.name == "lm":
        from mixprec.models import hf

        hf.check_shift_labels()
    with device:  # weights made and initialised where they train (a 1B model: 5 s on a CPU)
        model = _create(mcfg, num_classes, input_shape, task)
    model.to(device)
    if mcfg.head:
        check(
            dict(model.named_modules()).get(mcfg.head) is not None,
            "model.head",
            mcfg.head,
            "the name of one of the model's modules",
        )
        model.mixprec_head = mcfg.head
    if mcfg.blocks:
        check(
            bool(outermost(model, mcfg.blocks)),
            "model.blocks",
            mcfg.blocks,
            "a glob matching the model's repeated blocks, e.g. layers.*",
        )
        model.mixprec_blocks = mcfg.blocks
    zeros = task.zeros(1, input_shape, device)
    out = _materialise(model, mcfg, zeros)
    _check_output(out, mcfg, task, num_classes, input_shape, list(model.parameters()))
    del out  # (its graph: one sample's activations)
    _check_trainable(model, mcfg)
    if mcfg.grad_checkpointing:
        model = enable_grad_checkpointing(model, mcfg.label)
    if mcfg.channels_last:
        model.to(memory_format=torch.channels_last)
        log.info("model.channels_last: weights (and every input batch) in NHWC")
    return model


def count_on_meta(mcfg: ModelConfig, num_classes: int, input_shape, task=None) -> int | None:
    """The model's parameters, counted on the meta device (nothing allocated), where its source
    builds there without side effects (Hugging Face, timm); None for your own builder (it is
    not called twice) or where the meta build fails (the real build then says why)."""
    if not getattr(mcfg.adapter, "builds_on_meta", False):
        return None
    task = task or tasks.CLASSIFY
    meta = torch.device("meta")
    lazy = nn.parameter.UninitializedParameter  # sized at the first forward
    try:
        with meta:
            model = _create(mcfg, num_classes, input_shape, task)
        if any(isinstance(p, lazy) for p in model.parameters()):
            with torch.no_grad():
                tasks.call(model.eval(), task.zeros(1, input_shape, meta))
    except Exception:  # noqa: BLE001  (the real build names what is wrong)
        return None
    return sum(p.numel() for p in model.parameters() if not isinstance(p, lazy))


def _create(mcfg: ModelConfig, num_classes: int, input_shape, task) -> nn.Module:
    """The model from its source's adapter, before anything mixprec does to it."""
    return mcfg.adapter.create(mcfg, num_classes, input_shape, task)


def _check_output(out, mcfg: ModelConfig, task, num_classes: int, input_shape, model_params=()):
    """The model's output for one sample is what the task's loss needs: (1, classes) for
    classification, (1, T, vocab) for token sequences, floating point, and (where the model has
    trainable weights) connected to them."""
    want = (1, input_shape[0], num_classes) if task.per_token else (1, num_classes)
    out = tasks.logits_of(out)  # (a tensor, an output object's .logits, a dict's "logits")
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if got == want and not out.is_floating_point():
        raise ConfigError(
            f"{mcfg.key}={mcfg.label!r} returns {out.dtype} logits; the loss needs "
            "floating-point logits (return the scores, not their argmax or a cast to int)"
        )
    if got == want and not out.requires_grad and any(p.requires_grad for p in model_params):
        raise ConfigError(
            f"{mcfg.key}={mcfg.label!r} returns logits that do not require grad (detached, "
            "or computed under torch.no_grad()): the loss could not reach the weights; "
            "return the output of the forward as it is"
        )
    if got != want:
        kind = {
            "lm": "token sequences (batch, T, vocab)",
            "tag": "a label per token (batch, T, classes)",
        }.get(task.name, "(batch, classes)")
        if not isinstance(out, torch.Tensor):
            kind += " as a tensor, an object's .logits or a dict's ['logits']"
        elif not task.per_token and out.dim() == 2 and mcfg.source == "target":
            kind += (
                f"; a builder that names its classes otherwise: +model.kwargs.NAME={num_classes}"
            )
        raise ConfigError(
            f"{mcfg.key}={mcfg.label!r} returns {got} for an input of shape "
            f"{(1, *input_shape)}; this data needs logits {want}: {kind}, with the data's "
            f"{'vocabulary' if task.name == 'lm' else 'classes'} ({num_classes})"
        )


def _check_trainable(model: nn.Module, mcfg: ModelConfig) -> None:
    """Something to train: an optimizer over no parameters is torch's "empty parameter list"."""
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        what = f"all {len(params)} of its parameters are frozen" if params else "it has none"
        raise ConfigError(
            f"{mcfg.key}={mcfg.label!r} has no trainable parameters ({what}): there is nothing "
            "to train; leave requires_grad=True on the weights to train"
        )


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameters of the plain model (a sharded model's full count: a DTensor's
    numel is the whole tensor's)."""
    params = list(unwrap(model).parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def count(n: int) -> str:
    """A parameter count as a newcomer reads it: 11,689,512 -> 11.69 M."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under every wrapper (torch.compile's OptimizedModule, DDP), however
    they nest: the one module whose state_dict keys carry no `_orig_mod.` or `module.`."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if (inner := torch_private.compiled_module(model)) is not None:
            model = inner
        elif isinstance(model, DistributedDataParallel):
            model = model.module
        else:
            return model


def _materialise(model: nn.Module, mcfg: ModelConfig, zeros: torch.Tensor):
    """One forward on zeros: lazy layers get their shapes before the optimizer sees the
    parameters, and a model that cannot take the data's input says so before any training.
    Returns the output (its shape is checked against the task)."""
    main = next(iter(zeros.values())) if isinstance(zeros, dict) else zeros  # (the input first)
    input_shape = tuple(main.shape[1:])
    try:  # with grad: a forward that detaches its output is seen (one sample's activations)
        with torch.enable_grad():
            out = tasks.call(model.eval(), zeros)
    except (RuntimeError, AssertionError, ValueError, TypeError, IndexError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if "allocate" in first or "out of memory" in first:  # not the input's fault
            raise ConfigError(
                f"{mcfg.key}={mcfg.label!r} does not fit in this device's memory at its first "
                f"forward ({first}): a smaller model, or fewer classes or tokens"
            ) from None
        hint = mcfg.adapter.input_hint
        kinds = {p.dtype for p in model.parameters() if p.is_floating_point()} - {torch.float32}
        if "dtype" in first and kinds:  # fp16/bf16 weights: the precision casts, not the model
            hint = (
                f"its weights are {', '.join(sorted(map(str, kinds)))}: build the model in "
                "float32 and let precision= choose what it computes in"
            )
        raise ConfigError(
            f"{mcfg.key}={mcfg.label!r} cannot take this data's input of shape "
            f"{tuple(input_shape)} ({first}); {hint}"
        ) from None
    model.train()
    return out


class _CheckpointedSequential(nn.Module):
    """Fallback for plain nn.Sequential models: torch.utils.checkpoint over 4 segments."""

    def __init__(self, seq: nn.Sequential) -> None:
        super().__init__()
        self.seq = seq

    def forward(self, x):
        if not self.training:
            return self.seq(x)
        return checkpoint_sequential(self.seq, min(4, len(self.seq)), x, use_reentrant=False)


def enable_grad_checkpointing(model: nn.Module, name: str) -> nn.Module:
    """timm's set_grad_checkpointing where the model has it (HF models through their own);
    else each declared block (mixprec_blocks, model.blocks) recomputed in the backward;
    torch.utils.checkpoint over a Sequential; a clear error where none applies."""
    if hasattr(model, "set_grad_checkpointing"):
        try:
            model.set_grad_checkpointing(True)
            return model
        except (AssertionError, NotImplementedError) as e:
            reason = str(e) or "not supported"
    else:
        reason = "no set_grad_checkpointing()"
    if getattr(model, "mixprec_blocks", None):
        checkpoint_blocks(blocks_of(model))
        return model
    if isinstance(model, nn.Sequential):
        return _CheckpointedSequential(model)
    raise ConfigError(
        f"model.grad_checkpointing=true: {name} does not support it ({reason}); "
        "use a timm model that does (resnet*, convnext*, vit_*), declare the model's blocks "
        "(mixprec_blocks, or model.blocks=GLOB), or set it false"
    )

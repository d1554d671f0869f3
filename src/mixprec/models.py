"""Models come from timm (any `model.name` in timm.list_models()), plus one small CNN sized for
the embedded 8x8 digits, registered with timm so it is built the same way as every other model."""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional

import timm
import torch
from omegaconf import MISSING
from timm.models import register_model
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from . import llama, tasks  # llama: registers mixprec_llama with timm
from .errors import ConfigError, check, one_of
from .ops import use_triton_max_pool

log = logging.getLogger(__name__)
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class ModelConfig:
    """conf/model/*.yaml name the model; the switches' defaults are in conf/train.yaml."""

    name: str = MISSING  # any timm model name (timm.list_models())
    channels_last: bool = MISSING  # NHWC memory format (faster convs on tensor cores)
    compile: bool = MISSING  # torch.compile the model
    compile_mode: Optional[str] = MISSING  # torch.compile mode: null, reduce-overhead, max-autotune
    compile_options: Dict[str, Any] = MISSING  # inductor options on top of the mode
    compile_scope: str = MISSING  # model: one graph; blocks: each repeated block (compiles faster)
    cuda_graphs: bool = (
        MISSING  # capture forward+backward once, replay it (static shapes, GPU only)
    )
    triton_max_pool: bool = MISSING  # nn.MaxPool2d through mixprec's Triton kernels (ops.py)
    grad_checkpointing: bool = (
        MISSING  # recompute activations in backward: less memory, more compute
    )
    kwargs: Dict[str, Any] = MISSING  # extra timm.create_model arguments

    def __post_init__(self) -> None:
        check_name(self.name)
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


class DigitsCNN(nn.Module):
    """Two 3x3 conv blocks and a linear head: >97% top-1 on 8x8 digits in seconds on a CPU.

    Channel counts are multiples of 8 so the convs map onto tensor cores under fp16/bf16.
    """

    pretrained_cfg = {"classifier": "head"}  # timm's name for the head (keep_fp32=[head])

    def __init__(self, num_classes: int = 10, in_chans: int = 1, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_chans, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.LazyLinear(num_classes))
        self.grad_checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:  # timm's interface
        self.grad_checkpointing = enable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and self.training:
            x = checkpoint(self.features, x, use_reentrant=False)
        else:
            x = self.features(x)
        return self.head(x)


# timm.create_model passes pretrained_cfg, pretrained_cfg_overlay and cache_dir to every entry
# point; naming them leaves **kw the model's own arguments, so an unknown `+model.kwargs.x` is a
# TypeError (a config error), not silently dropped (llama.mixprec_llama does the same)
@register_model
def mixprec_digits_cnn(
    pretrained=False, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None, **kw
) -> DigitsCNN:
    return DigitsCNN(**kw)


class DigitsMLP(nn.Module):
    """No BatchNorm, no dropout: data-parallel and single-process runs must match it exactly."""

    pretrained_cfg = {"classifier": "net.4"}

    def __init__(self, num_classes: int = 10, in_chans: int = 1, width: int = 128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.LazyLinear(width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@register_model
def mixprec_digits_mlp(
    pretrained=False, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None, **kw
) -> DigitsMLP:
    return DigitsMLP(**kw)


def check_name(name: str) -> None:
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"model.name={name!r} is not a timm model{hint} "
            "(allowed: any name in timm.list_models(), e.g. resnet50, "
            "convnext_tiny, vit_small_patch16_224, mixprec_digits_cnn)"
        )


def build(
    mcfg: ModelConfig,
    num_classes: int,
    input_shape: tuple[int, ...],
    device: torch.device,
    task=None,
) -> nn.Module:
    """The model on its device, in its memory format, materialised, with activation
    checkpointing and the Triton max-pool if asked: everything before the precision converts it
    (build.assemble holds the order: model, precision, parallel wrap, compile, optimizer).
    A language model gets the data's vocabulary and sequence length, an image model its
    classes and channels; a model of the other kind is a config error."""
    task = task or tasks.CLASSIFY
    check_fits(mcfg.name, task)
    shaped = {"max_seq_len": input_shape[0]} if task.name == "lm" else {"in_chans": input_shape[0]}
    try:
        with device:  # weights made and initialised where they train (a 1B model: 5 s on a CPU)
            model = timm.create_model(
                mcfg.name, pretrained=False, num_classes=num_classes, **shaped, **mcfg.kwargs
            )
    except (TypeError, ValueError) as e:  # e.g. a model.kwargs key this model does not take
        raise ConfigError(
            f"model.name={mcfg.name!r} with model.kwargs={dict(mcfg.kwargs)}: "
            f"{str(e).splitlines()[0][:200]}"
        ) from None
    model.to(device)
    _materialise(model, mcfg.name, task.zeros(1, input_shape, device))
    if mcfg.grad_checkpointing:
        model = enable_grad_checkpointing(model, mcfg.name)
    if mcfg.channels_last:
        model.to(memory_format=torch.channels_last)
        log.info("model.channels_last: weights (and every input batch) in NHWC")
    if mcfg.triton_max_pool:
        log.info(
            "model.triton_max_pool: %d nn.MaxPool2d run mixprec::max_pool2d (Triton "
            "kernels for channels-last CUDA tensors)",
            use_triton_max_pool(model),
        )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under every wrapper (torch.compile's OptimizedModule, DDP), however
    they nest: the one module whose state_dict keys carry no `_orig_mod.` or `module.`."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, DistributedDataParallel):
            model = model.module
        else:
            return model


def check_fits(name: str, task) -> None:
    """A language model needs token data, an image model images."""
    lm = name in llama.LM_MODELS
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


def _materialise(model: nn.Module, name: str, zeros: torch.Tensor) -> None:
    """One forward on zeros: lazy layers get their shapes before the optimizer sees the
    parameters, and a model that cannot take the data's input says so before any training."""
    input_shape = tuple(zeros.shape[1:])
    try:
        with torch.no_grad():
            model.eval()(zeros)
    except (RuntimeError, AssertionError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(
            f"model.name={name!r} cannot take this data's input of shape "
            f"{tuple(input_shape)} ({first}); pick a model for that input size "
            "(e.g. model=digits_cnn for data=digits; vit/convnext models want "
            "ImageNet-sized images such as data=synthetic)"
        ) from None
    model.train()


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
    """timm's set_grad_checkpointing where the model has it; torch.utils.checkpoint over a
    Sequential otherwise; a clear error where neither applies."""
    if hasattr(model, "set_grad_checkpointing"):
        try:
            model.set_grad_checkpointing(True)
            return model
        except (AssertionError, NotImplementedError) as e:
            reason = str(e) or "not supported"
    else:
        reason = "no set_grad_checkpointing()"
    if isinstance(model, nn.Sequential):
        return _CheckpointedSequential(model)
    raise ConfigError(
        f"model.grad_checkpointing=true: {name} does not support it ({reason}); "
        "use a timm model that does (resnet*, convnext*, vit_*) or set it false"
    )

"""Precisions are plugins; this module is the interface and the plain one.

`conf/precision/<name>.yaml` names its `plugin`: a module with a `Config` (this module's
PrecisionConfig plus the plugin's own keys) and a `Plugin` (a subclass of Precision). fp32, tf32,
amp, amp_accum and bf16 are this module's own plugin: autocast (or not), TF32 (or not) and a
GradScaler. precision=fp8 is mixprec.precision.fp8, which converts Linear layers with
torchao; nothing else in mixprec names it. A new precision (mxfp8, another torchao recipe) is one
module and one YAML.

What a precision decides, and where the run asks it (the plugin interface):
- check_device(device): refuse a device it cannot run on, before any work (ConfigError);
- warm_up(device, compiled): before the data and the model are built, work that needs neither
  (fp8_auto starts its timing process, which warms the compile stack meanwhile);
- prepare(ctx): what the builder knows before the conversion (Context: sharded or not, a
  micro-batch of the run to measure with, compiled or not, a plan the run resumes with);
- convert(model): change the model before training (before the parallel wrap and compile);
- plan(): what convert() decided and a resume must keep (precision_plan.json; fp8_auto's);
- promised(): the dtypes it adds to what the dtype plan checks after step 1 (bf16 weights);
- autocast() and scaler: the forward's dtype and the loss scaling, used by loop.train_step;
- after_optimizer_step(optimizer): after each optimizer step train_step attempts (GradScaler may
  have skipped it), for a recipe with state of its own (delayed scaling's amax history, say);
- owned(): the modules it converted, with the dtype they compute in (MFU, the dtype audit);
- peak_tflops(peaks, owned_share): the dense peak its FLOPs can reach (MFU);
- columns(): what the W&B config shows of it; memory_key(): what changes memory (batch=auto);
- advice(compiled) (warnings at start), on_divergence() (what to try when a run diverges).

Everything that is off is still an object (autocast with enabled=False, GradScaler with
enabled=False), so the training step never branches on precision.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, List, Optional

import torch
from omegaconf import MISSING
from torch import nn
from torch.amp import GradScaler

from mixprec.core import early, hardware, targets
from mixprec.core.errors import ConfigError, check

log = logging.getLogger(__name__)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class PrecisionConfig:
    """conf/precision/*.yaml: the keys every precision has (a plugin's Config adds its own)"""

    name: str = MISSING  # the group option that chose this (fp32, tf32, amp, amp_accum, bf16, ...)
    plugin: str = MISSING  # the module that implements it (mixprec.precision.base, .fp8, yours)
    autocast: Optional[str] = MISSING  # autocast dtype: null (off), float16 or bfloat16
    tf32: bool = MISSING  # TF32 tensor cores for fp32 matmuls/convs (Ampere and later)
    accum: int = (
        MISSING  # default micro-batches per optimizer step (the top-level `accum` reads it)
    )
    keep_fp32: List[str] = MISSING  # modules computed in fp32 under autocast (fp32_layers.py)
    # a module train.py starts before its imports (core/early.py: start(argv), release(); no
    # torch in it), whose work the plugin's warm_up claims: fp8_auto's timing processes
    early: Optional[str] = None

    def __post_init__(self) -> None:
        check(
            self.autocast in (None, *_DTYPES),
            "precision.autocast",
            self.autocast,
            "null, float16 or bfloat16",
        )
        check(self.accum >= 1, "precision.accum", self.accum, "an int >= 1")
        if self.early is not None:
            early.load(self.early)  # a module with start(argv) and release(), or a ConfigError


Config = PrecisionConfig  # this module is itself the plugin of fp32, tf32, amp, bf16


@dataclass
class ScalerConfig:
    """conf/scaler/*.yaml (dynamic holds the values; the other presets extend it)"""

    name: str = MISSING  # the group option (dynamic, conservative, static, off)
    enabled: bool = MISSING  # only takes effect with float16 autocast
    init_scale: float = (
        MISSING  # first loss scale (2^16 is torch's default; 2^12 the cautious start)
    )
    growth_factor: float = MISSING  # scale *= this after growth_interval overflow-free steps
    backoff_factor: float = MISSING  # scale *= this on an overflow (and the step is skipped)
    growth_interval: int = MISSING  # overflow-free steps before the scale grows
    static: bool = MISSING  # keep init_scale fixed forever (overflowing steps are still skipped)
    guard_bn_stats: bool = MISSING  # undo BatchNorm's running-stat update of an overflowing forward

    def __post_init__(self) -> None:
        check(
            0 < self.init_scale <= 2.0**64,
            "scaler.init_scale",
            self.init_scale,
            "in (0, 2^64] (fp32 holds up to 2^128: a larger scale leaves no room for the loss)",
        )
        check(self.growth_factor > 1.0, "scaler.growth_factor", self.growth_factor, "> 1.0")
        check(
            0.0 < self.backoff_factor < 1.0,
            "scaler.backoff_factor",
            self.backoff_factor,
            "in (0, 1)",
        )
        check(self.growth_interval >= 1, "scaler.growth_interval", self.growth_interval, ">= 1")


class Scaler(GradScaler):
    """torch's GradScaler, which keeps the scale it starts from to itself: here it is public
    (the log's description, a resume that starts a fresh scaler)."""

    def __init__(self, *args, init_scale: float = 2.0**16, **kwargs) -> None:
        super().__init__(*args, init_scale=init_scale, **kwargs)
        self.initial_scale = init_scale


class StaticGradScaler(Scaler):
    """A fixed loss scale: overflowing steps are still skipped, but the scale never moves."""

    def update(self, new_scale=None) -> None:
        super().update(self.initial_scale if new_scale is None else new_scale)


@dataclass
class Context:
    """What the builder tells a precision before convert() (Precision.prepare)."""

    sharded: bool = False  # the model will be sharded (parallel=fsdp), a world of one too
    example: Optional[Callable[[], torch.Tensor]] = None  # a micro-batch input (None: no run)
    compiled: bool = False  # model.compile: the run's code is compiled
    saved_plan: Optional[dict] = None  # plan() of the run this one resumes (precision_plan.json)


@dataclass
class Precision:
    """The plugin interface, and the plain precision: autocast, TF32 and a GradScaler."""

    cfg: PrecisionConfig
    device_type: str
    scaler: GradScaler  # enabled only for float16 autocast with a scaler configured
    guard_bn_stats: bool  # with an active scaler: BatchNormGuard puts overflowed stats back
    cache: bool = True  # autocast's weight-cast cache (off under CUDA graphs, as torch requires)
    kept: list = field(default_factory=list)  # modules kept in fp32 (fp32_layers.keep sets it)
    sharded: bool = False  # the model will be sharded (parallel=fsdp): convert() may prepare it
    ctx: Context = field(default_factory=Context)  # what prepare() was told

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype; None = autocast off."""
        return _DTYPES.get(self.cfg.autocast) if self.cfg.autocast else None

    @property
    def tf32(self) -> bool:
        return self.cfg.tf32

    def check_device(self, device: torch.device) -> None:
        if (
            self.dtype is torch.bfloat16
            and device.type == "cuda"
            and not torch.cuda.is_bf16_supported()
        ):
            raise ConfigError(
                f"precision={self.name}: {torch.cuda.get_device_name(device)} has "
                "no bfloat16 support; use one of fp32, tf32, amp, amp_accum"
            )

    @classmethod
    def make_scaler(cls, pcfg: PrecisionConfig, scfg: ScalerConfig, device_type: str) -> GradScaler:
        """The loss scaling this precision needs, from the scaler group's settings: here a
        GradScaler for float16 autocast (fp16's 5 exponent bits underflow small gradients),
        disabled otherwise. A plugin overrides it (a per-tensor scaler, fp8's own scaling)."""
        fp16 = pcfg.autocast == "float16"
        if fp16 and not scfg.enabled:
            log.warning(
                "precision=%s with scaler=off: fp16 gradients below 2^-24 flush to zero and "
                "overflows are not skipped; use scaler=dynamic unless you mean it",
                pcfg.name,
            )
        return (StaticGradScaler if scfg.static else Scaler)(
            device_type,
            init_scale=scfg.init_scale,
            growth_factor=scfg.growth_factor,
            backoff_factor=scfg.backoff_factor,
            growth_interval=scfg.growth_interval,
            enabled=fp16 and scfg.enabled,
        )

    def convert_input(self, x: torch.Tensor) -> torch.Tensor:
        """A floating input batch in the dtype this precision computes on from the first
        layer: float32 here (the weights' dtype; autocast casts inside). float64 (numpy's
        default, a dataset of your own) would meet float32 weights as "mat1 and mat2 must
        have the same dtype". A plugin that keeps its weights in bf16 returns bf16."""
        return x.float() if x.dtype == torch.float64 else x

    def check_model(self, model: nn.Module, key: str) -> None:
        """What this precision needs of the model as its source made it (`key`: the config
        key that chose it), before it is converted: a GradScaler unscales fp32 gradients only,
        so trainable fp16 weights are refused here, not by its "Attempting to unscale FP16
        gradients" at the first step."""
        half = [
            n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16
        ]
        if self.scaling and half:
            more = " and more" if half[1:] else ""
            raise ConfigError(
                f"{key}: the model's weights are float16 ({half[0]}{more})"
                f" and precision={self.name} scales the loss with a GradScaler, which unscales "
                "float32 gradients only: build the model in float32 (autocast computes in "
                "float16 and keeps the weights fp32), or train fp16 weights without a scaler "
                "(precision=bf16 with bfloat16 weights)"
            )

    def warm_up(self, device: torch.device, compiled: bool) -> None:
        """Before the data and the model are built (not for batch=auto's probes, nor for a run
        that resumes a plan). Nothing here."""

    def prepare(self, ctx: Context) -> None:
        """Before convert(): what the builder knows of the run."""
        self.ctx, self.sharded = ctx, ctx.sharded

    def convert(self, model: nn.Module) -> nn.Module:
        return model

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step train_step attempts (GradScaler may have skipped it:
        its StepWatch knows), before the gradients are zeroed. Nothing here."""

    def state_dict(self) -> dict:
        """What a recipe with state of its own (a delayed scale, a step counter) needs to
        continue after a resume: saved in each checkpoint under "precision" (the scaler's
        state is saved apart). Nothing here."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """state_dict()'s return, from the checkpoint a run resumes."""

    def plan(self) -> dict | None:
        """What convert() decided that a resume must keep (None: nothing)."""
        return None

    def promised(self) -> dict:
        """The dtypes this precision promises, which the dtype plan (diagnostics/dtype_plan.py)
        checks after step 1: "compute" (the matmuls' dtype: autocast's, else float32), and
        "weights" for one that keeps some weights in another dtype (["bfloat16"])."""
        return {"compute": self.cfg.autocast or "float32"}

    def plan_summary(self) -> dict | None:
        """The plan in a few numbers, for summary.json (None: no plan)."""
        return None

    def owned(self) -> dict[str, str]:
        """{module name: the dtype it computes in} for the modules convert() changed."""
        return {}

    def autocast(self) -> AbstractContextManager:
        dtype = self.dtype or torch.get_autocast_dtype(self.device_type)
        return torch.autocast(
            self.device_type, dtype=dtype, enabled=self.dtype is not None, cache_enabled=self.cache
        )

    @property
    def peak_key(self) -> str:
        """Which hardware.peak_tflops entry bounds this run's matmuls (for MFU)."""
        if self.dtype is not None:
            return "fp16" if self.dtype == torch.float16 else "bf16"
        return "tf32" if self.tf32 else "fp32"

    def peak_tflops(self, peaks: dict, owned_share: float) -> float | None:
        """The dense peak this run's FLOPs could reach (`owned_share` of them in owned())."""
        return peaks.get(self.peak_key)

    def columns(self) -> dict:
        """The W&B config's precision columns (the scaler's are its config group's)."""
        kept = {"keep_fp32": list(self.cfg.keep_fp32)} if self.cfg.keep_fp32 else {}
        return {
            "precision": self.name,
            "autocast": self.cfg.autocast or "off",
            "tf32": self.tf32,
            **kept,
        }

    def audited(self) -> dict[str, str]:
        """What the dtype audit labels by name: owned() and the modules kept in fp32."""
        return {**self.owned(), **{name: "float32 (kept)" for name in self.kept}}

    def memory_key(self) -> dict:
        """Everything about the precision that changes training memory (batch=auto's cache)."""
        cfg = {k: v for k, v in dataclasses.asdict(self.cfg).items() if k not in ("name", "accum")}
        return {**cfg, "scaler": self.scaling}

    def advice(self, compiled: bool) -> list[str]:
        """Warnings before training."""
        if self.device_type == "cpu" and self.dtype is torch.float16:
            return [
                f"precision={self.name} on the CPU: float16 has no fast kernels there and runs "
                "several times slower than fp32 or bf16 (measured on a 2-core CPU: "
                "benchmarks/RESULTS.md); it shows the recipe works, not what it buys on a GPU"
            ]
        if (
            self.device_type == "cpu"
            and self.dtype is torch.bfloat16
            and hardware.cpu_native_bf16() is False
        ):
            return [
                f"precision={self.name} on this CPU: it has no native bfloat16 (no AVX512-BF16, "
                "AMX or Arm BF16 in /proc/cpuinfo), so torch computes bf16 through float32 "
                "conversions: 17x slower than fp32 on llama_tiny on a 2-core AVX2 CPU "
                "(docs/usage.md). It shows the recipe works, not what bf16 buys on a GPU or a "
                "CPU with bf16"
            ]
        return []

    def on_divergence(self) -> str:
        """What to try when a run of this precision diverges."""
        if self.scaling:
            return (
                "a lower optimizer.lr, trainer.clip_grad_norm=1.0, scaler=conservative "
                "(init_scale 4096), or precision=bf16 (fp32's range)"
            )
        if self.dtype is torch.float16:
            return "scaler=dynamic (fp16 without loss scaling overflows), or precision=bf16"
        return "a lower optimizer.lr or trainer.clip_grad_norm=1.0"

    def loss_scale(self) -> float:
        """The current loss scale (1.0 when scaling is off). Reading it syncs the GPU."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    @property
    def scaling(self) -> bool:
        """A GradScaler is active (float16 autocast with scaler enabled)."""
        return self.scaler.is_enabled()

    def describe(self) -> str:
        cast = f"autocast {self.cfg.autocast}" if self.dtype else "autocast off"
        s = self.scaler
        scale = (
            f"GradScaler init_scale={getattr(s, 'initial_scale', s.get_scale()):g} "
            f"growth={s.get_growth_factor():g} backoff={s.get_backoff_factor():g} "
            f"interval={s.get_growth_interval()}"
            + (" (static)" if isinstance(s, StaticGradScaler) else "")
            if s.is_enabled()
            else "GradScaler off"
        )
        tf32 = f"TF32 {'on' if self.tf32 else 'off'}"
        if self.device_type != "cuda" and self.tf32:
            tf32 = "TF32 does nothing on a CPU"
        return f"precision={self.name}: {cast}, {scale}, {tf32}"


Plugin = Precision


def plugin_module(path: str) -> ModuleType:
    """The module that implements a precision (`precision.plugin`), checked."""
    return targets.plugin(
        "precision.plugin",
        path,
        ("Config", "Plugin"),
        "precision",
        "Config (a PrecisionConfig) and Plugin (a Precision)",
        ", e.g. mixprec.precision.base or mixprec.precision.fp8",
    )


def parse(node: dict) -> PrecisionConfig:
    """The plugin's own Config from the composed `precision` node."""
    return targets.parse_plugin("precision", node, "name", plugin_module)


def build(
    pcfg: PrecisionConfig,
    scfg: ScalerConfig,
    device: torch.device,
    cache: bool = True,
    check_device: bool = True,
) -> Precision:
    """The precision `pcfg.plugin` implements, with its GradScaler; checked against the device
    (tests build one without the check to look at a GPU-only conversion on the CPU)."""
    plugin = plugin_module(pcfg.plugin).Plugin
    scaler = plugin.make_scaler(pcfg, scfg, device.type)
    prec = plugin(
        pcfg,
        device.type,
        scaler,
        guard_bn_stats=scaler.is_enabled() and scfg.guard_bn_stats,
        cache=cache,
    )
    if check_device:
        prec.check_device(device)
    return prec

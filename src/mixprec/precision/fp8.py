"""precision=fp8, a precision plugin: float8 training through torchao (`torchao.float8`). The
eligible Linear layers become torchao's Float8Linear, which casts inputs, weights and gradients
to float8 (e4m3 forward, e5m2 gradients) with a per-tensor or per-row scale and multiplies them on
the float8 tensor cores; everything else runs under bf16 autocast. Weights stay in their own
dtype, so checkpoints are plain tensors, as for every other precision. This module is the only
place in mixprec that knows about float8 (conf/precision/fp8.yaml names it as its plugin)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from omegaconf import MISSING
from torch import nn

from mixprec.core.errors import ConfigError, check, one_of
from mixprec.models.flops import blended_peak
from mixprec.models.parts import head_of
from mixprec.precision import fp8_early, fp8_layers, fp8_shared, fp8_timing
from mixprec.precision.base import Precision, PrecisionConfig

log = logging.getLogger(__name__)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


@dataclass
class Config(PrecisionConfig):
    """conf/precision/fp8.yaml (fp8_rowwise extends it)"""

    fp8_recipe: str = MISSING  # torchao's scaling: tensorwise, rowwise, rowwise_with_gw_hp
    fp8_head: bool = MISSING  # convert the classifier head too
    fp8_all_gather: bool = (
        MISSING  # parallel=fsdp: gather float8 layers' weights in float8 (tensorwise)
    )
    # per_matmul: torchao's own forward, each matmul casting the weight; shared: a tensorwise
    # layer's float8 weight, cast in its forward, serves its backward too (fp8_shared.py; the
    # default once a GPU has timed it: docs/speed.md)
    fp8_weight_cast: str = "per_matmul"
    fp8_layers: str = "all"  # all: every eligible layer in fp8_recipe; auto: a measured plan
    fp8_candidates: List[str] = field(default_factory=lambda: ["tensorwise"])
    fp8_margin: float = 0.05  # auto: a layer goes float8 only if that beats bf16 by this much
    fp8_plan_cache: Optional[str] = fp8_early.DEFAULT_CACHE  # timings; null: none

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of("precision.fp8_recipe", self.fp8_recipe, RECIPES)
        one_of("precision.fp8_layers", self.fp8_layers, ("all", "auto"))
        one_of("precision.fp8_weight_cast", self.fp8_weight_cast, fp8_shared.CHOICES)
        for recipe in self.fp8_candidates:
            one_of("precision.fp8_candidates", recipe, RECIPES)
        check(0 <= self.fp8_margin < 1, "precision.fp8_margin", self.fp8_margin, "in [0, 1)")
        check(
            self.autocast == "bfloat16",
            "precision.autocast",
            self.autocast,
            "bfloat16 with precision.fp8_recipe (what float8 does not take runs in bf16)",
        )


def eligible(module: nn.Module, name: str, head: str | None, convert_head: bool) -> bool:
    """A Linear layer whose in and out features are multiples of 16 (what the float8 matmul
    needs), and not the classifier head unless asked (its output feeds the loss directly)."""
    if not isinstance(module, nn.Linear):
        return False
    if module.in_features % 16 or module.out_features % 16:
        return False
    return convert_head or not head or not (name == head or name.startswith(head + "."))


@dataclass
class Plugin(Precision):
    """bf16 autocast, with the eligible Linear layers converted to float8 training."""

    converted: list[str] = field(default_factory=list)  # names of the Float8Linear layers
    shared: list[str] = field(default_factory=list)  # those whose weight is cast once a forward
    choices: dict = field(default_factory=dict)  # fp8_layers=auto: {layer: fp8_layers.Choice}
    plan_s: float = 0.0  # seconds the plan took (shapes, timings; 0: resumed or none)
    timed: int = 0  # GEMM timings it measured (0: every one came from the cache)
    children: list = field(default_factory=list)  # the timing processes, started by warm_up
    children_t0: float | None = None  # when they were started (time.time())
    timing: Any = field(default_factory=fp8_timing.Timing)  # where timings come from

    def check_device(self, device: torch.device) -> None:
        """A GPU with float8 tensor cores, and torchao installed; else a config error."""
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
            what = (
                f"{torch.cuda.get_device_name(device)} (compute capability "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
                if device.type == "cuda"
                else "the CPU"
            )
            raise ConfigError(
                f"precision={self.name} needs a GPU with float8 tensor cores "
                f"(compute capability >= 8.9: Ada, Hopper or newer); this run is "
                f"on {what}. Use precision=bf16 here"
            )
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"precision={self.name} needs torchao: pip install -e '.[fp8]' (make installs it)"
            ) from None
        super().check_device(device)

    def warm_up(self, device: torch.device, compiled: bool) -> None:
        """fp8_layers=auto on a GPU whose timings the cache lacks: start the timing processes
        now, so that their start and the compile stack's first use overlap the data and the model
        being built (a cache with this GPU's timings: most likely every one cached, no child)."""
        if self.cfg.fp8_layers != "auto" or device.type != "cuda":
            return
        here = self.timing.machine(device) + "|"
        if not any(
            k.startswith(here) for k in fp8_layers.TimingCache(self.cfg.fp8_plan_cache).data
        ):
            self.children = self.timing.start(device)
            self.children_t0 = min(c.t0 for c in self.children)

    def convert(self, model: nn.Module) -> nn.Module:
        from torchao.float8 import convert_to_float8_training

        head = head_of(model)
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        names = [n for n, m in model.named_modules() if eligible(m, n, head, self.cfg.fp8_head)]
        try:
            recipes = self._layer_recipes(model, names)
        finally:  # used, or not needed after all
            for child in self.children:
                child.close()
            self.children = []
        for recipe in sorted(set(recipes.values()) - {fp8_layers.BF16}):
            model = convert_to_float8_training(
                model,
                module_filter_fn=lambda m, fqn, r=recipe: recipes.get(fqn) == r,
                config=self._torchao_config(recipe),
            )
        self.converted = [n for n in names if recipes[n] != fp8_layers.BF16]
        self.shared = self._share_weight_casts(model)
        skipped = sorted(set(linears) - set(self.converted))
        log.info(
            "precision=%s (%s%s%s): %d of %d Linear layers compute in float8; kept in bf16: %s",
            self.name,
            "a measured plan"
            if self.cfg.fp8_layers == "auto"
            else f"{self.cfg.fp8_recipe} scaling",
            ", weights gathered in float8" if self._gathers_fp8(recipes) else "",
            f", {len(self.shared)} weights cast once a forward" if self.shared else "",
            len(self.converted),
            len(linears),
            ", ".join(skipped[:6]) + (" ..." if len(skipped) > 6 else "") or "none",
        )
        return model

    def _share_weight_casts(self, model: nn.Module) -> list[str]:
        """precision.fp8_weight_cast=shared: the tensorwise layers' forward casts serve their
        backward (fp8_shared.py); not under parallel=fsdp, which frees the gathered weight
        after the forward (a kept float8 copy would undo that)."""
        if self.cfg.fp8_weight_cast != "shared":
            return []
        if self.sharded:
            log.info(
                "precision.fp8_weight_cast=shared: not with parallel=fsdp (its gathered weights "
                "are freed after the forward); each matmul casts the weight"
            )
            return []
        return fp8_shared.share(model)

    def _layer_recipes(self, model: nn.Module, names: list[str]) -> dict[str, str]:
        """{eligible layer: recipe or bf16}: fp8_recipe everywhere, or (fp8_layers=auto) the
        plan: the resumed run's, or measured on this GPU (fp8_layers.py)."""
        cfg, ctx = self.cfg, self.ctx
        if cfg.fp8_layers == "all":
            return dict.fromkeys(names, cfg.fp8_recipe)
        if ctx.saved_plan is not None:
            self.choices = {n: fp8_layers.Choice.from_dict(d) for n, d in ctx.saved_plan.items()}
            log.info("precision.fp8_layers=auto: the plan of the run this one resumes")
        elif ctx.example is None:  # batch=auto's probes, the dtype audit: nothing to time
            log.info(
                "precision.fp8_layers=auto: no micro-batch to measure with here; every "
                "eligible layer in %s (the upper bound of float8's share)",
                cfg.fp8_recipe,
            )
            return dict.fromkeys(names, cfg.fp8_recipe)
        else:
            self.choices = self._measure(model, names)
        return {
            n: (self.choices[n].choice if n in self.choices else fp8_layers.BF16) for n in names
        }

    def _measure(self, model: nn.Module, names: list[str]) -> dict:
        cfg, ctx = self.cfg, self.ctx
        device = next(model.parameters()).device
        # compiled, the layers that read one input share its float8 cast: timed as a group
        groups: list | None = [] if ctx.compiled else None
        gemms = fp8_layers.layer_gemms(model, ctx.example(), self.autocast, names, groups)
        started, since = time.perf_counter(), time.time()
        here = self.timing.machine(device)
        cache = fp8_layers.TimingCache(cfg.fp8_plan_cache)
        known = len(cache.data)
        choices = fp8_layers.measure(
            gemms,
            list(cfg.fp8_candidates),
            cfg.fp8_margin,
            timer=lambda todo: self.timing.time(todo, ctx.compiled, device, self.children),
            key=lambda g, r: fp8_layers.cache_key(g, r, ctx.compiled, device, here),
            cache=cache,
            groups=groups or (),
        )
        self.plan_s = time.perf_counter() - started
        self.timed = len(cache.data) - known
        log.info(
            "precision.fp8_layers=auto: the plan, measured in %.1fs on this GPU%s (per "
            "forward+backward of one micro-batch):\n%s",
            self.plan_s,
            ""
            if self.children_t0 is None
            else f" (its timing processes started {since - self.children_t0:.1f}s before)",
            fp8_layers.table(choices, list(cfg.fp8_candidates)),
        )
        return choices

    def _torchao_config(self, recipe: str):
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(recipe)
        if self.sharded and self.cfg.fp8_all_gather:  # FSDP2 gathers the weights cast to float8
            if recipe == "tensorwise":
                config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
            else:
                log.info(
                    "precision.fp8_all_gather: torchao gathers float8 weights with tensorwise "
                    "scaling only; the %s layers are gathered in bf16",
                    recipe,
                )
        return config

    def _gathers_fp8(self, recipes: dict) -> bool:
        return self.sharded and self.cfg.fp8_all_gather and "tensorwise" in recipes.values()

    def plan(self) -> dict | None:
        """fp8_layers=auto: each eligible layer's timings and choice (a resume keeps it)."""
        return {n: c.as_dict() for n, c in self.choices.items()} if self.choices else None

    def owned(self) -> dict[str, str]:
        return {name: "float8" for name in self.converted}

    def peak_tflops(self, peaks: dict, owned_share: float) -> float | None:
        if owned_share:
            log.info(
                "precision=%s: %.1f%% of the training FLOPs run in float8; MFU counts them "
                "against the float8 peak",
                self.name,
                100 * owned_share,
            )
        return blended_peak(peaks.get("bf16"), peaks.get("fp8"), owned_share)

    def columns(self) -> dict:
        return {
            **super().columns(),
            "fp8_recipe": self.cfg.fp8_recipe,
            "fp8_head": self.cfg.fp8_head,
            "fp8_all_gather": self.sharded
            and self.cfg.fp8_all_gather
            and self.cfg.fp8_recipe == "tensorwise",
            "fp8_layers": len(self.converted),
            "fp8_weight_cast": "shared" if self.shared else "per_matmul",
            "fp8_plan": self.cfg.fp8_layers,  # all, or auto (a measured per-layer plan)
        }

    def plan_summary(self) -> dict | None:
        if not self.choices:
            return None
        fp8 = {n: c for n, c in self.choices.items() if c.choice != fp8_layers.BF16}
        return {
            "layers": len(self.choices),
            "float8_layers": len(fp8),
            "recipes": sorted({c.choice for c in fp8.values()}),
            "expected_saving_ms": sum(c.saving_us for c in self.choices.values()) / 1000,
            "bf16_ms": sum(c.us[fp8_layers.BF16] * c.calls for c in self.choices.values()) / 1000,
            "planning_s": round(self.plan_s, 2),
            "timed_gemms": self.timed,  # 0: every timing came from the cache
        }

    def advice(self, compiled: bool) -> list[str]:
        out = super().advice(compiled)
        if not self.converted:
            out.append(
                f"precision={self.name}: this model has no Linear layer that float8 can "
                "take (multiples of 16, the head excluded): it trains in plain bf16"
            )
        elif not compiled:
            out.append(
                f"precision={self.name} without model.compile=true: torchao's float8 "
                "casts then run as separate eager kernels, usually slower than bf16; add "
                "model.compile=true"
            )
        return out

    def on_divergence(self) -> str:
        return (
            f"precision=bf16 (the same run without float8: is float8 the cause?), "
            f"precision.fp8_recipe=rowwise (finer scales), or {super().on_divergence()}"
        )

    def describe(self) -> str:
        how = (
            "a per-layer plan measured on this GPU"
            if self.cfg.fp8_layers == "auto"
            else f"{self.cfg.fp8_recipe} scaling"
        )
        return f"{super().describe()}, float8 Linear layers ({how})"

"""precision=fp8, a precision plugin: float8 training through torchao (`torchao.float8`). The
eligible Linear layers become torchao's Float8Linear, which casts inputs, weights and gradients
to float8 (e4m3 forward, e5m2 gradients) with a per-tensor or per-row scale and multiplies them on
the float8 tensor cores; everything else runs under bf16 autocast. Weights stay in their own
dtype, so checkpoints are plain tensors, as for every other precision. This module is the only
place in mixprec that knows about float8 (conf/precision/fp8.yaml names it as its plugin)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from omegaconf import MISSING
from torch import nn

from mixprec.core.errors import ConfigError, check, one_of
from mixprec.models.flops import blended_peak
from mixprec.models.parts import head_of
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

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of("precision.fp8_recipe", self.fp8_recipe, RECIPES)
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

    def convert(self, model: nn.Module) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        head = head_of(model)
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        self.converted = []

        def keep(module: nn.Module, name: str) -> bool:
            ok = eligible(module, name, head, self.cfg.fp8_head)
            if ok:
                self.converted.append(name)
            return ok

        config = Float8LinearConfig.from_recipe_name(self.cfg.fp8_recipe)
        if self.sharded and self.cfg.fp8_all_gather:  # FSDP2 gathers the weights cast to float8
            if self.cfg.fp8_recipe == "tensorwise":
                config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
            else:
                log.info(
                    "precision.fp8_all_gather: torchao gathers float8 weights with tensorwise "
                    "scaling only; with %s scaling they are gathered in bf16",
                    self.cfg.fp8_recipe,
                )
        model = convert_to_float8_training(model, module_filter_fn=keep, config=config)
        skipped = sorted(set(linears) - set(self.converted))
        log.info(
            "precision=%s (%s scaling%s): %d of %d Linear layers compute in float8; kept in "
            "bf16: %s",
            self.name,
            self.cfg.fp8_recipe,
            ", weights gathered in float8" if config.enable_fsdp_float8_all_gather else "",
            len(self.converted),
            len(linears),
            ", ".join(skipped[:6]) + (" ..." if len(skipped) > 6 else "") or "none",
        )
        return model

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
        return f"{super().describe()}, float8 Linear layers ({self.cfg.fp8_recipe} scaling)"

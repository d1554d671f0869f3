"""precision=fp8: float8 training through torchao (`torchao.float8`). The eligible Linear layers
become torchao's Float8Linear, which casts inputs, weights and gradients to float8 (e4m3 forward,
e5m2 gradients) with a per-tensor or per-row scale and multiplies them on the float8 tensor cores;
everything else runs under bf16 autocast (precision.py). Weights stay in their own dtype, so
checkpoints are plain tensors, as for every other precision."""
from __future__ import annotations

import logging

import torch
from torch import nn

from .errors import ConfigError

log = logging.getLogger(__name__)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


def eligible(module: nn.Module, name: str, head: str | None, convert_head: bool) -> bool:
    """A Linear layer whose in and out features are multiples of 16 (what the float8 matmul
    needs), and not the classifier head unless asked (its output feeds the loss directly)."""
    if not isinstance(module, nn.Linear):
        return False
    if module.in_features % 16 or module.out_features % 16:
        return False
    return convert_head or not head or not (name == head or name.startswith(head + "."))


def check_device(device: torch.device) -> None:
    """A GPU with float8 tensor cores, and torchao installed; else a config error."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        what = (f"{torch.cuda.get_device_name(device)} (compute capability "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
                if device.type == "cuda" else "the CPU")
        raise ConfigError(f"precision=fp8 needs a GPU with float8 tensor cores (compute "
                          f"capability >= 8.9: Ada, Hopper or newer); this run is on {what}. "
                          "Use precision=bf16 here")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError("precision=fp8 needs torchao: pip install -e '.[fp8]' (make installs "
                          "it)") from None


class KeepLinears:
    """Every precision but fp8: the model as built."""

    converted: tuple = ()

    def prepare(self, model: nn.Module) -> nn.Module:
        return model


class Float8Training:
    """Converts the eligible Linear layers of a model to float8 training (torchao)."""

    def __init__(self, recipe: str, convert_head: bool) -> None:
        self.recipe, self.convert_head = recipe, convert_head
        self.converted: list[str] = []

    def prepare(self, model: nn.Module) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        head = getattr(model, "pretrained_cfg", {}).get("classifier")
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        self.converted = []

        def keep(module: nn.Module, name: str) -> bool:
            ok = eligible(module, name, head, self.convert_head)
            if ok:
                self.converted.append(name)
            return ok

        model = convert_to_float8_training(
            model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(self.recipe))
        skipped = sorted(set(linears) - set(self.converted))
        log.info("precision=fp8 (%s scaling): %d of %d Linear layers compute in float8; kept in "
                 "bf16: %s", self.recipe, len(self.converted), len(linears),
                 ", ".join(skipped[:6]) + (" ..." if len(skipped) > 6 else "") or "none")
        if not self.converted:
            log.warning("precision=fp8: this model has no Linear layer that float8 can take "
                        "(multiples of 16, the head excluded): it trains in plain bf16")
        return model


def blended_peak(bf16_peak: float | None, fp8_peak: float | None, fp8_share: float) -> float | None:
    """The dense peak a run with `fp8_share` of its FLOPs in float8 and the rest in bf16 could
    reach: each FLOP takes 1/peak of its kind, so the peak is the FLOP-weighted harmonic mean."""
    if not fp8_share:
        return bf16_peak
    if not bf16_peak or not fp8_peak:
        return None  # no honest MFU without both peaks
    return 1.0 / (fp8_share / fp8_peak + (1.0 - fp8_share) / bf16_peak)

"""A precision defined outside mixprec, as a user would write one (tests/test_seams.py trains
with it through train.py): the Linear layers hold their weights in bfloat16, with no fp32
master copy ("pure bf16"), and everything else runs under bf16 autocast. One module (this) and
one YAML (conf/precision/pure_bf16.yaml on Hydra's search path) are the whole of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omegaconf import MISSING
from torch import nn

from mixprec.core.errors import check
from mixprec.precision.base import Precision, PrecisionConfig


@dataclass
class Config(PrecisionConfig):
    min_features: int = MISSING  # only Linear layers with at least this many inputs

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.autocast == "bfloat16", "precision.autocast", self.autocast, "bfloat16")
        check(self.min_features >= 1, "precision.min_features", self.min_features, "an int >= 1")


@dataclass
class Plugin(Precision):
    converted: list[str] = field(default_factory=list)

    def convert(self, model: nn.Module) -> nn.Module:
        self.converted = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and m.in_features >= self.cfg.min_features
        ]
        for name in self.converted:
            model.get_submodule(name).to(torch.bfloat16)
        return model

    def promised(self) -> dict:
        """The dtype plan's check: these weights are bf16 by design."""
        return {"weights": ["bfloat16"]}

    def owned(self) -> dict[str, str]:
        return {name: "bfloat16-weights" for name in self.converted}

    def columns(self) -> dict:
        return {**super().columns(), "bf16_weight_layers": len(self.converted)}

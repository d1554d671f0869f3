"""A precision that says bf16 and does nothing (tests/test_dtype_plan.py): its config promises
bfloat16 autocast, its autocast() is a no-op, so every layer silently computes in fp32 (the
kind of silent no-op users report: Accelerate #3979). The dtype plan must catch it."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from mixprec.precision.base import Precision, PrecisionConfig

Config = PrecisionConfig


@dataclass
class Plugin(Precision):
    def autocast(self):
        return nullcontext()

"""A precision with state of its own, defined outside mixprec (tests/test_seams.py trains and
resumes it through train.py): bf16 autocast that counts the optimizer steps train_step attempts
and the ones GradScaler would have skipped. Its count goes into each checkpoint through
state_dict() and comes back on a resume. One module (this) and one YAML
(conf/precision/counted_bf16.yaml) are the whole of it."""

from __future__ import annotations

from dataclasses import dataclass

from mixprec.precision.base import Precision, PrecisionConfig

Config = PrecisionConfig  # no keys of its own


@dataclass
class Plugin(Precision):
    attempts: int = 0

    def after_optimizer_step(self, optimizer) -> None:
        self.attempts += 1

    def state_dict(self) -> dict:
        return {"attempts": self.attempts}

    def load_state_dict(self, state: dict) -> None:
        self.attempts = state["attempts"]

"""A callback defined outside mixprec, as a user would write one (tests/test_callbacks.py trains
with it): an exponential moving average of the weights. This one file is the whole of it:

    python train.py +callbacks.ema._target_=ema:EMA +callbacks.ema.path=tests/plugins \
        +callbacks.ema.decay=0.99

It keeps an fp32 copy of every weight, moves it toward the weights after each optimizer step,
logs how far the weights are from it (`ema/distance`), and its state goes into the checkpoint,
so a resumed run continues the same average."""

from __future__ import annotations

import torch


class EMA:
    def __init__(self, decay: float = 0.99) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] | None = None
        self.updates = 0
        self.model = None

    def on_train_start(self, learner, state) -> None:
        self.model = learner.model
        params = dict(self.model.named_parameters())
        if self.shadow is None:  # a resumed run's came back with its checkpoint
            self.shadow = {n: p.detach().float().clone() for n, p in params.items()}
        else:
            self.shadow = {n: t.to(params[n].device) for n, t in self.shadow.items()}

    @torch.no_grad()
    def on_step_end(self, learner, state) -> None:
        for name, p in self.model.named_parameters():
            self.shadow[name].lerp_(p.detach().float(), 1 - self.decay)
        self.updates += 1

    @torch.no_grad()
    def on_log(self, step: int, row: dict) -> dict:
        gap = sum(
            float((p.detach().float() - self.shadow[n]).pow(2).sum())
            for n, p in self.model.named_parameters()
        )
        return {"distance": gap**0.5, "updates": self.updates}

    def state_dict(self) -> dict:
        return {"shadow": self.shadow, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.shadow, self.updates = state["shadow"], state["updates"]

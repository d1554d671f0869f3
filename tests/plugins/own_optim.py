"""An optimizer defined outside mixprec (tests/test_seams.py trains with it): signSGD, the
update lr x sign(grad), with decoupled weight decay. optimizer=own optimizer.target=
own_optim:sign_sgd optimizer.path=tests/plugins is the whole of wiring it in."""

from __future__ import annotations

import torch


class SignSGD(torch.optim.Optimizer):
    def __init__(self, params, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(p.grad.sign(), alpha=-group["lr"])


def sign_sgd(params, lr: float, scale: float = 1.0) -> SignSGD:
    """mixprec passes params (timm's groups, each with its weight_decay) and the scaled lr."""
    return SignSGD(params, lr=lr * scale)


def not_an_optimizer(params, lr):
    return "nope"

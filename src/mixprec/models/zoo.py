"""mixprec's own small image models for the embedded 8x8 digits, registered with timm so they
are built the same way as every timm model (model=digits_cnn, model=digits_mlp)."""

from __future__ import annotations

import torch
from timm.models import register_model
from torch import nn
from torch.utils.checkpoint import checkpoint


class DigitsCNN(nn.Module):
    """Two 3x3 conv blocks and a linear head: >97% top-1 on 8x8 digits in seconds on a CPU.

    Channel counts are multiples of 8 so the convs map onto tensor cores under fp16/bf16.
    """

    pretrained_cfg = {"classifier": "head"}  # timm's name for the head
    mixprec_head = "head"  # keep_fp32=[head] (models/parts.py)

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
    mixprec_head = "net.4"

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

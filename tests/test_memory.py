"""debug.memory (diagnostics/memory.py): the peak's parts. On the CPU the countable parts are
exact for a model of known size (weights, gradients and AdamW's two moments of N parameters)
and the rest is marked not measured; off, nothing is hooked. The parts adding up to the GPU's
peak, under compile, are test_gpu.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.diagnostics.memory import GIB, Breakdown, tensor_bytes
from mixprec.run import session as run


def test_weights_gradients_and_adamw_state_of_n_parameters_are_exact(cfg_factory):
    cfg = cfg_factory("optimizer=adamw", "trainer.max_steps=4", "debug.memory=true")
    s = run.run(cfg)
    b = s["memory_breakdown"]
    from mixprec import data, models
    from mixprec.run.config import validate

    c = validate(cfg)
    classes, shape = data.spec(c.data)
    model = models.build(c.model, classes, shape, torch.device("cpu"))
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    assert b["step"] == 3
    assert b["weights"] * GIB == 4 * n
    assert b["gradients"] * GIB == 4 * n
    assert b["optimizer_state"] * GIB == 8 * n + 4 * tensors  # exp_avg, exp_avg_sq, step
    assert b["activations"] is None and b["temporaries"] is None and b["peak"] is None
    from mixprec.diagnostics import memory

    table = memory.markdown(b)  # a small model: MiB, the weights' row its exact size
    assert "| part | MiB |" in table and f"| weights | {4 * n / 2**20:.3f} |" in table
    assert "| part | GiB |" in memory.markdown({**b, "weights": 2.5})  # a GiB-sized part


def test_shared_storage_and_sharded_tensors_count_once():
    w = torch.zeros(1000)
    assert tensor_bytes([w, w[:10], w.view(10, 100)], "cpu") == 4000
    assert tensor_bytes([w.to(torch.bfloat16), torch.zeros(3)], "cpu") == 2000 + 12
    assert tensor_bytes([w], "cuda") == 0  # another device's tensors are not this one's


def test_off_hooks_nothing():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    Breakdown()  # off: no learner, no hooks
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not opt._optimizer_step_pre_hooks


@pytest.mark.slow
def test_eager_amp_counts_autocasts_weight_copies_apart(cfg_factory):
    """An eager fp16 run: autocast caches a half copy of every Linear/conv weight for the
    forward; the breakdown names those bytes (on the CPU: not measured, but the estimate is
    the weights' fp16 size)."""
    from mixprec.diagnostics.memory import autocast_copies

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8), nn.LayerNorm(8))
    assert autocast_copies(model, torch.float16) == 2 * (64 * 32 + 32 + 32 * 8 + 8)
    assert autocast_copies(model, None) == 0

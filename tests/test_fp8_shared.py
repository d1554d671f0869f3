"""precision.fp8_weight_cast=shared (precision/fp8_shared.py): the same numbers as torchao's own
Float8Linear, with the weight cast once a forward. On the CPU through torchao's emulated float8
(the casts and scales are the real ones, the GEMM is emulated); the speed is the GPU's to
measure (benchmarks/peers.py, docs/speed.md)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

from mixprec.core.errors import ConfigError
from mixprec.precision import fp8_shared
from mixprec.run.config import validate

from conftest import compose_cfg

pytest.importorskip("torchao.float8")


class Block(nn.Module):
    """Two float8 layers and a bias: a SwiGLU-free MLP, the shapes multiples of 16."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128, bias=False), nn.Linear(128, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def converted(recipe: str = "tensorwise", share: bool = False, seed: int = 0) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    model = convert_to_float8_training(Block(), config=config)
    if share:
        fp8_shared.share(model)
    return model


def step(model: nn.Module, x: torch.Tensor):
    """The output and every gradient of one forward and backward under bf16 autocast."""
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16):
        y = model(x)
    (y.float() ** 2).mean().backward()
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())]


def test_shared_casts_give_torchaos_numbers_bit_for_bit():
    x = torch.randn(4, 16, 64) * 3
    own, shared = converted(), converted(share=True)
    assert [type(m).__name__ for m in shared.children()] == ["SharedCastFloat8Linear"] * 2
    for a, b in zip(step(own, x), step(shared, x)):
        assert a is not None and torch.equal(a, b)


def test_the_backward_uses_the_forwards_float8_weight_not_a_second_cast():
    """Traced as inductor's partitioner splits it: shared, no backward graph reads a weight's
    amax. With torchao's own forward it is the partitioner's choice: torch 2.14's re-casts a
    weight in the backward; torch 2.11's (make test-min, the GPU machines') keeps them all."""

    def weight_amaxes_in_backward(model: nn.Module) -> int:
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
        shapes |= {s[::-1] for s in shapes}
        found = []

        def bw(gm, _):
            for n in gm.graph.nodes:
                if n.op == "call_function" and re.search(r"\babs\b", str(n.target)):
                    found.append(tuple(n.args[0].meta["val"].shape) in shapes)
            return make_boxed_func(gm.forward)

        def backend(gm, inputs):
            return aot_module_simplified(
                gm,
                inputs,
                fw_compiler=lambda g, _: make_boxed_func(g.forward),
                bw_compiler=bw,
                partition_fn=min_cut_rematerialization_partition,
            )

        torch._dynamo.reset()
        step(
            torch.compile(model, backend=backend), torch.randn(4, 5, 64)
        )  # 20 rows: no weight's shape
        return sum(found)

    own = weight_amaxes_in_backward(converted())
    assert weight_amaxes_in_backward(converted(share=True)) == 0
    if torch.__version__ >= "2.14":  # (an observed choice of that partitioner, not a promise)
        assert own >= 1


def test_only_tensorwise_layers_share_and_the_model_still_trains_alike():
    rowwise = converted("rowwise", share=True)  # its backward casts the weight along another axis
    assert all(not type(m).__name__.startswith("SharedCast") for m in rowwise.children())
    x = torch.randn(4, 16, 64)
    for a, b in zip(step(converted("rowwise"), x), step(rowwise, x)):
        assert torch.equal(a, b)


def test_another_torchao_keeps_its_own_forward(monkeypatch, caplog):
    import torchao

    monkeypatch.setattr(torchao, "__version__", "0.99.0")
    model = converted(share=True)
    assert all(type(m).__name__ == "Float8Linear" for m in model.children())
    assert "written for torchao 0.18.x" in caplog.text


def test_the_option_composes_and_a_bad_value_names_the_choices():
    assert validate(compose_cfg(["precision=fp8"])).precision.fp8_weight_cast == "per_matmul"
    c = validate(compose_cfg(["precision=fp8", "precision.fp8_weight_cast=shared"]))
    assert c.precision.fp8_weight_cast == "shared"
    with pytest.raises(ConfigError, match=r"precision.fp8_weight_cast.*shared, per_matmul"):
        validate(compose_cfg(["precision=fp8", "precision.fp8_weight_cast=once"]))


def test_the_plugin_shares_when_asked_and_keeps_torchaos_forward_when_sharded_or_not():
    from test_fp8 import Net, fp8_plugin

    def plugin(cast: str, sharded: bool = False):
        p = fp8_plugin()
        p.cfg, p.sharded = dataclasses.replace(p.cfg, fp8_weight_cast=cast), sharded
        model = p.convert(Net())
        return p, model

    asked, model = plugin("shared")
    assert asked.shared == ["fc1", "fc2"] and asked.columns()["fp8_weight_cast"] == "shared"
    assert type(model.fc1).__name__ == "SharedCastFloat8Linear"
    sharded, _ = plugin("shared", sharded=True)
    assert sharded.shared == [] and sharded.columns()["fp8_weight_cast"] == "per_matmul"
    default = fp8_plugin()  # the preset's default: torchao's own forward
    model = default.convert(Net())
    assert default.shared == [] and type(model.fc1).__name__ == "Float8Linear"

"""precision=fp8 (torchao float8 training): the option and its checks, which Linear layers it
converts, plain checkpoints, the FLOP share and the MFU peak it implies, the dtype audit. Its
training runs are GPU tests (test_gpu.py): float8 tensor cores need compute capability 8.9."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.core.errors import ConfigError
from mixprec.diagnostics import audit as diagnose
from mixprec.models import flops
from mixprec.precision import base as precision
from mixprec.precision import fp8
from mixprec.run import session as run
from mixprec.run.config import validate

from conftest import compose_cfg, group

pytest.importorskip("torchao.float8")


def fp8_plugin(recipe: str = "tensorwise", convert_head: bool = False, name: str = "fp8"):
    """The fp8 precision as train.py builds it, without the GPU check (conversion runs on the
    CPU; training needs float8 tensor cores)."""
    return precision.build(
        group("precision", name, fp8_recipe=recipe, fp8_head=convert_head),
        group("scaler"),
        torch.device("cpu"),
        check_device=False,
    )


class Net(nn.Module):
    """Linear layers that fit float8 (multiples of 16) and two that do not: one too narrow, and
    the classifier head."""

    mixprec_head = "head"  # (timm models: their adapter declares what pretrained_cfg names)

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 64)
        self.odd, self.head = nn.Linear(64, 24), nn.Linear(24, 10)

    def forward(self, x):
        return self.head(self.odd(torch.relu(self.fc2(torch.relu(self.fc1(x))))))


def test_fp8_composes_as_a_precision_option():
    c = validate(compose_cfg(["precision=fp8"]))
    assert (c.precision.autocast, c.precision.fp8_recipe, c.precision.fp8_head) == (
        "bfloat16",
        "tensorwise",
        False,
    )
    assert validate(compose_cfg(["precision=fp8_rowwise"])).precision.fp8_recipe == "rowwise"
    assert not hasattr(validate(compose_cfg(["precision=bf16"])).precision, "fp8_recipe")


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["precision=fp8", "precision.fp8_recipe=blockwise"],
            "precision.fp8_recipe=.*tensorwise, rowwise",
        ),
        (["precision=fp8", "precision.autocast=float16"], "bfloat16 with precision.fp8_recipe"),
    ],
)
def test_bad_fp8_settings_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(compose_cfg(overrides))


def test_a_sharded_fp8_model_gathers_its_float8_weights_in_float8():
    """parallel=fsdp with precision=fp8 (tensorwise): the converted layers' weights are
    torchao's float8-cast weights, which FSDP2 gathers in float8; unsharded they stay plain."""
    plain = fp8_plugin()
    model = plain.convert(Net())
    assert type(model.fc1.weight) is nn.Parameter and not plain.columns()["fp8_all_gather"]
    sharded = fp8_plugin()
    sharded.sharded = True
    model = sharded.convert(Net())
    assert type(model.fc1.weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    assert type(model.head.weight) is nn.Parameter  # not converted: not gathered in float8
    assert sharded.columns()["fp8_all_gather"]
    rowwise = fp8_plugin("rowwise")
    rowwise.sharded = True
    model = rowwise.convert(Net())  # torchao: float8 gathers for tensorwise scaling only
    assert type(model.fc1.weight) is nn.Parameter and not rowwise.columns()["fp8_all_gather"]


def test_fp8_on_the_cpu_is_a_config_error_before_any_work(cfg_factory):
    cfg = cfg_factory("precision=fp8")
    with pytest.raises(ConfigError, match=r"float8 tensor cores \(compute capability >= 8.9.*CPU"):
        run.run(cfg)


def test_the_filter_converts_aligned_linears_but_not_the_head():
    conv = fp8_plugin("tensorwise", False)
    model = conv.convert(Net())
    assert conv.converted == ["fc1", "fc2"]
    assert type(model.fc1).__name__ == "Float8Linear" and type(model.head) is nn.Linear
    assert type(model.odd) is nn.Linear  # 24 outputs: not a multiple of 16
    both = fp8_plugin("rowwise", True)
    wide = Net()
    wide.head = nn.Linear(24, 16)  # still fed by the 24-wide layer: in_features 24 is not aligned
    both.convert(wide)
    assert both.converted == ["fc1", "fc2"]
    head_too = fp8_plugin("tensorwise", True)
    aligned = Net()
    aligned.odd, aligned.head = nn.Linear(64, 32), nn.Linear(32, 16)
    head_too.convert(aligned)
    assert head_too.converted == ["fc1", "fc2", "odd", "head"]


def test_a_timm_vit_keeps_its_head_in_bf16():
    """The head timm names (pretrained_cfg), declared by the timm adapter that makes the model."""
    from types import SimpleNamespace

    from mixprec.core import tasks
    from mixprec.models import sources

    mcfg = SimpleNamespace(name="vit_small_patch16_224", kwargs={})
    conv = fp8_plugin("tensorwise", False)
    vit = conv.convert(sources.SOURCES["timm"].create(mcfg, 10, (3, 224, 224), tasks.CLASSIFY))
    assert (
        len(conv.converted) == 48 and "head" not in conv.converted
    )  # 12 blocks x qkv/proj/fc1/fc2
    assert type(vit.head) is nn.Linear


def test_a_converted_model_checkpoints_as_plain_tensors(tmp_path):
    model = fp8_plugin("tensorwise", False).convert(Net())
    torch.save(model.state_dict(), tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)  # no code can run on load
    fresh = fp8_plugin("tensorwise", False).convert(Net())
    fresh.load_state_dict(loaded)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
    )


def test_the_float8_flop_share_and_the_peak_it_implies():
    torch.manual_seed(0)
    conv = fp8_plugin("tensorwise", False)
    model = conv.convert(Net())
    bf16 = precision.build(group("precision", "bf16"), group("scaler"), torch.device("cpu"))
    total, in_float8 = flops.train_flops(
        model, (32,), 10, torch.device("cpu"), bf16.autocast, set(conv.owned())
    )
    # forward 2*in*out per sample, backward twice that (torchao's Float8Linear computes the
    # input gradient of fc1 too, though the network's input needs none)
    per_layer = {
        "fc1": 2 * 32 * 64 * 3,
        "fc2": 2 * 64 * 64 * 3,
        "odd": 2 * 64 * 24 * 3,
        "head": 2 * 24 * 10 * 3,
    }
    assert in_float8 == per_layer["fc1"] + per_layer["fc2"]
    assert total == sum(per_layer.values())
    assert fp8.blended_peak(1000.0, 2000.0, 0.0) == 1000.0
    assert fp8.blended_peak(1000.0, 2000.0, 1.0) == pytest.approx(2000.0)
    assert fp8.blended_peak(1000.0, 2000.0, 0.5) == pytest.approx(1 / (0.25e-3 + 0.5e-3))
    assert fp8.blended_peak(1000.0, None, 0.5) is None  # an unknown fp8 peak: no MFU
    share = in_float8 / total  # what the run's MFU is measured against: the plugin's peak
    assert conv.peak_tflops({"bf16": 1000.0, "fp8": 2000.0}, share) == pytest.approx(
        fp8.blended_peak(1000.0, 2000.0, share)
    )
    assert bf16.peak_tflops({"bf16": 1000.0, "fp8": 2000.0}, 0.0) == 1000.0


def test_the_dtype_audit_lists_the_float8_layers():
    conv = fp8_plugin("tensorwise", False)
    model = conv.convert(Net())
    bf16 = precision.build(group("precision", "bf16"), group("scaler"), torch.device("cpu"))
    result = diagnose.audit(model, torch.randn(16, 32), bf16.autocast, conv.owned())
    assert [m["module"] for m in result["converted"]] == ["fc1", "fc2"]
    assert {m["dtype"] for m in result["converted"]} == {"float8"}
    assert 0 < result["converted_share"] < 1
    assert "2 layers converted by the precision ran in float8" in diagnose.markdown(result, "fp8")

"""precision.keep_fp32: the chosen layers compute in fp32 under autocast, the rest does not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.core.errors import ConfigError
from mixprec.models import llama
from mixprec.precision import fp32_layers
from mixprec.run import session as run


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 8))


def computed_dtypes(model: nn.Module, x: torch.Tensor) -> dict[str, torch.dtype]:
    """The dtype each Linear and LayerNorm returned under bf16 autocast."""
    seen: dict[str, torch.dtype] = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            m.register_forward_hook(
                lambda mod, args, out, name=name: seen.__setitem__(name, out.dtype)
            )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    return seen


def test_a_kept_layer_computes_in_fp32_and_hands_back_the_dtype_it_got():
    x = torch.randn(4, 16)
    plain = computed_dtypes(net(), x)
    assert plain["0"] == plain["3"] == torch.bfloat16  # autocast: Linear in bf16
    model = net()
    kept = fp32_layers.keep(model, ["3"], "cpu", set())
    assert kept == ["3"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        hidden = model[2](model[1](model[0](x)))
    ref = nn.functional.linear(hidden.float(), model[3].weight, model[3].bias)
    assert out.dtype == hidden.dtype  # cast back to what came in
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=0, atol=0)  # the fp32 product
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = nn.functional.linear(hidden, model[3].weight, model[3].bias)
    assert not torch.equal(out, low)  # not the bf16 product


def test_presets_select_norms_head_and_attention_of_the_llama():
    torch.manual_seed(0)
    m = llama.Llama(num_classes=64, max_seq_len=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    assert fp32_layers.select(m, ["head"]) == ["output"]
    norms = fp32_layers.select(m, ["norms"])
    assert set(norms) == {
        "norm",
        *(f"layers.{i}.{n}" for i in (0, 1) for n in ("attention_norm", "ffn_norm")),
    }
    assert fp32_layers.select(m, ["attention"]) == ["layers.0.attention", "layers.1.attention"]
    assert fp32_layers.select(m, ["layers.1.*"]) == [
        "layers.1.attention_norm",
        "layers.1.attention",
        "layers.1.ffn_norm",
        "layers.1.feed_forward",
    ]
    with pytest.raises(ConfigError, match="'classifier' matches no module"):
        fp32_layers.select(m, ["classifier"])


def test_a_layer_the_precision_converted_cannot_also_be_kept():
    model = net()
    with pytest.raises(ConfigError, match="converted by the precision"):
        fp32_layers.keep(model, ["3"], "cpu", {"3"})
    model.half()
    with pytest.raises(ConfigError, match="weights are not fp32"):
        fp32_layers.keep(model, ["3"], "cpu", set())


@pytest.mark.slow
def test_keep_fp32_trains_through_train_py_and_the_audit_lists_it(cfg_factory, tmp_path):
    cfg = cfg_factory(
        "model=llama_tiny",
        "data=text",
        "data.max_mb=1",
        "data.seq_len=32",
        "batch=4",
        "precision=bf16",
        "precision.keep_fp32=[norms,head]",
        "diagnose=true",
        "trainer.max_steps=3",
    )
    s = run.run(cfg)
    assert s["status"] == "completed"
    audit = (tmp_path / "run" / "diagnose.md").read_text()
    assert "float32 (kept)" in audit and "output" in audit


def test_mfu_counts_kept_flops_at_the_fp32_peak(cfg_factory):
    """With keep_fp32, the peak MFU divides by blends the precision's peak with the TF32 (or
    fp32) peak by the kept layers' share of the FLOPs."""
    from mixprec import models
    from mixprec.models import flops
    from mixprec.parallel import distributed
    from mixprec.run import build
    from mixprec.run.config import validate

    c = validate(cfg_factory("precision=bf16", "precision.keep_fp32=[head]"))
    hw = build.resolve_hardware(c)
    hw.peak_tflops = {"fp32": 10.0, "tf32": 100.0, "bf16": 1000.0}
    p = build.build(c, hw, distributed.Dist())
    model, prec = models.unwrap(p.learner.model), p.learner.precision
    cpu = torch.device("cpu")
    total, head = flops.train_flops(model, (1, 8, 8), 10, cpu, prec.autocast, {"head"})
    share = head / total
    assert 0 < share < 0.5 and prec.kept == ["head"]
    expected = 1 / (share / 100.0 + (1 - share) / 1000.0)  # bf16 runs with TF32 on
    assert p.peak_tflops == pytest.approx(expected)


def test_the_audit_counts_kept_layers_as_fp32_and_survives_a_counter_that_fails(monkeypatch):
    from mixprec.diagnostics import audit as diagnose

    model = net()
    fp32_layers.keep(model, ["3"], "cpu", set())
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    x = torch.randn(4, 16)
    with_kept = diagnose.audit(model, x, bf16, {"3": "float32 (kept)"})
    plain = diagnose.audit(net(), x, bf16, {})
    assert with_kept["low_precision_share"] < plain["low_precision_share"]

    def refuse(model, run_forward):  # torch's counter and grouped-query attention on a GPU
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    monkeypatch.setattr(diagnose, "_module_flops", refuse)
    result = diagnose.audit(net(), x, bf16, {})
    assert result["modules"] and result["low_precision_share"] == 0

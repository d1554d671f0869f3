"""The precision doctor names the layer that overflowed: models built to overflow in a known
layer, in the forward and in the backward, directly and through train.py."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest
import timm
import torch
from timm.models import register_model
from torch import nn

from mixprec.core.errors import Diverged
from mixprec.diagnostics import doctor
from mixprec.precision.base import GradScaler, Precision, PrecisionConfig
from mixprec.run import session as run
from mixprec.training import loop

from conftest import run_module


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def planted(kind: str, num_classes: int = 4, in_features: int = 16) -> nn.Sequential:
    """A small MLP with one planted layer: 'forward' makes activations beyond fp16's range in
    `amplifier`; 'backward' keeps the forward small (a shrink before it) while its weights,
    x1e5, blow the scaled gradient of its input past fp16's range."""
    torch.manual_seed(0)
    amplifier = nn.Linear(32, 32)
    with torch.no_grad():
        amplifier.weight.mul_(3e4 if kind == "forward" else 1e5)
    layers = [
        ("stem", nn.Linear(in_features, 32)),
        ("act", nn.ReLU()),
        ("norm", nn.BatchNorm1d(32)),
        ("shrink", Scale(1.0 if kind == "forward" else 1e-5)),
        ("amplifier", amplifier),
        ("act2", nn.ReLU()),
        ("head", nn.Linear(32, num_classes)),
    ]
    return nn.Sequential(OrderedDict(layers))


def learner(model: nn.Module, autocast: str | None = "float16") -> loop.Learner:
    cfg = PrecisionConfig("amp", "mixprec.precision.base", autocast, False, 1, [])
    enabled = autocast == "float16"
    prec = Precision(cfg, "cpu", GradScaler("cpu", init_scale=65536.0, enabled=enabled), False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return loop.Learner(model, opt, sched, prec)


def batch() -> list:
    torch.manual_seed(1)
    return [(torch.randn(8, 16), torch.randint(0, 4, (8,)))]


def test_names_the_layer_whose_forward_leaves_fp16s_range():
    found = doctor.locate(learner(planted("forward")), batch(), 65536.0)
    assert found["where"] == "forward"
    assert found["module"] == "amplifier" and found["type"] == "Linear"
    assert found["dtype"] == "float16" and found["max_abs_out"] == float("inf")
    assert found["max_abs_in"] < 100  # its input was fine: it made the overflow
    assert found["loss_scale"] == 65536.0 and found["nonfinite_params"] == []


def test_names_the_layer_whose_backward_overflows_at_the_scale_of_the_step():
    lr = learner(planted("backward"))
    found = doctor.locate(lr, batch(), 65536.0)
    assert found["where"] == "backward" and found["module"] == "amplifier"
    assert found["dtype"] == "float16" and found["max_abs_out"] == float("inf")
    assert 0 < found["max_abs_in"] < 65504  # the gradient it was handed was finite
    assert doctor.locate(lr, batch(), 1.0)["where"] == "none"  # unscaled, nothing overflows


def test_bf16_has_the_range_the_same_model_needs():
    assert doctor.locate(learner(planted("forward"), "bfloat16"), batch(), 1.0)["where"] == "none"


def test_the_re_run_leaves_weights_gradients_statistics_and_rng_as_they_were():
    lr = learner(planted("backward"))
    model = lr.model
    x, y = batch()[0]
    model(x).sum().backward()  # gradients of a step in flight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    doctor.locate(lr, batch(), 65536.0)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm stats included
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())


@register_model
def doctor_planted_backward(pretrained=False, num_classes=4, in_chans=1, **kwargs):
    return nn.Sequential(nn.Flatten(), planted("backward", num_classes, in_chans * 8 * 8))


@register_model
def doctor_planted_inf(pretrained=False, num_classes=4, in_chans=1, **kwargs):
    """Its forward overflows even fp32: `blowup` multiplies by 1e30 twice."""
    torch.manual_seed(0)
    layers = [
        ("flat", nn.Flatten()),
        ("stem", nn.Linear(in_chans * 64, 32)),
        ("blowup", nn.Sequential(Scale(1e30), Scale(1e30))),
        ("head", nn.Linear(32, num_classes)),
    ]
    return nn.Sequential(OrderedDict(layers))


SMALL = ["data=synthetic", "data.shape=[1,8,8]", "data.num_classes=4", "data.val_steps=1"]


def test_debug_locate_names_the_layer_in_summary_and_trains_as_without_it(cfg_factory):
    assert timm.is_model("doctor_planted_backward")
    common = [
        "model.name=doctor_planted_backward",
        *SMALL,
        "precision=amp",
        "batch=8",
        "trainer.max_steps=4",
        "ckpt.at_end=true",
    ]
    located = run.run(cfg_factory(*common, "debug.locate=true"))
    plain = run.run(cfg_factory(*common))
    assert located["skipped_steps"] >= 1 and plain["doctor"] == []
    first = located["doctor"][0]
    assert first["module"] == "1.amplifier" and first["where"] == "backward"
    assert first["trigger"] == doctor.SKIPPED and first["loss_scale"] == 65536.0
    assert len(located["doctor"]) == min(located["skipped_steps"], doctor.Doctor.LIMIT)
    # the re-runs changed nothing: the same loss and weights as the run without the doctor
    assert located["train_loss"] == plain["train_loss"]
    a = torch.load(located["checkpoint"], weights_only=True)["model"]
    b = torch.load(plain["checkpoint"], weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_divergence_stop_names_the_layer_without_being_asked(cfg_factory, tmp_path):
    """fp16 whose loss scale collapses (every step skipped, the weights still finite): the
    doctor re-runs the latest batch at the scale of the stop and names the planted layer."""
    cfg = cfg_factory(
        "model.name=doctor_planted_backward",
        *SMALL,
        "precision=amp",
        "batch=8",
        "trainer.max_steps=6",
        "debug.min_loss_scale=30000",  # 65536 -> 32768 -> 16384: a collapse at the 2nd skip
    )
    with pytest.raises(Diverged, match=r"The doctor: .*backward of 1\.amplifier"):
        run.run(cfg)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    (found,) = summary["doctor"]
    assert found["trigger"] == "divergence stop" and found["module"] == "1.amplifier"
    assert found["loss_scale"] == 16384.0 and "The doctor" in summary["error"]
    shown = run_module("mixprec.diagnose", [str(tmp_path / "run")])
    assert shown.returncode == 0, shown.stderr
    assert "1.amplifier" in shown.stdout and "divergence stop" in shown.stdout


def test_a_static_scale_that_overflows_every_step_stops_the_run(cfg_factory, tmp_path):
    """scaler=static never backs off: where its scale overflows the gradients at every step,
    each step is skipped and the run took batches for ever (no step counts). It stops after
    debug.max_skipped_steps in a row, as a divergence (exit 3), naming what to change."""
    cfg = cfg_factory(
        "model.name=doctor_planted_backward",
        *SMALL,
        "precision=amp",
        "scaler=static",
        "scaler.init_scale=65536",
        "batch=8",
        "trainer.max_steps=6",
        "trainer.log_every=1",
        "debug.max_skipped_steps=4",
    )
    with pytest.raises(Diverged, match=r"skipped the last 4 steps in a row.*scaler.init_scale"):
        run.run(cfg)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 0
    assert summary["skipped_steps"] == 4


def test_weights_already_broken_are_named_and_locate_catches_the_step_before(cfg_factory):
    """Without a scaler a non-finite loss still steps: by the divergence stop the weights are
    NaN and the stop can only say so; debug.locate=true examines the step before its update."""
    common = ["model.name=doctor_planted_inf", *SMALL, "precision=fp32", "batch=8"]
    with pytest.raises(Diverged) as stop:
        run.run(cfg_factory(*common, "trainer.max_steps=6"))
    assert "weights are already non-finite (stem.weight" in str(stop.value)
    assert "debug.locate=true" in str(stop.value)
    cfg = cfg_factory(*common, "trainer.max_steps=6", "debug.locate=true")
    with pytest.raises(Diverged):
        run.run(cfg)
    found = json.loads((Path(cfg.run_dir) / "summary.json").read_text())["doctor"]
    assert found[0]["step"] == 1 and found[0]["trigger"] == "non-finite loss"
    assert found[0]["where"] == "forward" and found[0]["module"] == "blowup.1"
    assert found[0]["dtype"] == "float32" and found[0]["max_abs_in"] > 1e29


def test_a_scale_that_overflows_the_output_gradient_is_named_not_not_reproduced():
    """GradScaler skips a step when scale x dL/dlogits leaves fp16's range at the head's output:
    no layer made it, and the doctor says so (it said 'not reproduced')."""
    model = nn.Sequential(OrderedDict([("stem", nn.Linear(16, 32)), ("head", nn.Linear(32, 4))]))
    lr = learner(model)
    found = doctor.locate(lr, batch(), 2.0**40)
    assert found["where"] == "loss scale"
    assert found["module"] == "head" and found["dtype"] == "float16"
    assert found["max_abs_in"] == float("inf")
    assert doctor.locate(lr, batch(), 65536.0)["where"] == "none"  # a sane scale: nothing
    f = {**found, "step": 3, "trigger": doctor.SKIPPED}
    text = doctor.sentence(f)
    assert (
        "loss scale itself overflowed" in text and "head" in text and "not reproduced" not in text
    )


def test_diagnose_tells_a_finished_fp32_run_what_was_not_measured_and_how(cfg_factory):
    """A newcomer's first diagnose: fp32 casts nothing, so debug.numerics has nothing to probe
    (said at the run's start and by diagnose); a finished run is to be run again, not resumed
    (a resume of it trains nothing more); a stopped one may be resumed."""
    from mixprec import diagnose

    cfg = cfg_factory(*SMALL, "precision=fp32", "trainer.max_steps=2", "debug.numerics=true")
    s = run.run(cfg)
    assert not (Path(cfg.run_dir) / "numerics.jsonl").exists()
    shown = diagnose.shown_run(Path(cfg.run_dir))
    assert "Nothing to measure: precision=fp32 casts nothing" in shown
    assert "Run it again with debug.locate=true" in shown and "resume" not in shown
    assert s["status"] == "completed"
    stopped = {**s, "status": "preempted"}
    (Path(cfg.run_dir) / "summary.json").write_text(json.dumps(stopped))
    shown = diagnose.shown_run(Path(cfg.run_dir))
    assert "Run it again (or resume it) with debug.locate=true" in shown

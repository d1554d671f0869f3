"""The precision story behaves: overflow halves the scale and skips the step (and nothing else
moves), static scales stay put, bf16 tracks fp32, clipping acts on true gradients."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

from mixprec.core import hardware, process
from mixprec.optim import optimizers as optim
from mixprec.precision import base as precision
from mixprec.precision.step_guards import BatchNormGuard
from mixprec.run import build
from mixprec.run.config import validate
from mixprec.training import loop

from conftest import compose_cfg, group

CPU = torch.device("cpu")


def fp16(device: torch.device = CPU, **scaler) -> precision.Precision:
    return precision.build(group("precision", "amp"), group("scaler", "dynamic", **scaler), device)


def fp32() -> precision.Precision:
    return precision.build(group("precision", "fp32"), group("scaler", "dynamic"), CPU)


def constant_lr(opt) -> torch.optim.lr_scheduler.LRScheduler:
    return optim.build_scheduler(group("scheduler", "constant"), opt, total_steps=10)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def batches(n: int, size: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 16, generator=g), torch.randint(0, 4, (size,), generator=g))
        for _ in range(n)
    ]


class InfGrad(nn.Module):
    """Multiplies the incoming gradient by `factor` (inf to simulate an fp16 overflow)."""

    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return _Scale.apply(x, self)


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mod):
        ctx.mod = mod
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.mod.factor, None


def setup(amp, sched="constant", fused=False):
    model = nn.Sequential(mlp(), InfGrad())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    sch = optim.build_scheduler(group("scheduler", sched, warmup_steps=0), opt, total_steps=10)
    return model, opt, sch


def run_steps(model, opt, sch, amp, data, state=None):
    """The loop's per-step bookkeeping, over `data` one batch per step."""
    learner = loop.Learner(model, opt, sch, amp)
    state = state or loop.TrainState()
    for x, y in data:
        out = loop.train_step(learner, [(x, y)])
        if out.stepped:
            sch.step()
            state.step += 1
        else:
            state.skipped_steps += 1
    return state


@pytest.mark.parametrize("fused", [False, True])
def test_overflow_halves_the_scale_and_skips_the_step(fused):
    """Also with a fused optimizer (the CUDA default), which GradScaler lets skip the update
    inside its kernel: the step must still count as skipped."""
    amp = fp16(init_scale=1024.0)
    model, opt, sch = setup(amp, "cosine", fused)
    weights = [p.detach().clone() for p in model.parameters()]
    lr_before = opt.param_groups[0]["lr"]
    model[1].factor = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        state = run_steps(model, opt, sch, amp, batches(1, 8))
    assert amp.loss_scale() == 512.0
    assert (state.step, state.skipped_steps) == (0, 1)
    assert sch.last_epoch == 0 and opt.param_groups[0]["lr"] == lr_before
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    model[1].factor = 1.0  # the next clean step goes through at the halved scale
    state = run_steps(model, opt, sch, amp, batches(1, 8, seed=2), state)
    assert (state.step, state.skipped_steps, amp.loss_scale()) == (1, 1, 512.0)
    assert sch.last_epoch == 1
    assert not all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def bn_steps(guarded: bool, blow_up: int | None, dev: str = "cpu", mode: str | None = None):
    """Three fp16 steps of a conv + BatchNorm net (compiled with `mode` if given); the input of
    step `blow_up` is scaled by 1e5, past fp16's 65504, so that its forward overflows."""
    device = torch.device(dev)
    model, amp = bn_net().to(device), fp16(device, guard_bn_stats=guarded)
    bn = model[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    net = torch.compile(model, mode=mode) if mode else model
    learner = loop.Learner(net, opt, constant_lr(opt), amp)
    assert learner.bn_guard.enabled == guarded
    g = torch.Generator().manual_seed(1)
    stats, outs = [], []
    for i in range(3):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        x, y = (x * 1e5 if i == blow_up else x).to(device), y.to(device)
        outs.append(loop.train_step(learner, [(x, y)]))
        stats.append(torch.cat([bn.running_mean, bn.running_var]).cpu())
    model.eval()
    with torch.no_grad(), amp.autocast():
        logits = model(x)
    return model, stats, outs, logits


@pytest.mark.parametrize(
    "guarded,dev,mode",
    [
        (True, "cpu", None),
        (False, "cpu", None),
        pytest.param(True, "cuda", None, marks=pytest.mark.gpu),
        pytest.param(True, "cuda", "reduce-overhead", marks=pytest.mark.gpu),
    ],
)
def test_an_overflowing_forward_leaves_batchnorm_statistics_alone(guarded, dev, mode):
    _, stats, outs, logits = bn_steps(guarded, blow_up=1, dev=dev, mode=mode)
    assert not torch.isfinite(outs[1].loss) and not outs[1].stepped  # GradScaler skipped it
    assert torch.isfinite(outs[2].loss) and outs[2].stepped  # and training carries on
    if guarded:  # the skipped step left no trace; the next one updated the stats as usual
        assert torch.equal(stats[1], stats[0]) and not torch.equal(stats[2], stats[1])
        assert torch.isfinite(stats[2]).all() and torch.isfinite(logits).all()
    else:  # what the guard prevents: NaN statistics for good, so every evaluation is NaN
        assert torch.isnan(stats[2]).all() and torch.isnan(logits).all()


def test_the_batchnorm_guard_changes_nothing_on_clean_steps():
    m1, s1, _, _ = bn_steps(True, blow_up=None)
    m2, s2, _, _ = bn_steps(False, blow_up=None)
    assert all(torch.equal(a, b) for a, b in zip(s1, s2))
    assert all(
        torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values())
    )
    assert not BatchNormGuard(mlp(), True).enabled  # no BatchNorm: no work


def test_scale_grows_after_growth_interval_clean_steps():
    amp = fp16(init_scale=8.0, growth_interval=3)
    model, opt, sch = setup(amp)
    run_steps(model, opt, sch, amp, batches(3, 8))
    assert amp.loss_scale() == 16.0


def test_static_scale_never_moves_but_still_skips():
    amp = fp16(init_scale=256.0, static=True, growth_interval=1)
    model, opt, sch = setup(amp)
    state = run_steps(model, opt, sch, amp, batches(2, 8))
    assert amp.loss_scale() == 256.0 and state.step == 2
    model[1].factor = float("inf")
    state = run_steps(model, opt, sch, amp, batches(1, 8), state)
    assert amp.loss_scale() == 256.0 and state.skipped_steps == 1


def test_disabled_scaler_is_a_no_op_object():
    amp = fp32()
    assert not amp.scaler.is_enabled() and amp.loss_scale() == 1.0 and not amp.scaling
    loss = torch.tensor(2.0, requires_grad=True)
    assert amp.scaler.scale(loss) is loss


def test_bf16_loss_is_close_to_fp32():
    data = batches(1, 64)
    x, y = data[0]
    losses = {}
    for name, dtype in (("fp32", None), ("bf16", "bfloat16")):
        amp = precision.build(group("precision", name), group("scaler", "dynamic"), CPU)
        model = mlp()
        with amp.autocast():
            out = model(x)
        assert out.dtype == (torch.bfloat16 if dtype else torch.float32)
        losses[name] = nn.functional.cross_entropy(out.float(), y).item()
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
    assert losses["bf16"] != losses["fp32"]  # it really ran in bf16


def _one_step_delta(accum: int, micro: int, amp=None):
    amp = amp or fp32()
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ((x, y),) = batches(1, accum * micro)
    micro_batches = list(zip(x.split(micro), y.split(micro)))
    loop.train_step(loop.Learner(model, opt, constant_lr(opt), amp), micro_batches)
    return [b - a for a, b in zip(model.parameters(), before)]


def test_accumulation_4x8_equals_one_batch_of_32():
    big, acc = _one_step_delta(1, 32), _one_step_delta(4, 8)
    for a, b in zip(big, acc):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(a.abs().sum() > 0 for a in big)


@pytest.mark.parametrize("scaled", [False, True])
def test_clipping_bounds_the_true_gradient_norm(scaled):
    amp = fp16(init_scale=65536.0) if scaled else None
    amp = amp or fp32()
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # delta = -clipped grad
    out = loop.train_step(
        loop.Learner(model, opt, constant_lr(opt), amp), batches(1, 32), clip_grad_norm=0.05
    )
    delta = torch.cat([(b - a).flatten() for a, b in zip(model.parameters(), before)])
    assert out.stepped and out.grad_norm > 0.05  # the raw norm really was above the limit
    assert delta.norm().item() <= 0.05 * 1.001
    assert delta.norm().item() > 0.05 * 0.99  # clipped to the limit, not to zero


@pytest.mark.parametrize("rule,expected", [("linear", 0.3), ("sqrt", 0.1 * 3**0.5), ("none", 0.1)])
def test_lr_scaling_rule(rule, expected):
    ocfg = group("optimizer", "sgd", lr=0.1, base_batch=256, scale_lr=rule)
    assert optim.scaled_lr(ocfg, 768) == pytest.approx(expected)


def test_schedules_warm_up_and_decay():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sch = optim.build_scheduler(
        group("scheduler", "cosine", warmup_steps=4, warmup_start=0.25), opt, total_steps=20
    )
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(20):
        opt.step()
        sch.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(0.25) and lrs[4] == pytest.approx(1.0)
    assert lrs[20] == pytest.approx(0.0, abs=1e-9) and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    opt = torch.optim.SGD(mlp().parameters(), lr=1.0)
    sch = optim.build_scheduler(group("scheduler", "onecycle"), opt, total_steps=8)
    for _ in range(8):
        opt.step()
        sch.step()  # exactly total_steps steps must not raise
    opt = torch.optim.SGD(mlp().parameters(), lr=1.0)
    sch = optim.build_scheduler(group("scheduler", "step", step_size=3, gamma=0.5), opt, 10)
    for _ in range(6):
        opt.step()
        sch.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)


def test_wsd_holds_the_full_lr_until_its_decay_then_falls_linearly_to_its_floor():
    """scheduler=wsd over 24 steps: 4 of warm-up, then of the 20 left the last quarter (5)
    decays linearly to 0.1 x lr; steps 4-19 are at the full lr."""
    opt = torch.optim.SGD(mlp().parameters(), lr=2.0)
    scfg = group("scheduler", "wsd", warmup_steps=4, decay_fraction=0.25, min_lr_ratio=0.1)
    sch = optim.build_scheduler(scfg, opt, total_steps=24)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(24):
        opt.step()
        sch.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[2] < lrs[4] == pytest.approx(2.0)
    assert all(v == pytest.approx(2.0) for v in lrs[4:20])
    assert lrs[22] == pytest.approx(2.0 * (1 - 0.9 * 3 / 5)) and lrs[24] == pytest.approx(0.2)


def test_optimizer_skips_weight_decay_on_norms_and_biases():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = optim.build_optimizer(group("optimizer", "sgd", weight_decay=0.1), model, 0.1, CPU)
    decays = {len(g["params"]): g["weight_decay"] for g in opt.param_groups}
    assert decays == {3: 0.0, 1: 0.1}  # bias, bn weight, bn bias vs the linear weight


class OverflowOnce(InfGrad):
    """Sends an inf gradient on the first `n` backward passes, then behaves."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x):
        self.factor = float("inf") if self.n > 0 else 1.0
        self.n -= 1
        return super().forward(x)


def loop_run(model, data, device, fused: bool, tmp_path, settle_late: bool = True):
    """loop.train over `data` for 8 optimizer steps, logging every 4."""
    from mixprec.sinks.tracking import Tracker
    from mixprec.training.ledger import Hooks
    from mixprec.training.perf import Throughput
    from mixprec.training.safety import DivergenceGuard

    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    learner = loop.Learner(
        model,
        opt,
        optim.build_scheduler(group("scheduler", "cosine"), opt, 8),
        fp16(device, init_scale=1024.0),
    )
    plan = loop.Plan(
        total_steps=8, epochs=10, accum=1, log_every=4, samples_per_step=8, settle_late=settle_late
    )
    from mixprec import sinks

    tracker = Tracker(
        sinks.build(sinks.LoggerConfig({}), sinks.Context(tmp_path, {}, "test", (), None))
    )
    hooks = Hooks(
        tracker,
        Throughput(device, 0),
        DivergenceGuard(device, 3, 1.0),
        lambda: hardware.memory_stats(device),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        state = loop.train(learner, data, loop.TrainState(), plan, hooks)
    tracker.close("completed")
    return learner, state


def digits_like(device):
    from torch.utils.data import TensorDataset

    from mixprec.data import Context, Data
    from mixprec.data.loaders import EpochLoader

    ((x, y),) = batches(1, 64)
    ds, ctx = TensorDataset(x, y), Context(8, device, seed=0)
    return Data(EpochLoader(ds, ctx), EpochLoader(ds, ctx, shuffle=False), 4, (16,))


@pytest.mark.parametrize(
    "fused,dev", [(False, "cpu"), (True, "cpu"), pytest.param(True, "cuda", marks=pytest.mark.gpu)]
)
@pytest.mark.slow
def test_the_loop_counts_skipped_steps_and_holds_the_scheduler(tmp_path, fused, dev):
    """Fused: the skip flag stays on the device and the loop settles each step one step late
    (on CUDA the flag reaches the host through a pinned copy behind an event)."""
    device = torch.device(dev)
    model = nn.Sequential(mlp(), OverflowOnce(2)).to(device)
    ref_model, at_once = copy.deepcopy(model), copy.deepcopy(model)
    data = digits_like(device)
    # log_every 4: attempts 1-4 (two of them skipped) and 7 are settled late, as the next one runs
    learner, state = loop_run(model, data, device, fused, tmp_path)
    assert (state.step, state.skipped_steps, state.attempts) == (8, 2, 10)
    assert learner.scheduler.last_epoch == 8  # stepped only after the 8 real optimizer steps
    assert learner.precision.loss_scale() == 256.0  # halved twice
    rows = [
        __import__("json").loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [4, 8]
    assert train_rows[0]["amp/skipped_steps"] == 2 and train_rows[0]["amp/loss_scale"] == 256.0
    assert all(r["train/grad_norm"] is not None for r in train_rows)
    # the same batches through train_step, settled at once: the late settling changes nothing
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, fused=fused)
    ref = loop.Learner(
        ref_model,
        ref_opt,
        optim.build_scheduler(group("scheduler", "cosine"), ref_opt, 8),
        fp16(device, init_scale=1024.0),
    )
    steps = 0
    for epoch in range(2):
        data.train.set_epoch(epoch)
        for xb, yb in data.train:
            if steps < 8:
                out = loop.train_step(ref, [(xb, yb)])
                steps += out.stepped
                if out.stepped:
                    ref.scheduler.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):  # a wrong LR moves them by %
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # trainer.settle_late=false: every step settled at once, the same weights
    loop_run(at_once, digits_like(device), device, fused, tmp_path / "now", settle_late=False)
    for p, q in zip(model.parameters(), at_once.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_flop_count_runs_no_kernel_yet_counts_what_a_real_step_counts():
    """The MFU count runs on the meta device (on a GPU its eager step on the real device cost
    5-14 s of the start). It must count what a step on the device counts, module by module, for
    a ResNet in channels_last, and run nothing there: the run's random
    stream is the same as if no count had happened."""
    from mixprec import models
    from mixprec.core.tasks import CLASSIFY
    from mixprec.models import flops

    cfg = validate(compose_cfg(["model=resnet50", "model.channels_last=true"]))
    model = models.build(cfg.model, 10, (3, 32, 32), CPU)
    args = (fp32().autocast, 16, CLASSIFY, (3, 32, 32), 10)
    on_meta = flops._flop_counts(model, torch.device("meta"), *args)
    assert on_meta == flops._flop_counts(model, CPU, *args)
    assert on_meta["Global"]  # counted at all
    before = torch.get_rng_state()
    flops.train_flops(model, (3, 32, 32), 10, CPU, fp32().autocast)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_model_that_cannot_run_on_meta_is_counted_on_its_device():
    """A forward that reads a value (`.item()`: no meta tensor has one) fails on the meta
    device; the count falls back to a step on the model's device and is still exact."""

    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(12, 10)

        def forward(self, x):
            return self.lin(x.flatten(1)) * (1.0 + 0.0 * x.sum().item())

    from mixprec.models import flops

    with pytest.raises((NotImplementedError, RuntimeError)):
        Reads().to("meta")(torch.zeros(2, 3, 2, 2, device="meta"))
    linear = 2 * 12 * 10  # the input needs no gradient: forward + weight gradient
    assert flops.train_flops(Reads(), (3, 2, 2), 10, CPU, fp32().autocast)[0] == 2 * linear


def test_mfu_flop_count_matches_a_hand_count():
    from mixprec.models import flops

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    amp = fp32()
    conv = 2 * 8 * 8 * 8 * 3 * 3 * 3  # 2 * Cout * H * W * Cin * k * k per sample
    linear = 2 * 512 * 10
    # backward: weight grads for both; input grad for the linear only (the image needs none)
    want = conv + linear + conv + 2 * linear
    assert flops.train_flops(model, (3, 8, 8), 10, CPU, amp.autocast)[0] == want
    assert all(p.grad is None for p in model.parameters())  # counted on a copy
    assert flops.mfu(want, 1000.0, 1.0) == pytest.approx(want * 1000 / 1e12)
    assert flops.mfu(want, 1000.0, None) is None


@pytest.mark.parametrize(
    "name,tf32", [("fp32", False), ("tf32", True), ("amp", True), ("bf16", True), ("fp32", False)]
)
def test_each_precision_sets_the_tf32_switches(name, tf32):
    """TF32 is part of the precision: fp32 means IEEE fp32 matmuls and convolutions, the others
    allow TF32 tensor cores (checked on torch's backend flags, which the CPU carries too). The
    run's one place for process settings applies it; building a precision changes nothing."""
    process.set_tf32(not tf32)  # start from the opposite, so a no-op set_tf32 fails
    c = validate(compose_cfg([f"precision={name}", "hardware=cpu"]))
    precision.build(c.precision, c.scaler, CPU)
    assert process.tf32_enabled() is (not tf32)  # a builder has no process-wide side effects
    process.apply(build.process_settings(c, c.hardware), CPU)
    mode = "tf32" if tf32 else "ieee"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert torch.backends.cuda.matmul.fp32_precision == mode
        assert torch.backends.cudnn.conv.fp32_precision == mode
    else:
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
        assert torch.backends.cudnn.allow_tf32 is tf32


def test_trainer_deterministic_switches_torchs_algorithms_on_for_its_run_and_off_after(
    monkeypatch,
):
    """trainer.deterministic=true: torch's deterministic algorithms and cuBLAS's fixed
    workspace for the run; the next run in the process without it gets torch's default back."""
    from mixprec.core import process
    from mixprec.run import build
    from mixprec.run.config import validate

    from conftest import compose_cfg

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        for on in (True, False):
            c = validate(compose_cfg([f"trainer.deterministic={str(on).lower()}"]))
            settings = build.process_settings(c, build.resolve_hardware(c))
            process.apply(settings, torch.device("cpu"))
            assert torch.are_deterministic_algorithms_enabled() is on
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    "flags,warned",
    [
        ("fpu sse2 avx avx2 fma", True),  # AVX2 only: bf16 through float32 conversions
        ("fpu sse2 avx2 avx512f avx512_bf16", False),
        ("fpu sse2 avx2 amx_bf16 amx_tile", False),
    ],
)
def test_bf16_on_a_cpu_without_native_bf16_warns_once_at_the_start(
    tmp_path, monkeypatch, flags, warned
):
    """Issue 93, item 4: bf16 ran 17x slower than fp32 on an AVX2-only CPU with no word; amp
    had one. The CPU's flags (Linux's cpuinfo) decide; a CPU with AVX512-BF16 or AMX is quiet."""
    from mixprec.core import hardware

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    )
    monkeypatch.setattr(hardware, "CPUINFO", cpuinfo)
    said = precision.build(group("precision", "bf16"), group("scaler", "dynamic"), CPU).advice(
        False
    )
    assert bool(said) == warned and (not said or "no native bfloat16" in said[0]), said
    fp32 = precision.build(group("precision", "fp32"), group("scaler", "dynamic"), CPU)
    assert fp32.advice(False) == []
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # an AVX2-only host, emulated: no bf16
    assert hardware.cpu_native_bf16() is False

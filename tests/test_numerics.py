"""debug.numerics (diagnostics/numerics.py): the cast counters on planted tensors with known
underflow, subnormal and saturation shares, checked against torchao's own float8 cast; the probe
in a run (every log_every steps, the run trained exactly as without it); off costs no kernel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.diagnose import shown_run
from mixprec.diagnostics.numerics import cast_numerics
from mixprec.run import session as run

from conftest import train_losses

pytest.importorskip("torchao.float8")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def planted(top: float, flushed: float, small: float) -> torch.Tensor:
    """100 elements: 1 at `top`, 10 that flush to zero, 20 left subnormal, 69 ones."""
    return torch.tensor([top] + [flushed] * 10 + [small] * 20 + [1.0] * 69)


def test_fp16_counts_flushed_subnormal_and_overflowing_elements():
    # fp16: below 2^-25 flushes to 0, below 2^-14 is subnormal, beyond 65520 is inf
    r = cast_numerics(planted(70000.0, 1e-8, 1e-6), torch.float16)
    assert (r["underflow"], r["subnormal"], r["saturated"]) == (0.10, 0.20, 0.01)
    assert r["amax"] == 70000.0 and r["sqnr_db"] is None  # an inf in the cast: no ratio


def test_e4m3_tensorwise_scales_amax_to_448_then_counts():
    # amax 448 -> scale 1: e4m3 flushes below 2^-10, is subnormal below 2^-6; nothing saturates
    r = cast_numerics(planted(448.0, 1e-4, 0.01), E4M3)
    assert (r["underflow"], r["subnormal"], r["saturated"]) == (0.10, 0.20, 0.0)
    # the same tensor 1000x larger: dynamic scaling gives the same shares
    big = cast_numerics(planted(448.0, 1e-4, 0.01) * 1000, E4M3)
    assert (big["underflow"], big["subnormal"], big["saturated"]) == (0.10, 0.20, 0.0)


def test_rowwise_scales_each_row_on_its_own():
    """One row 10^4 times the other: a scale per tensor flushes the small row's small values
    (and more), a scale per row treats each row as alone."""
    row = planted(448.0, 1e-4, 0.01)
    x = torch.stack([row, row * 1e4])
    per_row = cast_numerics(x, E4M3, rowwise=True)
    assert (per_row["underflow"], per_row["subnormal"]) == (0.10, 0.20)
    per_tensor = cast_numerics(x, E4M3)
    assert per_tensor["underflow"] > 0.4  # the small row's 0.01s and 1s flush too
    pow2 = cast_numerics(x, E4M3, rowwise=True, pow2=True)  # scale rounded down: 448 -> 256
    assert pow2["saturated"] == 0.0 and pow2["amax"] == 448e4


def test_e5m2_and_the_sqnr_agree_with_torchaos_own_cast():
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import tensor_to_scale

    torch.manual_seed(0)
    x = torch.randn(256, 64, dtype=torch.bfloat16) * torch.logspace(-6, 2, 64)
    for dtype in (E4M3, E5M2):
        ours = cast_numerics(x, dtype)
        theirs = hp_tensor_and_scale_to_float8(x, tensor_to_scale(x, dtype), dtype)
        back = theirs.to_original_precision().float()
        xf = x.float()
        sqnr = 10 * torch.log10(xf.square().sum() / (xf - back).square().sum())
        assert ours["sqnr_db"] == pytest.approx(float(sqnr), abs=0.05)
        flushed = ((xf != 0) & (back == 0)).sum() / (xf != 0).sum()
        assert ours["underflow"] == pytest.approx(float(flushed))
    assert cast_numerics(x, E4M3)["sqnr_db"] > cast_numerics(x, E5M2)["sqnr_db"]  # 3 vs 2 bits


RUN = ["trainer.max_steps=4", "trainer.log_every=2", "ckpt.at_end=false", "precision=amp"]


@pytest.mark.slow
def test_numerics_probe_logged_steps_and_leave_training_as_it_was(cfg_factory):
    on = cfg_factory(*RUN, "debug.numerics=true")
    summary = run.run(on)
    off = cfg_factory(*RUN)
    run.run(off)
    # the probe re-runs a micro-batch with hooks; the run trains bit for bit as without it
    on_dir, off_dir = Path(on.run_dir), Path(off.run_dir)
    assert train_losses(on_dir) == train_losses(off_dir)
    rows = [json.loads(line) for line in (on_dir / "numerics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [2, 4]
    layers = {r["layer"] for r in rows}
    assert layers == {"features.0", "features.3", "head.2"}  # the convs and the Linear
    assert {r["tensor"] for r in rows} == {"input", "weight", "grad_output"}
    assert all(r["format"] == "float16" for r in rows)
    grads = [r for r in rows if r["tensor"] == "grad_output"]
    assert all(r["amax"] > 1.0 for r in grads)  # the gradients at the loss scale 65536
    metrics = [json.loads(line) for line in (on_dir / "metrics.jsonl").read_text().splitlines()]
    curves = [r for r in metrics if "numerics/underflow_max" in r]
    assert [r["step"] for r in curves] == [2, 4]
    assert "numerics/head.2/grad_output/subnormal" in curves[0]
    assert summary["numerics"][0]["step"] == 4
    assert not (off_dir / "numerics.jsonl").exists()
    shown = shown_run(on_dir)
    assert "## numerics" in shown and "| head.2 | Linear | float16 |" in shown


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_of_a_loop(numerics, tmp_path) -> int:
    """Aten ops of 4 optimizer steps of a small fp16 CNN (logged every 2) with `numerics` as
    the loop's numerics hook (None: the Hooks default)."""
    from torch import nn

    from mixprec.core import hardware
    from mixprec.diagnostics.numerics import Numerics
    from mixprec.precision import base as precision
    from mixprec.sinks.tracking import Tracker
    from mixprec.training import loop
    from mixprec.training.ledger import Hooks
    from mixprec.training.perf import Throughput
    from mixprec.training.safety import DivergenceGuard

    from conftest import group

    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = precision.build(group("precision", "amp"), group("scaler"), cpu)
    learner = loop.Learner(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1), prec)
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))) for _ in range(4)]

    class Data:
        val = batches[:1]

        class train:
            @staticmethod
            def set_epoch(epoch, skip=0):
                pass

            def __iter__(self):
                return iter(batches)

        train = train()

    plan = loop.Plan(total_steps=4, epochs=1, accum=1, log_every=2, samples_per_step=4)
    hooks = Hooks(
        Tracker([]),
        Throughput(cpu, 0),
        DivergenceGuard(cpu, 3, 1.0),
        lambda: hardware.memory_stats(cpu),
    )
    if numerics == "on":
        hooks.numerics = Numerics(learner, tmp_path)
    elif numerics == "off":
        hooks.numerics = Numerics()
    with Count() as c:
        loop.train(learner, Data(), loop.TrainState(), plan, hooks)
    return c.ops


def test_numerics_off_runs_no_extra_kernel(tmp_path):
    """The loop with debug.numerics off runs exactly the kernels of the loop without the
    numerics hook, and with it on, more (its probe on the logged steps)."""
    absent, off = ops_of_a_loop(None, tmp_path), ops_of_a_loop("off", tmp_path)
    on = ops_of_a_loop("on", tmp_path)
    assert off == absent < on
    assert len((tmp_path / "numerics.jsonl").read_text().splitlines()) == 2 * 2 * 3  # 2 probes


def numerics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "numerics.jsonl").read_text().splitlines()]


def probed(rows: list[dict]) -> list[tuple]:
    return sorted((r["step"], r["layer"], r["tensor"]) for r in rows)


KILLED = [
    "hardware=cpu",
    "logger=none",
    "precision=amp",
    "debug.numerics=true",
    "trainer.log_every=2",
    "trainer.perf_warmup_steps=0",
    "ckpt.every_steps=10",
]


@pytest.mark.slow
def test_numerics_rows_follow_the_metrics_rules_after_sigkill_a_torn_line_and_overwrite(tmp_path):
    """numerics.jsonl was appended to as it was: after SIGKILL to the process group and
    resume=auto its rows past the checkpoint came twice, a resumed row was glued onto a line a
    full disk tore, and overwrite=true kept the previous run's rows."""
    import os
    import signal
    import time

    from conftest import finish, run_train, start_train

    d = tmp_path / "run"
    proc = start_train([*KILLED, "trainer.max_steps=400", f"hydra.run.dir={d}"])
    deadline = time.time() + 180
    while time.time() < deadline:  # a checkpoint, and rows logged past it
        ckpts = list((d / "checkpoints").glob("step_*.pt"))
        rows = numerics_rows(d)[:-1] if (d / "numerics.jsonl").exists() else []
        if ckpts and rows and max(r["step"] for r in rows) > 10 + 2:
            break
        assert proc.poll() is None, finish(proc, 10)
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    finish(proc, 30)
    with (d / "numerics.jsonl").open("a") as f:
        f.write('{"step": 7, "layer": "fea')  # a line torn by a full disk
    done = run_train([*KILLED, "trainer.max_steps=24", "resume=auto", f"hydra.run.dir={d}"])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = numerics_rows(d)  # every line is whole JSON
    assert len(probed(rows)) == len(set(probed(rows))), "a probed step came twice"
    assert sorted({r["step"] for r in rows}) == list(range(2, 25, 2))
    steps = [json.loads(x)["step"] for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 24

    again = run_train(
        [
            "hardware=cpu",
            "logger=none",
            "trainer.max_steps=2",
            "overwrite=true",
            f"hydra.run.dir={d}",
        ]
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert not (d / "numerics.jsonl").exists(), "overwrite=true kept the previous run's numerics"


def test_a_run_killed_before_its_first_checkpoint_starts_its_numerics_over(cfg_factory):
    cfg = cfg_factory(*RUN, "debug.numerics=true")
    d = Path(cfg.run_dir)
    d.mkdir(parents=True)
    left = {"step": 2, "layer": "features.0", "tensor": "input", "format": "float16"}
    (d / "numerics.jsonl").write_text(json.dumps(left) + "\n")  # what the killed run logged
    run.run(cfg_factory(*RUN, "debug.numerics=true", "resume=auto", f"run_dir={d}"))
    rows = numerics_rows(d)
    assert len(probed(rows)) == len(set(probed(rows)))
    assert sorted({r["step"] for r in rows}) == [2, 4]

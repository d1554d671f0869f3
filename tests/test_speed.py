"""The speed switches on the CPU: torch.compile on a tiny model, channels_last end to end, the
CUDA-graph switch's checks, the loader's prefetch path and the optimizer kernel choice.
(Their speed is measured by benchmarks/bare_vs_train.py on a GPU, not here.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec import models
from mixprec.compile import compiling
from mixprec.core.errors import ConfigError
from mixprec.data.loaders import prefetch, prefetch_in_thread
from mixprec.optim import optimizers as optim
from mixprec.run import session as run
from mixprec.run.config import validate

from conftest import CONF, group

SYNTH = [
    "data=synthetic",
    "data.shape=[3,16,16]",
    "data.num_classes=10",
    "batch=8",
    "model=resnet18",
    "trainer.max_steps=3",
]


def losses(cfg) -> list[float]:
    rows = (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["train/loss"] for r in map(json.loads, rows) if "train/loss" in r]


@pytest.mark.slow
def test_compile_trains_a_tiny_model_like_eager(cfg_factory, tmp_path):
    eager = cfg_factory("model=digits_mlp", "trainer.max_steps=3", "+model.kwargs.width=16")
    compiled = cfg_factory(
        "model=digits_mlp",
        "trainer.max_steps=3",
        "+model.kwargs.width=16",
        "model.compile=true",
        f"run_dir={tmp_path / 'compiled'}",
    )
    run.run(eager)
    s = run.run(compiled)
    assert s["status"] == "completed" and s["steps"] == 3
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)


@pytest.mark.slow
def test_compile_options_sit_on_top_of_the_mode_and_bad_keys_are_named(
    cfg_factory, tmp_path, monkeypatch
):
    seen = {}
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: seen.update(kw) or real(m, **kw))
    c = cfg_factory(
        "model=digits_mlp",
        "trainer.max_steps=3",
        "+model.kwargs.width=16",
        "model.compile=true",
        "model.compile_mode=reduce-overhead",
        "+model.compile_options.conv_1x1_as_mm=true",
        f"run_dir={tmp_path / 'o'}",
    )
    assert run.run(c)["status"] == "completed"
    assert seen == {"options": {"triton.cudagraphs": True, "conv_1x1_as_mm": True}}
    with pytest.raises(ConfigError, match="model.compile_options: Unexpected .*no_such_option"):
        compiling.compile_model(torch.nn.Linear(2, 2), None, {"no_such_option": True})


def test_the_fast_preset_leaves_the_tuning_off_and_the_documented_switch_turns_it_on(cfg_factory):
    """experiment=fast keeps reduce-overhead's CUDA graphs but not coordinate-descent tuning (a
    new machine's first step: over 230 s with it on an H100, 65-78 s without); the switch its
    comment gives composes with option keys this torch accepts (a renamed key would stop the
    preset only on the GPU, minutes into compiling) and turns the tuning on."""

    def options(*overrides):
        c = validate(cfg_factory("experiment=fast", *overrides))
        compiling.compile_model(  # an unknown key raises ConfigError
            torch.nn.Linear(2, 2), c.model.compile_mode, dict(c.model.compile_options)
        )
        return compiling.compile_kwargs(c.model.compile_mode, dict(c.model.compile_options))[
            "options"
        ]

    default = options()
    assert default["coordinate_descent_tuning"] is False and default["triton.cudagraphs"] is True
    switch = "model.compile_options.coordinate_descent_tuning=true"
    assert switch in (CONF / "experiment" / "fast.yaml").read_text()
    assert options(switch)["coordinate_descent_tuning"] is True


def test_compile_options_are_unused_not_an_error_without_compile(cfg_factory, caplog):
    """`experiment=fast model.compile=false` (the preset's eager baseline) must run although the
    preset sets inductor options: they are unused, and the log says so; nothing is compiled."""
    c = validate(
        cfg_factory(
            "model=digits_mlp",
            "+model.kwargs.width=16",
            "+model.compile_options.conv_1x1_as_mm=true",
        )
    )
    with caplog.at_level("INFO", logger="mixprec.models"):
        model = compiling.compiled(
            models.build(c.model, 10, (1, 8, 8), torch.device("cpu")), c.model
        )
    assert not hasattr(model, "_orig_mod")  # not an OptimizedModule
    assert (
        "model.compile=false: model.compile_options {'conv_1x1_as_mm': True} unused" in caplog.text
    )


def test_counting_flops_does_not_compile_the_model_for_another_shape():
    """The MFU FLOP count must not run the compiled model. On the H200 (torch 2.11) a compiled
    forward first called under FlopCounterMode was never compiled afterwards: train.py with
    model.compile=true trained at eager speed (4,615 vs 6,619 img/s). Counting on the eager
    module leaves dynamo untouched until the first real batch, which it then compiles."""
    from mixprec.models import flops

    graphs = []

    def backend(gm, example_inputs):
        graphs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    torch._dynamo.reset()
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10)
    )
    compiled = torch.compile(eager, backend=backend)
    cpu = torch.device("cpu")
    count = flops.train_flops(compiled, (3, 8, 8), 10, cpu, contextlib.nullcontext)[0]
    assert count == flops.train_flops(eager, (3, 8, 8), 10, cpu, contextlib.nullcontext)[0]
    assert graphs == []  # nothing compiled yet: the first real batch fixes the static shape
    compiled(torch.zeros(5, 3, 8, 8))
    assert len(graphs) == 1


@pytest.mark.slow
def test_channels_last_reaches_the_model_and_its_inputs(cfg_factory):
    c = validate(cfg_factory(*SYNTH, "model.channels_last=true"))
    model = models.build(c.model, 10, (3, 16, 16), torch.device("cpu"))
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.conv1.weight.is_contiguous()
    from mixprec import data

    d = data.build(c.data, data.Context(8, torch.device("cpu"), 0, channels_last=True))
    x, _ = next(iter(d.train))
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    assert run.run(cfg_factory(*SYNTH, "model.channels_last=true"))["status"] == "completed"


def test_cuda_graphs_needs_a_gpu_and_excludes_compile(cfg_factory):
    with pytest.raises(ConfigError, match="model.cuda_graphs=true .*needs a GPU"):
        run.run(cfg_factory(*SYNTH, "model.cuda_graphs=true"))
    with pytest.raises(ConfigError, match="model.cuda_graphs.*false with model.compile"):
        validate(cfg_factory(*SYNTH, "model.cuda_graphs=true", "model.compile=true"))


def test_prefetch_stages_every_batch_in_order():
    staged = list(
        prefetch(iter([(1, 2), (3, 4), (5, 6)]), lambda b: (b[0] * 10, b[1]), torch.device("cpu"))
    )
    assert staged == [(10, 2), (30, 4), (50, 6)]


def test_staging_thread_keeps_order_stays_bounded_and_raises_errors():
    import threading

    seen = []

    def source():
        for i in range(20):
            seen.append(i)
            yield (i, -i)

    gen = prefetch_in_thread(source(), lambda b: (b[0] * 10, b[1]), torch.device("cpu"), depth=2)
    assert [next(gen) for _ in range(3)] == [(0, 0), (10, -1), (20, -2)]
    assert len(seen) <= 3 + 2 + 1  # yielded + queued + one being staged: bounded read-ahead
    gen.close()  # a run that stops mid-epoch: the thread must end, not leak
    assert not any(t.name == "mixprec-stage" for t in threading.enumerate())
    assert list(prefetch_in_thread(iter([(1, 2), (3, 4)]), lambda b: b, torch.device("cpu"))) == [
        (1, 2),
        (3, 4),
    ]

    def bad(_b):
        raise ConfigError("unreadable image x.jpg")

    with pytest.raises(ConfigError, match="x.jpg"):  # an error in the thread reaches the loop
        list(prefetch_in_thread(iter([(1, 2)]), bad, torch.device("cpu")))


def test_optimizer_kernels_follow_the_config():
    model = torch.nn.Linear(4, 4)
    cpu = torch.device("cpu")
    opt = optim.build_optimizer(group("optimizer", "sgd", foreach=True), model, 0.1, cpu)
    assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")
    opt = optim.build_optimizer(group("optimizer", "sgd"), model, 0.1, cpu)  # fused only on CUDA
    assert not opt.defaults.get("fused")
    with pytest.raises(ConfigError, match="optimizer.fused"):
        group("optimizer", "sgd", fused=True, foreach=True)


def sgd_under_a_scaler(fused: bool, overflow_at=(0, 3), steps=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4)
    )
    opt = optim.build_optimizer(
        group("optimizer", "sgd", fused=fused, foreach=not fused), model, 0.1, torch.device("cpu")
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(steps):
        garbage = torch.full((8 * 6 * 6 * 4 + 64,), 1e30)  # freed memory that empty_like may reuse
        del garbage
        loss = model(torch.randn(16, 3, 8, 8)).pow(2).mean()
        scaler.scale(loss).backward()
        if step in overflow_at:  # fp16's overflow of the first steps, and one later on
            model[0].weight.grad[0, 0, 0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], scaler.get_scale()


def test_fused_sgd_under_a_scaler_skipping_its_first_step_trains_exactly_like_foreach():
    """torch's fused SGD makes its momentum buffers with empty_like on the first step and the
    kernel returns on found_inf without writing them: after a skipped first step training ran on
    uninitialised memory. mixprec zeroes them up front, so fused trains like foreach (to float
    rounding: the kernels order their arithmetic differently)."""
    fused, scale_f = sgd_under_a_scaler(fused=True)
    ref, scale_r = sgd_under_a_scaler(fused=False)
    assert scale_f == scale_r == 2.0**10 / 4  # both overflows were skipped and backed off
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert optim.use_fused(group("optimizer", "sgd"), "cuda")  # the CUDA default, amp included
    assert not optim.use_fused(group("optimizer", "sgd"), "cpu")


def test_batch_search_leaves_cudnn_benchmark_as_it_was_even_on_error():
    from mixprec.core import hardware

    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = True
        with pytest.raises(RuntimeError):
            with hardware.cudnn_benchmark(False):
                assert torch.backends.cudnn.benchmark is False
                raise RuntimeError("a probe failed")
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = before


@pytest.mark.parametrize(
    "name,block,count",
    [
        ("resnet18", "BasicBlock", 8),
        ("convnext_tiny", "ConvNeXtBlock", 18),
        ("vit_small_patch16_224", "Block", 12),
    ],
)
def test_the_repeated_blocks_of_timm_models_are_found(name, block, count):
    import timm

    blocks = compiling.repeated_blocks(timm.create_model(name, num_classes=10))
    assert len(blocks) == count and {type(b).__name__ for b in blocks} == {block}


@pytest.mark.slow
def test_blocks_scope_compiles_in_place_and_trains_like_eager(cfg_factory, tmp_path):
    """model.compile_scope=blocks: identical blocks compile to one graph, the same losses as
    eager, the checkpoint's keys unchanged
    (no `_orig_mod.`), and a model without repeated blocks is a config error naming the key."""
    vit = [
        *SYNTH,
        "data.shape=[3,32,32]",
        "model=vit_small",
        "model.name=vit_tiny_patch16_224",
        "+model.kwargs.img_size=32",
        "+model.kwargs.depth=3",
    ]  # 3 blocks: one compiled graph
    eager = cfg_factory(*vit)
    blocks = cfg_factory(
        *vit, "model.compile=true", "model.compile_scope=blocks", f"run_dir={tmp_path / 'blocks'}"
    )
    from torch._dynamo.utils import counters

    run.run(eager)
    torch._dynamo.reset()
    counters.clear()
    assert run.run(blocks)["status"] == "completed"
    # one graph for training and one for evaluation, shared by the three blocks (not one each)
    assert counters["stats"]["unique_graphs"] == 2
    assert losses(blocks) == pytest.approx(losses(eager), rel=1e-3)
    keys = [
        set(torch.load(Path(c.run_dir) / "checkpoints" / "last.pt", weights_only=True)["model"])
        for c in (eager, blocks)
    ]
    assert keys[0] == keys[1]
    with pytest.raises(
        ConfigError,
        match="compile_scope=blocks: mixprec_digits_mlp has no repeated blocks",
    ):
        run.run(
            cfg_factory(
                "model=digits_mlp",
                "model.compile=true",
                "model.compile_scope=blocks",
                f"run_dir={tmp_path / 'mlp'}",
            )
        )
    with pytest.raises(ConfigError, match="model.compile_scope.*'layers'.*model, blocks"):
        validate(cfg_factory("model.compile_scope=layers"))
    with pytest.raises(ConfigError, match="model.compile_scope.*compile_mode=reduce-overhead"):
        validate(
            cfg_factory(
                "model.compile=true",
                "model.compile_scope=blocks",
                "model.compile_mode=reduce-overhead",
            )
        )


def test_the_warm_start_fix_keeps_a_cached_tuned_config(monkeypatch):
    """inductor_fix's recheck (torch <= 2.11): a kernel of one config whose cache holds the
    tuned winner keeps it marked as tuned (run() then does not tune again), and a winner the
    saved kernel was not compiled for is compiled; a miss changes nothing."""
    from types import SimpleNamespace as NS

    from torch._inductor.runtime import triton_heuristics as th

    from mixprec.internals import inductor_fix

    def cfg(x):
        return NS(kwargs={"XBLOCK": x}, num_warps=4, num_stages=1)

    monkeypatch.setattr(th, "triton_config_to_hashable", lambda c: tuple(c.kwargs.items()))
    start = cfg(64)
    kernel = NS(
        compile_results=[NS(config=start)],
        filename="k.py",
        inductor_meta={"coordinate_descent_tuning": True},
        is_statically_launchable=lambda: True,
        fn=NS(fn=object()),
        _precompile_config=lambda c: NS(config=c, compiled=True),
    )
    tuned_same = cfg(64)
    tuned_same.found_by_coordesc = True
    monkeypatch.setattr(th, "check_autotune_cache", lambda c, f, m: ([tuned_same], None, {}))
    inductor_fix._recheck_autotune_cache(kernel, reload_kernel_from_src=None)
    assert kernel.compile_results[0].config is start and start.found_by_coordesc

    tuned_other = cfg(128)
    tuned_other.found_by_coordesc = True
    monkeypatch.setattr(th, "check_autotune_cache", lambda c, f, m: ([tuned_other], None, {}))
    kernel.compile_results = [NS(config=cfg(64))]
    inductor_fix._recheck_autotune_cache(kernel, reload_kernel_from_src=None)
    assert kernel.compile_results[0].compiled and kernel.compile_results[0].config is tuned_other

    monkeypatch.setattr(th, "check_autotune_cache", lambda c, f, m: (c, None, {}))
    miss = cfg(32)
    kernel.compile_results = [NS(config=miss), NS(config=cfg(16))]
    inductor_fix._recheck_autotune_cache(kernel, reload_kernel_from_src=None)
    assert len(kernel.compile_results) == 2 and not hasattr(miss, "found_by_coordesc")


END_WORKERS = """
import json, logging, os, sys, time
from pathlib import Path
from mixprec.internals import quick_exit
from torch._inductor import async_compile

pool = async_compile.AsyncCompile.process_pool()  # as inductor starts it to compile kernels
assert pool.submit(os.getpid).result() != os.getpid()  # its workers are up
workers = quick_exit._children(pool.process.pid)
warned = []


class Keep(logging.Handler):
    def emit(self, record):
        warned.append(record.getMessage())


for name in ("", "torch", "torch._inductor"):
    logging.getLogger(name).addHandler(Keep(logging.WARNING))
if os.environ.get("KILL_ONLY"):  # how the check sees a pool killed under torch's feet
    pool.process.kill()
    pool.process.wait()
else:
    quick_exit.end_compile_workers()
async_compile.shutdown_compile_workers()  # torch's own handler, after ours at exit


def running(pid):
    try:  # a process that is gone, or a zombie, has ended
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def alive():
    return [w for w in workers if running(w)]


for _ in range(0 if os.environ.get("KILL_ONLY") else 200):
    if not alive():  # SIGKILL lands asynchronously: on a loaded machine it takes a moment
        break
    time.sleep(0.05)

print(json.dumps({"sidecar": pool.process.returncode, "workers": len(workers),
                  "alive": alive(), "warned": [w for w in warned if "pool" in w.lower()]}))
"""


@pytest.mark.slow
def test_at_exit_inductors_compile_workers_are_killed_not_waited_for(tmp_path):
    """torch's own atexit handler asks inductor's compile-worker sidecar (what inductor starts
    to compile Triton kernels on a GPU) to stop and waits while it and each worker tear down an
    interpreter holding torch (3.2 s on this 2-core CPU with 4 workers; benchmarks/RESULTS.md).
    quick_exit ends them first: the sidecar killed, its workers gone, and torch's shutdown
    afterwards finds the pool closed and says nothing."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_COMPILE_THREADS": "2",  # a sidecar with a pool of 2
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
        "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
    }

    def ended(kill_only: bool) -> dict:
        p = subprocess.run(
            [sys.executable, "-c", END_WORKERS],
            env={**env, "KILL_ONLY": "1" if kill_only else ""},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    out = ended(kill_only=False)
    assert out["sidecar"] == -signal.SIGKILL and out["workers"] >= 1
    assert out["alive"] == [] and out["warned"] == []
    crude = ended(kill_only=True)  # the sidecar alone killed: what these checks would see
    assert crude["alive"] and crude["warned"]

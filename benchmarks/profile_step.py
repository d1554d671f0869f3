"""Where a training step's GPU time goes: train.py's own parts (build.build) and step
(loop.train_step) under torch.profiler, kernels grouped by what they do.

    python3 benchmarks/profile_step.py                           # experiment=fast (ResNet-50, amp, compiled)
    python3 benchmarks/profile_step.py model.compile=false        # the eager step
    python3 benchmarks/profile_step.py model.compile_options.coordinate_descent_tuning=true
    python3 benchmarks/profile_step.py --groups lm --base experiment=lm_table hydra.mode=RUN \
        model=llama_8b_slice precision=bf16        # the LM step (GEMMs, attention, norms, loss)

Prints the step's rate (timed without the profiler), then a table: GPU time per step by kernel
group (convolution, GEMM, BatchNorm, elementwise/fused, optimizer, GradScaler, copies, other)
and the idle time (step wall time minus the time some kernel ran). Writes the table as JSON
(--out) and, with --trace, the Chrome trace.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GROUPS = [  # first match wins; names as cuDNN, cuBLAS, inductor (triton_*) and torch give them
    ("inductor reductions (BatchNorm statistics and their backward)", r"^triton_(red|per)_"),
    ("inductor max-pool (forward, and its backward from saved offsets)", r"^triton_.*max_pool2d"),
    ("inductor pointwise (BatchNorm apply, ReLU, add, max-pool, casts)", r"^triton_poi_"),
    ("convolution (cuDNN)", r"conv|xmma|implicit_gemm|cudnn|dgrad|wgrad|fprop"),
    ("cuBLAS GEMM (1x1 convolutions run as GEMMs, the classifier)", r"gemm|nvjet|cublas|cutlass"),
    ("optimizer (fused SGD)", r"multi_tensor|fused_sgd|sgd"),
    ("GradScaler", r"amp_|non_finite|unscale|update_scale"),
    ("copies / memset", r"memcpy|memset|copy"),
]


LM_GROUPS = [  # a decoder's step: compiled blocks (inductor), eager head and loss
    # torch._scaled_mm's GEMMs: cuBLAS names its float8 kernels nvjet_sm90_qqtst_.. and
    # nvjet_sm90_qrtst_.. (bf16's are nvjet_sm90_tst_..), cutlass's carry e4m3 / e5m2
    ("fp8 GEMM (torch._scaled_mm)", r"^nvjet_sm\d+_q|e4m3|e5m2"),
    ("attention (flash / cuDNN / efficient SDPA)", r"flash|fmha|attention|sdpa|cudnn"),
    ("GEMM, bf16/fp32 (cuBLAS, cutlass)", r"gemm|nvjet|cublas|cutlass|xmma"),
    # inductor names a fused kernel after the ops it holds: fp8's amax, scale (a clamped
    # reciprocal) and cast, fused into the RMSNorm or SwiGLU they follow, name scaled_mm's
    # inputs or the reciprocal; their time is what fp8 adds to the step
    (
        "fp8 scaling: amax, scale, cast (inductor, fused)",
        r"^triton_.*(scaled_mm|abs_max|reciprocal)",
    ),
    ("inductor reductions (RMSNorm, loss)", r"^triton_(red|per)_"),
    ("inductor pointwise (SwiGLU, RoPE, casts)", r"^triton_poi_"),
    ("cross-entropy / log-softmax (aten, the head's loss)", r"softmax|nll_loss|cross_entropy"),
    ("optimizer (fused AdamW) and grad-norm clipping", r"multi_tensor|adam|norm|foreach"),
    ("copies / memset / casts (aten)", r"memcpy|memset|copy|elementwise|cast|fill"),
]


def group_of(name: str, groups=None) -> str:
    low = name.lower()
    for group, pattern in groups or GROUPS:
        if re.search(pattern, low):
            return group
    return "other"


def device_kernels(events) -> list:
    """The kernels that ran on the GPU. Kineto also puts each record_function range (as
    Optimizer.step#AdamW.step) on the GPU's timeline, spanning the kernels it launched: counted
    as a kernel it would count the optimizer twice (torch's own totals leave them out too)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [
        e for e in events if e.device_type == cuda and not getattr(e, "is_user_annotation", False)
    ]


MATMUL_GROUPS = ("GEMM", "attention", "convolution")  # the kernels the FLOP count is made of


def roofline(parts, batch: int, step_ms: float, per_group: dict) -> dict:
    """The step against its own roofline: the run's counted training FLOPs (those MFU uses) at
    the dense peak of its precision (fp8: float8 and bf16 blended by FLOP share), beside the
    time its matmul, attention and convolution kernels took. What is left between the two is
    the non-matmul kernels, the GPU's idle time and the matmuls' own shortfall from peak."""
    from mixprec.models import flops as counted

    if not (parts.flops_per_sample and parts.peak_tflops):
        return {}
    flops = parts.flops_per_sample * batch
    ideal = flops / (parts.peak_tflops * 1e12) * 1e3
    matmul = sum(v for g, v in per_group.items() if any(k in g for k in MATMUL_GROUPS))
    mfu = counted.mfu(parts.flops_per_sample, batch / step_ms * 1e3, parts.peak_tflops)
    return {
        "flops_per_step": flops,
        "peak_tflops": parts.peak_tflops,
        "roofline_ms_per_step": round(ideal, 2),
        "mfu_profiled": round(mfu, 4),  # the run's own MFU, at the profiled step's rate
        "matmul_kernel_ms": round(matmul, 2),
        "matmul_kernels_at_peak": round(ideal / matmul, 4) if matmul else None,
    }


def busy_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1.0
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="train.py overrides on top of --base")
    ap.add_argument("--base", default="experiment=fast")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--steps", type=int, default=50, help="timed steps (without the profiler)")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "profile_step.json")
    ap.add_argument("--groups", choices=("vision", "lm"), default="vision", help="kernel groups")
    a = ap.parse_args()
    if a.steps < 1 or a.profile_steps < 1 or a.warmup < 0:
        ap.error(
            f"--steps and --profile-steps must be >= 1, --warmup >= 0 "
            f"(got {a.steps}, {a.profile_steps}, {a.warmup})"
        )
    try:  # before the build: an --out that cannot be written is known at once
        a.out.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(a.out.parent, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        ap.error(f"--out {a.out}: its folder cannot be written ({e.strerror})")
    os.environ.setdefault("WANDB_MODE", "disabled")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from torch.profiler import ProfilerActivity, profile

    from mixprec.core.errors import MixprecError
    from mixprec.parallel import distributed
    from mixprec.run import build
    from mixprec.run.config import compose_config, validate
    from mixprec.training import loop

    try:
        c = validate(compose_config([a.base, "logger=none", *a.overrides]))
        hw = build.resolve_hardware(c)
        parts = build.build(c, hw, distributed.init(hw.device))
    except MixprecError as e:  # a bad value, a GPU preset on a CPU: train.py's one line
        ap.exit(e.exit_code, f"profile_step.py: {e.label}: {e}\n")
    except (HydraException, OmegaConfBaseException) as e:  # an override Hydra cannot compose
        ap.exit(2, f"profile_step.py: config error: {str(e).splitlines()[0]}\n")
    learner, batch = parts.learner, parts.layout.batch

    def epochs():
        """The training batches, epoch after epoch: more steps than an epoch go on."""
        epoch = 0
        while True:
            parts.data.train.set_epoch(epoch)
            yield from parts.data.train
            epoch += 1

    batches = epochs()

    cuda = parts.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def steps(n: int) -> None:
        for _ in range(n):
            loop.train_step(learner, [next(batches)])

    t0 = time.perf_counter()
    steps(a.warmup)
    sync()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    steps(a.steps)
    sync()
    step_ms = 1e3 * (time.perf_counter() - t0) / a.steps
    with profile(
        activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    ) as prof:
        t0 = time.perf_counter()
        steps(a.profile_steps)
        sync()
        prof_ms = 1e3 * (time.perf_counter() - t0) / a.profile_steps
    kernels = device_kernels(prof.events())
    per_group: dict[str, float] = {}
    for e in kernels:
        g = group_of(e.name, LM_GROUPS if a.groups == "lm" else GROUPS)
        per_group[g] = per_group.get(g, 0.0) + e.device_time / 1e3 / a.profile_steps
    busy = busy_union([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3
    busy /= a.profile_steps
    top = sorted(
        (
            (sum(k.device_time for k in kernels if k.name == n) / 1e3 / a.profile_steps, n)
            for n in {k.name for k in kernels}
        ),
        reverse=True,
    )[:15]
    result = {
        "config": [a.base, *a.overrides],
        "gpu": torch.cuda.get_device_name() if cuda else "CPU",
        "torch": torch.__version__,
        "batch": batch,
        "warmup_s": round(warm_s, 1),
        "step_ms": round(step_ms, 2),
        "images_per_s": round(batch / step_ms * 1e3),
        "tokens_per_s": round(batch * getattr(c.data, "seq_len", 0) / step_ms * 1e3)
        if a.groups == "lm"
        else None,
        "profiled_step_ms": round(prof_ms, 2),
        "kernel_ms_per_step": {
            g: round(v, 2) for g, v in sorted(per_group.items(), key=lambda kv: -kv[1])
        },
        "kernels_per_step": round(len(kernels) / a.profile_steps),
        "gpu_busy_ms_per_step": round(busy, 2),
        "idle_ms_per_step": round(prof_ms - busy, 2),
        "top_kernels_ms": [[round(t, 3), n[:120]] for t, n in top],
        **roofline(parts, batch, prof_ms, per_group),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    if a.trace:
        prof.export_chrome_trace(str(a.trace))
    print(json.dumps(result, indent=2))
    rate = (
        f"{result['tokens_per_s']:,} tokens/s"
        if a.groups == "lm"
        else f"{result['images_per_s']:,} img/s"
    )
    print(
        f"\n{result['gpu']}: {' '.join(result['config'])}, batch {batch}: {rate}, {step_ms:.1f} ms/step"
    )
    if result.get("roofline_ms_per_step"):
        print(
            f"the step's FLOPs at the dense peak ({parts.peak_tflops:.0f} TFLOP/s): "
            f"{result['roofline_ms_per_step']:.2f} ms (MFU {result['mfu_profiled']:.3f}); "
            f"its matmul and attention kernels ran {result['matmul_kernel_ms']:.2f} ms, "
            f"{result['matmul_kernels_at_peak']:.0%} of peak while they ran"
        )
    print("| kernels | ms per step | share of the step |\n|---|---|---|")
    for g, v in result["kernel_ms_per_step"].items():
        print(f"| {g} | {v:.2f} | {v / prof_ms:.1%} |")
    print(
        f"| GPU idle (no kernel running) | {prof_ms - busy:.2f} | {(prof_ms - busy) / prof_ms:.1%} |"
    )
    parts.data.close()


if __name__ == "__main__":
    main()

"""Is inductor's max-pool backward the slow part of experiment=fast's stem? Times MaxPool2d(3, 2, 1)
forward + backward on the stem's activation (ResNet-50 at 224², batch 512: 512×64×112×112 fp16,
channels_last), eager (aten's CUDA kernels) next to torch.compile (inductor, with and without
coordinate-descent tuning), mixprec's Triton kernels (model.triton_max_pool=true, eager and with
inductor compiling around them) and the bandwidth floor of the bytes they must move.

    python3 benchmarks/maxpool_backward.py                 # on a GPU (about 2 min, most of it compiling)
    python3 benchmarks/maxpool_backward.py --batch 4 --device cpu --iters 3   # a smoke run

Why: the profile of the tuned preset (benchmarks/RESULTS.md, session 8) has one 3.1 ms kernel,
`triton_poi_fused_add_max_pool2d_with_indices_max_pool2d_with_indices_backward`, whose bytes need
about 0.25 ms; benchmarks/maxpool_partition.py shows it reads saved offsets (no recompute).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mixprec.models.ops import max_pool2d


def pool(x):
    return F.max_pool2d(x, 3, 2, 1)


def triton_pool(x):
    """model.triton_max_pool=true: mixprec::max_pool2d, our Triton kernels (src/mixprec/models/ops.py)."""
    return max_pool2d(x, [3, 3], [2, 2], [1, 1], [1, 1], False)[0]


def step(fn, x, g):
    """Forward and backward of fn at x with incoming gradient g; returns x's gradient."""
    x.grad = None
    fn(x).backward(g)
    return x.grad


def timed(fn, x, g, iters: int) -> float:
    """Milliseconds per forward + backward, after 3 warm-up calls (the compiles)."""
    for _ in range(3):
        step(fn, x, g)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step(fn, x, g)
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


def kernel_ms(fn, x, g, iters: int = 5) -> dict:
    """GPU time per forward + backward of each kernel, from torch.profiler (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step(fn, x, g)
        torch.cuda.synchronize()
    per: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:80]] = per.get(e.name[:80], 0.0) + e.device_time / 1e3 / iters
    return {k: round(v, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", nargs="*", help="the rows whose names start with these")
    ap.add_argument(
        "--code-dir", type=Path, help="write each compiled variant's generated code here"
    )
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="for the floor (H200: 4.8)")
    a = ap.parse_args()
    dtype = torch.float16 if a.device == "cuda" else torch.float32
    x = torch.randn(a.batch, 64, 112, 112, device=a.device, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    g = torch.randn_like(pool(x.detach()))
    want = step(pool, x, g).clone()
    fns = {
        "eager (aten)": pool,
        "compiled (inductor)": torch.compile(pool),
        "compiled, coordinate-descent tuned": torch.compile(
            pool, options={"coordinate_descent_tuning": True}
        ),
        "mixprec Triton kernels (model.triton_max_pool=true)": triton_pool,
        "compiled around the mixprec Triton kernels": torch.compile(triton_pool),
    }
    rows, kernels = {}, {}
    for name, fn in fns.items():
        if a.only and not name.startswith(tuple(a.only)):
            continue
        torch._dynamo.reset()
        if a.code_dir and name.startswith("compiled"):
            from torch._inductor.utils import run_and_get_code

            got, code = run_and_get_code(step, fn, x, g)
            a.code_dir.mkdir(parents=True, exist_ok=True)
            (a.code_dir / (re.sub(r"\W+", "_", name).strip("_") + ".py")).write_text(
                "\n\n# ----- next graph -----\n".join(code)
            )
        else:
            got = step(fn, x, g)
        # ties in a window (fp16) may route a gradient to another element
        assert (got != want).float().mean() < 0.01, f"{name}: a different gradient"
        rows[name] = round(timed(fn, x, g, a.iters), 3)
        if x.is_cuda:
            kernels[name] = kernel_ms(fn, x, g)
    # with int8 offsets: the forward reads x and writes the output and the offsets; the backward
    # reads the incoming gradient and the offsets and writes x's gradient
    backward = g.numel() * g.element_size() + g.numel() + x.numel() * x.element_size()
    rows["bandwidth floor, forward + backward"] = round(2 * backward / (a.bandwidth_tbs * 1e9), 3)
    rows["bandwidth floor, backward alone"] = round(backward / (a.bandwidth_tbs * 1e9), 3)
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                "torch": torch.__version__,
                "shape": list(x.shape),
                "dtype": str(dtype),
                "ms_forward_and_backward": rows,
                "kernel_ms": kernels,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

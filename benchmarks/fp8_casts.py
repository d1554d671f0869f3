"""fp8's scaling on the 8B slice, split by what is cast: each float8 cast a tensorwise step makes
(amax, scale, cast: torchao's own hp_tensor_to_float8_dynamic, compiled), timed alone at the
shapes of four Llama-3-8B layers at 2 x 4,096 tokens, grouped as weight casts, activation casts
(the forward's inputs, and the backward's again for the grad-weight GEMM) and gradient casts.

    python benchmarks/fp8_casts.py --out benchmarks/results/fp8-casts.json

Alone, no cast is fused with the norm or SwiGLU that makes its input as in the compiled step, so
the sum is an upper bound of the step's scaling kernels (profile_step.py --groups lm measures
those); what it splits is where that time can come from, and what sharing the weight's cast
(precision.fp8_weight_cast=shared) can save: one weight cast a step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SLICE = dict(dim=4096, kv=1024, ffn=14336, layers=4, tokens=2 * 4096)


def casts(s: dict) -> dict[str, list[tuple[tuple[int, int], torch.dtype, int]]]:
    """{role: [(shape, dtype, casts a step)]} for one step of the slice (tensorwise, compiled:
    the q, k, v layers share their input's cast, as w1 and w3 do)."""
    d, kv, f, m, n = s["dim"], s["kv"], s["ffn"], s["tokens"], s["layers"]
    weights = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f)]  # wq wk wv wo w1 w3 w2
    inputs = [(m, d), (m, d), (m, d), (m, f)]  # norm out (q,k,v), attention out, norm out, SwiGLU
    grads = [(m, d), (m, kv), (m, kv), (m, d), (m, f), (m, f), (m, d)]  # each layer's output grad
    return {
        # forward, and (torchao's own forward: where the partitioner recomputes it) backward
        "weights (fp32 -> e4m3), one cast each": [(w, torch.float32, n) for w in weights],
        "activations (bf16 -> e4m3): forward inputs": [(x, torch.bfloat16, n) for x in inputs],
        "activations (bf16 -> e4m3): backward, for grad-weight": [
            (x, torch.bfloat16, n) for x in inputs
        ],
        "gradients (bf16 -> e5m2), two layouts each": [(g, torch.bfloat16, 2 * n) for g in grads],
    }


def time_cast(shape, dtype, target, reps: int) -> float:
    """ms of one compiled amax + scale + cast of a tensor of `shape` (CUDA events)."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    x = torch.randn(shape, device="cuda", dtype=dtype)
    fn = torch.compile(
        lambda t: hp_tensor_to_float8_dynamic(t, target, LinearMMConfig())._data, dynamic=False
    )
    for _ in range(3):
        fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.exit(2, "fp8_casts.py: needs a CUDA GPU with float8 (compute capability >= 8.9)\n")
    if a.reps < 1:
        ap.error(f"--reps must be >= 1 (got {a.reps})")
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "roles": {}}
    known: dict = {}
    for role, items in casts(SLICE).items():
        target = torch.float8_e5m2 if role.startswith("gradients") else torch.float8_e4m3fn
        ms = 0.0
        for shape, dtype, count in items:
            key = (shape, dtype, target)
            if key not in known:
                known[key] = time_cast(shape, dtype, target, a.reps)
            ms += known[key] * count
        result["roles"][role] = round(ms, 2)
    total = sum(result["roles"].values())
    print(f"{result['gpu']}: fp8 tensorwise casts of one 8B-slice step, each alone (ms)")
    print("| cast | ms per step |\n|---|---|")
    for role, ms in result["roles"].items():
        print(f"| {role} | {ms:.2f} |")
    print(f"| all (upper bound: none fused with its producer) | {total:.2f} |")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())

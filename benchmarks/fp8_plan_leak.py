"""Why the fp8 plan times in a child process: allocated MiB after each in-process timing of
precision/fp8_timing.time_gemm on ViT-B/16's MLP shapes (batch 128), and after
torch.compiler.reset() + gc + empty_cache. On an H200 (2026-12-02): 130, 197, 262, 328, and 328
after the reset, with and without the CUDA graph's reset and autocast's cache off. The plan now
runs its timings through fp8_timing.time_in_child, and that memory leaves with the child
(tests/test_gpu.py::test_the_fp8_timings_leave_nothing_allocated_in_the_training_process).

    python benchmarks/fp8_plan_leak.py
"""

from __future__ import annotations

import gc

import torch

from mixprec.precision import fp8_layers, fp8_timing


def allocated_mib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**20


def main() -> None:
    dev = torch.device("cuda")
    print("start", allocated_mib())
    for g in [fp8_layers.Gemm(25216, 768, 3072, True), fp8_layers.Gemm(25216, 3072, 768, True)]:
        for recipe in ("bf16", "tensorwise"):
            us = fp8_timing.time_gemm((g,), recipe, True, dev)
            gc.collect()
            print(g, recipe, f"{us:.1f} us; allocated MiB after: {allocated_mib():.1f}")
    torch.compiler.reset()
    gc.collect()
    torch.cuda.empty_cache()
    print("after reset", f"{allocated_mib():.1f}")


if __name__ == "__main__":
    main()

"""Where HF's Llama loses ~3 % to mixprec's at the 8B slice's shape (benchmarks/RESULTS.md): its
final RMSNorm runs eagerly outside the compiled blocks, written in Python (upcast to fp32, pow,
mean, rsqrt, two multiplies), while mixprec's Llama uses torch's nn.RMSNorm. This times one
forward + backward of each on the last hidden state (batch 2 x 4,096 tokens x 4,096), side by
side in one process, and the same HF norm compiled.

    python3 benchmarks/hf_rmsnorm.py            # needs a GPU and transformers
"""

from __future__ import annotations

import json

import torch


def timed(norm, x, steps: int = 50) -> float:
    """Milliseconds per forward + backward."""
    for _ in range(5):
        norm(x).sum().backward()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        norm(x).sum().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    dev, dim = "cuda", 4096
    x = torch.randn(2, 4096, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    hf = LlamaRMSNorm(dim, eps=1e-5).to(dev)
    ours = torch.nn.RMSNorm(dim, eps=1e-5).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        rows = {
            "hf LlamaRMSNorm, eager": timed(hf, x),
            "torch nn.RMSNorm, eager": timed(ours, x),
            "hf LlamaRMSNorm, compiled": timed(torch.compile(hf), x),
        }
    print(json.dumps({k: round(v, 3) for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()

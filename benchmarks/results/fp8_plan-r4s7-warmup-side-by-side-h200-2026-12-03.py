"""Side by side: the plan's timing children with and without their warm-up (cold caches each
time), on the 8B slice's todo; wall from start_children to the last result, the parent
starting the plan 1 s after the children (its data and model)."""
import json, os, sys, tempfile, time
import torch
from mixprec.precision import fp8_timing
from mixprec.precision.fp8_plan import Gemm
G = lambda m, k, n: Gemm(m, k, n, False)
todo = []
for shapes in ([G(8192, 4096, 4096), G(8192, 4096, 1024), G(8192, 4096, 1024)], [G(8192, 4096, 4096)],
               [G(8192, 4096, 14336), G(8192, 4096, 14336)], [G(8192, 14336, 4096)]):
    for r in ("tensorwise", "bf16"):
        todo.append((tuple(shapes), r))
dev = torch.device("cuda", 0)
torch.zeros(1, device=dev)
out = []
for i, mode in enumerate(sys.argv[1].split(",")):
    d = tempfile.mkdtemp()
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=f"{d}/i", TRITON_CACHE_DIR=f"{d}/t", MIXPREC_FP8_WARMUP=mode)
    t0 = time.perf_counter()
    kids = fp8_timing.start_children(dev, True)
    time.sleep(1.0)
    us = fp8_timing.time_in_child(todo, True, dev, kids)
    wall = time.perf_counter() - t0
    out.append({"mode": mode, "wall_s": round(wall, 2), "us": [round(u, 1) for u in us]})
    print(json.dumps(out[-1]), flush=True)

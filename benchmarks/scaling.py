"""Data-parallel scaling: train.py on 1 GPU, then under torchrun on N GPUs (DDP, NCCL), the same
per-GPU batch, measured back to back in one run.

    python3 benchmarks/scaling.py                     # ResNet-50 amp channels_last, batch 256/GPU
    python3 benchmarks/scaling.py --gpus 2 --extra precision=bf16

samples/s is train.py's steady rate (warm-up excluded), summed over ranks; scaling efficiency =
rate(N) / (N x rate(1)).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "experiment=resnet50_synthetic",
    "precision=amp",
    "model.channels_last=true",
    "batch=256",
    "logger=none",
    "trainer.max_steps=80",
    "trainer.perf_warmup_steps=20",
    "trainer.log_every=20",
]


def run(nproc: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        launch = (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
            ]
            if nproc > 1
            else [sys.executable]
        )
        cmd = [*launch, str(ROOT / "train.py"), *BASE, *extra, f"hydra.run.dir={d}"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if p.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
        s = json.loads((Path(d) / "summary.json").read_text())
        dirs = [x for x in Path(d).iterdir()]
    return {
        "gpus": nproc,
        "samples_per_s": s["samples_per_s"],
        "world_size": s["world_size"],
        "effective_batch": s["effective_batch"],
        "peak_mem_gib": s["peak_mem_gib"],
        "mfu": s["mfu"],
        "wall_s": round(time.perf_counter() - t0, 1),
        "run_dir_entries": sorted(x.name for x in dirs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--extra", nargs="*", default=[], help="more train.py overrides")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "scaling.json")
    a = ap.parse_args()
    import torch

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "gpus_visible": torch.cuda.device_count(),
        "torch": torch.__version__,
        "command": " ".join(["python3", *sys.argv]),
        "overrides": BASE + a.extra,
    }
    rows = []
    for n in (1, a.gpus):
        rows.append(run(n, a.extra))
        print(json.dumps(rows[-1]), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    one, many = rows
    eff = many["samples_per_s"] / (a.gpus * one["samples_per_s"])
    print(f"\n{meta['date']} {a.gpus}x {meta['gpu']}, torch {meta['torch']}")
    print("| GPUs | samples/s | speed-up | efficiency |\n|---|---|---|---|")
    print(f"| 1 | {one['samples_per_s']:,.0f} | 1.00x | 100 % |")
    print(
        f"| {a.gpus} | {many['samples_per_s']:,.0f} | "
        f"{many['samples_per_s'] / one['samples_per_s']:.2f}x | {100 * eff:.1f} % |"
    )


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

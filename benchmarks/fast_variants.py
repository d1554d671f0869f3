"""experiment=fast on synthetic data next to variants of it (inductor options, batch), each a
train.py run of the same length in one process tree, as ratios to the preset itself.

    python3 benchmarks/fast_variants.py                   # the preset, with its kernel tuning on, at batch 768
    python3 benchmarks/fast_variants.py --variants "precision=bf16" "+model.compile_options.aggressive_fusion=true"

Each run compiles from scratch unless inductor's cache holds its kernels: with
coordinate-descent tuning on, the first compile takes 3-5 minutes, so give each run --timeout 600.
Measured rows: benchmarks/RESULTS.md ("experiment=fast").
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from loader import train_rate

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["model.compile_options.coordinate_descent_tuning=true", "batch=768"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--variants", nargs="*", default=VARIANTS, help="train.py overrides, one variant each"
    )
    ap.add_argument("--skip-preset", action="store_true", help="the variants only (no ratios)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per train.py run")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "fast_variants.json")
    a = ap.parse_args()
    import torch

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "steps": a.steps,
    }
    common = ["experiment=fast", f"trainer.max_steps={a.steps}", "trainer.perf_warmup_steps=30"]
    rows = []
    for v in [*([] if a.skip_preset else [""]), *a.variants]:
        r = {"variant": v or "experiment=fast", **train_rate([*common, *v.split()], a.timeout)}
        if rows and not a.skip_preset and r.get("median_window") and rows[0].get("median_window"):
            r["vs_preset"] = round(r["median_window"] / rows[0]["median_window"], 3)
        rows.append(r)
        print(json.dumps(r), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

"""The front door, measured: `python train.py precision=P batch=B` on the embedded default for
every precision and batch, as a new user runs it (W&B offline included): wall time, optimizer
steps, val top-1 and samples/s.

    python benchmarks/headline.py                                  # fp32/amp/bf16 x 16..1024
    python benchmarks/headline.py --precisions amp --batches 768
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


def one(precision: str, batch: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "train.py"),
                f"precision={precision}",
                f"batch={batch}",
                f"hydra.run.dir={d}",
                *extra,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "WANDB_MODE": "offline"},
        )
        wall = time.perf_counter() - t0
        if proc.returncode:
            return {"precision": precision, "batch": batch, "error": proc.stderr[-1000:]}
        s = json.loads((Path(d) / "summary.json").read_text())
    return {
        "precision": precision,
        "batch": batch,
        "wall_s": round(wall, 1),
        "steps": s["steps"],
        "val_acc1": s["val_acc1"],
        "samples_per_s": s["samples_per_s"],
        "device": s["device"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precisions", default="fp32,amp,bf16")
    ap.add_argument("--batches", default="16,64,256,512,768,1024")
    ap.add_argument("--extra", default="", help="more train.py overrides, space-separated")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "headline.json")
    a = ap.parse_args()
    rows = []
    for p in a.precisions.split(","):
        for b in map(int, a.batches.split(",")):
            rows.append(one(p, b, a.extra.split()))
            r = rows[-1]
            print(
                f"{p:5s} batch {b:5d}: "
                + (
                    f"{r['wall_s']:6.1f} s wall, {r['steps']:5d} steps, "
                    f"val_acc1 {r['val_acc1']:.4f}, {r['samples_per_s'] or 0:,.0f} samples/s "
                    f"({r['device']})"
                    if "error" not in r
                    else "FAILED " + r["error"]
                ),
                flush=True,
            )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

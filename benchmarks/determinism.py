"""What trainer.deterministic buys and costs: the same seed run twice with it off and twice with
it on, one run after another on one device, each run's losses compared with its twin's.

    python benchmarks/determinism.py                                  # the 8B slice, bf16 and fp8
    python benchmarks/determinism.py --precisions bf16 --steps 40 --out benchmarks/results/det

For each precision and setting: tokens/s (steady state, the run's summary), and how far the twin
runs' train/loss and val/loss rows differ (0.0 at every step: bit for bit). Writes
determinism.md and determinism.json into --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(precision: str, deterministic: bool, a, where: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "train.py"), "experiment=quality_lm", "hydra.mode=RUN"]
    cmd += [f"precision={precision}", f"trainer.deterministic={str(deterministic).lower()}"]
    cmd += [f"trainer.max_steps={a.steps}", f"trainer.val_every={a.steps // 3}", "logger=none"]
    cmd += ["trainer.log_every=5", "resume=null", f"hydra.run.dir={where}", *a.extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": (p.stdout + p.stderr)[-1500:]}
    rows = [json.loads(r) for r in (where / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((where / "summary.json").read_text())
    return {
        "tokens_per_s": summary.get("tokens_per_s"),
        "train": {r["step"]: r["train/loss"] for r in rows if "train/loss" in r},
        "val": {r["step"]: r["val/loss"] for r in rows if "val/loss" in r},
    }


def largest_gap(x: dict, y: dict) -> float:
    return max((abs(x[k] - y[k]) for k in x if k in y), default=float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("extra", nargs="*", help="more train.py overrides")
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in a.precisions.split(","):
            for det in (False, True):
                runs = [
                    one_run(precision, det, a, Path(tmp) / f"{precision}-{det}-{i}") for i in (0, 1)
                ]
                key = f"{precision} deterministic={str(det).lower()}"
                if any("error" in r for r in runs):
                    results[key] = {"error": next(r["error"] for r in runs if "error" in r)}
                else:
                    results[key] = {
                        "tokens_per_s": [r["tokens_per_s"] for r in runs],
                        "train_gap": largest_gap(runs[0]["train"], runs[1]["train"]),
                        "val_gap": largest_gap(runs[0]["val"], runs[1]["val"]),
                        "steps": a.steps,
                    }
                print(key, json.dumps(results[key])[:400], flush=True)
    lines = [
        f"# trainer.deterministic ({time.strftime('%Y-%m-%d')}): experiment=quality_lm, {a.steps} steps",
        "",
        "| precision, setting | tokens/s (run 1, run 2) | largest train/loss gap between the twins "
        "| largest val/loss gap |",
        "|---|---|---|---|",
    ]
    for key, r in results.items():
        if "error" in r:
            lines.append(f"| {key} | error: {r['error'][-200:]!r} | - | - |")
            continue
        rate = ", ".join(f"{v:,.0f}" if v else "-" for v in r["tokens_per_s"])
        lines.append(f"| {key} | {rate} | {r['train_gap']:.3g} | {r['val_gap']:.3g} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "determinism.md").write_text(text)
        (a.out / "determinism.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

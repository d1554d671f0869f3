"""Does precision=fp8_auto never lose? train.py side by side in one call, each run a process of
its own on the same GPU: bf16, uniform float8 (tensorwise, and rowwise where asked) and fp8_auto
(the per-layer plan measured on this GPU) on the fp8 table's vision models (batch 128, 224x224,
compiled per block, 60 steps, 20 of warm-up) and the LM table's Llamas (batch 2 x 4,096 bytes,
20 steps, 8 of warm-up). Prints and writes rate ÷ bf16 per run, the plan's float8 layers, the
planning time with a cold cache (--cold: inductor's and Triton's too), and the planning time of `python -m mixprec.fp8_plan` on the
now warm cache.

    python benchmarks/fp8_plan.py --out outputs/bench/fp8_plan                 # everything
    python benchmarks/fp8_plan.py --models vit_base,convnext_tiny --out DIR     # a part
    python benchmarks/fp8_plan.py --models llama_8b_slice --repeat 3 --out DIR   # alternated
    python benchmarks/fp8_plan.py --models convnext_tiny --uniform none --repeat 4 --steps 220 --warmup 40

--steps and --warmup set trainer.max_steps and trainer.perf_warmup_steps (longer timing windows);
each row also lists the rate of every logged window after the warm-up ("windows").

With --repeat N the precisions run N rounds in turn (bf16, fp8, fp8_auto, bf16, ...): the
later fp8_auto runs start on the warm cache, and each rate is set against its own round's bf16.
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
VISION = {
    "vit_base": "vit_base_patch16_224",
    "vit_large": "vit_large_patch16_224",
    "convnext_tiny": "convnext_tiny",
}
LMS = ("llama_1b", "llama_8b_slice")


def overrides(model: str) -> list[str]:
    if model in VISION:
        return ["experiment=fp8_table", "hydra.mode=RUN", f"model.name={VISION[model]}"]
    return ["experiment=lm_table", "hydra.mode=RUN", f"model={model}"]


def train(model: str, precision: str, cache: Path, cold: bool = False, steps: tuple = ()) -> dict:
    """One train.py run; `cold`: inductor's and Triton's caches empty (a new machine); `steps`:
    (max_steps, perf_warmup_steps), or () for the experiment's own."""
    with tempfile.TemporaryDirectory() as d:
        args = [*overrides(model), f"precision={precision}", "logger=none", f"hydra.run.dir={d}"]
        if steps:
            args += [f"trainer.max_steps={steps[0]}", f"trainer.perf_warmup_steps={steps[1]}"]
        if precision == "fp8_auto":
            args.append(f"precision.fp8_plan_cache={cache}")
        env = {**os.environ, "WANDB_MODE": "offline"}
        if cold:
            env |= {"TORCHINDUCTOR_CACHE_DIR": f"{d}/inductor", "TRITON_CACHE_DIR": f"{d}/triton"}
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env,
        )
        wall = time.perf_counter() - t0
        if proc.returncode:
            return {"model": model, "precision": precision, "error": proc.stderr[-1500:]}
        s = json.loads((Path(d) / "summary.json").read_text())
        plan = (
            json.loads((Path(d) / "precision_plan.json").read_text())
            if precision == "fp8_auto"
            else None
        )
        windows = [
            round(r.get("perf/tokens_per_s") or r["perf/samples_per_s"])
            for line in (Path(d) / "metrics.jsonl").read_text().splitlines()
            if (r := json.loads(line)).get("perf/samples_per_s")
        ]
    rate = s.get("tokens_per_s") or s["samples_per_s"]
    timings = [x for x in proc.stderr.splitlines() if x.startswith("fp8 plan:")]
    out = {
        "model": model,
        "precision": precision,
        "rate": rate,
        "unit": "tokens/s" if s.get("tokens_per_s") else "samples/s",
        "peak_mem_gib": s["peak_mem_gib"],
        "train_loss": s["train_loss"],
        "wall_s": round(wall, 1),
        "fp8_layers": (s.get("precision_plan") or {}).get("float8_layers"),
        "planning_s": (s.get("precision_plan") or {}).get("planning_s"),
        "timed_gemms": (s.get("precision_plan") or {}).get("timed_gemms"),
        "windows": windows,  # each logged window's rate after the warm-up
        "timings": timings,  # the timing child's lines: each (shape, recipe)'s µs and seconds
    }
    if plan:
        out["plan"] = {
            n: {k: c.get(k) for k in ("choice", "us", "gemm", "group")} for n, c in plan.items()
        }
    return out


def cached_plan_s(model: str, cache: Path) -> float | None:
    """`python -m mixprec.fp8_plan` on the warm cache: the planning time a second start pays."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mixprec.fp8_plan",
            *overrides(model),
            f"precision.fp8_plan_cache={cache}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("planned in"):
            return float(line.split()[2].rstrip("s"))
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join([*VISION, *LMS]))
    ap.add_argument("--uniform", default="llama_8b_slice", help="models that also run fp8 (all)")
    ap.add_argument("--rowwise", default="", help="models that also run fp8_rowwise")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "fp8_plan")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the precisions, alternated")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="the first fp8_auto run with inductor's and Triton's caches empty (a new machine)",
    )
    ap.add_argument("--steps", type=int, help="trainer.max_steps (default: the experiment's)")
    ap.add_argument("--warmup", type=int, default=20, help="trainer.perf_warmup_steps with --steps")
    a = ap.parse_args()
    steps = (a.steps, a.warmup) if a.steps else ()
    a.out.mkdir(parents=True, exist_ok=True)
    cache = a.out / "fp8_plan_cache.json"
    rows = []
    for model in a.models.split(","):
        precisions = [
            "bf16",
            *(["fp8"] if model in a.uniform.split(",") else []),
            *(["fp8_rowwise"] if model in a.rowwise.split(",") else []),
            "fp8_auto",
        ]
        runs = [
            train(model, p, cache, cold=a.cold and i == 0 and p == "fp8_auto", steps=steps)
            for i in range(a.repeat)
            for p in precisions
        ]
        for i, r in enumerate(runs):
            r["round"] = i // len(precisions)
            base = runs[r["round"] * len(precisions)]  # this round's bf16
            if "rate" in r and "rate" in base:
                r["vs_bf16"] = round(r["rate"] / base["rate"], 3)
            print(json.dumps({k: v for k, v in r.items() if k != "plan"}), flush=True)
        auto = next((r for r in runs if r["precision"] == "fp8_auto"), {})
        if "rate" in auto:
            auto["cached_planning_s"] = cached_plan_s(model, cache)
            print(
                f"{model}: fp8_auto planning {auto['planning_s']}s cold, {auto['cached_planning_s']}s cached"
            )
        rows += runs
        (a.out / "fp8_plan.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| model | precision | rate | ÷ bf16 | float8 layers | planning s (cold / cached) | peak GiB | train loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "rate" not in r:
            lines.append(f"| {r['model']} | {r['precision']} | failed | | | | | |")
            continue
        plan = (
            f"{r['planning_s']} / {r.get('cached_planning_s')}"
            if r["planning_s"] is not None
            else ""
        )
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['rate']:,.0f} {r['unit']} | {r.get('vs_bf16', '')} | "
            f"{'' if r['fp8_layers'] is None else r['fp8_layers']} | {plan} | {r['peak_mem_gib']:.1f} | {r['train_loss']:.4f} |"
        )
    (a.out / "fp8_plan.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

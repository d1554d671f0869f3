"""What fits on a 24 GB card, per memory technique: the deepest Llama (1B-shaped layers: d_model
2048, FFN 8192, 32 heads / 8 KV heads; one sequence of 2,048 bytes per step) that trains under
`hardware=rtx3090` (the process capped at 24 GiB) with fp32, amp, amp + activation
checkpointing, + 8-bit AdamW states, and bf16 + checkpointing + CPU offload of the optimizer
(offload takes no GradScaler). And the seeds' "checkpointing trades 30 % compute for 50 %
memory", measured on that model: step time and peak memory with and without it.

Per technique: two probe runs (2 and 6 layers) give peak memory = a + b x layers; the depth
predicted to fill the cap is run, then one layer more, stepping down until one completes.
Every probe is a train.py process of its own (as a user runs it), eager, 4 optimizer steps; the
checkpointing pair runs 13 (10 timed), alone on the GPU. The five techniques search side by side
(each probe is capped at 24 GiB by its own process, so five fit on an H200's 139 GiB; what they
measure is memory, which the neighbours do not change): one H200, about a third of the
sequential ~10 minutes (`--serial` runs them one after another).

    python3 benchmarks/fits_24gb.py --out fits.json

`--breakdown` instead shows what each technique removes (issue 42): every technique, and its
baseline, at one depth (6 layers) with `debug.memory=true`, the peak of step 3 in its parts
(weights, optimizer state, activations, autocast's copies, gradients, temporaries; the allocator's
reserve beside it), side by side with the parts' change against the baseline:

    python3 benchmarks/fits_24gb.py --breakdown --out breakdown.json

Measured rows: benchmarks/RESULTS.md ("What fits on a 24 GB card").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

BASE = [
    "hardware=rtx3090",
    "model=llama_1b",
    "data=text",
    "data.seq_len=2048",
    "data.val_sequences=2",
    "batch=1",
    "optimizer=adamw",
    "optimizer.scale_lr=none",
    "trainer.max_steps=4",
    "trainer.perf_warmup_steps=0",
    "trainer.log_every=2",
    "trainer.clip_grad_norm=null",
    "ckpt.at_end=false",
    "logger=none",
]
TECHNIQUES = {
    "fp32": ["precision=fp32"],
    "amp": ["precision=amp"],
    "amp + checkpointing": ["precision=amp", "model.grad_checkpointing=true"],
    "amp + checkpointing + 8-bit states": [
        "precision=amp",
        "model.grad_checkpointing=true",
        "optimizer.state=8bit",
    ],
    "bf16 + checkpointing + CPU offload": [
        "precision=bf16",
        "model.grad_checkpointing=true",
        "optimizer.offload=cpu",
    ],
}
# --breakdown: (technique, its baseline, overrides), each at BREAKDOWN_LAYERS layers
BREAKDOWN = [
    ("fp32", None, ["precision=fp32"]),
    ("amp", "fp32", ["precision=amp"]),
    ("bf16", "fp32", ["precision=bf16"]),
    ("amp + checkpointing", "amp", ["precision=amp", "model.grad_checkpointing=true"]),
    ("amp + 8-bit states", "amp", ["precision=amp", "optimizer.state=8bit"]),
    ("amp + 4-bit states", "amp", ["precision=amp", "optimizer.state=4bit"]),
    ("amp + fp8 states", "amp", ["precision=amp", "optimizer.state=fp8"]),
    ("bf16 + bf16 weights and states", "bf16", ["precision=bf16", "optimizer.state=bf16"]),
    ("bf16 + CPU offload", "bf16", ["precision=bf16", "optimizer.offload=cpu"]),
    ("amp + keep_fp32 [head]", "amp", ["precision=amp", "precision.keep_fp32=[head]"]),
    ("amp + FSDP2, a world of one", "amp", ["precision=amp", "parallel=fsdp"]),
]
BREAKDOWN_LAYERS = 6
PARTS = ("weights", "optimizer_state", "activations", "autocast_copies", "gradients")
PARTS += ("temporaries", "inputs_and_buffers")
D, FFN, VOCAB = 2048, 8192, 256
PER_LAYER = D * D * 2 + 2 * D * (D // 4) + 3 * D * FFN + 2 * D  # q,o; k,v (8 of 32 heads); FFN
CAP_GIB = 24.0
RUNS = itertools.count()


def params(layers: int) -> int:
    return layers * PER_LAYER + 2 * VOCAB * D + D


def probe(
    extra: list[str], layers: int, out: Path, timed: bool = False, memory: bool = False
) -> dict:
    """One train.py run in its own process (a fresh CUDA context: nothing left from the last)."""
    steps = ["trainer.max_steps=13", "trainer.perf_warmup_steps=3"] if timed else []
    steps += ["debug.memory=true"] if memory else []
    name = re.sub(r"[^A-Za-z0-9_.-]", "", "_".join(e.split("=")[-1] for e in extra))
    run_dir = out / f"{next(RUNS)}-{name}-{layers}"  # (no [ ] in a Hydra override's value)
    cmd = [sys.executable, str(ROOT / "train.py"), *BASE, *extra, *steps]
    cmd += [f"model.kwargs.n_layers={layers}", f"hydra.run.dir={run_dir}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    row: dict = {"ok": proc.returncode == 0, "rc": proc.returncode}
    if (run_dir / "summary.json").exists():
        s = json.loads((run_dir / "summary.json").read_text())
        row.update(peak_gib=s["peak_mem_gib"], after_step_gib=s.get("after_step_gib"))
        sps = s.get("samples_per_s")
        row.update(step_ms=1000 * s["batch"] / sps if sps else None, error=s.get("error"))
        row.update(breakdown=s.get("memory_breakdown"))
    elif proc.returncode:
        lines = (proc.stderr + proc.stdout).strip().splitlines()
        row["error"] = next((x for x in reversed(lines) if "error" in x.lower()), "")[:300]
    print(f"  {layers:3d} layers {extra}: {row} ({time.monotonic() - t0:.0f} s)", flush=True)
    return {"layers": layers, **row}


def deepest(extra: list[str], out: Path) -> dict:
    small, large = probe(extra, 2, out), probe(extra, 6, out)
    probes = [small, large]
    if not (small["ok"] and large["ok"]):
        return {"probes": probes, "max_layers": 0 if not small["ok"] else 2}
    per_layer = (large["peak_gib"] - small["peak_gib"]) / 4
    fixed = small["peak_gib"] - 2 * per_layer
    guess = max(7, math.floor((CAP_GIB * 0.98 - fixed) / per_layer))
    best, layers = 6, guess
    while layers > 6 and layers > guess - 3:  # the fit is good to a layer or two
        probes.append(p := probe(extra, layers, out))
        if p["ok"]:
            best = layers
            for more in range(layers + 1, layers + 4):  # up while it still fits
                probes.append(p := probe(extra, more, out))
                if not p["ok"]:
                    break
                best = more
            break
        layers -= 1
    return {
        "probes": probes,
        "gib_per_layer": per_layer,
        "gib_fixed": fixed,
        "max_layers": best,
        "max_params_b": params(best) / 1e9,
    }


def breakdown(args) -> None:
    """Each technique's peak in its parts beside its baseline's (5 processes at a time: each
    capped at 24 GiB; memory is what they measure, which neighbours do not change)."""
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    with ThreadPoolExecutor(1 if args.serial else 5) as pool:
        found = pool.map(lambda t: probe(t[2], BREAKDOWN_LAYERS, args.runs, memory=True), BREAKDOWN)
        for (name, _, _), row in zip(BREAKDOWN, found):
            result["rows"][name] = row
    args.out.write_text(json.dumps(result, indent=1))
    print(breakdown_table(result["rows"]))


def breakdown_table(rows: dict) -> str:
    """GiB per part, and under each technique the change against its baseline's part."""
    head = "| technique (against) | peak | " + " | ".join(p.replace("_", " ") for p in PARTS)
    out = [head + " | reserve |", "|---" * (len(PARTS) + 3) + "|"]
    for name, base, _ in BREAKDOWN:
        b = rows.get(name, {}).get("breakdown")
        if not b or b.get("peak") is None:
            out.append(f"| {name} | {rows.get(name, {}).get('error') or 'no breakdown'} |")
            continue
        ref = (rows.get(base or "", {}) or {}).get("breakdown") or {}
        cells = []
        for part in ("peak", *PARTS, "reserve"):
            v, r = b.get(part), ref.get(part)
            cell = "-" if v is None else f"{v:.2f}"
            if base and v is not None and r is not None and abs(v - r) >= 0.005:
                cell += f" ({v - r:+.2f})"
            cells.append(cell)
        out.append(f"| {name}{f' ({base})' if base else ''} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("fits_24gb.json"))
    ap.add_argument("--runs", type=Path, default=Path("/tmp/mixprec-fits"))
    ap.add_argument("--serial", action="store_true", help="one technique at a time")
    ap.add_argument("--breakdown", action="store_true", help="each technique's parts, 6 layers")
    args = ap.parse_args()
    if args.breakdown:
        return breakdown(args)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    t0 = time.monotonic()
    with ThreadPoolExecutor(1 if args.serial else len(TECHNIQUES)) as pool:
        found = pool.map(lambda extra: deepest(extra, args.runs), TECHNIQUES.values())
        for name, row in zip(TECHNIQUES, found):
            result["rows"][name] = row
            args.out.write_text(json.dumps(result, indent=1))
    result["search_s"] = round(time.monotonic() - t0)
    print(f"searched in {result['search_s']} s", flush=True)
    print("\n| technique | deepest that trains | weights | GiB per layer | fixed GiB |")
    print("|---|---|---|---|---|")
    for name, r in result["rows"].items():
        print(
            f"| {name} | {r['max_layers']} layers | {r.get('max_params_b', 0):.2f} B | "
            f"{r.get('gib_per_layer', float('nan')):.2f} | {r.get('gib_fixed', float('nan')):.2f} |"
        )
    amp = probe(TECHNIQUES["amp"], 6, args.runs, timed=True)
    ckpt = probe(TECHNIQUES["amp + checkpointing"], 6, args.runs, timed=True)
    if amp.get("step_ms") and ckpt.get("step_ms"):
        result["checkpointing_6_layers"] = {
            "amp": amp,
            "amp + checkpointing": ckpt,
            "step_time_ratio": ckpt["step_ms"] / amp["step_ms"],
            "peak_ratio": ckpt["peak_gib"] / amp["peak_gib"],
        }
        print(f"\ncheckpointing at 6 layers (amp): {result['checkpointing_6_layers']}")
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

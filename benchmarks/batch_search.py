"""batch=auto against an independent bisection, on one GPU under an emulated card.

    python benchmarks/batch_search.py                 # ResNet-50 224^2, hardware=rtx3090 (24 GiB)

For each configuration: (1) `train.py ... batch=auto` (no cache) searches, then trains 50 steps at
the batch it chose; (2) a separate plain-PyTorch bisection (own code, fresh process, the same
memory cap) finds the true largest batch to a step of 8. Prints both, the ratio and the search time.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "fp32": ["precision=fp32"],
    "amp": ["precision=amp"],
    "amp+ckpt": ["precision=amp", "model.grad_checkpointing=true"],
    "bf16": ["precision=bf16"],
}


def true_max(precision: str, ckpt: bool, cap_gib: float) -> int:
    """Plain loop, doubling from 64 then bisecting to 8 (not mixprec's search code)."""
    import timm
    import torch
    import torch.nn.functional as F

    total = torch.cuda.get_device_properties(0).total_memory / 1024**3
    torch.cuda.set_per_process_memory_fraction(cap_gib / total)
    torch.backends.cudnn.benchmark = True
    dtype = {"fp32": None, "amp": torch.float16, "bf16": torch.bfloat16}[precision]

    def fits(b: int) -> bool:
        try:
            model = timm.create_model("resnet50", num_classes=1000).cuda()
            if ckpt:
                model.set_grad_checkpointing(True)
            opt = torch.optim.SGD(
                model.parameters(), lr=1e-6, momentum=0.9, nesterov=True, fused=True
            )
            scaler = torch.amp.GradScaler("cuda", enabled=dtype is torch.float16)
            x = torch.randn(b, 3, 224, 224, device="cuda")
            y = torch.randint(0, 1000, (b,), device="cuda")
            for _ in range(3):
                with torch.autocast(
                    "cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None
                ):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            model = opt = x = y = None  # noqa: F841
            import gc

            gc.collect()
            torch.cuda.empty_cache()

    lo, hi = 0, 64
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 8:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="fp32,amp,amp+ckpt")
    ap.add_argument("--hardware", default="rtx3090")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "batch_search.json")
    a = ap.parse_args()
    import torch
    from omegaconf import OmegaConf

    cap = OmegaConf.load(ROOT / "conf" / "hardware" / f"{a.hardware}.yaml").memory_gib
    rows = []
    for name in a.configs.split(","):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            proc = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "train.py"),
                    "experiment=resnet50_synthetic",
                    f"hardware={a.hardware}",
                    *CONFIGS[name],
                    "batch=auto",
                    "batch_search.cache=null",
                    "trainer.max_steps=50",
                    "logger=none",
                    f"hydra.run.dir={d}",
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - t0
            log = proc.stdout + proc.stderr
            s = json.loads((Path(d) / "summary.json").read_text())
        m = re.search(
            r"batch=auto: largest micro-batch that trains is (\d+) \(searched, ([\d.]+)s\)", log
        )
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import batch_search as b; "
            f"print(b.true_max({CONFIGS[name][0].split('=')[1]!r}, {'ckpt' in name}, {cap}))"
        )
        tm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        true = int(tm.stdout.strip().splitlines()[-1]) if tm.returncode == 0 else None
        row = {
            "config": name,
            "auto_found": int(m.group(1)) if m else None,
            "search_s": float(m.group(2)) if m else None,
            "chosen_batch": s["batch"],
            "status_after_50_steps": s["status"],
            "steps": s["steps"],
            "samples_per_s": s["samples_per_s"],
            "peak_mem_gib": s["peak_mem_gib"],
            "true_max": true,
            "train_py_wall_s": round(wall, 1),
        }
        row["found_vs_true"] = row["auto_found"] / true if true and row["auto_found"] else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "hardware": a.hardware,
                    "cap_gib": cap,
                    "rows": rows,
                },
                indent=2,
            )
        )
    base = next((r for r in rows if r["config"] == "fp32"), None)
    print(
        "\n| config | batch=auto found | true max (bisect, step 8) | found/true | chosen (5% margin) | search s | 50 steps | img/s | peak GiB | max batch vs fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = (
            f"{r['auto_found'] / base['auto_found']:.2f}x"
            if base and base["auto_found"] and r["auto_found"]
            else "-"
        )
        print(
            f"| {r['config']} | {r['auto_found']} | {r['true_max']} | {r['found_vs_true'] or 0:.3f} | "
            f"{r['chosen_batch']} | {r['search_s']} | {r['status_after_50_steps']} | "
            f"{r['samples_per_s'] or 0:.0f} | {r['peak_mem_gib']:.1f} | {ratio} |"
        )


if __name__ == "__main__":
    main()

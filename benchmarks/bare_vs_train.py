"""train.py against a bare PyTorch loop doing the same work, side by side in one run.

    python benchmarks/bare_vs_train.py --preset cpu     # digits CNN on this CPU, fp32
    python benchmarks/bare_vs_train.py --preset gpu     # ResNet-50 224^2 synthetic, batch 256

Each measurement is a fresh process (bare and train.py alike), warm-up steps excluded, the GPU
synchronised at the timing boundaries; repeats alternate bare/train.py and the median is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRESETS = {
    "cpu": dict(precisions=["fp32"], batch=64, steps=300, warmup=30, repeats=3,
                train_args=["hardware=cpu"]),
    "gpu": dict(precisions=["fp32", "amp", "bf16"], batch=256, steps=60, warmup=15, repeats=3,
                train_args=["experiment=resnet50_synthetic"]),
}


def bare(preset: str, precision: str, batch: int, steps: int, warmup: int) -> dict:
    """The seeds' plain loop: autocast + GradScaler + SGD, nothing else."""
    import timm
    import torch
    import torch.nn.functional as F

    import mixprec.models  # noqa: F401  (registers mixprec_digits_cnn with timm)
    from mixprec.precision import set_tf32

    cuda = preset == "gpu"
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = cuda
    set_tf32(precision != "fp32")
    dtype = {"fp32": None, "tf32": None, "amp": torch.float16, "bf16": torch.bfloat16}[precision]
    if cuda:
        model = timm.create_model("resnet50", num_classes=1000).to(device)
        data = [(torch.randn(batch, 3, 224, 224, device=device),
                 torch.randint(0, 1000, (batch,), device=device))]
        batches = lambda: iter(data * 10**9)  # noqa: E731  (the same batch every step)
    else:
        from torch.utils.data import DataLoader, TensorDataset

        from mixprec.config import DataConfig
        from mixprec.data.digits import tensors
        x, y, _, _ = tensors(DataConfig())
        model = timm.create_model("mixprec_digits_cnn", num_classes=10, in_chans=1).to(device)
        model(x[:1])  # materialise the lazy head
        loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True)
        batches = lambda: (b for _ in range(10**9) for b in loader)  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                          weight_decay=5e-5, **({"fused": True} if cuda else {}))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    it = batches()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(warmup + steps):
        if step == warmup:
            sync()
            t0 = time.perf_counter()
        x, y = next(it)
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    sync()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 1024**3 if cuda else None
    return {"samples_per_s": steps * batch / dt, "peak_mem_gib": peak}


def via_train_py(preset: str, precision: str, batch: int, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        args = [sys.executable, str(ROOT / "train.py"), *PRESETS[preset]["train_args"],
                f"precision={precision}", f"batch={batch}", "logger=none",
                f"trainer.max_steps={warmup + steps}", f"trainer.perf_warmup_steps={warmup}",
                f"hydra.run.dir={d}"]
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"train.py failed:\n{proc.stderr[-3000:]}")
        s = json.loads((Path(d) / "summary.json").read_text())
    return {"samples_per_s": s["samples_per_s"], "peak_mem_gib": s["peak_mem_gib"]}


def in_subprocess(preset, precision, batch, steps, warmup) -> dict:
    code = (f"import json,sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            f"import bare_vs_train as b; print(json.dumps(b.bare({preset!r}, {precision!r}, "
            f"{batch}, {steps}, {warmup})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--precisions", help="comma list, e.g. fp32,amp,bf16")
    ap.add_argument("--out", type=Path, help="JSON results file")
    a = ap.parse_args()
    p = dict(PRESETS[a.preset])
    repeats = a.repeats or p["repeats"]
    precisions = a.precisions.split(",") if a.precisions else p["precisions"]
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    meta = {"date": time.strftime("%Y-%m-%d"), "device": gpu, "torch": torch.__version__,
            "preset": a.preset, "batch": p["batch"], "steps": p["steps"], "warmup": p["warmup"],
            "repeats": repeats, "command": " ".join([Path(sys.executable).name, *sys.argv])}
    out = a.out or ROOT / "benchmarks" / "results" / f"bare_vs_train-{a.preset}-{meta['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for prec in precisions:
        runs = {"bare": [], "train.py": []}
        for r in range(repeats):
            for name, fn in (("bare", in_subprocess), ("train.py", via_train_py)):
                res = fn(a.preset, prec, p["batch"], p["steps"], p["warmup"])
                runs[name].append(res)
                print(f"  {prec} repeat {r + 1}/{repeats} {name:8s} "
                      f"{res['samples_per_s']:9.1f} samples/s", flush=True)
        med = {k: statistics.median(x["samples_per_s"] for x in v) for k, v in runs.items()}
        rows.append({"precision": prec, "bare_samples_per_s": med["bare"],
                     "train_samples_per_s": med["train.py"], "ratio": med["train.py"] / med["bare"],
                     "bare_peak_gib": runs["bare"][0]["peak_mem_gib"],
                     "train_peak_gib": runs["train.py"][0]["peak_mem_gib"], "runs": runs})
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))  # after every row
    print(f"\n{meta['date']} {gpu} torch {torch.__version__}, preset {a.preset}, batch "
          f"{p['batch']}, {p['steps']} timed steps after {p['warmup']}, median of {repeats}")
    print("| precision | bare loop samples/s | train.py samples/s | train.py / bare |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['bare_samples_per_s']:.1f} | {r['train_samples_per_s']:.1f} "
              f"| {r['ratio']:.3f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

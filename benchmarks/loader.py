"""Can the input pipeline keep up with the GPU? Loader throughput on generated ImageNet-sized JPEGs
next to the GPU's ResNet-50 training rate, measured in one run.

    python3 benchmarks/loader.py                     # 10,000 JPEGs, 16 workers, batch 256
    python3 benchmarks/loader.py --no-train          # loader rates only

Each row reports its overall rate and the median of its 10-batch (10-step) windows: a 10,000-image
folder restarts its epoch every 39 batches (and train.py evaluates then), which a real dataset's
5,000-batch epochs do not; the median leaves those restarts out.

Rows: (1) the loader alone, each `data.decode` path (workers: decode + RandomResizedCrop in
DataLoader workers; device: workers read bytes, nvJPEG decodes on the GPU), images/s delivered
on the GPU as normalised float batches; (2) train.py on synthetic data (the GPU's rate, no input
pipeline); (3) train.py end to end on the JPEG folder with each decode path. The JPEGs sit in
the page cache (a warm dataset): disk speed is not measured.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(500, 375), (375, 500), (500, 333), (500, 400), (640, 480), (400, 300)]  # ImageNet-like


def _jpeg(args) -> int:
    import numpy as np
    from PIL import Image
    path, seed = args
    rng = np.random.default_rng(seed)
    w, h = SIZES[seed % len(SIZES)]
    small = Image.fromarray(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8))
    img = np.asarray(small.resize((w, h), Image.BICUBIC), dtype=np.float32)
    img += rng.normal(0, 8, img.shape)  # texture: photo-like file sizes
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    return os.path.getsize(path)


def make_jpegs(root: Path, n_train: int, n_val: int, classes: int, workers: int) -> dict:
    jobs = []
    for split, n in (("train", n_train), ("val", n_val)):
        for i in range(n):
            d = root / split / f"c{i % classes:03d}"
            d.mkdir(parents=True, exist_ok=True)
            jobs.append((d / f"{i}.jpg", i + (0 if split == "train" else 10**6)))
    with Pool(workers) as pool:
        sizes = pool.map(_jpeg, jobs, chunksize=64)
    return {"images": len(sizes), "mean_kb": sum(sizes) / len(sizes) / 1024}


def loader_rate(root: Path, decode: str, batch: int, workers: int, batches: int) -> dict:
    import torch
    from mixprec import data
    from mixprec.config import compose_config, validate
    c = validate(compose_config(["data=imagenet", f"data.root={root}", f"data.decode={decode}",
                                 "hardware=h200", f"hardware.num_workers={workers}"]))
    hw = c.hardware
    workers_ = data.Workers(hw.num_workers, hw.pin_memory, hw.persistent_workers)
    d = data.build(c.data, data.Context(batch, torch.device("cuda"), 0, channels_last=True,
                                        workers=workers_))

    def epochs():  # as training sees them: epoch after epoch (10,000 JPEGs are 39 batches)
        for epoch in itertools.count():
            d.train.set_epoch(epoch)
            yield from d.train

    it, warmup = epochs(), 20  # the first batches include the workers' start
    for _ in range(warmup):
        next(it)
    torch.cuda.synchronize()
    t0, n, marks = time.perf_counter(), 0, []
    for x, _ in it:
        n += 1
        if n % 10 == 0:  # windows of 10 batches: their median leaves out the epoch restarts
            torch.cuda.current_stream().synchronize()
            marks.append(time.perf_counter())
        if n == batches:
            break
    x.sum().item()  # the last batch really arrived
    dt = time.perf_counter() - t0
    it.close()
    d.close()  # stop the 16 workers now (at exit torch 2.11 would wait 5 s for each)
    windows = [10 * batch / (b - a) for a, b in zip([t0, *marks], marks)]
    return {"decode": decode, "batches": n, "images_per_s": n * batch / dt,
            "median_window_images_per_s": statistics.median(windows)}


def train_rate(extra: list[str], steps: int, warmup: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, str(ROOT / "train.py"), "model=resnet50", "precision=amp",
               "model.channels_last=true", "batch=256", "logger=none", f"hydra.run.dir={d}",
               f"trainer.max_steps={steps}", f"trainer.perf_warmup_steps={warmup}",
               "trainer.log_every=10", *extra]
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:  # keep what it logged: where did the time go?
            log = (Path(d) / "train.log").read_text() if (Path(d) / "train.log").exists() else ""
            return {"args": extra, "error": f"timed out after {timeout:.0f}s",
                    "log_head": log[:2500], "log_tail": log[-2500:]}
        if p.returncode:
            return {"args": extra, "error": p.stderr[-2000:]}
        s = json.loads((Path(d) / "summary.json").read_text())
        rows = [json.loads(r) for r in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        head = (Path(d) / "train.log").read_text()[:1500]  # start-up: where the time goes
    windows = [r["perf/samples_per_s"] for r in rows
               if "perf/samples_per_s" in r and r["step"] > warmup]
    return {"args": extra, "samples_per_s": s["samples_per_s"],
            "median_window_samples_per_s": statistics.median(windows) if windows else None,
            "peak_mem_gib": s["peak_mem_gib"], "wall_s": round(time.perf_counter() - t0, 1),
            "log_head": head}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=100, help="timed loader-only batches")
    ap.add_argument("--train-steps", type=int, default=400,
                    help="end-to-end steps: long enough to drain the workers' prefetch buffer")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per train.py run")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "loader.json")
    a = ap.parse_args()
    import torch
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cpu_cores": os.cpu_count(), "workers": a.workers,
            "batch": a.batch, "command": " ".join(["python3", *sys.argv])}
    rows: list[dict] = []

    def save(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "jpegs"
        t0 = time.perf_counter()
        meta["dataset"] = make_jpegs(root, a.images, 50 * 10, 10, a.workers)
        meta["dataset"]["generate_s"] = round(time.perf_counter() - t0, 1)
        print(meta["dataset"], flush=True)
        for decode in ("workers", "device"):
            save({"row": f"loader only, decode={decode}",
                  **loader_rate(root, decode, a.batch, a.workers, a.batches)})
        if not a.no_train:
            save({"row": "train.py, synthetic data (GPU rate)",
                  **train_rate(["data=synthetic"], 60, 15, a.timeout)})
            for decode in ("workers", "device"):
                save({"row": f"train.py, JPEG folder, decode={decode}",
                      **train_rate(["data=imagenet", f"data.root={root}", f"data.decode={decode}",
                                    f"hardware.num_workers={a.workers}"],
                                   a.train_steps, a.train_steps // 2, a.timeout)})
    print(f"\n{meta['date']} {meta['gpu']}, torch {meta['torch']}, {a.workers} workers, "
          f"batch {a.batch}, {meta['dataset']['images']} JPEGs of {meta['dataset']['mean_kb']:.0f} KB")
    print("| path | images/s overall | median 10-step window (no epoch restarts) |\n|---|---|---|")
    for r in rows:
        rate = r.get("images_per_s") or r.get("samples_per_s")
        med = r.get("median_window_images_per_s") or r.get("median_window_samples_per_s")
        print(f"| {r['row']} | {rate:,.0f} | {med:,.0f} |" if rate and med
              else f"| {r['row']} | {r.get('error', 'error')[:60]} | |")


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

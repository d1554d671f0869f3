"""Can the input pipeline keep up with the GPU? Every data path of `data=imagenet` next to the GPU's
rate on synthetic data, measured in one run on generated ImageNet-sized JPEGs.

    python3 benchmarks/loader.py                          # every row (about 15 min on one H200)
    python3 benchmarks/loader.py --rows core,loader       # the CPU ceiling and the loader alone
    python3 benchmarks/loader.py --rows eager --images 20000
    python3 benchmarks/loader.py --rows fast --overrides model.compile_mode=max-autotune

Rows (--rows, comma-separated groups):
- core:   the CPU decode ceiling: images/s on one core of what a worker does per image
          (decode + RandomResizedCrop + flip), for the original JPEGs and the prepared copy;
- handoff: the loader's ceiling with nothing to decode (workers hand over ready uint8 crops):
          shared memory, pinning, the copy to the GPU and the normalisation alone (the busiest
          thread of the training process near 1.0 core: the serial part);
- loader: the training loader alone, 150 batches across epochs, images/s delivered on the GPU as
          normalised float batches, per path (original or prepared copy; decode in workers or
          on the GPU with nvJPEG); `loader-original` or `loader-prepared` for one path only,
          `loader-workers` for the prepared copy with 4 and 2 fewer workers than --workers;
          each loader row also says where the CPU went (cores busy, the workers' cores, the
          busiest threads of the training process);
- eager:  train.py, ResNet-50 amp channels_last batch 256: synthetic data, the original JPEGs,
          the prepared copy (decoded by the workers, and by nvJPEG);
- fast:   train.py experiment=fast (compiled, batch 512): synthetic, the prepared copy (and the
          original JPEGs with the group `fast-original`).
Each train.py row runs whole epochs (3 by default) of a folder with >= 100 steps per epoch and
reports summary.json's samples_per_s (every training step after the warm-up, epoch boundaries
included; evaluation excluded) and the median of its 10-step windows (inside an epoch), each as a
ratio to the synthetic row of the same config. The JPEGs sit in the page cache (a warm dataset):
disk speed is not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(500, 375), (375, 500), (500, 333), (500, 400), (640, 480), (400, 300)]  # ImageNet-like
EAGER = ["model=resnet50", "precision=amp", "model.channels_last=true", "batch=256"]
FAST = ["experiment=fast"]


def photo(rng, w: int, h: int, contrast: float = 1.0, grid: tuple[int, int] = (6, 8)):
    """A photo-like float image (h, w, 3): a bicubic blow-up of a few random pixels (its
    contrast scaled about mid-grey) with sensor-like noise, which gives photo-like JPEG sizes."""
    import numpy as np
    from PIL import Image

    small = Image.fromarray(rng.integers(0, 255, (*grid, 3), dtype=np.uint8))
    img = np.asarray(small.resize((w, h), Image.BICUBIC), dtype=np.float32)
    return 128 + contrast * (img - 128) + rng.normal(0, 8, img.shape)


def _jpeg(args) -> int:
    import numpy as np
    from PIL import Image

    path, seed = args
    rng = np.random.default_rng(seed)
    img = photo(rng, *SIZES[seed % len(SIZES)])
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    return os.path.getsize(path)


def make_jpegs(root: Path, n_train: int, n_val: int, classes: int, workers: int) -> dict:
    jobs = []
    for split, n in (("train", n_train), ("val", n_val)):
        for i in range(n):
            d = root / split / f"c{i % classes:03d}"
            d.mkdir(parents=True, exist_ok=True)
            jobs.append((d / f"{i}.jpg", i + (0 if split == "train" else 10**7)))
    with Pool(workers) as pool:
        sizes = pool.map(_jpeg, jobs, chunksize=64)
    return {"images": len(sizes), "mean_kb": round(sum(sizes) / len(sizes) / 1024, 1)}


def core_rate(root: Path, n: int = 800) -> dict:
    """One core's images/s of a worker's work (decode + RandomResizedCrop(224) + flip)."""
    import torch

    from mixprec.data.imagenet import train_transform
    from mixprec.data.images import CheckedImageFolder, read_image

    torch.set_num_threads(1)  # as in a DataLoader worker
    ds = CheckedImageFolder(root / "train", train_transform(224), False)
    for i in range(50):  # warm: page cache, allocator
        ds[i]
    t0 = time.perf_counter()
    for i in range(50, 50 + n):
        ds[i]
    full = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(50, 50 + n):
        read_image(ds.samples[i][0])
    return {
        "images_per_s_per_core": round(full),
        "decode_only_per_core": round(n / (time.perf_counter() - t0)),
    }


def loader_rate(root: Path, decode: str, batch: int, workers: int, batches: int) -> dict:
    import torch

    from mixprec import data
    from mixprec.run.config import compose_config, validate

    c = validate(
        compose_config(
            [
                "data=imagenet",
                f"data.root={root}",
                f"data.decode={decode}",
                "hardware=h200",
                f"hardware.num_workers={workers}",
            ]
        )
    )
    hw = c.hardware
    d = data.build(
        c.data,
        data.Context(
            batch,
            torch.device("cuda"),
            0,
            channels_last=True,
            workers=data.Workers(hw.num_workers, hw.pin_memory, hw.persistent_workers),
        ),
    )

    def epochs():  # as training sees them: epoch after epoch
        epoch = 0
        while True:
            d.train.set_epoch(epoch)
            yield from d.train
            epoch += 1

    row = timed(epochs(), batch, batches)
    d.close()
    return row


def cpu_ticks() -> dict:
    """CPU ticks so far: busy and idle over the cores this process may use, each thread of this
    process, and this process's children (the loader workers)."""
    cores, busy, idle = os.sched_getaffinity(0), 0, 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *v = line.split()
        if name[3:].isdigit() and int(name[3:]) in cores:
            v = [int(x) for x in v]
            idle += v[3] + v[4]
            busy += sum(v[:8]) - v[3] - v[4]

    def used(stat: str) -> int:  # utime + stime, after the "(comm)" field
        f = stat[stat.rindex(")") + 2 :].split()
        return int(f[11]) + int(f[12])

    threads, children = {}, 0
    for t in os.listdir("/proc/self/task"):
        try:
            threads[t] = used(Path(f"/proc/self/task/{t}/stat").read_text())
        except OSError:
            pass
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == os.getpid():
            children += used(stat)
    return {"busy": busy, "idle": idle, "threads": threads, "children": children}


def cpu_use(a: dict, b: dict, seconds: float) -> dict:
    """Where the CPU went between two cpu_ticks(): the share of the allowed cores that were busy,
    the workers' use in cores, and the busiest threads of this process in cores (a thread near
    1.0 is a serial ceiling: the DataLoader's pinning thread, the training loop)."""
    hz = os.sysconf("SC_CLK_TCK")
    busy, idle = b["busy"] - a["busy"], b["idle"] - a["idle"]
    top = sorted((b["threads"][t] - a["threads"].get(t, 0) for t in b["threads"]), reverse=True)
    return {
        "cores_busy": round(busy / max(1, busy + idle), 2),
        "workers_cores": round((b["children"] - a["children"]) / hz / seconds, 1),
        "main_threads_cores": [round(x / hz / seconds, 2) for x in top[:3]],
    }


def timed(it, batch: int, batches: int) -> dict:
    """Images/s of `batches` batches from `it` after 20 (the first include the workers' start),
    overall and the median of 10-batch windows, and where the CPU went; closes `it`."""
    import torch

    for _ in range(20):
        next(it)
    torch.cuda.synchronize()
    ticks = cpu_ticks()
    t0, n, marks = time.perf_counter(), 0, []
    for x, _ in it:  # noqa: B007  (the last batch is read after the loop)
        n += 1
        if n % 10 == 0:
            torch.cuda.current_stream().synchronize()
            marks.append(time.perf_counter())
        if n == batches:
            break
    x.sum().item()  # the last batch really arrived
    dt = time.perf_counter() - t0
    cpu = cpu_use(ticks, cpu_ticks(), dt)
    it.close()
    windows = [10 * batch / (b - a) for a, b in zip([t0, *marks], marks)]
    return {
        "images_per_s": round(n * batch / dt),
        "median_window": round(statistics.median(windows)),
        **cpu,
    }


class _Ready:
    """A dataset whose samples are ready uint8 crops (no file, no decode): what is left of the
    loader is the hand-off (worker -> shared memory -> pinning -> GPU copy -> normalise)."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i):
        import torch

        return torch.full((3, 224, 224), i % 251, dtype=torch.uint8), i % 100


def handoff_rate(batch: int, workers: int, batches: int) -> dict:
    """The loader's ceiling without decoding: ready crops through the same EpochLoader."""
    import torch

    from mixprec import data
    from mixprec.data.imagenet import STATS
    from mixprec.data.images import loaders

    ctx = data.Context(
        batch,
        torch.device("cuda"),
        0,
        channels_last=True,
        workers=data.Workers(workers, True, True),
    )
    train, _ = loaders(_Ready(), _Ready(), ctx, STATS)
    train.set_epoch(0)
    row = timed(iter(train), batch, batches)
    train.close()
    return row


def train_rate(args: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable,
            str(ROOT / "train.py"),
            "logger=none",
            f"hydra.run.dir={d}",
            "trainer.log_every=10",
            *args,
        ]
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            log = (Path(d) / "train.log").read_text() if (Path(d) / "train.log").exists() else ""
            return {"error": f"timed out after {timeout:.0f}s", "log_tail": log[-2500:]}
        if p.returncode:
            why = [ln for ln in p.stderr.splitlines() if "Error" in ln or "Exception" in ln]
            return {
                "error": f"exit {p.returncode}",
                "error_line": why[-1][:500] if why else None,
                "stdout": p.stdout[-1500:],
                "stderr": p.stderr[-1500:],
            }
        s = json.loads((Path(d) / "summary.json").read_text())
        rows = [json.loads(r) for r in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    warm = next((int(a.split("=")[1]) for a in args if "perf_warmup_steps" in a), 5)
    windows = [
        r["perf/samples_per_s"] for r in rows if r.get("perf/samples_per_s") and r["step"] > warm
    ]
    first = re.search(r"first step took ([0-9.]+)s", p.stdout + p.stderr)
    return {
        "samples_per_s": round(s["samples_per_s"]),
        "first_step_s": float(first.group(1)) if first else None,
        "median_window": round(statistics.median(windows)) if windows else None,
        "steps": s["steps"],
        "val_acc1": s.get("val_acc1"),
        "peak_mem_gib": s["peak_mem_gib"],
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--images",
        type=int,
        default=52_000,
        help="training JPEGs (>= 100 steps per epoch at batch 512)",
    )
    ap.add_argument("--val", type=int, default=1_000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--short-side", type=int, default=256, help="the prepared copy's")
    ap.add_argument("--epochs", type=int, default=3, help="train.py rows: whole epochs")
    ap.add_argument("--rows", default="core,handoff,loader,eager,fast")
    ap.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds per train.py run "
        "(experiment=fast's first compile: 1-2 min; 3-5 min with its kernel tuning on)",
    )
    ap.add_argument(
        "--overrides",
        nargs="*",
        default=[],
        help="train.py overrides added to every train.py row, e.g. model.compile_mode=max-autotune",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "loader.json")
    a = ap.parse_args()
    import torch

    from mixprec import prepare

    groups = set(a.rows.split(","))
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cpu_cores": len(os.sched_getaffinity(0)),
        "workers": a.workers,
        "command": " ".join(["python3", *sys.argv]),
    }
    rows: list[dict] = []

    def save(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        raw, small = Path(tmp) / "jpegs", Path(tmp) / f"jpegs-{a.short_side}"
        t0 = time.perf_counter()
        meta["dataset"] = make_jpegs(raw, a.images, a.val, a.classes, a.workers)
        meta["dataset"]["generate_s"] = round(time.perf_counter() - t0, 1)
        rec = prepare.prepare(
            raw, small, prepare.Recipe(a.short_side, 90, False), a.workers, progress=False
        )
        meta["prepared"] = {k: rec[k] for k in ("short_side", "quality", "images", "seconds")}
        meta["prepared"]["mean_kb"] = round(rec["bytes"] / rec["images"] / 1024, 1)
        print(meta, flush=True)
        prepared = f"prepared {a.short_side}"
        paths = {"original": raw, prepared: small}
        if "core" in groups:
            for name, root in paths.items():
                save({"row": f"one core, {name}", **core_rate(root)})
        if "handoff" in groups:
            save(
                {
                    "row": "loader alone, ready uint8 crops (no decode: the hand-off ceiling)",
                    **handoff_rate(256, a.workers, 150),
                }
            )
        for name, root in paths.items():
            if "loader" in groups or f"loader-{name.split()[0]}" in groups:
                for decode in ("workers", "device"):
                    save(
                        {
                            "row": f"loader alone, {name}, decode={decode}",
                            **loader_rate(root, decode, 256, a.workers, 150),
                        }
                    )
        if "loader-workers" in groups:  # fewer workers than cores: room for the main process
            for w in (a.workers - 4, a.workers - 2):
                save(
                    {
                        "row": f"loader alone, {prepared}, decode=workers, {w} workers",
                        **loader_rate(small, "workers", 256, w, 150),
                    }
                )
        per_epoch = {"eager": a.images // 256, "fast": a.images // 512}
        runs = {
            "eager": [("original", "workers"), (prepared, "workers"), (prepared, "device")],
            "fast": [
                (prepared, "workers"),
                *([("original", "workers")] if "fast-original" in groups else []),
            ],
        }
        for group, base in (("eager", EAGER), ("fast", FAST)):
            if group not in groups:
                continue
            common = [
                *base,
                f"trainer.epochs={a.epochs}",
                "trainer.max_steps=null",
                "trainer.min_steps=0",
                "trainer.perf_warmup_steps=30",
                *a.overrides,
            ]
            synth = train_rate(
                [
                    *common,
                    "data=synthetic",
                    f"data.num_classes={a.classes}",
                    f"data.steps_per_epoch={per_epoch[group]}",
                ],
                a.timeout,
            )
            save({"row": f"{group}: train.py, synthetic data", **synth})
            for name, decode in runs[group]:
                r = train_rate(
                    [
                        *common,
                        "data=imagenet",
                        f"data.root={paths[name]}",
                        f"data.decode={decode}",
                        f"hardware.num_workers={a.workers}",
                    ],
                    a.timeout,
                )
                for k in ("samples_per_s", "median_window"):
                    if r.get(k) and synth.get(k):
                        r[f"{k}_vs_synthetic"] = round(r[k] / synth[k], 3)
                save({"row": f"{group}: train.py, {name}, decode={decode}", **r})
    print(
        f"\n{meta['date']} {meta['gpu']}, torch {meta['torch']}, {meta['cpu_cores']} cores, "
        f"{a.workers} workers, {meta['dataset']['images']} JPEGs of "
        f"{meta['dataset']['mean_kb']:.0f} KB; prepared copy {meta['prepared']['mean_kb']:.0f} KB"
    )
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

"""Does a path that changes pixels change accuracy? The same training on a generated JPEG folder
whose classes carry real visual signal, read in its original form and as a prepared copy
(python -m mixprec.prepare), and decoded on the GPU (nvJPEG, its own resize).

    python3 benchmarks/prepared_accuracy.py              # ResNet-18, 224x224, 8 epochs, seeds 0 and 1

The folder: scikit-learn's handwritten digits (1,797 real 8x8 scans), each drawn several times
into an ImageNet-sized photo-like JPEG (500x375 to 640x480, quality 90) at a random place, size
(70-95 % of the shorter side) and contrasting colour on a muted textured background. The first 1,400
digits make the training images, the other 397 the validation images (digits never seen in
training). train.py with RandomResizedCrop + flip, as for ImageNet; val top-1 per path and seed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader import SIZES, photo, train_rate  # noqa: E402


def _draw(args) -> None:
    import numpy as np
    from PIL import Image

    path, digit, seed = args
    rng = np.random.default_rng(seed)
    w, h = SIZES[seed % len(SIZES)]
    img = photo(rng, w, h, contrast=0.4, grid=(5, 6))
    side = int(min(w, h) * rng.uniform(0.7, 0.95))
    ink = Image.fromarray((digit * 255 / 16).astype(np.uint8)).resize((side, side), Image.BICUBIC)
    alpha = np.asarray(ink, dtype=np.float32)[..., None] / 255
    top, left = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
    patch = img[top : top + side, left : left + side]
    dark = patch.mean() > 128  # ink that stands out from the background under it
    colour = rng.integers(0, 70, 3).astype(np.float32) + (0 if dark else 185)
    img[top : top + side, left : left + side] = patch * (1 - alpha) + colour * alpha
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(path, quality=90)


def make_digit_folder(root: Path, copies: int, val_copies: int, workers: int) -> dict:
    from sklearn.datasets import load_digits

    digits = load_digits()
    jobs = []
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        split, n = ("train", copies) if i < 1400 else ("val", val_copies)
        d = root / split / str(label)
        d.mkdir(parents=True, exist_ok=True)
        jobs += [(d / f"{i}_{k}.jpg", image, 1000 * i + k) for k in range(n)]
    with Pool(workers) as pool:
        pool.map(_draw, jobs, chunksize=32)
    return {
        "train": sum(1 for j in jobs if "/train/" in str(j[0])),
        "val": sum(1 for j in jobs if "/val/" in str(j[0])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=8, help="training images per digit")
    ap.add_argument("--val-copies", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--short-side", type=int, default=256)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument(
        "--out", type=Path, default=ROOT / "outputs" / "bench" / "prepared_accuracy.json"
    )
    a = ap.parse_args()
    from mixprec import prepare

    # a stop (Ctrl-C, or SIGTERM from timeout or a scheduler) leaves no generated images behind:
    # both unwind through the TemporaryDirectory below, which removes them
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    meta = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python3", *sys.argv])}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        raw, small = Path(tmp) / "digits", Path(tmp) / f"digits-{a.short_side}"
        print(f"generating digit photos in {raw} ...", flush=True)
        meta["images"] = make_digit_folder(raw, a.copies, a.val_copies, a.workers)
        print(f"preparing a copy at short side {a.short_side} ...", flush=True)
        prepare.prepare(raw, small, prepare.Recipe(a.short_side, 90, False), a.workers, False)
        paths = [
            ("original", raw, "workers"),
            (f"prepared {a.short_side}", small, "workers"),
            ("original", raw, "device"),
        ]
        for seed in a.seeds.split(","):
            for name, root, decode in paths:
                print(f"seed {seed}: training on {name} ({decode}) ...", flush=True)
                r = train_rate(
                    [
                        "model=resnet18",
                        "precision=amp",
                        "model.channels_last=true",
                        "batch=256",
                        "data=imagenet",
                        f"data.root={root}",
                        f"data.decode={decode}",
                        f"hardware.num_workers={a.workers}",
                        f"trainer.epochs={a.epochs}",
                        "trainer.perf_warmup_steps=10",
                        f"seed={seed}",
                    ],
                    300,
                )
                rows.append({"path": name, "decode": decode, "seed": int(seed), **r})
                print(json.dumps(rows[-1]), flush=True)
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print("| path | decode | seed | val top-1 | img/s |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['path']} | {r['decode']} | {r['seed']} | {r.get('val_acc1')} | "
            f"{r.get('samples_per_s')} |"
        )


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

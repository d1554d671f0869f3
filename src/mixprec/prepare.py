"""A prepared copy of an ImageNet-style folder: every image re-encoded as a JPEG whose shorter side
is at most `--short-side` pixels (the approach of FFCV's dataset writer). The loader workers then
decode about half the pixels per image, and the copy is a fraction of the original's size (it
stays in the page cache). It changes pixels: benchmarks/RESULTS.md measures what that does to
speed and accuracy, and docs/real-data.md says when to use it.

    python -m mixprec.prepare /data/imagenet /data/imagenet-256
    python train.py data=imagenet data.root=/data/imagenet-256 ...

The copy is written next to DST and renamed into place when complete, so DST is either absent
or whole; DST/prepared.json records how it was made. Exit codes: 2 bad arguments, 4 an unreadable
image (with --bad-images fail, the default), 0 done."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing import Pool
from pathlib import Path

from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS
from tqdm import tqdm

from mixprec.core.errors import ConfigError, DataError, MixprecError
from mixprec.data.images import classes

log = logging.getLogger("mixprec.prepare")


@dataclass(frozen=True)
class Recipe:
    short_side: int  # the shorter side of every written image, at most (smaller ones keep theirs)
    quality: int  # JPEG quality of re-encoded images
    skip_bad: bool  # an unreadable image is left out (else the whole copy stops)


def shrink(src: Path, dst: Path, recipe: Recipe) -> tuple[int, int, str | None]:
    """Write src's prepared version to dst: (bytes read, bytes written, error or None). A JPEG
    already small enough is copied byte for byte; any other image is resized with an antialiased
    filter (after libjpeg's DCT-domain reduction where the image is much larger) and encoded."""
    size = 0
    try:
        size = src.stat().st_size  # a dangling symlink or a symlink loop fails here: unreadable
        with Image.open(src) as im:
            w, h = im.size
            scale = recipe.short_side / min(w, h)
            if scale >= 1 and im.format == "JPEG":
                shutil.copyfile(src, dst)
                return size, size, None
            target = (max(1, round(w * scale)), max(1, round(h * scale))) if scale < 1 else (w, h)
            im.draft("RGB", (2 * target[0], 2 * target[1]))  # decode at >= 2x the target: fast
            out = im.convert("RGB").resize(target, Image.Resampling.LANCZOS)
        out.save(dst, format="JPEG", quality=recipe.quality)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        return size, 0, f"{src} ({type(e).__name__}: {e})"
    return size, dst.stat().st_size, None


def _job(args) -> tuple[int, int, str | None]:
    return shrink(*args)


def plan(src: Path, tmp: Path) -> list[tuple[Path, Path]]:
    """(source image, destination) for every image of src/train and src/val, the class folders
    created under tmp. A non-JPEG keeps its name with .jpg appended (no clash with a JPEG)."""
    pairs = []
    for split in ("train", "val"):
        for name in classes(src / split):
            (tmp / split / name).mkdir(parents=True)
            for f in sorted((src / split / name).iterdir()):
                if f.suffix.lower() in IMG_EXTENSIONS:  # what ImageFolder reads
                    out = f.name if f.suffix.lower() in (".jpg", ".jpeg") else f.name + ".jpg"
                    pairs.append((f, tmp / split / name / out))
    return pairs


def prepare(src: Path, dst: Path, recipe: Recipe, workers: int, progress: bool = True) -> dict:
    """Write the prepared copy of src to dst (absent before, whole after); returns its record."""
    inside = [
        (a, b) for a, b in ((dst, src), (src, dst)) if a.resolve().is_relative_to(b.resolve())
    ]
    if inside:
        a, b = ("DST", "SRC") if inside[0][0] is dst else ("SRC", "DST")
        raise ConfigError(
            f"{a} {inside[0][0]} is inside {b} {inside[0][1]}: the copy would change its own "
            "source; choose a DST outside SRC"
        )
    if dst.exists() or dst.is_symlink():
        raise ConfigError(
            f"DST {dst} exists; remove it or choose another directory (the copy "
            "is written whole or not at all)"
        )
    tmp = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    t0, read, written, failed = time.perf_counter(), 0, 0, []
    try:
        pairs = plan(src, tmp)
        with Pool(workers) as pool:
            jobs = pool.imap_unordered(_job, ((s, d, recipe) for s, d in pairs), chunksize=32)
            for r, w, err in tqdm(
                jobs, total=len(pairs), desc="prepare", unit="img", disable=not progress
            ):
                read, written = read + r, written + w
                if err and not recipe.skip_bad:
                    raise DataError(
                        f"unreadable image {err}; fix or remove it, or pass --bad-images skip"
                    )
                if err:
                    failed.append(err)
                    log.warning("skipping unreadable image %s", err)
        record = {
            "source": str(src.resolve()),
            **asdict(recipe),
            "images": len(pairs) - len(failed),
            "skipped": failed,
            "source_bytes": read,
            "bytes": written,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        for path in (tmp / "train", tmp / "val"):  # a skipped image's folder may be empty now
            for d in path.iterdir():
                if not any(d.iterdir()):
                    raise DataError(
                        f"every image of class folder {d.name} ({path.name}) was "
                        "unreadable; the copy would lack that class"
                    )
        (tmp / "prepared.json").write_text(json.dumps(record, indent=2) + "\n")
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Recipe]:
    ap = argparse.ArgumentParser(
        prog="python -m mixprec.prepare", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "src", type=Path, help="an ImageNet-style folder: src/train/<class>/*, src/val/<class>/*"
    )
    ap.add_argument("dst", type=Path, help="where the copy goes (must not exist)")
    ap.add_argument(
        "--short-side",
        type=int,
        default=256,
        help="shorter side of every image, at most (default 256: data.eval_resize)",
    )
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality 1-95 (default 90)")
    ap.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every core)"
    )
    ap.add_argument(
        "--bad-images",
        choices=("fail", "skip"),
        default="fail",
        help="an unreadable image stops the copy (fail, exit 4) or is left out (skip)",
    )
    a = ap.parse_args(argv)
    if a.short_side < 8:
        raise ConfigError(f"--short-side={a.short_side}: must be >= 8")
    if not 1 <= a.quality <= 95:
        raise ConfigError(f"--quality={a.quality}: must be in 1..95 (PIL's JPEG range)")
    if a.workers < 1:
        raise ConfigError(f"--workers={a.workers}: must be >= 1")
    return a, Recipe(a.short_side, a.quality, a.bad_images == "skip")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        a, recipe = parse(argv)
        r = prepare(a.src, a.dst, recipe, a.workers, progress=sys.stderr.isatty())
    except MixprecError as e:
        log.error("%s: %s", e.label, e)
        return e.exit_code
    log.info(
        "prepared %d images in %.0f s: %.2f GB -> %.2f GB at %s (short side <= %d, quality %d)",
        r["images"],
        r["seconds"],
        r["source_bytes"] / 1e9,
        r["bytes"] / 1e9,
        a.dst,
        recipe.short_side,
        recipe.quality,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m mixprec.prepare: the prepared (resized, re-encoded) copy of an image folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_data import TINY

from mixprec import prepare
from mixprec.run import session as run

from conftest import run_module


def photo(w: int, h: int, seed: int) -> Image.Image:
    """A smooth, photo-like image (a bicubic blow-up of a few random pixels)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (5, 6, 3), dtype=np.uint8)).resize(
        (w, h), Image.BICUBIC
    )


def folder(root: Path) -> Path:
    for split in ("train", "val"):
        for k, c in enumerate(("cat", "dog")):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(4):
                photo(120, 90, 10 * k + i).save(d / f"{i}.jpg", quality=95)
            photo(40, 30, 99).save(d / "small.jpg", quality=95)  # already under the short side
            photo(100, 100, 7).save(d / "square.png")
    return root


def test_the_copy_has_every_image_at_the_short_side_and_trains(cfg_factory, tmp_path):
    src, dst = folder(tmp_path / "src"), tmp_path / "dst"
    assert prepare.main([str(src), str(dst), "--short-side", "48", "--workers", "2"]) == 0
    record = json.loads((dst / "prepared.json").read_text())
    assert record["images"] == 24 and record["short_side"] == 48 and record["quality"] == 90
    assert record["bytes"] < record["source_bytes"]
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            d = dst / split / c
            assert sorted(p.name for p in d.iterdir()) == [
                "0.jpg",
                "1.jpg",
                "2.jpg",
                "3.jpg",
                "small.jpg",
                "square.png.jpg",
            ]
            assert Image.open(d / "0.jpg").size == (64, 48)  # 120x90: aspect kept
            assert Image.open(d / "square.png.jpg").format == "JPEG"
            assert Image.open(d / "square.png.jpg").size == (48, 48)
            # small enough already: the very same bytes
            assert (d / "small.jpg").read_bytes() == (src / split / c / "small.jpg").read_bytes()
    summary = run.run(cfg_factory("data=imagenet", f"data.root={dst}", *TINY))
    assert summary["status"] == "completed" and summary["val_acc1"] is not None


def test_the_prepared_pixels_are_the_resized_original(tmp_path):
    """libjpeg's DCT-domain reduction + LANCZOS + quality 90 stays close to a plain LANCZOS
    resize of the decoded original (PSNR > 30 dB): what the copy changes is the resolution."""
    src = tmp_path / "a.jpg"
    photo(640, 480, 3).save(src, quality=95)
    dst = tmp_path / "b.jpg"
    prepare.shrink(src, dst, prepare.Recipe(160, 90, False))
    ours = np.asarray(Image.open(dst).convert("RGB"), dtype=np.float64)
    ref = np.asarray(
        Image.open(src).convert("RGB").resize((213, 160), Image.LANCZOS), dtype=np.float64
    )
    assert ours.shape == ref.shape == (160, 213, 3)
    psnr = 10 * np.log10(255**2 / np.mean((ours - ref) ** 2))
    assert psnr > 30, psnr


@pytest.mark.slow
def test_bad_input_exits_with_its_code_and_writes_nothing(tmp_path, caplog):
    src = folder(tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    cmd = [sys.executable, "-m", "mixprec.prepare", str(src), str(dst), "--workers", "1"]
    p = run_module("mixprec.prepare", cmd[3:])  # the exit code a shell sees
    assert p.returncode == 2 and f"DST {dst} exists" in p.stderr
    dst.rmdir()
    args = cmd[3:]
    assert prepare.main([*args, "--quality", "0"]) == 2
    assert "--quality=0" in caplog.text and not dst.exists()
    assert prepare.main([str(tmp_path / "nowhere"), str(dst)]) == 2
    assert "nowhere/train does not exist" in caplog.text

    (src / "train" / "cat" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    assert prepare.main(args) == 4
    assert "broken.jpg" in caplog.text and "--bad-images skip" in caplog.text
    assert not dst.exists() and [q.name for q in tmp_path.iterdir()] == ["src"]  # no partial dir
    assert prepare.main([*args, "--bad-images", "skip"]) == 0
    record = json.loads((dst / "prepared.json").read_text())
    assert record["images"] == 24 and len(record["skipped"]) == 1
    assert "broken.jpg" in record["skipped"][0]


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_dst_inside_src_is_refused_and_src_is_left_as_it_was(tmp_path, caplog):
    src = folder(tmp_path / "src")
    before = _tree(src)
    for dst in (src / "prepared", src / "train" / "copy", src):
        assert prepare.main([str(src), str(dst), "--workers", "1"]) == 2
        assert "inside" in caplog.text and not dst.joinpath("prepared.json").exists()
    assert prepare.main([str(src / "train" / ".."), str(src / "val" / ".." / "copy")]) == 2
    # and SRC inside DST's would-be tree: DST an ancestor of SRC
    assert prepare.main([str(src), str(tmp_path)]) == 2
    assert _tree(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.slow
def test_a_symlink_loop_or_a_dangling_symlink_is_an_unreadable_image(tmp_path, caplog):
    src, dst = folder(tmp_path / "src"), tmp_path / "dst"
    cat = src / "train" / "cat"
    (cat / "loop_a.jpg").symlink_to(cat / "loop_b.jpg")
    (cat / "loop_b.jpg").symlink_to(cat / "loop_a.jpg")
    cmd = [sys.executable, "-m", "mixprec.prepare", str(src), str(dst), "--workers", "2"]
    p = run_module("mixprec.prepare", cmd[3:])
    assert p.returncode == 4 and "loop_" in p.stderr and "Traceback" not in p.stderr
    assert not dst.exists()
    for f in ("loop_a.jpg", "loop_b.jpg"):
        (cat / f).unlink()
    (cat / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    assert prepare.main([str(src), str(dst), "--workers", "1"]) == 4
    assert "gone.jpg" in caplog.text and not dst.exists()
    assert prepare.main([str(src), str(dst), "--workers", "1", "--bad-images", "skip"]) == 0
    assert len(json.loads((dst / "prepared.json").read_text())["skipped"]) == 1

"""Real-data paths on generated files: ImageNet-style folders and CIFAR-format batches."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mixprec import run
from mixprec.config import ConfigError

TINY = ["model=resnet18", "batch=4", "trainer.max_steps=2", "data.image_size=32",
        "data.eval_resize=36"]


def make_folder(root: Path, classes=("cat", "dog"), n=6) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(d / f"{i}.jpg")
    return root


def test_imagenet_style_folder_trains_and_evaluates(cfg_factory, tmp_path):
    root = make_folder(tmp_path / "imgs")
    cfg = cfg_factory("data=imagenet", f"data.root={root}", *TINY)
    summary = run.run(cfg)
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["val_acc1"] is not None  # evaluated on the 12 val images
    rows = [json.loads(l) for l in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert any("val/acc1" in r for r in rows)


@pytest.mark.parametrize("damage,needle", [
    (lambda r: None, "does not exist"),
    (lambda r: [p.unlink() for p in (r / "train" / "dog").iterdir()], "empty class folder"),
])
def test_folder_errors_are_clear(cfg_factory, tmp_path, damage, needle):
    root = tmp_path / "imgs"
    if needle != "does not exist":
        make_folder(root)
    damage(root)
    with pytest.raises(ConfigError, match=needle):
        run.run(cfg_factory("data=imagenet", f"data.root={root}", *TINY))


def test_unreadable_image_fails_with_its_path_or_is_skipped(cfg_factory, tmp_path):
    root = make_folder(tmp_path / "imgs")
    bad = root / "train" / "cat" / "broken.jpg"
    bad.write_bytes(b"not a jpeg at all")
    with pytest.raises(ConfigError, match="unreadable image .*broken.jpg"):
        run.run(cfg_factory("data=imagenet", f"data.root={root}", *TINY, "batch=13",
                            "trainer.max_steps=1"))
    summary = run.run(cfg_factory("data=imagenet", f"data.root={root}", *TINY, "batch=13",
                                  "trainer.max_steps=1", "data.bad_images=skip",
                                  f"run_dir={tmp_path / 'skip'}"))
    assert summary["status"] == "completed"


def test_cifar10_format_files(cfg_factory, tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10
    d = tmp_path / "cifar" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in [*((f"data_batch_{i}", 8) for i in range(1, 6)), ("test_batch", 8)]:
        with open(d / name, "wb") as f:
            pickle.dump({"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8),
                         "labels": rng.integers(0, 10, n).tolist()}, f)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    import torchvision.datasets.cifar as cifar_module
    monkeypatch.setattr(CIFAR10, "_check_integrity", lambda self: True)  # fake files, real format:
    monkeypatch.setattr(cifar_module, "check_integrity", lambda *a, **k: True)  # skip the md5s
    summary = run.run(cfg_factory("data=cifar10", f"data.root={tmp_path / 'cifar'}", "model=resnet18",
                                  "batch=8", "trainer.max_steps=3"))
    assert summary["status"] == "completed" and summary["steps"] == 3


def test_cifar10_missing_is_a_clear_error(cfg_factory, tmp_path):
    with pytest.raises(ConfigError, match="data.download=true"):
        run.run(cfg_factory("data=cifar10", f"data.root={tmp_path}", "trainer.max_steps=1"))

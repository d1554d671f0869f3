"""Real-data paths on generated files: ImageNet-style folders and CIFAR-format batches."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mixprec.core.errors import ConfigError, DataError
from mixprec.run import session as run

TINY = [
    "model=resnet18",
    "batch=4",
    "trainer.max_steps=2",
    "data.image_size=32",
    "data.eval_resize=36",
]


def make_folder(root: Path, classes=("cat", "dog"), n=6, smooth: bool = False) -> Path:
    """Generated JPEGs: noise (40x48), or photo-like smooth 64x48 images (`smooth`), on which
    two decoders agree closely."""
    rng = np.random.default_rng(int(smooth))
    for split in ("train", "val"):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                if smooth:
                    small = Image.fromarray(rng.integers(0, 255, (4, 5, 3), dtype=np.uint8))
                    small.resize((64, 48), Image.BICUBIC).save(d / f"{i}.jpg", quality=95)
                else:
                    Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(
                        d / f"{i}.jpg"
                    )
    return root


def test_imagenet_style_folder_trains_and_evaluates(cfg_factory, tmp_path):
    root = make_folder(tmp_path / "imgs")
    cfg = cfg_factory("data=imagenet", f"data.root={root}", *TINY)
    summary = run.run(cfg)
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["val_acc1"] is not None  # evaluated on the 12 val images
    rows = [json.loads(l) for l in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert any("val/acc1" in r for r in rows)


def test_read_image_gives_pil_pixels_for_every_format(tmp_path):
    """torchvision's decoders where they read the format, PIL where not (BMP, TIFF): the same
    RGB pixels either way; 16-bit PNGs are scaled to 8 bits (PIL would clip them)."""
    import torch
    from torchvision.transforms.functional import pil_to_tensor

    from mixprec.data.images import read_image

    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8))
    files = {
        "a.bmp": rgb,
        "b.tif": rgb,
        "c.png": rgb.convert("RGBA"),
        "d.jpg": rgb.convert("L"),
        "e.jpg": rgb.convert("CMYK"),
        "f.webp": rgb,
    }
    for name, im in files.items():
        im.save(tmp_path / name)
        x = read_image(str(tmp_path / name))
        assert x.dtype == torch.uint8 and x.shape == (3, 20, 30), name
        assert torch.equal(x, pil_to_tensor(Image.open(tmp_path / name).convert("RGB"))), name
    Image.fromarray(np.full((4, 6), 65535, dtype=np.uint16)).save(tmp_path / "g.png")
    assert read_image(str(tmp_path / "g.png")).eq(255).all()


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda r: None, "does not exist"),
        (lambda r: [p.unlink() for p in (r / "train" / "dog").iterdir()], "empty class folder"),
    ],
)
def test_folder_errors_are_clear(cfg_factory, tmp_path, damage, needle):
    root = tmp_path / "imgs"
    if needle != "does not exist":
        make_folder(root)
    damage(root)
    with pytest.raises(ConfigError, match=needle):
        run.run(cfg_factory("data=imagenet", f"data.root={root}", *TINY))


@pytest.mark.slow
def test_unreadable_image_fails_with_its_path_or_is_skipped(cfg_factory, tmp_path):
    root = make_folder(tmp_path / "imgs")
    bad = root / "train" / "cat" / "broken.jpg"
    bad.write_bytes(b"not a jpeg at all")
    with pytest.raises(DataError, match="unreadable image .*broken.jpg"):
        run.run(
            cfg_factory(
                "data=imagenet", f"data.root={root}", *TINY, "batch=13", "trainer.max_steps=1"
            )
        )
    summary = run.run(
        cfg_factory(
            "data=imagenet",
            f"data.root={root}",
            *TINY,
            "batch=13",
            "trainer.max_steps=1",
            "data.bad_images=skip",
            f"run_dir={tmp_path / 'skip'}",
        )
    )
    assert summary["status"] == "completed"


@pytest.mark.slow
def test_cifar10_format_files(cfg_factory, tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    d = tmp_path / "cifar" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in [*((f"data_batch_{i}", 8) for i in range(1, 6)), ("test_batch", 8)]:
        with open(d / name, "wb") as f:
            pickle.dump(
                {
                    "data": rng.integers(0, 255, (n, 3072), dtype=np.uint8),
                    "labels": rng.integers(0, 10, n).tolist(),
                },
                f,
            )
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    import torchvision.datasets.cifar as cifar_module

    monkeypatch.setattr(CIFAR10, "_check_integrity", lambda self: True)  # fake files, real format:
    monkeypatch.setattr(cifar_module, "check_integrity", lambda *a, **k: True)  # skip the md5s
    summary = run.run(
        cfg_factory(
            "data=cifar10",
            f"data.root={tmp_path / 'cifar'}",
            "model=resnet18",
            "batch=8",
            "trainer.max_steps=3",
        )
    )
    assert summary["status"] == "completed" and summary["steps"] == 3


def test_cifar10_missing_is_a_clear_error(cfg_factory, tmp_path):
    with pytest.raises(ConfigError, match="data.download=true"):
        run.run(cfg_factory("data=cifar10", f"data.root={tmp_path}", "trainer.max_steps=1"))


def smooth_jpegs(root: Path) -> Path:
    return make_folder(root, n=4, smooth=True)


def _batches(dcfg_overrides, cfg_factory, root, split="val", n=1):
    import torch

    from mixprec import data
    from mixprec.run.config import validate

    c = validate(
        cfg_factory(
            "data=imagenet",
            f"data.root={root}",
            "data.image_size=32",
            "data.eval_resize=36",
            *dcfg_overrides,
        )
    )
    d = data.build(c.data, data.Context(8, torch.device("cpu"), c.seed))
    loader = d.val if split == "val" else d.train
    if split == "train":
        loader.set_epoch(0)
    return [b for _, b in zip(range(n), loader)]


def test_device_decode_gives_the_images_the_workers_give(cfg_factory, tmp_path):
    """data.decode=device (torchvision.io.decode_jpeg; nvJPEG on a GPU) crops, resizes and
    normalises the evaluation images like the PIL path does."""
    root = smooth_jpegs(tmp_path / "imgs")
    ((xw, yw),) = _batches(["data.decode=workers"], cfg_factory, root)
    ((xd, yd),) = _batches(["data.decode=device"], cfg_factory, root)
    assert xw.shape == xd.shape == (8, 3, 32, 32) and xd.dtype == xw.dtype
    assert (yw == yd).all()
    diff = (xw - xd).abs().mean()  # sub-pixel crop offsets (crop-then-resize) and rounding
    assert diff < 0.1  # normalised units: ~6 grey levels of 255
    assert diff < 0.25 * (xw - xw.flip(-1)).abs().mean()  # far closer than a mirrored image


def test_device_decode_trains_and_augments(cfg_factory, tmp_path):
    root = smooth_jpegs(tmp_path / "imgs")
    ((x1, _),) = _batches(["data.decode=device"], cfg_factory, root, "train")
    ((x2, _),) = _batches(["data.decode=device", "seed=1"], cfg_factory, root, "train")
    assert x1.shape == (8, 3, 32, 32) and not torch_equal(x1, x2)  # random crops differ by seed
    summary = run.run(
        cfg_factory("data=imagenet", f"data.root={root}", "data.decode=device", *TINY)
    )
    assert summary["status"] == "completed" and summary["val_acc1"] is not None


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


@pytest.mark.slow
def test_device_decode_names_a_file_it_cannot_decode(cfg_factory, tmp_path):
    root = smooth_jpegs(tmp_path / "imgs")
    Image.new("RGB", (40, 40)).save(root / "train" / "cat" / "odd.png")
    with pytest.raises(DataError, match="odd.png.*JPEG only"):
        run.run(
            cfg_factory(
                "data=imagenet",
                f"data.root={root}",
                "data.decode=device",
                *TINY,
                "batch=9",
                "trainer.max_steps=1",
            )
        )
    with pytest.raises(ConfigError, match="batch=10: data=imagenet holds fewer training samples"):
        run.run(
            cfg_factory(
                "data=imagenet", f"data.root={root}", *TINY, "batch=10", "trainer.max_steps=1"
            )
        )  # an epoch of 9 images: never a whole step
    with pytest.raises(
        ConfigError,
        match="accum=3: one optimizer step needs 3 micro-batches of 4 "
        "but an epoch of data=imagenet holds 2",
    ):
        run.run(
            cfg_factory(
                "data=imagenet",
                f"data.root={root}",
                *TINY,
                "batch=4",
                "accum=3",
                "trainer.max_steps=1",
            )
        )


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_persistent_workers_serve_the_same_batches(tmp_path, rank, world):
    """One stream of batches across epochs (persistent workers) gives every epoch (and a
    mid-epoch resume) the same batches as a fresh DataLoader per epoch, for each DDP rank."""
    import torch
    from torch.utils.data import TensorDataset

    from mixprec.data.loaders import EpochLoader

    ds = TensorDataset(torch.arange(40 * world).float(), torch.arange(40 * world))
    from mixprec.data import Context, Workers

    ctx = Context(
        8, torch.device("cpu"), seed=3, rank=rank, world=world, workers=Workers(num_workers=2)
    )
    fresh, kept = EpochLoader(ds, ctx), EpochLoader(ds, ctx, persistent=True)
    streams = []
    for epoch, skip in [(0, 0), (1, 0), (2, 0), (2, 2), (3, 0)]:
        got = []
        for loader in (fresh, kept):
            loader.set_epoch(epoch, skip)
            got.append([y.tolist() for _, y in loader])
        assert got[0] == got[1] and len(got[0]) == 5 - skip
        streams.append(kept._stream)
    assert fresh._stream is None
    # epochs 0-2 came from one stream (its workers ran on into the next epoch); the resume at
    # (2, 2) started another, which went on into epoch 3
    assert streams[0] is streams[1] is streams[2] and streams[3] is streams[4] is not streams[2]


def test_a_persistent_stream_left_part_way_resumes_where_asked(tmp_path):
    """An epoch abandoned after two batches (max_steps) and a later set_epoch elsewhere: the
    batches are those of a fresh loader, never the abandoned stream's next ones."""
    import torch
    from torch.utils.data import TensorDataset

    from mixprec.data import Context, Workers
    from mixprec.data.loaders import EpochLoader

    ds = TensorDataset(torch.arange(40).float(), torch.arange(40))
    ctx = Context(8, torch.device("cpu"), seed=5, workers=Workers(num_workers=2))
    fresh, kept = EpochLoader(ds, ctx), EpochLoader(ds, ctx, persistent=True)
    kept.set_epoch(0)
    it = iter(kept)
    first = [next(it)[1].tolist() for _ in range(2)]
    it.close()
    fresh.set_epoch(0)
    assert first == [y.tolist() for _, y in fresh][:2]
    for loader in (fresh, kept):
        loader.set_epoch(1, 1)
    assert [y.tolist() for _, y in kept] == [y.tolist() for _, y in fresh]
    kept.close()
    assert kept._stream is None


@pytest.mark.slow
def test_a_run_stops_its_persistent_workers_before_it_returns(cfg_factory, tmp_path, monkeypatch):
    """A run that ends mid-epoch leaves persistent workers with batches queued. run() stops them
    before returning (Data.close): left to interpreter exit, torch 2.11 with pinned memory joins
    each for 5 s (pytorch#81794; 80 s for 16 workers on the H200 host)."""
    import multiprocessing as mp

    from mixprec.training import loop

    root = make_folder(tmp_path / "imgs", n=12)
    before, seen, train = set(mp.active_children()), [], loop.train

    def train_and_look(*a, **kw):  # the workers exist while the loop runs
        out = train(*a, **kw)
        seen.extend(w for w in mp.active_children() if w not in before)
        return out

    monkeypatch.setattr(loop, "train", train_and_look)
    summary = run.run(
        cfg_factory(
            "data=imagenet",
            f"data.root={root}",
            *TINY,
            "batch=2",
            "hardware.num_workers=2",
            "hardware.persistent_workers=true",
        )
    )
    assert summary["steps"] == 2  # of 12 micro-batches: the epoch was left part-way
    assert len(seen) >= 2  # the two persistent train workers were running
    assert not any(w.is_alive() for w in seen)


def test_the_fast_preset_takes_a_real_dataset(cfg_factory, tmp_path):
    """experiment=fast data=imagenet (the README's real-data command) composes and validates: the
    preset sets no key of one dataset (it once set data.steps_per_epoch, synthetic's only, and
    every real-data run of it stopped with exit 2)."""
    from mixprec.run.config import validate

    root = make_folder(tmp_path / "imgs", n=2)
    c = validate(cfg_factory("experiment=fast", "data=imagenet", f"data.root={root}"))
    assert c.data.name == "imagenet" and c.model.compile_mode == "reduce-overhead"


def test_cifar10_download_without_a_network_is_one_data_error(cfg_factory, tmp_path, monkeypatch):
    """Issue 93, item 8: `data=cifar10 data.download=true` with no network was an 86-line
    URLError traceback (exit 1); one DataError (exit 4) saying what to do instead."""
    import urllib.error
    import urllib.request

    def no_network(*args, **kwargs):
        raise urllib.error.URLError(OSError(101, "Network is unreachable"))

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setattr(urllib.request.OpenerDirector, "open", no_network)
    cfg = cfg_factory("data=cifar10", f"data.root={tmp_path / 'c10'}", "data.download=true")
    with pytest.raises(DataError, match="the download failed .*put cifar-10-batches-py"):
        run.run(cfg)

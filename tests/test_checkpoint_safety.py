"""A checkpoint never runs code when it is read (issue 66, item 1). torch's DCP reader unpickles
a sharded checkpoint's .metadata with plain pickle and each non-tensor entry with
torch.load(weights_only=False); each payload here is a real one (os.system touching a file),
first shown to run through torch's own reader, then refused on every path of mixprec that
reads a checkpoint: resume=auto, resume=<another run's .dcp>, export, and the readers of run
dirs (diagnose, the study), which must not touch it at all."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from mixprec.checkpoint import dcp as checkpoint_dcp
from mixprec.checkpoint import store as checkpoint
from mixprec.core.errors import CheckpointError

from conftest import SHARDED, run_module, run_train


class Payload:
    """Unpickled, it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def small_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, opt)
    return model, opt, {"model": m, "optimizer": o}


def save(state: dict, where: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(where))


def poison_metadata(ckpt: Path, marker: Path) -> None:
    """.metadata replaced by a pickle whose loading runs the payload (and then yields the real
    metadata, so that a reader that ran it would go on as if nothing happened)."""
    real = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(pickle.dumps((Payload(marker), pickle.loads(real))))


def poison_entry(state: dict, marker: Path) -> dict:
    """The optimizer's lr, a non-tensor entry (DCP stores it with torch.save), as a payload."""
    state["optimizer"]["param_groups"][0]["lr"] = Payload(marker)
    return state


@pytest.mark.parametrize("how", ["metadata", "entry"])
def test_torchs_own_reader_runs_the_payload_and_mixprecs_refuses_it(tmp_path, how):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    _, _, state = small_state()
    ckpt = tmp_path / "step_1.dcp"
    save(poison_entry(state, marker) if how == "entry" else state, ckpt)
    if how == "metadata":
        poison_metadata(ckpt, marker)
    # the payload is live: torch's own FileSystemReader runs it
    _, _, target = small_state()
    try:
        dcp.load(target, checkpoint_id=str(ckpt), no_dist=True)
    except BaseException:  # noqa: BLE001 (the tuple .metadata may not load on: it ran by then)
        pass
    assert marker.exists(), "the payload did not run through torch's reader: the test is void"
    marker.unlink()

    model, opt, _ = small_state()
    learner = type("L", (), {"model": model, "optimizer": opt})()
    with pytest.raises(CheckpointError, match="refused") as e:
        checkpoint_dcp.read(ckpt, learner)
    assert str(ckpt) in str(e.value)
    if how == "metadata":
        with pytest.raises(CheckpointError, match="refused"):
            checkpoint_dcp.full_model(ckpt)
    else:  # export reads the model's entries alone: the optimizer's payload stays unread
        assert checkpoint_dcp.full_model(ckpt).keys() == model.state_dict().keys()
    assert not marker.exists()


def test_the_safe_reader_loads_a_real_checkpoint_exactly(tmp_path):
    model, opt, state = small_state()
    ckpt = tmp_path / "step_1.dcp"
    save(state, ckpt)
    fresh, fresh_opt, _ = small_state()
    learner = type("L", (), {"model": fresh, "optimizer": fresh_opt})()
    checkpoint_dcp.read(ckpt, learner)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    assert fresh_opt.state_dict()["param_groups"][0]["lr"] == 1e-3
    saved = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], saved)
    weights = checkpoint_dcp.full_model(ckpt)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_a_metadata_that_is_not_dcps_is_refused_and_a_garbage_one_named(tmp_path):
    ckpt = tmp_path / "step_1.dcp"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(shutil.rmtree))
    with pytest.raises(CheckpointError, match=r"shutil\.rmtree.*refused"):
        checkpoint_dcp.metadata(ckpt)
    (ckpt / ".metadata").write_bytes(b"garbage" * 10)
    with pytest.raises(CheckpointError, match="damaged"):
        checkpoint_dcp.metadata(ckpt)
    # a callable inside torch's metadata module that is not one of its classes
    (ckpt / ".metadata").write_bytes(b"ctorch.distributed.checkpoint.metadata\nfield\n.")
    with pytest.raises(CheckpointError, match="refused"):
        checkpoint_dcp.metadata(ckpt)


def rewrite_with_payload(ckpt: Path, marker: Path) -> None:
    """The run's own sharded checkpoint, every entry as it was but the optimizer's lr, saved
    anew through DCP: what an attacker who edits a checkpoint can make."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    full = ckpt.parent / "full.pt"
    dcp_to_torch_save(str(ckpt), str(full))  # trusted here: our own run's checkpoint
    state = torch.load(full, weights_only=False)
    full.unlink()
    meta = (ckpt / checkpoint_dcp.META).read_bytes()
    shutil.rmtree(ckpt)
    save(poison_entry(state, marker), ckpt)
    (ckpt / checkpoint_dcp.META).write_bytes(meta)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["metadata", "entry"])
def test_no_path_that_reads_a_sharded_checkpoint_runs_its_payload(sharded_run, tmp_path, how):
    d = tmp_path / "run"
    shutil.copytree(sharded_run, d, symlinks=True)
    ckpt = d / "checkpoints" / "step_00000002.dcp"
    marker = tmp_path / "ran"
    if how == "metadata":
        poison_metadata(ckpt, marker)
    else:
        rewrite_with_payload(ckpt, marker)

    resumed = run_train([*SHARDED, "trainer.max_steps=4", "resume=auto", f"hydra.run.dir={d}"])
    assert resumed.returncode == 5, (resumed.stdout + resumed.stderr)[-3000:]
    assert "refused" in resumed.stdout + resumed.stderr
    assert not marker.exists(), "resume=auto ran the payload"

    other = tmp_path / "other"
    p = run_train([*SHARDED, "trainer.max_steps=4", f"resume={ckpt}", f"hydra.run.dir={other}"])
    assert p.returncode == 5 and not marker.exists(), (p.stdout + p.stderr)[-3000:]

    exported = run_module("mixprec.export", [str(d)])
    if how == "metadata":
        assert exported.returncode == 5, exported.stderr[-2000:]
        assert "refused" in exported.stderr.strip().splitlines()[-1]
    else:  # export reads the model's entries alone: the payload stays unread
        assert exported.returncode == 0, exported.stderr[-2000:]
    assert not marker.exists(), "export ran the payload"

    # a folder holding a plain meta.pt and the .metadata is enough for export to read it
    bare = tmp_path / "bare.dcp"
    bare.mkdir()
    for name in (".metadata", checkpoint_dcp.META):
        shutil.copy(ckpt / name, bare / name)
    if how == "metadata":
        exported = run_module("mixprec.export", [str(bare)])
        assert exported.returncode == 5 and not marker.exists(), exported.stderr[-2000:]

    for module, args in [("mixprec.diagnose", [d]), ("mixprec.study", [tmp_path])]:
        run_module(module, args)
        assert not marker.exists(), f"{module} ran the payload"


def test_a_plain_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "last.pt"
    torch.save({"format": checkpoint.FORMAT, "model": Payload(marker)}, path)
    with pytest.raises(CheckpointError, match=str(path)):
        checkpoint.load(path)
    assert not marker.exists()

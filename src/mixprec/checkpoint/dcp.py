"""ckpt.sharded=true: checkpoints in torch.distributed.checkpoint's format (DCP), each rank
writing its own shard of the model and optimizer state, for states too large to gather on one
host (what parallel=fsdp exists for).

A checkpoint is a directory, checkpoints/step_N.dcp: the ranks' shard files and DCP's
.metadata, plus meta.pt (rank 0: the loop state, scaler, scheduler, every rank's RNG state and
the config, the same entries a one-file checkpoint has beside its tensors). It is written as
.step_N.dcp.partial and renamed when whole, so a crash mid-write never leaves a step_N.dcp that
is not; checkpoints/last.dcp is a symlink to the newest. A resume reads each rank's part into
the model as this run shards it, so another world size reshards on load (DCP matches tensors by
name and offset). `python -m mixprec.export` joins the shards into one plain weights file."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from mixprec.core import files
from mixprec.core.errors import CheckpointError
from mixprec.models import unwrap
from mixprec.parallel import distributed

SUFFIX = ".dcp"
META = "meta.pt"
LAST = "last" + SUFFIX


def is_dcp(path: Path) -> bool:
    """A DCP checkpoint directory: its meta.pt is written last, so one that has it is whole
    (step_N.dcp, or a .partial / .stale one that a kill left between two renames)."""
    return path.is_dir() and (path / META).is_file() and (path / ".metadata").is_file()


def step_of(path: Path) -> int:
    """N of step_N.pt, step_N.dcp, .step_N.dcp.partial (-1 where the name holds no step)."""
    digits = path.name.lstrip(".").split("_", 1)[-1].split(".", 1)[0]
    return int(digits) if digits.isdigit() else -1


def write(directory: Path, learner, meta: dict, step: int, keep: int) -> Path:
    """Every rank: its shard into checkpoints/step_N.dcp; rank 0 also meta.pt, the rename,
    last.dcp and the removal of all but the newest `keep`. Returns the checkpoint's path."""
    main = distributed.rank() == 0
    final = directory / f"step_{step:08d}{SUFFIX}"
    partial = directory / f".{final.name}.partial"
    if main:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a crash's leftover
    _barrier()
    with files.space_checked(partial / META):
        import torch.distributed.checkpoint as dcp

        dcp.save(_states(learner), checkpoint_id=str(partial))  # returns once .metadata is out
    if main:
        files.write_atomic(partial / META, lambda f: torch.save(meta, f))
        stale = directory / f".{final.name}.stale"
        if final.exists():  # the same step written again after a resume: moved aside first,
            shutil.rmtree(stale, ignore_errors=True)  # so that a whole copy is there at every
            os.replace(final, stale)  # moment (checkpoint.latest falls back to it)
        os.replace(partial, final)
        tmp = directory / f".{LAST}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(final.name, tmp)
        os.replace(tmp, directory / LAST)
        files.sync_dir(directory)
        shutil.rmtree(stale, ignore_errors=True)
        for old in sorted(directory.glob(f"step_*{SUFFIX}"))[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def read(path: Path, learner) -> None:
    """Every rank: load its part of the model and optimizer state from the checkpoint `path`,
    resharded to this run's layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _states(learner)
    with damaged_as_checkpoint_error(path):
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        unwrap(learner.model),
        learner.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


def full_model(path: Path) -> dict:
    """The whole model's weights from a DCP checkpoint, in one process (no process group): for
    export. DCP's own converter writes the full state to a file, read back here."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / "full.pt"
        with damaged_as_checkpoint_error(path):
            dcp_to_torch_save(str(path), str(out))
        return torch.load(out, map_location="cpu", weights_only=True)["model"]


@contextmanager
def damaged_as_checkpoint_error(path: Path):
    """A shard missing, truncated or garbage, or a garbage .metadata: a CheckpointError
    naming the checkpoint (exit 5) on every rank. torch's CheckpointException derives from
    BaseException (it passed every `except Exception`: tracebacks, exit 1)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (CheckpointException, Exception) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        causes = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
        why = causes[-1] if causes else (lines[0] if lines else type(e).__name__)
        where = f"{path} ({path.resolve().name})" if path.is_symlink() else str(path)
        raise CheckpointError(
            f"checkpoint {where} cannot be read: a shard or its .metadata is missing, truncated "
            f"or damaged ({why[:300]})"
        ) from None


def _states(learner) -> dict:
    """The model's and optimizer's state as this rank holds them (DTensor shards when
    sharded), keyed by parameter name: what DCP saves and loads into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(unwrap(learner.model), learner.optimizer)
    return {"model": model, "optimizer": optimizer}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

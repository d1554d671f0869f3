"""ckpt.sharded=true: checkpoints in torch.distributed.checkpoint's format (DCP), each rank
writing its own shard of the model and optimizer state, for states too large to gather on one
host (what parallel=fsdp exists for).

A checkpoint is a directory, checkpoints/step_N.dcp: the ranks' shard files and DCP's
.metadata, plus meta.pt (rank 0: the loop state, scaler, scheduler, every rank's RNG state and
the config, the same entries a one-file checkpoint has beside its tensors). It is written as
.step_N.dcp.partial and renamed when whole, so a crash mid-write never leaves a step_N.dcp that
is not; checkpoints/last.dcp is a symlink to the newest. A resume reads each rank's part into
the model as this run shards it, so another world size reshards on load (DCP matches tensors by
name and offset). `python -m mixprec.export` joins the shards into one plain weights file.

Reading one never runs code. torch's own reader unpickles .metadata with plain `pickle` and
every non-tensor entry (the optimizer's lr, betas, ...) with `torch.load(weights_only=False)`:
both are replaced here through DCP's public interfaces (a StorageReader's `read_metadata`, a
LoadPlanner's `load_bytes`). The metadata is unpickled allowing DCP's metadata classes, torch's
Size and dtypes alone; each entry is read with `weights_only=True`. Anything else is refused
as a CheckpointError naming the file, before a byte of it runs."""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
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
        dcp.load(state, storage_reader=_reader(path), planner=_planner())
    set_state_dict(
        unwrap(learner.model),
        learner.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


def full_model(path: Path) -> dict:
    """The whole model's weights from a DCP checkpoint, in one process (no process group): for
    export. The state to load into is laid out from the metadata (each model tensor's shape
    and dtype), so the safe reader serves here too."""
    import torch.distributed.checkpoint as dcp

    meta = metadata(path)
    model = {}
    for fqn, md in meta.state_dict_metadata.items():
        where = (meta.planner_data or {}).get(fqn, ())
        if len(where) == 2 and where[0] == "model" and hasattr(md, "size"):
            model[where[1]] = torch.empty(md.size, dtype=md.properties.dtype)
    with damaged_as_checkpoint_error(path):
        dcp.load(
            {"model": model}, storage_reader=_reader(path, meta), planner=_planner(), no_dist=True
        )
    return model


def metadata(path: Path):
    """The checkpoint's .metadata, unpickled allowing DCP's own metadata classes alone: a
    CheckpointError naming the file for anything else (it could run code) or a damaged file."""
    try:
        with open(path / ".metadata", "rb") as f:
            return _MetadataUnpickler(f).load()
    except _Refused as e:
        raise CheckpointError(
            f"checkpoint {_named(path)}: its .metadata refers to {e}, which DCP's metadata never "
            "holds; refused (loading it could run code)"
        ) from None
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"checkpoint {_named(path)} cannot be read: its .metadata is missing, truncated or "
            f"damaged ({type(e).__name__}: {str(e)[:200]})"
        ) from None


def _named(path: Path) -> str:
    """The checkpoint as a message names it: last.dcp with the step it links to."""
    return f"{path} ({path.resolve().name})" if path.is_symlink() else str(path)


class _Refused(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """What DCP pickles into .metadata (torch 2.11-2.14): its metadata dataclasses and enum,
    the filesystem writer's _StorageInfo, torch.Size, dtypes, layouts and the checkpoint's
    path. A global outside that list is refused before it is looked up."""

    CLASSES = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
    MODULE = "torch.distributed.checkpoint.metadata"

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.CLASSES:
            return super().find_class(module, name)
        if module == self.MODULE and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type):  # a dataclass or enum of DCP's, nothing callable else
                return found
        raise _Refused(f"{module}.{name}")


def _reader(path: Path, checked=None):
    """torch's FileSystemReader with the metadata read by `metadata` (its public hook). The
    metadata is read and checked here, before dcp.load: torch 2.11's loader swallows every
    exception of read_metadata and then fails with "metadata is None", which would hide a
    refusal behind a message about damage."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    checked = metadata(path) if checked is None else checked

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = checked
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return Reader(str(path))


def _planner():
    """torch's DefaultLoadPlanner with each non-tensor entry read as plain data: it is loaded
    with weights_only=True, and what the planner then unpickles is that data saved anew."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                plain = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                what = f"an entry ({read_item.dest_index.fqn}) that is not plain data"
                raise _Refused(f"{what} ({str(e).splitlines()[0][:200]})") from None
            again = io.BytesIO()
            torch.save(plain, again)
            again.seek(0)
            super().load_bytes(read_item, again)

    return Planner()


@contextmanager
def damaged_as_checkpoint_error(path: Path):
    """A shard missing, truncated or garbage, or a garbage .metadata: a CheckpointError
    naming the checkpoint (exit 5) on every rank. torch's CheckpointException derives from
    BaseException (it passed every `except Exception`: tracebacks, exit 1)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (CheckpointException, Exception) as e:
        inner = _within(e, (_Refused, CheckpointError))
        if isinstance(inner, _Refused):
            raise CheckpointError(
                f"checkpoint {_named(path)}: it holds {inner}; refused (loading it could run code)"
            ) from None
        if inner is not None:  # the safe reader's own error, e.g. about .metadata
            raise inner from None
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        causes = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
        why = causes[-1] if causes else (lines[0] if lines else type(e).__name__)
        raise CheckpointError(
            f"checkpoint {_named(path)} cannot be read: a shard or its .metadata is missing, "
            f"truncated or damaged ({why[:300]})"
        ) from None


def _within(e: BaseException, kinds: tuple, depth: int = 0) -> BaseException | None:
    """The first exception of `kinds` in `e`, its causes, or torch's wrapping of each rank's
    failure (CheckpointException.failures: {rank: (exception, traceback)})."""
    if isinstance(e, kinds):
        return e
    if depth > 8:
        return None
    inner = [
        f[0] if isinstance(f, tuple) else f for f in (getattr(e, "failures", None) or {}).values()
    ]
    for nested in [*inner, e.__cause__, e.__context__]:
        if isinstance(nested, BaseException) and nested is not e:
            found = _within(nested, kinds, depth + 1)
            if found is not None:
                return found
    return None


def _states(learner) -> dict:
    """The model's and optimizer's state as this rank holds them (DTensor shards when
    sharded), keyed by parameter name: what DCP saves and loads into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(unwrap(learner.model), learner.optimizer)
    return {"model": model, "optimizer": optimizer}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

"""Writing a file whole or not at all: the one write-to-temp-then-rename of the project.

A reader (a resume, the report, a second process) sees the old file or the new one, never half
of one: the bytes go to a temp file beside the target, are fsync'ed, renamed over the target, and
the directory entry is fsync'ed too, so a power loss right after the rename keeps the new file.
A failure on the way (a full disk) removes the temp file and leaves the target as it was; a
full disk is a DiskFull error naming the file (exit 8), not a traceback.
"""

from __future__ import annotations

import errno
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from .errors import DiskFull

FULL = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL = 1 << 20  # bytes: torch.save reports a full disk as a RuntimeError, so look


def write_atomic(path: Path, write: Callable[[IO[bytes]], Any] | bytes | str) -> Path:
    """Replace `path` with what `write(f)` writes into a binary file (or with the given bytes or
    text), atomically and durably."""
    if isinstance(write, (bytes, str)):
        data = write.encode() if isinstance(write, str) else write
        write = lambda f: f.write(data)  # noqa: E731
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        full = isinstance(e, Exception) and disk_full(e, path.parent)  # before the temp goes
        tmp.unlink(missing_ok=True)
        if full:
            raise no_space(path) from None
        raise
    sync_dir(path.parent)
    return path


@contextmanager
def space_checked(path: Path) -> Iterator[None]:
    """A full disk while writing `path` in this block is DiskFull naming it."""
    try:
        yield
    except OSError as e:
        if disk_full(e, path.parent):
            raise no_space(path) from None
        raise


def disk_full(e: BaseException, directory: Path) -> bool:
    """An OSError that says so (ENOSPC, a quota), or any write error with the disk nearly full."""
    chain = [e, e.__cause__, e.__context__]
    if any(isinstance(x, OSError) and x.errno in FULL for x in chain):
        return True
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < NEARLY_FULL


def no_space(path: Path) -> DiskFull:
    try:
        st = os.statvfs(path.parent)
        free = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return DiskFull(
        f"no space left to write {path} ({free}); free some space or move the run "
        "(hydra.run.dir), then resume=auto continues from the last checkpoint"
    )


def link_atomic(target: Path, path: Path) -> Path:
    """Make `path` a hard link to `target`, replacing what was there in one rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.link(target, tmp)
    os.replace(tmp, path)
    sync_dir(path.parent)
    return path


def sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain(v: Any) -> Any:
    """JSON for what json does not take: tensors/numpy scalars by value, inf/nan as strings
    (JSON has neither; every line stays valid JSON), anything else as its str."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v.item() if hasattr(v, "item") else str(v)


def finite(obj: Any) -> Any:
    """inf/nan as strings, in nested dicts and lists too (the doctor's findings)."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return plain(obj) if isinstance(obj, float) and not math.isfinite(obj) else obj


def write_json(path: Path, obj: Any) -> Path:
    """`obj` as indented JSON, atomically (summary.json, wandb.json, caches)."""
    text = json.dumps(finite(obj), indent=2, default=plain)
    return write_atomic(path, text + "\n")

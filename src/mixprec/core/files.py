"""Writing a file whole or not at all: the one write-to-temp-then-rename of the project.

A reader (a resume, the report, a second process) sees the old file or the new one, never half
of one: the bytes go to a temp file beside the target, are fsync'ed, renamed over the target, and
the directory entry is fsync'ed too, so a power loss right after the rename keeps the new file.
A failure on the way (a full disk) removes the temp file and leaves the target as it was; a
full disk is a DiskFull error naming the file (exit 8), a folder that cannot be written (a
read-only filesystem, no permission) an Unwritable error naming it (exit 9), not a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import resource
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from mixprec.core.errors import DiskFull, MixprecError, Unwritable

FULL = (errno.ENOSPC, errno.EDQUOT)
DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
NEARLY_FULL = 1 << 20  # bytes: torch.save reports a full disk as a RuntimeError, so look


def write_atomic(path: Path, write: Callable[[IO[bytes]], Any] | bytes | str) -> Path:
    """Replace `path` with what `write(f)` writes into a binary file (or with the given bytes or
    text), atomically and durably."""
    write_together({path: write})
    return path


def write_together(outputs: dict[Path, Callable[[IO[bytes]], Any] | bytes | str]) -> None:
    """write_atomic for files that belong together (study.md, study.json and study.png): every
    one is written whole to a temp file first, then all are renamed; a rename that fails (a
    file that cannot be replaced) puts back the ones already renamed, from hard links kept of
    them. A full disk or a refused write leaves the old set as it was, never a new file beside
    an old one; the error names the file."""
    pid = os.getpid()
    temps = {path: path.with_name(f".{path.name}.{pid}.tmp") for path in outputs}
    together = len(outputs) > 1  # one file: its rename is the switch, nothing to put back
    olds = {p: p.with_name(f".{p.name}.old.{pid}.tmp") for p in outputs} if together else {}
    path = next(iter(outputs))
    renamed: list[Path] = []
    try:
        for path, write in outputs.items():
            _write_whole(temps[path], write)
        for path in olds:
            if path.is_file():
                _keep(path, olds[path])
        for path in outputs:
            os.replace(temps[path], path)
            renamed.append(path)
    except BaseException as e:
        full = isinstance(e, Exception) and disk_full(e, path.parent)  # before the temps go
        capped = isinstance(e, Exception) and size_capped(e, [*temps.values()])
        for done in renamed:  # the old set back
            with contextlib.suppress(OSError):
                if done in olds and olds[done].exists():
                    os.replace(olds[done], done)
                else:
                    done.unlink()
        for leftover in [*temps.values(), *olds.values()]:
            with contextlib.suppress(OSError):  # a read-only filesystem refuses even this
                leftover.unlink(missing_ok=True)
        if capped:
            raise DiskFull(
                f"cannot write {path}: the process's file size limit ({capped} bytes, ulimit -f) "
                "is smaller than the file; nothing was replaced. Raise the limit, then "
                "resume=auto continues from the last whole checkpoint"
            ) from None
        if full:
            raise no_space(path) from None
        if denied(e) or (isinstance(e, OSError) and e.errno == errno.EBUSY):
            raise not_writable(path, e) from None
        raise
    for old in olds.values():
        old.unlink(missing_ok=True)
    for directory in {p.parent for p in outputs}:
        sync_dir(directory)


def _keep(path: Path, old: Path) -> None:
    """A copy of `path` to put back: a hard link, or a real copy where links are refused."""
    old.unlink(missing_ok=True)
    try:
        os.link(path, old)
    except OSError:
        shutil.copy2(path, old)


def _write_whole(tmp: Path, write: Callable[[IO[bytes]], Any] | bytes | str) -> None:
    if isinstance(write, (bytes, str)):
        data = write.encode() if isinstance(write, str) else write
        write = lambda f: f.write(data)  # noqa: E731
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def space_checked(path: Path) -> Iterator[None]:
    """A full disk while writing `path` in this block is DiskFull naming it; a folder that
    cannot be written, Unwritable."""
    try:
        yield
    except OSError as e:
        if disk_full(e, path.parent):
            raise no_space(path) from None
        if denied(e):
            raise not_writable(path, e) from None
        raise


@contextmanager
def cli_errors(out: Path) -> Iterator[None]:
    """A command line tool's writes into `out`: a full disk or a folder it cannot write is one
    line and its exit code (8, 9), as any MixprecError is, not a traceback."""
    try:
        try:
            yield
        except OSError as e:  # a write not through write_atomic: the folder is what it names
            if disk_full(e, out):
                raise no_space(out) from None
            if denied(e):
                raise not_writable(out, e) from None
            raise
    except MixprecError as e:
        print(f"{e.label}: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None


def denied(e: BaseException) -> bool:
    """An error that says the place cannot be written (read-only, no permission), here or as
    the cause of another (torch.save wraps it in a RuntimeError)."""
    return any(
        isinstance(x, OSError) and x.errno in DENIED for x in (e, e.__cause__, e.__context__)
    )


def not_writable(path: Path, e: BaseException) -> Unwritable:
    why = next(
        (x.strerror for x in (e, e.__cause__, e.__context__) if isinstance(x, OSError)), str(e)
    )
    return Unwritable(
        f"cannot write {path} ({why}); make its folder writable or move the run "
        "(hydra.run.dir), then resume=auto continues from the last checkpoint"
    )


def writable_dir(path: Path) -> str | None:
    """Why a folder (made if missing) cannot hold a run's files, without making anything: the
    nearest part of it that exists is a file, or is on a read-only filesystem or not writable;
    None when it can."""
    path = Path(path).absolute()
    there = next((p for p in (path, *path.parents) if p.exists()), None)
    if there is None:
        return None
    if not there.is_dir():
        return f"{there} is a file, not a folder"
    if not os.access(there, os.W_OK | os.X_OK):
        read_only = os.statvfs(there).f_flag & os.ST_RDONLY
        return f"{there} is on a read-only filesystem" if read_only else f"{there} is not writable"
    try:  # /proc, /sys: root may "write" there, but no folder can be made (a probe, removed)
        os.rmdir(tempfile.mkdtemp(prefix=".mixprec-probe-", dir=there))
    except OSError as e:
        return f"{there} takes no new folders ({e.strerror}: a kernel filesystem?)"
    return None


def size_capped(e: BaseException, written: list[Path]) -> int | None:
    """The file size limit (RLIMIT_FSIZE, `ulimit -f`) where a write failed at it: EFBIG, or
    a writer that wraps it (torch.save's "unexpected pos") with a temp file at the limit."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    chain = [e, e.__cause__, e.__context__]
    if any(isinstance(x, OSError) and x.errno == errno.EFBIG for x in chain):
        return soft
    for path in written:
        with contextlib.suppress(OSError):
            if path.stat().st_size >= soft:
                return soft
    return None


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


RUN_LOCK = ".lock"  # a run dir's lock file: held (flock) by the one process writing the run


def locked(path: Path) -> bool:
    """Whether a live process holds a flock on `path` now (a run dir's RUN_LOCK: the run is
    being written); False where the file is missing or free."""
    try:  # (never through a link, never blocking on a FIFO)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


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

"""What a run dir held before a run wrote, so that a refused run takes back only what it made
(rundir.py's lock is held the whole time): every path it created goes, every path it found is
left or put back as it was, and nothing is ever deleted or written through a link."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from mixprec.core import files

log = logging.getLogger(__name__)

# a found file up to this size is kept in memory so that a refused run can put it back whole
# (larger ones, metrics.jsonl of a long run, are cut back to their length if the run appended)
KEEP_BYTES = 64 << 20
# inside a logger's folder only small files are kept (W&B's debug.log, replaced by its link):
# a refused run adds its own run there and writes into nothing else; checkpoints/ is never read
KEEP_INSIDE = {"checkpoints": 0, "wandb": 1 << 20, "tensorboard": 1 << 20}


@dataclass
class _Entry:
    """One path as a run found it (lstat, never through a link)."""

    kind: str  # "file", "dir", "link" or "other"
    ino: int = 0
    size: int = 0
    mtime_ns: int = 0
    mode: int = 0
    data: bytes | None = None  # a small file's contents
    target: str | None = None  # a link's
    children: dict[str, _Entry] | None = None  # a real dir's entries, one level down


def _entry(path: Path, depth: int = 0, keep: int = 0) -> _Entry | None:
    """`path` as it is now; `depth` levels of a real dir's entries; the bytes of a file up to
    `keep` bytes long."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return _Entry("link", target=os.readlink(path))
    if stat.S_ISREG(st.st_mode):
        data = None
        if st.st_size <= keep:
            with contextlib.suppress(OSError):  # an unreadable file: only its length is kept
                data = _read_nofollow(path)
        return _Entry("file", st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, data)
    if stat.S_ISDIR(st.st_mode):
        kids = {p.name: _entry(p, depth - 1, keep) for p in path.iterdir()} if depth else None
        kids = {k: v for k, v in kids.items() if v is not None} if kids is not None else None
        return _Entry("dir", st.st_ino, mode=st.st_mode, children=kids)
    return _Entry("other", st.st_ino)


def _read_nofollow(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        return f.read()


class Footprint:
    """What a run dir held of the names a run writes, taken with the lock held before the run
    writes anything; `withdraw()` takes a refused run back out of it: every path the run
    created goes, every path it found is left or put back as it was. Nothing is ever deleted
    or written through a link: a found link is a leaf, its target untouched."""

    def __init__(self, run_dir: Path, names: tuple[str, ...]) -> None:
        self.run_dir = run_dir
        self.names = names
        found = {n: _entry(run_dir / n, 1, KEEP_INSIDE.get(n, KEEP_BYTES)) for n in self.names}
        self.found = {n: e for n, e in found.items() if e is not None}

    def withdraw(self) -> None:
        for name in self.names:
            path = self.run_dir / name
            before = self.found.get(name)
            if before is None:
                remove(path)
                continue
            _put_back(path, before)
            now = _entry(path)
            if before.children is not None and now is not None and now.kind == "dir":
                for child in list(path.iterdir()):
                    was = before.children.get(child.name)
                    remove(child) if was is None else _put_back(child, was)


def remove(path: Path) -> None:
    """Remove what the run made at `path`: a link itself (never what it points to), a file,
    or a real folder with what is in it (shutil.rmtree unlinks links inside, never follows)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _put_back(path: Path, before: _Entry) -> None:
    """A found path as it was: a link re-made, a small file's bytes restored, a large file
    cut back to its length where the run appended to it."""
    now = _entry(path)
    if before.kind == "link":
        if now is None or now.kind != "link" or now.target != before.target:
            remove(path)
            os.symlink(before.target, path)
        return
    if before.kind != "file" or (now is not None and now.kind == "dir"):
        return
    if now is not None and (now.ino, now.size, now.mtime_ns) == (
        before.ino,
        before.size,
        before.mtime_ns,
    ):
        return
    if before.data is not None:
        if now is not None and now.kind == "link":
            path.unlink()
        files.write_atomic(path, before.data)
        os.chmod(path, stat.S_IMODE(before.mode))
    elif now is not None and now.kind == "file" and now.ino == before.ino:
        if now.size > before.size:
            os.truncate(path, before.size)
    else:
        log.warning("%s was changed by the refused run and is too large to put back", path)

"""One writer per run dir, and what a run dir that already holds a run means.

- An advisory lock (flock on `<run dir>/.lock`) is held for the run's life. The kernel drops it
  when the process ends, however it ends, so a lock file left by a dead process is simply taken
  over (the file says whose it was); a live holder makes a second run stop with RunDirBusy.
- A run dir that holds a run (metrics.jsonl, summary.json or checkpoints/) is continued only with
  `resume=...`, started over only with `overwrite=true`, and otherwise refused: re-running into
  it by accident would append to its metrics and replace its checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import logging.handlers
import os
import shutil
import socket
import stat
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from mixprec.core import files
from mixprec.core.errors import ConfigError, RunDirBusy
from mixprec.run.footprint import remove

log = logging.getLogger(__name__)
# what marks a mixprec run (last.dcp: ckpt.sharded's checkpoints)
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints/last.pt", "checkpoints/last.dcp")
DIAGNOSE_FILES = ("diagnose.md", "diagnose.json", "loss_scale.png")
PLAN_FILE = "precision_plan.json"  # a run dir's precision plan (Precision.plan(): fp8_auto's)
# what a run appends to row by row, each row with its step: a resume of the run's own checkpoint
# keeps the rows up to its step (a killed run logged past it), a run that starts over none
APPENDED = ("metrics.jsonl", "numerics.jsonl")


def made_by_a_run() -> tuple[str, ...]:
    """What a run may leave in its run dir: checkpoints, every sink's files, diagnostics."""
    from mixprec import sinks

    return ("checkpoints", *sinks.run_files(), *APPENDED, PLAN_FILE, *DIAGNOSE_FILES)


def continue_appended(run_dir: Path, step: int, evaluated: bool) -> None:
    """A resume of this run dir's own checkpoint at `step`: each appended file keeps its rows
    up to the step (and a torn last line goes), so the resumed rows follow on whole."""
    from mixprec.sinks.local import drop_rows_after

    for name in APPENDED:
        if (run_dir / name).exists():
            drop_rows_after(run_dir / name, step, evaluated)


def restart_appended(run_dir: Path) -> None:
    """A run that starts over in its own dir (resume=auto before its first checkpoint): its
    appended rows and its summary start over too."""
    for name in (*APPENDED, "summary.json"):
        (run_dir / name).unlink(missing_ok=True)


class RunDirLock:
    """`with RunDirLock(run_dir):` while training; RunDirBusy if another process holds it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / files.RUN_LOCK
        self.fd: int | None = None
        self.remove_empty_dir = False  # a withdrawn run: the dir Hydra made for it, if empty

    def __enter__(self) -> RunDirLock:
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = open_lock(self.path, os.O_RDWR | os.O_CREAT)
            except FileNotFoundError:  # a withdrawn run removed its empty dir meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunDirBusy(
                    f"run dir {self.path.parent} is in use by {holder}; one writer per "
                    "run dir: wait for it, stop it, or choose another hydra.run.dir"
                ) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed it as we opened it (a clean exit): the new one
        previous = _read_holder(fd)
        if previous != "an unknown process":
            log.info("run dir lock: took over the lock left by %s (no longer running)", previous)
        self.fd = fd
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        try:
            with files.space_checked(self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(holder).encode(), 0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        """The lock file goes with the run (removed while held: a process that opened it a
        moment before finds it unlinked and takes the new one, _same_file); a withdrawn run's
        dir goes too where nothing else is left in it, still under the lock."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            if self.remove_empty_dir:
                with contextlib.suppress(OSError):  # the user's files are there: it stays
                    self.path.parent.rmdir()
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def open_lock(path: Path, flags: int) -> int:
    """Open a run dir's lock file, never through a link (a planted `.lock` link would have the
    run truncate and write its target) and never blocking on a FIFO; anything that is not a
    plain file is RunDirBusy naming it. FileNotFoundError where it is missing and not created."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a link; EISDIR: a folder; ENXIO: a FIFO with no reader
        raise _not_a_lock(path, e.strerror) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_lock(path, "not a plain file")
    return fd


def _not_a_lock(path: Path, why: str) -> RunDirBusy:
    return RunDirBusy(
        f"{path} is not a run's lock file ({why}); mixprec writes a plain file there and "
        "never writes through a link. Remove it if it is not yours, or choose another "
        "hydra.run.dir"
    )


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` is still the file `fd` holds (not unlinked or replaced since)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


# what a run writes into its dir beside what made_by_a_run() names: Hydra's files, the console log
JOURNAL = (".hydra", "train.log")


def _unlink_if_free(lock: Path) -> bool:
    """Remove a lock file no live process holds (and say whether it is gone). A refused run
    must not remove a live run's lock: that run may still be building, with nothing but its
    lock in the dir, and a third run would then take the dir beside it."""
    try:
        fd = open_lock(lock, os.O_RDWR)
    except FileNotFoundError:
        return True
    except RunDirBusy:  # not a lock of ours: left where it is
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        lock.unlink(missing_ok=True)  # while holding it: no one takes it between the two
    finally:
        os.close(fd)
    return True


def busy(run_dir: Path) -> bool:
    """Whether a live process holds the run dir's lock now (a glance: it may take it a moment
    later, when RunDirLock says so)."""
    return files.locked(run_dir / files.RUN_LOCK)


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']} (since {info['since']})"
    except (ValueError, KeyError, OSError):
        return "an unknown process"


def holds_a_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_FILES)


def prepare(run_dir: Path, resume: str | None, overwrite: bool) -> Aside | None:
    """Apply the rule for a run dir that already holds a run (call with the lock held):
    resume=auto continues it; a new run (resume=null, or from another run's checkpoint) needs
    an empty run dir or overwrite=true (then the previous run is set aside: the Aside). What
    dead writers left half-written goes first."""
    clean_stale(run_dir)
    if not holds_a_run(run_dir) or resume == "auto":
        return None
    if overwrite and resume and _inside(Path(resume).expanduser(), run_dir):
        raise ConfigError(
            f"resume={resume} with overwrite=true: overwrite would delete the checkpoint this run "
            "resumes from. Continue the run with resume=auto, or start it over with "
            "overwrite=true and no resume"
        )
    if not overwrite:
        raise ConfigError(
            f"run dir {run_dir} already holds a run; continue it with "
            f"resume=auto, start it over with overwrite=true, or choose another "
            "hydra.run.dir"
        )
    log.warning(
        "overwrite=true: the previous run's files in %s are set aside, and removed once this run "
        "writes its first checkpoint or ends (a run refused before its first step puts them back)",
        run_dir,
    )
    return Aside(run_dir)


ASIDE = ".overwritten"  # <run dir>/.overwritten.<pid>: the previous run, until this one starts


class Aside:
    """overwrite=true: the previous run's files moved (renamed, nothing copied) into a hidden
    folder of the run dir until this run has started for real. A run refused before that puts
    them back (`put_back`), so a refusal changes nothing; otherwise they go (`drop`). Its own
    checkpoints behind a linked checkpoints/ are removed at once (a rename would move the
    link, and the new run's checkpoints would no longer go where it points)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.dir = run_dir, run_dir / f"{ASIDE}.{os.getpid()}"
        self.dir.mkdir()
        self.moved: list[str] = []
        for name in made_by_a_run():
            path = run_dir / name
            if name == "checkpoints" and path.is_symlink():
                remove_run_checkpoints(path)
            elif name == "checkpoints" and path.is_dir():  # the run's own, not what else is there
                (self.dir / name).mkdir()
                for ckpt in run_checkpoints(path):
                    self._move(f"{name}/{ckpt.name}")
            elif os.path.lexists(path):
                self._move(name)

    def _move(self, name: str) -> None:
        os.rename(self.run_dir / name, self.dir / name)
        self.moved.append(name)

    def put_back(self) -> None:
        for name in self.moved:
            remove(self.run_dir / name)  # the refused run's own, if it made one
            os.rename(self.dir / name, self.run_dir / name)
        self.moved = []
        self.drop()

    def drop(self) -> None:
        if self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)


def clean_stale(run_dir: Path) -> None:
    """With the lock held: remove the temp files of writers that are no longer alive
    (files.write_atomic's `.NAME.PID.tmp`: a SIGKILL mid-write leaves one of a checkpoint's
    full size) and sharded checkpoints whose write never finished (`.step_N.dcp.partial`
    without its meta.pt)."""
    from mixprec.checkpoint.dcp import is_dcp

    for folder in (run_dir, run_dir / "checkpoints", run_dir / ".hydra"):
        if not folder.is_dir():
            continue
        for tmp in folder.glob(".*.tmp"):
            pid = tmp.name.rsplit(".", 2)[-2]
            if pid.isdigit() and not _alive(int(pid)):
                tmp.unlink(missing_ok=True)
                log.info("removed %s, left by a writer that is gone (pid %s)", tmp, pid)
        for aside in folder.glob(f"{ASIDE}.*") if folder == run_dir else ():
            pid = aside.name.rsplit(".", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):  # an overwrite=true run that was killed
                shutil.rmtree(aside, ignore_errors=True)
                log.info("removed %s, the run an overwrite=true run that is gone replaced", aside)
        for partial in folder.glob(".step_*.dcp.partial"):
            if not is_dcp(partial):
                shutil.rmtree(partial, ignore_errors=True)
                log.info("removed %s, a sharded checkpoint whose write never finished", partial)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_run(run_dir: Path) -> None:
    """Remove what a run left in its run dir (and nothing else that lives there)."""
    for name in made_by_a_run():
        path = run_dir / name
        if name == "checkpoints" and path.is_dir():
            remove_run_checkpoints(path)
            if not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()
        elif not path.is_symlink():  # a link is the user's: neither it nor its target goes
            remove(path)


def remove_run_checkpoints(path: Path) -> None:
    """A run's own checkpoints (last.pt, step_*.pt, sharded ones), also behind a linked
    checkpoints/ (the link and everything else behind it stay)."""
    for ckpt in run_checkpoints(path):
        remove(ckpt)  # (last.dcp: a symlink, unlinked)


def run_checkpoints(path: Path) -> list[Path]:
    """What of a checkpoints/ folder a run wrote: last.pt, last.dcp, step_*.pt, step_*.dcp and
    sharded writes that never finished; nothing else there is the run's."""
    named = [path / "last.pt", path / "last.dcp"]
    found = [*path.glob("step_*.pt"), *path.glob("step_*.dcp"), *path.glob(".step_*.dcp.partial")]
    return [p for p in named if os.path.lexists(p)] + found


def _inside(path: Path, run_dir: Path) -> bool:
    try:
        return path.resolve().is_relative_to(run_dir.resolve())
    except OSError:
        return False


class LogFile(logging.FileHandler):
    """train.log; a write it cannot make (a full disk) turns it off with one line on stderr
    instead of a traceback per record, and the run goes on (its own writes say what failed)."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            sys.stderr.write(
                f"mixprec: cannot write {self.baseFilename} ({sys.exc_info()[1]}); "
                "it stops here, the console log goes on\n"
            )

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)


class Journal:
    """What a run records about itself in its run dir beside its results: Hydra's files
    (`.hydra/config.yaml`, `hydra.yaml`, `overrides.yaml`) and the console log (`train.log`).

    Nothing is written until the run is accepted (the lock is held, the config and the run dir's
    rule passed, a resume fitted): until then log records are held in memory, and a refused run
    drops them and removes the run dir Hydra made for it if it is still empty. So a refused run
    never relabels or appends to the run it was refused from. A multirun job accepts at once: its
    dir is new, and the sweep's report reads its config and log even when it failed."""

    def __init__(self) -> None:
        self.buffer = logging.handlers.MemoryHandler(1_000_000, flushLevel=logging.CRITICAL + 1)
        self.file: logging.Handler | None = None
        self.run_dir: Path | None = None
        logging.getLogger().addHandler(self.buffer)

    def accept(self, run_dir: Path, cfg) -> None:
        """Write Hydra's files into `run_dir` and the held log records into its train.log."""
        if self.file is not None:
            return
        from mixprec.core import launch

        # outside Hydra (mixprec.train from Python) the config alone, as the study reads it
        hydra_files = launch.hydra_files(cfg) or {"config.yaml": OmegaConf.to_yaml(cfg)}
        if hydra_files:
            (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
            for name, text in hydra_files.items():
                files.write_atomic(run_dir / ".hydra" / name, text)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = LogFile(run_dir / "train.log")
        self.file.setFormatter(
            logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        )
        self.buffer.setTarget(self.file)
        self.buffer.flush()
        logging.getLogger().addHandler(self.file)
        logging.getLogger().removeHandler(self.buffer)

    @property
    def accepted(self) -> bool:
        """Whether the run was accepted and wrote its files (its train.log is open)."""
        return self.file is not None

    def close(self, run_dir: Path | None) -> None:
        """End of the run: close train.log, or (never accepted) drop the held records and the
        empty run dir Hydra made."""
        root = logging.getLogger()
        root.removeHandler(self.buffer)
        self.buffer.buffer.clear()
        if self.file is not None:
            root.removeHandler(self.file)
            self.file.close()
        elif run_dir is not None and run_dir != Path(".") and run_dir.is_dir():
            left = {p.name for p in run_dir.iterdir()}
            if left <= {files.RUN_LOCK} and _unlink_if_free(run_dir / files.RUN_LOCK):  # ours
                try:
                    run_dir.rmdir()
                except OSError:  # another run started writing into it meanwhile
                    pass

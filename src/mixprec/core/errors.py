"""What can stop a run, by kind. Each kind has its own exit code (docs/failures.md),
so a script or a scheduler can tell a typo from a diverged run from a broken file."""

from __future__ import annotations

import difflib
import signal
from typing import Any, Iterable


class MixprecError(Exception):
    """A stop that mixprec explains in one message; `exit_code` is what train.py exits with."""

    exit_code = 1
    label = "error"


class ConfigError(MixprecError, ValueError):
    """A config value that cannot run; the message names the key and what is allowed."""

    exit_code, label = 2, "config error"


class Diverged(MixprecError, RuntimeError):
    """Training cannot recover (non-finite loss or weights); the message says what to try."""

    exit_code, label = 3, "training diverged"


class DataError(MixprecError):
    """A fault in the data found while training (an unreadable image mid-epoch)."""

    exit_code, label = 4, "data error"


class CheckpointError(MixprecError):
    """A checkpoint that cannot be read, or does not fit this run; the message names the file."""

    exit_code, label = 5, "checkpoint error"


class RunDirBusy(MixprecError):
    """Another live process is writing this run dir (one writer per run dir)."""

    exit_code, label = 6, "run dir in use"


class OutOfMemory(MixprecError):
    """The GPU ran out of memory; the message gives the batch, the peak and what to try."""

    exit_code, label = 7, "out of memory"


class DiskFull(MixprecError):
    """No space left where the run writes (a checkpoint, metrics.jsonl, summary.json)."""

    exit_code, label = 8, "disk full"


class Unwritable(MixprecError):
    """Where the run writes cannot be written: a read-only filesystem, no permission, a file
    where a folder must be; the message names the path."""

    exit_code, label = 9, "cannot write"


class DtypeMismatch(MixprecError):
    """The tensors of a run are not in the dtypes its config promises (the dtype plan, read
    from the live objects after the first step: diagnostics/dtype_plan.py)."""

    exit_code, label = 10, "dtype plan mismatch"


class Preempted(MixprecError):
    """A stop signal arrived; the run checkpointed (if it could) and exits 128 + the signal."""

    label = "preempted"

    def __init__(self, signum: int, checkpointed: bool = True) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum, self.checkpointed, self.exit_code = signum, checkpointed, 128 + signum


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed; {key} must be {allowed}")


def one_of(key: str, value: Any, options: Iterable) -> None:
    options = tuple(options)
    check(value in options, key, value, "one of " + ", ".join(map(str, options)))


def nearest(name: str, options: Iterable[str]) -> str:
    """'; did you mean X?' for the closest option, or ''."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else ""

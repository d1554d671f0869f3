"""Exit as soon as the run is over. After its final line a process still runs every atexit
handler (loader workers, W&B, inductor's compile workers), then tears the interpreter down:
every module, tensor and CUDA object freed one by one, seconds for a process that compiled a
model. install() registers, before anything else can, the handler that atexit runs last: it
flushes the logs and ends the process with the code it was going to exit with, skipping the
teardown (the OS frees the memory and the GPU's context either way).

inductor's compile workers (a sidecar process and its pool, one per core) are shut down by
torch's own atexit handler, which asks the sidecar to stop and waits while it and each worker
tear down an interpreter holding torch (3.2 s with 4 workers on a 2-core CPU). exiting_with()
registers, after torch's, a handler that atexit runs before it: the run is over, so the sidecar
and its workers are killed, and torch's shutdown finds nothing left to wait for."""

from __future__ import annotations

import atexit
import os
import signal
import sys
from pathlib import Path

from mixprec import internals

_code: list[int] = []


def install() -> None:
    """Call first thing in the entrypoint, before torch and Hydra register their handlers."""
    if internals.enabled("quick_exit"):
        atexit.register(_exit_now)


def exiting_with(code: object) -> None:
    """The code the process is about to exit with (a SystemExit's code, as Python reads it)."""
    _code[:] = [code if isinstance(code, int) else 0 if code is None else 1]
    atexit.register(end_compile_workers)  # registered after torch's handler: runs before it


def end_compile_workers() -> None:
    """Kill inductor's compile-worker sidecars and their workers (where torch has started
    any), and mark each pool closed, so that torch's shutdown returns at once."""
    module = sys.modules.get("torch._inductor.async_compile")
    for pool in list(getattr(module, "_pool_set", None) or ()):
        sidecar, lock = getattr(pool, "process", None), getattr(pool, "write_lock", None)
        if sidecar is None or lock is None or not getattr(pool, "running", False):
            continue  # another kind of pool, or this torch's differs: torch shuts it down
        with lock:
            pool.running = False  # torch's shutdown: "not running", nothing to do
        for pid in [*_children(sidecar.pid), sidecar.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        sidecar.wait()
        if getattr(pool, "log_file", None):
            pool.log_file.close()


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; none found elsewhere)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _exit_now() -> None:
    if not _code:  # no code recorded (an entrypoint that did not say): let Python finish
        return
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_code[0])

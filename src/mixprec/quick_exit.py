"""Exit as soon as the run is over. After its final line a process still runs every atexit
handler (loader workers, W&B, inductor's compile workers), then tears the interpreter down:
every module, tensor and CUDA object freed one by one, seconds for a process that compiled a
model. install() registers, before anything else can, the handler that atexit runs last: it
flushes the logs and ends the process with the code it was going to exit with, skipping the
teardown (the OS frees the memory and the GPU's context either way)."""

from __future__ import annotations

import atexit
import os
import sys

_code: list[int] = []


def install() -> None:
    """Call first thing in the entrypoint, before torch and Hydra register their handlers."""
    atexit.register(_exit_now)


def exiting_with(code: object) -> None:
    """The code the process is about to exit with (a SystemExit's code, as Python reads it)."""
    _code[:] = [code if isinstance(code, int) else 0 if code is None else 1]


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

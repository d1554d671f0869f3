"""Patches of torch's and CPython's private internals, all in one place: each reads or changes
state that no public API exposes, so each is version-gated or switchable (docs/architecture.md
lists them with what they buy and the versions they were measured on). inductor_fix.py: a warm
start must not re-tune cached kernels; quick_exit.py: exit without the interpreter's teardown
once the final line is written. (tuning_ahead, coordinate-descent tuning compiled ahead in
worker processes, is gone: model.compile_cache, torch's own cache artifacts, starts a new
machine 104 s sooner, benchmarks/RESULTS.md.)

Each is switched off by naming it in MIXPREC_PATCHES_OFF (comma-separated: inductor_fix,
quick_exit; `all` for every one), so that what it buys can be measured side by side
and a torch it breaks can still run. And each is gated by version (GATES): on a torch (or, for
quick_exit, a Python) it was not written and tested for, it does nothing and says so once.

May import: nothing of mixprec's (the lowest floor: every other may import it).
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("mixprec")
SWITCH = "MIXPREC_PATCHES_OFF"
PATCHES = ("inductor_fix", "quick_exit")
# the versions each patch was written and tested for (major.minor): measured on the GPU with torch
# 2.11, tested on the CPU with 2.11 (CI's minimum) and 2.14 (CI); inductor's bug that
# inductor_fix mends was fixed upstream after 2.11
GATES = {
    "inductor_fix": ("torch", ("2.11",)),
    "quick_exit": ("python", ("3.11", "3.12", "3.13")),
}
_said: set[str] = set()


def enabled(name: str) -> bool:
    """Whether the patch `name` may be applied: MIXPREC_PATCHES_OFF does not name it, and this
    torch (Python) is one it was written for. A patch that is off says why, once."""
    off = {w.strip() for w in os.environ.get(SWITCH, "").split(",") if w.strip()}
    why = None
    if name in off or "all" in off:
        why = f"{SWITCH}={os.environ[SWITCH]}"
    else:
        what, versions = GATES[name]
        have = _version(what)
        if have not in versions:
            why = f"written for {what} {', '.join(versions)}; this is {what} {have}"
    if why is None:
        return True
    if name not in _said:
        _said.add(name)
        log.info("%s is off (%s)", name, why)
    return False


def _version(what: str) -> str:
    """major.minor of torch or of this Python."""
    if what == "python":
        return f"{sys.version_info[0]}.{sys.version_info[1]}"
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])

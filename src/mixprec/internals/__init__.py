"""Patches of torch's and CPython's private internals, all in one place: each reads or changes
state that no public API exposes, so each is version-gated or switchable (docs/architecture.md
lists them with what they buy and the versions they were measured on). inductor_fix.py: a warm
start must not re-tune cached kernels; tuning_ahead.py, tuning_policy.py, tuning_workers.py:
coordinate-descent tuning compiled ahead in worker processes; quick_exit.py: exit without the
interpreter's teardown once the final line is written.

Each is switched off by naming it in MIXPREC_PATCHES_OFF (comma-separated: inductor_fix,
tuning_ahead, quick_exit; `all` for every one), so that what it buys can be measured side by side
and a torch it breaks can still run.

May import: core.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("mixprec")
SWITCH = "MIXPREC_PATCHES_OFF"
PATCHES = ("inductor_fix", "tuning_ahead", "quick_exit")
_said: set[str] = set()


def enabled(name: str) -> bool:
    """Whether the patch `name` may be applied (MIXPREC_PATCHES_OFF does not name it); a patch
    switched off says so once."""
    off = {w.strip() for w in os.environ.get(SWITCH, "").split(",") if w.strip()}
    if name in off or "all" in off:
        if name not in _said:
            _said.add(name)
            log.info("%s is off (%s=%s)", name, SWITCH, os.environ[SWITCH])
        return False
    return True

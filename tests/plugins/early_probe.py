"""An early module (core/early.py) from outside mixprec: conf/precision/early_probe.yaml names
it. It records, in the file $EARLY_PROBE names, whether torch was imported when train.py
started it, the command line it was given, and its release."""

from __future__ import annotations

import json
import os
import sys


def _say(event: dict) -> None:
    with open(os.environ["EARLY_PROBE"], "a") as f:
        f.write(json.dumps(event) + "\n")


def start(argv: list[str]) -> None:
    _say({"event": "start", "torch_imported": "torch" in sys.modules, "argv": argv})


def release() -> None:
    _say({"event": "release", "torch_imported": "torch" in sys.modules})

"""The patches of private internals (src/mixprec/internals/): each has its switch
(MIXPREC_PATCHES_OFF) and its version gate, and off it leaves torch's own objects in place."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec import internals


@pytest.mark.slow
def test_every_patch_of_private_internals_has_its_switch():
    """MIXPREC_PATCHES_OFF switches each patch off in a fresh process: inductor's recheck stays
    torch's own, and no exit handler of mixprec's is registered."""
    code = """
import atexit
from torch._inductor.runtime import triton_heuristics as th
before = th.CachingAutotuner.recheck_autotune_cache
from mixprec.internals import inductor_fix, quick_exit
quick_exit.install()
applied = inductor_fix.apply()
own = before is th.CachingAutotuner.recheck_autotune_cache
print(applied, atexit._ncallbacks(), own)
"""

    def run(off: str) -> list[str]:
        env = {**os.environ, "MIXPREC_PATCHES_OFF": off}
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout.split()

    off = run("all")
    assert off[0] == "False" and off[2] == "True"
    on = run("")
    without_exit = run("quick_exit")  # one name switches one patch
    assert int(on[1]) == int(without_exit[1]) + 1 == int(off[1]) + 1
    assert on[0] == without_exit[0]  # inductor_fix as its gate says, either way


def test_a_patch_on_a_torch_it_was_not_written_for_does_nothing_and_says_so_once(
    monkeypatch, caplog
):
    monkeypatch.delenv(internals.SWITCH, raising=False)
    monkeypatch.setattr(internals, "_said", set())
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert internals.enabled("inductor_fix")  # the version it was written for
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with caplog.at_level(logging.INFO, logger="mixprec"):
        assert not internals.enabled("inductor_fix") and not internals.enabled("inductor_fix")
    said = [r.message for r in caplog.records if "inductor_fix is off" in r.message]
    assert said == ["inductor_fix is off (written for torch 2.11; this is torch 2.99)"]
    monkeypatch.setattr(internals, "GATES", {**internals.GATES, "quick_exit": ("python", ("2.7",))})
    assert not internals.enabled("quick_exit")  # a Python it was not written for
    assert set(internals.GATES) == set(internals.PATCHES)  # every patch has its gate


# torch's private state that mixprec once read outside internals/ (issue 67): the names
PRIVATE_STATE = {
    "_orig_mod",
    "_local_tensor",
    "_init_scale",
    "_growth_factor",
    "_backoff_factor",
    "_growth_interval",
    "_growth_tracker",
    "_per_optimizer_states",
    "_BatchNorm",
    "_NormBase",
}


def private_torch_names(path) -> list[str]:
    """The places in one module that reach torch's underscore names: `import torch._x`,
    `from torch._x import` / `from torch import _x`, `torch._x` in code, and the private
    state above as an attribute or a getattr string (docstrings and messages may name them)."""
    import ast

    tree, found = ast.parse(path.read_text()), []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if "._" in a.name]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            private = "._" in node.module or any(a.name.startswith("_") for a in node.names)
            found += [f"{where} from {node.module} import ..."] if private else []
        elif isinstance(node, ast.Attribute):
            root = node
            while isinstance(root, ast.Attribute):
                root = root.value
            torchs = isinstance(root, ast.Name) and root.id in ("torch", "nn")
            if (torchs and node.attr.startswith("_") and not node.attr.startswith("__")) or (
                node.attr in PRIVATE_STATE
            ):
                found.append(f"{where} .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "import_module"
            and node.args
            and str(getattr(node.args[0], "value", "")).startswith("torch._")
        ):
            found.append(f"{where} import_module {node.args[0].value}")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("getattr", "hasattr")
            and len(node.args) > 1
            and getattr(node.args[1], "value", None) in PRIVATE_STATE
        ):
            found.append(f"{where} getattr {node.args[1].value}")
    return found


def test_no_private_torch_name_is_read_outside_internals():
    """Private names where they are declared: every read of torch's underscore names (dynamo's
    counters, OptimizedModule, the foreach kernels, GradScaler's and DTensor's private state)
    goes through src/mixprec/internals/, the lowest floor; elsewhere the public API."""
    src = Path(__file__).resolve().parents[1] / "src" / "mixprec"
    found = [
        hit
        for path in sorted(src.rglob("*.py"))
        if "internals" not in path.relative_to(src).parts
        for hit in private_torch_names(path)
    ]
    assert not found, "torch's private names outside internals/: " + ", ".join(found)
    # (the check finds what it looks for: the reader itself is full of them)
    assert len(private_torch_names(src / "internals" / "torch_private.py")) >= 5

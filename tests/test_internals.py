"""The patches of private internals (src/mixprec/internals/): each has its switch
(MIXPREC_PATCHES_OFF) and its version gate, and off it leaves torch's own objects in place."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

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

"""benchmarks/peers.py, the side-by-side command, on a CPU-sized model: each side of a row runs
in its own process and the table's ratio is the two sides' measured rates."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT


def peers(*args: str) -> subprocess.CompletedProcess:
    """benchmarks/peers.py on llama_tiny's shape on the CPU, lm_fp32, 10 timed steps."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--tiny", "--device", "cpu"]
        + ["--rows", "lm_fp32", "--steps", "10", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_side_by_side_command_writes_the_ratio_of_its_two_measured_rates(tmp_path):
    p = peers("--warmup", "2", "--out", str(tmp_path))
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    got = json.loads((tmp_path / "peers.json").read_text())["lm_fp32"]
    peer, mine = got["peer"]["rate"], got["mixprec"]["rate"]
    assert peer > 0 and mine > 0 and got["peer"]["unit"] == got["mixprec"]["unit"] == "tokens/s"
    row = next(
        line for line in (tmp_path / "peers.md").read_text().splitlines() if "| lm_fp32 |" in line
    )
    assert float(re.search(r"\*\*([\d.]+)\*\*", row).group(1)) == pytest.approx(
        mine / peer, abs=6e-4
    )
    bad = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--rows", "lm_fp64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "lm_fp64" in bad.stderr and "lm_bf16" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,said",
    [
        (["--tiny", "--device", "cpu", "--rows", "lm_fp32", "--steps", "-3"], "--steps must"),
        (["--rows", "lm_bf16"], "needs a CUDA GPU and none is visible"),
    ],
    ids=["negative-steps", "cuda-default-on-a-cpu"],
)
def test_a_bad_command_is_one_line_and_exit_2(args, said):
    """Issue 90, item 15: each was a traceback (the second after the peer's whole run)."""
    import torch

    if "cuda" in said and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.slow
def test_hf_off_leaves_the_hugging_face_side_out_and_the_table_says_so(tmp_path):
    p = peers("--warmup", "1", "--hf", "off", "--torchtitan", "off", "--out", str(tmp_path))
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    got = json.loads((tmp_path / "peers.json").read_text())["lm_fp32"]
    assert got["peer"] is None and got["mixprec"]["rate"] > 0
    assert "| lm_fp32 | - | - |" in (tmp_path / "peers.md").read_text()

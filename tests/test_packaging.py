"""environment.yml (conda) and pyproject.toml (pip) must ask for the same packages."""

from __future__ import annotations

import re
import tomllib

import yaml

from conftest import ROOT


def _norm(req: str) -> str:
    return re.sub(r"\s+", "", req.split("#")[0]).lower()


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    want = {
        _norm(r)
        for r in project["dependencies"]
        + extras["test"]
        + extras["sweep"]
        + extras["cluster"]
        + extras["fp8"]
        + extras["tensorboard"]
    }
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    got = {_norm(r) for r in pip if not r.startswith("-e")}
    assert got == want, f"only in environment.yml: {got - want}; only in pyproject: {want - got}"


def test_the_minimums_ci_installs_are_the_ones_pyproject_declares():
    """make test-min installs .ci/min-constraints.txt: the lower bounds of torch and torchvision
    in pyproject.toml, so the declared floor is a tested one."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = dict(
        r.split(">=", 1)
        for r in project["dependencies"]
        if r.startswith(("torch>", "torchvision>"))
    )
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / ".ci" / "min-constraints.txt").read_text().splitlines()
        if "==" in line
    )
    assert {k: v.split(".")[:2] for k, v in pins.items()} == {
        k: v.split(".")[:2] for k, v in floors.items()
    }

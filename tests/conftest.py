"""Shared fixtures: compose any config the way train.py does, shrunk to a CPU-sized run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from mixprec.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
register_configs()

# Small enough for a 2-core CPU: a couple of steps, no W&B unless a test asks for it.
CPU_SMALL = ["hardware=cpu", "logger=none", "trainer.log_every=1", "trainer.perf_warmup_steps=0"]


def compose_cfg(overrides: list[str], run_dir: Path | None = None) -> DictConfig:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        extra = [f"run_dir={run_dir}"] if run_dir is not None else ["run_dir=."]
        return compose("train", overrides=[*extra, *overrides])


@pytest.fixture
def cfg_factory(tmp_path):
    def make(*overrides: str, small: bool = True) -> DictConfig:
        return compose_cfg([*(CPU_SMALL if small else []), *overrides], tmp_path / "run")
    return make


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def run_train(args: list[str], cwd: Path = ROOT, env_extra: dict | None = None,
              timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env_extra or {})}
    env.pop("WANDB_API_KEY", None)
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

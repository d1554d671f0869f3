"""Every `python train.py` command in the README and docs/*.md works as written: the ones a CPU
can run train
(shortened by appended overrides: a step or two, no W&B, a temporary run dir), the GPU ones stop
at once with a message that says they need a GPU, and the ones naming data we do not have stop at
once naming data.root. Single runs are composed and run in this process, as train.py would;
sweeps run as train.py subprocesses. SLURM commands are exercised by test_slurm.py, torchrun by
test_distributed.py."""

from __future__ import annotations

import os
import re
import shlex

import pytest
import yaml

from mixprec.core.errors import ConfigError
from mixprec.run import session as run

from conftest import ROOT, compose_cfg, run_train

SHORT = [
    "trainer.max_steps=2",
    "trainer.min_steps=0",
    "trainer.log_every=1",
    "logger=none",
    "trainer.perf_warmup_steps=0",
]
# optuna's objective is samples/s. Sampler seed 8 draws two trials that do not compile (seed 0's
# both did: 9 and 22 s of CPU compile; compiled jobs of a sweep are test_lm.py's)
TIMED = ["trainer.max_steps=11", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=8"]
# a language model's commands on a smaller shape too: this CPU has no bf16 or fp16 matmul units
# (12x slower than fp32), and the defaults' batch of 8,192 tokens took 9 s a step in bf16
LM_SHORT = ["data.seq_len=32", "data.val_sequences=8", "batch=8"]
# torchao's low-bit optimizers compile their step once per weight shape: llama_tiny's 6 shapes
# become 3 when every projection is square (8bit: 6 compiles in 41 s, 3 in 29 s, on 2 cores)
TAO_SHORT = ["model.kwargs.n_kv_heads=4", "model.kwargs.ffn_dim=128"]
GPU = re.compile(
    r"experiment=(resnet50_synthetic|fast|seed_table|fp8_table|lm_table|optim_table|quality_lm|quality_llama_1b)|"
    r"needs_gpu=true|optimizer.offload=cpu|"
    r"model=llama_(1b|8b_slice)|"
    r"precision=fp8|batch=auto|"
    r"cuda_graphs=true|hardware=(rtx3090|a100|h100|h200)"
)
SWEEP_PRESETS = (
    "experiment=precision_sweep",
    "experiment=accuracy_parity",
    "experiment=optuna_throughput",
)


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def readme_commands(refused: bool = False) -> list[str]:
    """The docs' `python train.py` commands (`refused`: those whose comment says the run is
    refused, which must then be refused before it trains)."""
    text = "".join(p.read_text() for p in DOCS)
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line, _, comment = line.partition("  #")
            line = line.strip()
            if line.startswith("python train.py") and "hydra/launcher=slurm" not in line:
                if not refused or "refused" in comment:
                    commands.append(line)
    assert refused or len(commands) >= 15, commands
    return sorted(set(commands), key=commands.index)


def as_the_shell_passes(command: str) -> list[str]:
    args = [os.path.expandvars(a) for a in shlex.split(command)[2:]]
    return [a for a in args if not a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_works_as_written(command, tmp_path):
    args = as_the_shell_passes(command)
    short = SHORT + (LM_SHORT if re.search(r"data=(text|tokens)\b", command) else [])
    if "model=llama_tiny" in command and "optimizer.state=" in command:
        short += TAO_SHORT
    if "-m" in args or any(a in SWEEP_PRESETS for a in args):
        extra = TIMED if "optuna" in command else []
        if "hydra.sweeper.params.batch" in command:  # what it shows is the quoting: 2 jobs do
            extra = ["hydra.sweeper.params.precision=fp32"]
        proc = run_train([*args, *short, *extra, f"hydra.sweep.dir={tmp_path}"], timeout=400)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert (tmp_path / "report.md").exists()
        if "optuna" in command:  # the study ran its trials and names the best parameters
            best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
            assert best["best_value"] > 0
            assert set(best["best_params"]) == {"batch", "model.channels_last", "model.compile"}
            assert len([d for d in tmp_path.iterdir() if d.name.isdigit()]) == 2
        return
    cfg = compose_cfg([*args, *short], tmp_path / "run")  # the parser train.py uses
    if command in readme_commands(refused=True):  # the docs say so: refused, nothing trained
        with pytest.raises(ConfigError):
            run.run(cfg)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    elif GPU.search(command) or "data.root=" in command:
        with pytest.raises(ConfigError, match="GPU|CUDA|data.root"):
            run.run(cfg)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    else:
        assert run.run(cfg)["status"] == "completed"

"""What a run says to the person at the terminal: the final line (how it ended, its headline
numbers, where its files are) and the exact next command or advice."""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
from pathlib import Path

from mixprec.core import hardware, launch


def final_line(s) -> str:
    """How the run ended, its headline numbers, where its files are, and what to do next."""
    sm, run_dir = s.summary, s.p.run_dir
    head = f"{sm['status']} in {sm['wall_s']:.1f}s at step {sm['steps']}/{sm['optimizer_steps']}"
    if s.status == "completed":
        sps = f"{sm['samples_per_s']:,.0f} samples/s" if sm["samples_per_s"] else "samples/s n/a"
        if sm.get("tokens_per_s"):
            sps = f"{sm['tokens_per_s']:,.0f} tokens/s"
        acc = _quality(sm)
        return (
            f"{head}: {acc}, {sps}, peak {sm['peak_mem_gib']:.2f} GiB ({sm['memory']}) -> {run_dir}"
        )
    ckpt = sm["checkpoint"] or "none written"
    if s.status == "preempted":
        name = signal.Signals(s.error.signum).name
        if launch.multirun() and not launch.own_process():  # the stop ends the whole sweep
            return f"{head} ({name}); checkpoint: {ckpt}; finish the sweep with: " + (
                sweep_resume_command() or resume_command(run_dir)
            )
        return f"{head} ({name}); checkpoint: {ckpt}; continue with: {resume_command(run_dir)}"
    return f"{head} ({s.error.label if s.error else 'error'}); last checkpoint: {ckpt} -> {run_dir}"


def _quality(sm: dict) -> str:
    """The headline quality number: top-1, or a language model's val loss (and bits per byte)."""
    if sm.get("val_acc1") is not None:
        return f"val_acc1 {sm['val_acc1']:.4f}"
    if sm.get("val_loss") is not None:
        bpb = f" ({sm['val_bpb']:.3f} bits/byte)" if sm.get("val_bpb") is not None else ""
        return f"val_loss {sm['val_loss']:.4f}{bpb}"
    return "no evaluation"


def resume_command(run_dir: Path) -> str:
    """The command that continues this run: its overrides, resume=auto and its run dir."""
    keep = [
        o
        for o in launch.task_overrides()
        if not o.startswith(("resume=", "hydra.run.dir=", "hydra.sweep.", "hydra/launcher"))
    ]
    args = [*keep, "resume=auto", f"hydra.run.dir={hydra_value(str(run_dir))}"]
    script = Path(sys.argv[0]).name or "train.py"
    return " ".join([*launcher(), script, *map(shlex.quote, args)])


def sweep_resume_command() -> str | None:
    """The one command that finishes an interrupted multirun: its overrides as typed (its
    sweeps included, so every job keeps its dir), resume=auto and its sweep dir. Finished
    jobs are read back, the stopped one continues from its checkpoint, the rest run, then
    the report is written."""
    saved, sweep = launch.sweep_overrides(), launch.sweep_dir()
    if saved is None or sweep is None:
        return None
    keep = [o for o in saved[0] if not o.startswith(("resume=", "hydra.sweep.dir="))]
    args = [*keep, "resume=auto", f"hydra.sweep.dir={hydra_value(str(sweep))}"]
    script = Path(sys.argv[0]).name or "train.py"
    return " ".join(["python", script, "-m", *map(shlex.quote, args)])


def launcher() -> list[str]:
    """How this process was started: python, or torchrun (one node: its process count)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env:
        return ["python"]
    if env.get("WORLD_SIZE") == env.get("LOCAL_WORLD_SIZE"):
        return ["torchrun", f"--nproc_per_node={env.get('LOCAL_WORLD_SIZE')}"]
    return ["torchrun", "<this job's torchrun options>"]  # several nodes: their rendezvous


def hydra_value(value: str) -> str:
    """A value as Hydra's override parser reads it: plain where it may be, else quoted (a path
    with spaces or non-ASCII characters)."""
    if re.fullmatch(r"[A-Za-z0-9_/.\-:+@~]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def oom_advice(p) -> str:
    mem = hardware.memory_stats(p.device)
    return (
        f"out of GPU memory at batch={p.layout.batch} (peak {mem['mem/peak_gib']:.2f} GiB, "
        f"cap {p.hw.memory_gib} GiB on {p.hw.name}); try a smaller batch, "
        "model.grad_checkpointing=true, or batch=auto"
    )


def diverged(step: int, advice: str) -> str:
    return (
        f"the run ended at step {step} with non-finite loss, weights or BatchNorm "
        f"statistics; its results are not usable. Try {advice}"
    )

"""What a run says about itself: the W&B settings and the config that ran (resolved values, only
the keys that apply), summary.json, the final console line, and messages that give the exact
next command."""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import shlex
import signal
import sys
from pathlib import Path

import torch

from . import __version__, hardware, optim
from .errors import MixprecError
from .tracking import wandb_mode, write_json_atomic


def _hydra():
    from hydra.core.hydra_config import HydraConfig
    return HydraConfig.get() if HydraConfig.initialized() else None


def multirun() -> bool:
    hc = _hydra()
    return hc is not None and str(hc.mode) == "RunMode.MULTIRUN"


def own_process() -> bool:
    """This job runs in a process of its own (a submitit job: SLURM, or hydra/launcher=local)."""
    return "SUBMITIT_EXECUTOR" in os.environ


def wandb_settings(p) -> dict | None:
    """wandb.init's project/entity/group/name/tags/mode, or None with logger=none."""
    c, hc = p.config, _hydra()
    if c.logger.name != "wandb":
        return None
    name = (hc.job.override_dirname if hc else "") or Path(c.run_dir).name
    tags = {c.precision.name, c.model.name, p.hw.name, c.name, *c.logger.tags}
    return dict(project=c.logger.project, entity=c.logger.entity, group=group(c, hc), name=name,
                tags=sorted(tags), mode=wandb_mode(c.logger.mode), timeout_s=c.logger.timeout_s)


def group(c, hc) -> str:
    """logger.group, else `<name>-<sweep>` for a multirun (its dated sweep dir) and
    `<name>-<date>` for a single run."""
    if c.logger.group:
        return c.logger.group
    if hc is not None and str(hc.mode) == "RunMode.MULTIRUN":
        sweep = Path(hc.sweep.dir)
        dated = re.fullmatch(r"\d{4}-\d{2}-\d{2}", sweep.parent.name)
        return f"{c.name}-{sweep.parent.name + '_' if dated else ''}{sweep.name}"
    return f"{c.name}-{datetime.date.today().isoformat()}"


def wandb_id(blob: dict | None, source: Path | None, run_dir: Path) -> str | None:
    """The W&B run to continue: only this run dir's own (a run started from another run's
    checkpoint is a new run, with a new id)."""
    if blob is None or source is None:
        return None
    return blob.get("wandb_id") if source.resolve().parent.parent == run_dir.resolve() else None


def what_ran(p) -> dict:
    """The W&B config: values after resolution, only the keys that apply to this run."""
    c, prec, lay = p.config, p.learner.precision, p.layout
    gpu = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else "CPU"
    opt = {k: v for k, v in dataclasses.asdict(c.optimizer).items() if v is not None}
    opt["fused"] = optim.use_fused(c.optimizer, p.device.type)
    sched = {k: v for k, v in dataclasses.asdict(c.scheduler).items() if v is not None}
    if c.scheduler.name != "onecycle":
        sched["warmup_steps"] = c.scheduler.warmup(p.plan.total_steps)
    model = {k: v for k, v in dataclasses.asdict(c.model).items()
             if v not in ({}, None) and not (k.startswith("compile_") and not c.model.compile)}
    out = {"precision": c.precision.name,
           "autocast": str(prec.dtype).replace("torch.", "") if prec.dtype else "off",
           "tf32": prec.tf32, "batch": lay.batch, "accum": lay.accum, "world_size": lay.world,
           "effective_batch": lay.effective, "lr": p.lr, "optimizer_steps": p.plan.total_steps,
           "optimizer": opt, "scheduler": sched, "model": model,
           "data": dataclasses.asdict(c.data), "hardware": p.hw.name, "gpu": gpu,
           "device": str(p.device), "memory_cap_gib": p.hw.memory_gib,
           "trainer": {k: v for k, v in dataclasses.asdict(c.trainer).items() if v is not None},
           "seed": c.seed, "experiment": c.name, "torch": torch.__version__,
           "mixprec": __version__}
    if prec.scaling:
        out["scaler"] = {k: v for k, v in dataclasses.asdict(c.scaler).items() if k != "enabled"}
    if c.precision.fp8_recipe:
        out.update(fp8_recipe=c.precision.fp8_recipe, fp8_head=c.precision.fp8_head,
                   fp8_layers=len(prec.linears.converted))
    if lay.max_batch is not None:
        out["max_batch"] = lay.max_batch
    return {k: v for k, v in out.items() if v is not None}


def record_failure(cfg, e: MixprecError, replace: bool = False) -> None:
    """summary.json for a run that failed before training wrote one: a multirun job with a
    config error (for the sweep's report and exit code), or, with `replace`, a resume that did
    not fit a run dir whose earlier summary would still say `completed`."""
    from omegaconf import OmegaConf
    pick = lambda key: OmegaConf.select(cfg, key, default=None, throw_on_missing=False)  # noqa: E731
    run_dir = Path(pick("run_dir") or ".")
    if run_dir.is_dir() and (replace or not (run_dir / "summary.json").exists()):
        write_json_atomic(run_dir / "summary.json", {
            "status": "failed", "precision": pick("precision.name"), "batch": pick("batch"),
            "steps": 0, "model": pick("model.name"), "data": pick("data.name"), "error": str(e),
            "exit_code": e.exit_code})


def final_line(s) -> str:
    """How the run ended, its headline numbers, where its files are, and what to do next."""
    sm, run_dir = s.summary, s.p.run_dir
    head = f"{sm['status']} in {sm['wall_s']:.1f}s at step {sm['steps']}/{sm['optimizer_steps']}"
    if s.status == "completed":
        sps = f"{sm['samples_per_s']:,.0f} samples/s" if sm["samples_per_s"] else "samples/s n/a"
        acc = f"val_acc1 {sm['val_acc1']:.4f}" if sm["val_acc1"] is not None else "no evaluation"
        return (f"{head}: {acc}, {sps}, peak {sm['peak_mem_gib']:.2f} GiB ({sm['memory']}) -> "
                f"{run_dir}")
    ckpt = sm["checkpoint"] or "none written"
    if s.status == "preempted":
        name = signal.Signals(s.error.signum).name
        return (f"{head} ({name}); checkpoint: {ckpt}; continue with: "
                f"{resume_command(run_dir)}")
    return f"{head} ({s.error.label if s.error else 'error'}); last checkpoint: {ckpt} -> {run_dir}"


def resume_command(run_dir: Path) -> str:
    """The command that continues this run: its overrides, resume=auto and its run dir."""
    hc = _hydra()
    keep = [o for o in (hc.overrides.task if hc else [])
            if not o.startswith(("resume=", "hydra.run.dir=", "hydra.sweep.", "hydra/launcher"))]
    args = [*keep, "resume=auto", f"hydra.run.dir={run_dir}"]
    return " ".join(["python", Path(sys.argv[0]).name or "train.py", *map(shlex.quote, args)])


def oom_advice(p) -> str:
    mem = hardware.memory_stats(p.device)
    return (f"out of GPU memory at batch={p.layout.batch} (peak {mem['mem/peak_gib']:.2f} GiB, "
            f"cap {p.hw.memory_gib} GiB on {p.hw.name}); try a smaller batch, "
            "model.grad_checkpointing=true, or batch=auto")

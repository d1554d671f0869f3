"""What ran, as the dashboards' config (W&B's columns, TensorBoard's config text): resolved
values (the effective batch, the lr actually used, the hardware profile and GPU that ran), and
only the keys that apply to this run's data, model, optimizer and precision."""

from __future__ import annotations

import dataclasses

import torch

from mixprec import __version__
from mixprec.optim import optimizers as optim


def what_ran(p) -> dict:
    c, lay = p.config, p.layout
    gpu = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else "CPU"
    opt = {k: v for k, v in dataclasses.asdict(c.optimizer).items() if v is not None}
    opt["fused"] = optim.use_fused(c.optimizer, p.device.type)
    sched = {k: v for k, v in dataclasses.asdict(c.scheduler).items() if v is not None}
    if c.scheduler.name != "onecycle":
        sched["warmup_steps"] = c.scheduler.warmup(p.plan.total_steps)
    model = {
        k: v
        for k, v in dataclasses.asdict(c.model).items()
        if v not in ({}, None) and not (k.startswith("compile_") and not c.model.compile)
    }
    if c.model.source != "hf":
        model.pop("hf", None)
    if c.model.source != "timm":  # the group file's timm name did not build this model
        model.pop("name", None)
    model["source"] = c.model.source
    out = {
        **p.learner.precision.columns(),
        "batch": lay.batch,
        "accum": lay.accum,
        "world_size": lay.world,
        "effective_batch": lay.effective,
        "parallel": _plugin_shown(
            {k: v for k, v in dataclasses.asdict(c.parallel).items() if v is not None}
        ),
        "lr": p.lr,
        "optimizer_steps": p.plan.total_steps,
        "optimizer": opt,
        "scheduler": sched,
        "model": model,
        "data": _plugin_shown(dataclasses.asdict(c.data)),
        "hardware": p.hw.name,
        "gpu": gpu,
        "device": str(p.device),
        "memory_cap_gib": p.hw.memory_gib,
        "trainer": {k: v for k, v in dataclasses.asdict(c.trainer).items() if v is not None},
        "seed": c.seed,
        "experiment": c.name,
        "torch": torch.__version__,
        "mixprec": __version__,
        "logger": p.config.logger.names,
    }
    if p.learner.precision.scaling:
        out["scaler"] = {k: v for k, v in dataclasses.asdict(c.scaler).items() if k != "enabled"}
    if lay.max_batch is not None:
        out["max_batch"] = lay.max_batch
    return {k: v for k, v in out.items() if v is not None}


def _plugin_shown(group: dict) -> dict:
    """A group's keys with its plugin module only where it is not mixprec's own (which its
    name already says): a run with a strategy or dataset of yours shows whose it was."""
    if str(group.get("plugin", "")).startswith("mixprec."):
        group = {k: v for k, v in group.items() if k != "plugin"}
    return group

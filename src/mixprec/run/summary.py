"""summary.json: how a run ended and its headline numbers, made by one producer (make) for every
way a run can end: trained (completed, failed, preempted: of_session), refused before training
(a config error in a sweep job, a resume that did not fit: of_refusal), or never written (read,
for the report). The contract's keys come first, in the contract's order, and are always there
(null where unknown); metric values take their names from the registry (metrics.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from mixprec import models
from mixprec.checkpoint import store as checkpoint
from mixprec.core import hardware, metrics
from mixprec.core.errors import MixprecError
from mixprec.sinks.local import make, write
from mixprec.training import perf


def of_session(s) -> dict:
    """The summary of a run that started training, however it ended (run.Session)."""
    p, c, st = s.p, s.p.config, s.state
    meter, mem = s.hooks.meter, hardware.memory_stats(p.device)
    val = {m.summary: None for m in metrics.METRICS if m.key.startswith("val/")}  # null: n/a
    val.update({metrics.summary_name(k): v for k, v in st.val.items()})
    return make(
        s.error,
        status=s.status,
        precision=c.precision.name,
        batch=p.layout.batch,
        accum=p.layout.accum,
        effective_batch=p.layout.effective,
        world_size=p.layout.world,
        steps=st.step,
        samples_per_s=meter.steady_rate,
        seed=c.seed,  # with precision, what a study pairs the run by
        peak_mem_gib=mem["mem/peak_gib"],
        **val,
        skipped_steps=st.skipped_steps,
        loss_scale=_loss_scale(p.learner.precision),
        mfu=meter.mfu(meter.steady_rate),
        wall_s=s.wall_s,
        train_s=round(s.train_s, 3),
        tokens_per_s=meter.tokens(meter.steady_rate),
        task=p.data.task.name,
        train_loss=st.last_loss,
        optimizer_steps=p.plan.total_steps,
        lr=p.lr,
        model=c.model.label,
        **dict(zip(("params", "params_trainable"), models.parameter_counts(p.learner.model))),
        data=c.data.name,
        hardware=p.hw.name,
        device=str(p.device),
        memory=hardware.memory_kind(p.device),
        torch=torch.__version__,
        max_batch=p.layout.max_batch,
        batch_auto=p.layout.why,  # batch=auto: what grows per sample, what is fixed
        grad_checkpointing=c.model.grad_checkpointing,
        memory_cap_gib=p.hw.memory_gib,
        checkpoint=_path(checkpoint.latest(s.ckpt.parent)),  # last.pt, or last.dcp
        doctor=s.hooks.doctor.findings,  # where steps overflowed (doctor.py)
        precision_plan=p.learner.precision.plan_summary(),  # fp8_auto's per-layer plan
        dtype_plan=s.hooks.dtype_plan.result,  # the live dtypes after step 1 (dtype_plan.py)
        memory_breakdown=s.memory.result,  # debug.memory: the peak's parts (GiB)
        numerics=s.hooks.numerics.latest or None,  # the worst casts at the last probe
        first_step_s=meter.first_step_s,
        compile_s=perf.compile_s(),
        compile_first_step_s=meter.compile_first_s,
        tune_s=perf.tune_s(),
        **{metrics.summary_name(k): v for k, v in s.phases.result.items()},
    )


def of_state(state, precision: str) -> dict:
    """A finished run's summary from its checkpoint's loop state (its summary.json is gone)."""
    val = {metrics.summary_name(k): v for k, v in state.val.items()}
    return make(
        status="completed", precision=precision, steps=state.step, **{"val_acc1": None, **val}
    )


def _loss_scale(prec) -> float | None:
    try:
        return prec.loss_scale() if prec.scaling else None
    except RuntimeError:  # the device is in a bad state after a CUDA error
        return None


def of_refusal(cfg, e: MixprecError) -> dict:
    """The summary of a run that failed before training (`cfg`: the composed DictConfig)."""
    from omegaconf import OmegaConf

    pick = lambda key: OmegaConf.select(cfg, key, default=None, throw_on_missing=False)  # noqa: E731
    return make(
        e,
        status="failed",
        precision=pick("precision.name"),
        batch=pick("batch"),
        steps=0,
        seed=pick("seed"),
        model=pick("model.target") or pick("model.name"),
        data=pick("data.name"),
    )


def record_refusal(cfg, e: MixprecError, replace: bool = False) -> None:
    """Write of_refusal into the run dir: for a multirun job with a config error (the sweep's
    report and exit code read it), or, with `replace`, over a summary that would still say
    `completed` after a resume that did not fit."""
    from omegaconf import OmegaConf

    run_dir = Path(OmegaConf.select(cfg, "run_dir", default=None, throw_on_missing=False) or ".")
    if run_dir.is_dir() and (replace or not (run_dir / "summary.json").exists()):
        write(run_dir, of_refusal(cfg, e))


def _path(p: Path | None) -> str | None:
    return None if p is None else str(p)

"""Builds every object from the config, runs the loop, and always closes the logger.

This is the only module that reads the config; everything it builds gets plain objects/numbers.
"""
from __future__ import annotations

import logging
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from . import (batch_size, checkpoint, diagnose, distributed, hardware, loop, models, optim,
               perf, precision)
from . import data as datasets
from .config import ConfigError, TrainConfig, validate
from .safety import DivergenceGuard, Diverged, Preempted, StopSignals
from .tracking import Tracker, wandb_mode

log = logging.getLogger("mixprec")


EXIT_CONFIG, EXIT_DIVERGED = 2, 3  # preemption exits with 128 + the signal number


def main(cfg: DictConfig) -> float | None:
    """Hydra's task function: returns the objective (for sweepers such as Optuna); one clear
    message and a distinct exit code for each way to stop. In a multirun a failed job raises, so
    Hydra records it and the sweep goes on (the report shows it as a failed row)."""
    try:
        return run(cfg)[cfg.objective]
    except (ConfigError, Diverged) as e:  # an OOM is logged in run() and raised as it is
        config = isinstance(e, ConfigError)
        log.error("%s: %s", "config error" if config else "training diverged", e)
        if _multirun():
            raise
        raise SystemExit(EXIT_CONFIG if config else EXIT_DIVERGED) from None
    except Preempted as e:
        log.warning("preempted (%s): checkpoint written; continue with resume=auto", e)
        raise SystemExit(e.exit_code) from None


def _multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    return HydraConfig.initialized() and str(HydraConfig.get().mode) == "RunMode.MULTIRUN"


def run(cfg: DictConfig) -> dict:
    """Train as configured; returns the summary (also written to summary.json)."""
    c: TrainConfig = validate(cfg)
    hw = hardware.resolve(c.hardware)
    dd = distributed.init(hw.device)  # world 1 unless started by torchrun / SLURM
    try:
        return _run(c, cfg, hw, dd)
    finally:
        distributed.close()


def _run(c: TrainConfig, cfg: DictConfig, hw, dd: distributed.Dist) -> dict:
    device = hardware.setup(hw, dd.local_rank)
    run_dir = Path(distributed.broadcast_str(c.run_dir, dd))  # rank 0's Hydra run dir
    _seed_everything(c.seed + dd.rank)  # DDP copies rank 0's initial weights to every rank
    amp = precision.build(c.precision, c.scaler, device)
    models.check_name(c.model.name)  # fail fast, before any data is built
    world = dd.world
    batch, accum, max_batch = _choose_batch(c, hw, device, world)
    effective_batch = batch * accum * world
    data = datasets.build(c.data, hw, batch, device, c.seed, c.model.channels_last, dd.rank, world)
    model = models.build(c.model, data.num_classes, data.input_shape, device)
    peak = hw.peak_tflops.get(amp.peak_key)
    flops = (perf.train_flops_per_sample(model, data.input_shape, data.num_classes, device,
                                         amp.autocast)
             if peak else None)  # MFU needs a known peak: skip the count where there is none
    if c.model.cuda_graphs:  # a fixed batch shape: the one every training step has
        model = models.capture_graphs(model, _example(c, data.input_shape, device, batch), amp)
    lr = optim.scaled_lr(c.optimizer, effective_batch)
    optimizer = optim.build_optimizer(c.optimizer, model, lr, device)
    model = distributed.wrap(model, dd, device)
    steps_per_epoch = len(data.train) // accum
    if steps_per_epoch < 1:  # also with max_steps: no epoch would ever yield a step
        raise ConfigError(f"batch={batch} accum={accum}: one optimizer step needs "
                          f"{batch * accum} samples but an epoch of data={c.data.name} has "
                          f"{len(data.train) * batch}; lower batch or accum")
    total_steps = c.trainer.max_steps or steps_per_epoch * c.trainer.epochs
    scheduler = optim.build_scheduler(c.scheduler, optimizer, total_steps)
    _announce(c, hw, device, amp, batch, accum, effective_batch, lr, total_steps)

    resolved = OmegaConf.to_container(cfg, resolve=True)
    ckpt_path = run_dir / "checkpoints" / "last.pt"
    found = checkpoint.find(c.resume, run_dir) if c.resume else None
    blob = checkpoint.load(found) if found else None
    state = loop.TrainState()
    if blob is not None:
        state = checkpoint.restore(blob, found, model=model, optimizer=optimizer,
                                   scaler=amp.scaler, scheduler=scheduler,
                                   state_cls=loop.TrainState)
        log.info("resumed from %s at step %d (epoch %d, micro-batch %d)", found, state.step,
                 state.epoch, state.batch_in_epoch)
    tracker = Tracker(run_dir, _wandb_settings(c, hw) if c.logger.name == "wandb" else None,
                      resolved, run_id=blob["wandb_id"] if blob else None, rank0=dd.main,
                      resume_step=state.step if blob else None)

    def save(st: loop.TrainState) -> None:
        if dd.main:  # one writer; every rank holds the same weights
            checkpoint.save(ckpt_path, model=model, optimizer=optimizer, scaler=amp.scaler,
                            scheduler=scheduler, state=st, config=resolved,
                            wandb_id=tracker.run_id, keep=c.ckpt.keep)

    settings = loop.LoopSettings(
        epochs=c.trainer.epochs if c.trainer.max_steps is None else sys.maxsize,
        max_steps=c.trainer.max_steps, accum=accum, log_every=c.trainer.log_every,
        clip_grad_norm=c.trainer.clip_grad_norm, samples_per_step=effective_batch,
        ckpt_every=c.ckpt.every_steps, world=world, guard_bn_stats=c.scaler.guard_bn_stats)
    if max_batch is not None:
        tracker.log({"mem/max_batch": max_batch}, state.step)
    if c.diagnose:
        diagnose.on_run(checkpoint.unwrap(model), optimizer, _example(c, data.input_shape, device),
                        amp, tracker, run_dir, c.trainer.log_every)
    phases = hardware.PhaseMemory(model, optimizer, device)
    meter = perf.Throughput(device, c.trainer.perf_warmup_steps,
                            mfu=lambda sps: perf.mfu(flops, sps, peak, world))
    guard = DivergenceGuard(device, c.debug.max_bad_steps, c.debug.min_loss_scale,
                            reduce=distributed.all_reduce)
    torch.autograd.set_detect_anomaly(c.debug.detect_anomaly)
    hardware.reset_peak(device)
    t0, status, stop, oom = time.perf_counter(), "failed", StopSignals(), ""
    try:
        with stop:
            state = loop.train(model, data, F.cross_entropy, optimizer, scheduler, amp, tracker,
                               state, settings, meter, memory=lambda: hardware.memory_stats(device),
                               guard=guard, stop=stop, save=save, no_sync=distributed.no_sync,
                               reduce=distributed.all_reduce,
                               show_progress=sys.stderr.isatty() and dd.main)
        loop.save_if_healthy(save, state, guard, model)
        status = "completed"
    except Preempted:
        status = "preempted"
        raise
    except torch.OutOfMemoryError:  # not re-raised here: its traceback would pin the tensors
        mem = hardware.memory_stats(device)
        oom = (f"out of GPU memory at batch={batch} (peak {mem['mem/peak_gib']:.2f} GiB, cap "
               f"{hw.memory_gib} GiB on {hw.name}); try a smaller batch, "
               "model.grad_checkpointing=true, or batch=auto")
        log.error(oom)
    finally:
        data.close()  # stop loader workers now, not at interpreter exit (EpochLoader.close)
        summary = _summary(c, status, state, meter, amp, batch, accum, world, device,
                           time.perf_counter() - t0, hw, phases.result, max_batch)
        tracker.summary(summary)
        tracker.close(status)
        if status == "preempted":
            stop.forward()  # e.g. submitit's handler: requeue the job (it resumes with resume=auto)
    if status == "failed":  # only an OOM gets here: a fresh error, the failed step's memory freed
        batch_size.release()
        raise torch.OutOfMemoryError(oom)
    if c.diagnose and dd.main:
        diagnose.loss_scale_plot(run_dir)
    log.info("done: %s", {k: summary[k] for k in ("steps", "samples_per_s", "peak_mem_gib",
                                                  "val_acc1", "skipped_steps", "loss_scale")})
    return summary


def diagnose_only(cfg: DictConfig) -> str:
    """The audit for a config without training (`python -m mixprec.diagnose`)."""
    c = validate(cfg)
    device = hardware.setup(hardware.resolve(c.hardware))
    amp = precision.build(c.precision, c.scaler, device)
    num_classes, shape = datasets.spec(c.data)
    model = models.build(c.model, num_classes, shape, device)
    result = diagnose.audit(model, _example(c, shape, device), amp.autocast)
    return diagnose.markdown(result, amp.name)


def _example(c: TrainConfig, input_shape, device, n: int = 2) -> torch.Tensor:
    fmt = torch.channels_last if c.model.channels_last else torch.contiguous_format
    return torch.randn(n, *input_shape, device=device).contiguous(memory_format=fmt)


def _choose_batch(c: TrainConfig, hw, device, world: int) -> tuple[int, int, int | None]:
    """(micro-batch, accum, the searched maximum or None) from batch/accum/effective_batch."""
    batch, accum, max_batch = c.batch, c.accum, None
    if batch == "auto":
        batch, max_batch = _auto_batch(c, hw, device)
    if c.effective_batch is None:
        return batch, accum, max_batch
    if max_batch is not None:
        batch, accum, note = batch_size.split_effective(c.effective_batch, batch, world)
        if note:
            log.warning(note)
    else:
        accum, rest = divmod(c.effective_batch, batch * world)
        if rest or accum < 1:
            raise ConfigError(f"effective_batch={c.effective_batch} is not a multiple of batch="
                              f"{batch} x world size {world}; pick a batch that divides it, or "
                              "batch=auto to choose one")
    log.info("effective_batch=%d: micro-batch %d x accum %d x world %d", c.effective_batch,
             batch, accum, world)
    return batch, accum, max_batch


def _auto_batch(c: TrainConfig, hw, device) -> tuple[int, int]:
    """(micro-batch to use, the largest that trained)."""
    if device.type != "cuda":
        raise ConfigError("batch=auto searches GPU memory and needs a CUDA device; on the CPU "
                          "give batch=<int>")
    num_classes, shape = datasets.spec(c.data)
    bs = c.batch_search

    def probe(b: int) -> int:  # real steps with fresh state: the memory training will need
        model = models.build(c.model, num_classes, shape, device)
        amp = precision.build(c.precision, c.scaler, device)
        opt = optim.build_optimizer(c.optimizer, model, 1e-6, device)
        watch = precision.StepWatch(opt)
        x = _example(c, shape, device, b)
        y = torch.randint(0, num_classes, (b,), device=device)
        # training holds a second input batch (the prefetched next one, or synthetic data's
        # validation batch): without it a checkpointed bf16 run at 1,208 OOMed in its first steps
        second = torch.empty_like(x)  # noqa: F841
        stepped = 0
        for _ in range(3 * bs.probe_steps):  # skipped fp16 steps allocate no optimizer state
            stepped += loop.train_step(model, [(x, y)], F.cross_entropy, opt, amp, watch,
                                       c.trainer.clip_grad_norm).stepped
            if stepped >= bs.probe_steps:
                break
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)  # the peak guides the next probe

    settings = batch_size.SearchSettings(bs.start, bs.growth, bs.resolution, bs.margin, bs.aim,
                                         cache=Path(bs.cache).expanduser() if bs.cache else None)
    key = {"model": c.model.name, "kwargs": c.model.kwargs, "shape": list(shape),
           "classes": num_classes, "autocast": c.precision.autocast, "scaler": c.scaler.enabled,
           "optimizer": c.optimizer.name, "channels_last": c.model.channels_last,
           "compile": [c.model.compile, c.model.compile_mode],
           "grad_checkpointing": c.model.grad_checkpointing, "gpu": torch.cuda.get_device_name(device),
           "memory_gib": hw.memory_gib, "torch": torch.__version__,
           "clip": c.trainer.clip_grad_norm is not None, "resolution": bs.resolution}
    t0, limit = time.perf_counter(), hardware.memory_limit(device, hw.memory_gib)
    with hardware.cudnn_benchmark(False):  # probes: heuristics, no per-shape algorithm timing
        found, hit = batch_size.cached(key, settings, lambda: batch_size.search(
            probe, settings, agree=distributed.all_min, limit=limit))
    found = distributed.all_min(found)  # a rank that read a different cache still agrees
    batch = batch_size.with_margin(found, bs.margin)
    log.info("batch=auto: largest micro-batch that trains is %d (%s, %.1fs); using %d (margin "
             "%.0f%%, rounded to a multiple of 8)", found, "cached" if hit else "searched",
             time.perf_counter() - t0, batch, 100 * bs.margin)
    return batch, found


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _announce(c: TrainConfig, hw, device, amp, batch, accum, effective_batch, lr,
              total_steps) -> None:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    log.info("hardware=%s (%s), torch %s", hw.name, gpu, torch.__version__)
    log.info(amp.describe())
    if device.type == "cpu" and amp.dtype is not None:
        log.warning("precision=%s on the CPU: autocast %s is emulated there and far slower "
                    "than fp32 (measure it on a GPU; fp32 is the default for that reason)",
                    c.precision.name, amp.dtype)
    log.info("model=%s data=%s batch=%d accum=%d -> effective batch %d; lr %.4g (%s scaling "
             "from %.4g at %d); %d optimizer steps", c.model.name, c.data.name, batch, accum,
             effective_batch, lr, c.optimizer.scale_lr, c.optimizer.lr, c.optimizer.base_batch,
             total_steps)


def _wandb_settings(c: TrainConfig, hw) -> dict:
    from hydra.core.hydra_config import HydraConfig

    group, name = c.logger.group, Path(c.run_dir).name
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        name = hc.job.override_dirname or name
        if group is None and str(hc.mode) == "RunMode.MULTIRUN":
            group = f"{c.name}-{Path(hc.sweep.dir).name}"
    tags = [c.precision.name, c.model.name, hw.name, c.name, *c.logger.tags]
    return dict(project=c.logger.project, entity=c.logger.entity, group=group or c.name,
                name=name, tags=sorted(set(tags)), mode=wandb_mode(c.logger.mode))


def _summary(c: TrainConfig, status, state, meter, amp, batch, accum, world, device, wall_s,
             hw, phases: dict, max_batch: int | None) -> dict:
    mem = hardware.memory_stats(device)
    try:
        scale = amp.loss_scale()
    except RuntimeError:  # the device is in a bad state after a CUDA error
        scale = None
    return {"status": status, "precision": c.precision.name, "batch": batch, "accum": accum,
            "effective_batch": batch * accum * world, "world_size": world, "steps": state.step,
            "samples_per_s": meter.steady_rate, "peak_mem_gib": mem["mem/peak_gib"],
            "val_acc1": state.val_acc1, "val_loss": state.val_loss, "train_loss": state.last_loss,
            "skipped_steps": state.skipped_steps, "loss_scale": scale,
            "mfu": meter.mfu(meter.steady_rate),
            "wall_s": wall_s, "model": c.model.name, "hardware": hw.name, "device": str(device),
            "torch": torch.__version__, "max_batch": max_batch,
            "grad_checkpointing": c.model.grad_checkpointing, "memory_cap_gib": hw.memory_gib,
            **{k.split("/")[1]: v for k, v in phases.items()}}

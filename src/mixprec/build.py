"""The one builder: turns the validated config into the parts of a run (device, batch layout,
data, model, optimizer, schedule, loop plan) and says what it built. With run.py, the only
reader of the config: everything it builds gets plain objects and numbers."""
from __future__ import annotations

import dataclasses
import logging
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import (batch_size, config, distributed, hardware, loop, models, optim, perf, precision,
               process)
from . import data as datasets
from .config import TrainConfig
from .errors import ConfigError

log = logging.getLogger("mixprec")


@dataclass
class Layout:
    """How each optimizer step's samples are laid out over micro-batches and processes."""

    batch: int  # micro-batch per process
    accum: int  # micro-batches per optimizer step
    world: int  # processes
    max_batch: int | None = None  # the largest micro-batch that trained (batch=auto)

    @property
    def effective(self) -> int:
        return self.batch * self.accum * self.world

    def as_dict(self) -> dict:
        return {"batch": self.batch, "accum": self.accum, "world": self.world}


@dataclass
class Parts:
    """Everything a run is made of, built and checked."""

    config: TrainConfig
    hw: hardware.HardwareConfig  # the resolved profile (never `auto`)
    dist: distributed.Dist
    device: torch.device
    layout: Layout
    data: datasets.Data
    learner: loop.Learner
    plan: loop.Plan
    lr: float  # the learning rate that runs (after LR scaling)
    flops_per_sample: int | None  # training FLOPs (for MFU; counted where a peak is known)
    peak_tflops: float | None  # the dense peak this run's FLOPs could reach (for MFU)

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)


def resolve_hardware(c: TrainConfig) -> hardware.HardwareConfig:
    return hardware.resolve(c.hardware, config.hardware_profiles())


@dataclass(frozen=True)
class Spec:
    """What the model is built for: the data's classes and input shape, and the micro-batch
    (CUDA graphs are captured for that one shape)."""

    num_classes: int
    input_shape: tuple[int, ...]
    batch: int


def build(c: TrainConfig, hw: hardware.HardwareConfig, dd: distributed.Dist) -> Parts:
    device = hardware.setup(hw, dd.local_rank)
    if c.needs_gpu and device.type != "cuda":
        raise ConfigError(f"experiment={c.name} is sized for a GPU (needs_gpu=true) and this run "
                          "would train on the CPU; run it on a CUDA machine, or try the "
                          "pipeline on the CPU with a small shape, e.g. `needs_gpu=false "
                          "model=resnet18 data.shape=[3,32,32] batch=8 trainer.max_steps=20`")
    process.apply(process_settings(c, hw), device)
    seed_everything(c.seed + dd.rank)  # DDP copies rank 0's initial weights to every rank
    prec = new_precision(c, device)
    layout = _layout(c, hw, device, dd.world)
    data = datasets.build(c.data, datasets.Context(
        layout.batch, device, c.seed, c.model.channels_last, dd.rank, dd.world,
        datasets.Workers(hw.num_workers, hw.pin_memory, hw.persistent_workers)))
    lr = optim.scaled_lr(c.optimizer, layout.effective)
    counted: list = []
    model, optimizer = assemble(c, prec, Spec(data.num_classes, data.input_shape, layout.batch),
                                device, dd, lr, inspect=lambda m: counted.extend(
                                    _flops_and_peak(m, data, hw, prec, device)))
    plan = _plan(c, len(data.train), layout)
    scheduler = optim.build_scheduler(c.scheduler, optimizer, plan.total_steps)
    learner = loop.Learner(model, optimizer, scheduler, prec)
    parts = Parts(c, hw, dd, device, layout, data, learner, plan, lr, *counted)
    announce(parts)
    return parts


def process_settings(c: TrainConfig, hw: hardware.HardwareConfig) -> process.Settings:
    blocks = c.model.compile and c.model.compile_scope == "blocks"
    return process.Settings(
        tf32=c.precision.tf32, cudnn_benchmark=hw.cudnn_benchmark, memory_gib=hw.memory_gib,
        profile=hw.name, recompile_limit=models.BLOCK_RECOMPILE_LIMIT if blocks else None,
        detect_anomaly=c.debug.detect_anomaly)


def new_precision(c: TrainConfig, device: torch.device) -> precision.Precision:
    # torch: CUDA graphs need autocast's weight-cast cache off
    return precision.build(c.precision, c.scaler, device, cache=not c.model.cuda_graphs)


def assemble(c: TrainConfig, prec: precision.Precision, spec: Spec, device: torch.device,
             dd: distributed.Dist, lr: float, inspect=lambda model: None) -> tuple:
    """(model, optimizer) in the one build order: the model, the precision's conversion, the
    parallel wrap, compile (or CUDA graphs), then the optimizer. Sharding (FSDP2) replaces the
    parameters in the wrap, so the optimizer must come after it; torch.compile wraps the
    parallel module, as torch recommends for DDP. `inspect` sees the converted, unwrapped model
    (the FLOP count). Training and every batch=auto probe are built here."""
    model = models.build(c.model, spec.num_classes, spec.input_shape, device)
    model = prec.convert(model)
    inspect(model)
    model = distributed.wrap(model, dd, device)
    if c.model.cuda_graphs:  # a fixed batch shape: the one every training step has
        models.capture_graphs(models.unwrap(model),
                              example(c, spec.input_shape, device, spec.batch), prec)
    model = models.compiled(model, c.model)
    return model, optim.build_optimizer(c.optimizer, models.unwrap(model), lr, device)


def _flops_and_peak(model, data, hw, prec, device) -> tuple[int | None, float | None]:
    """Training FLOPs per sample and the dense peak they could reach: the precision's peak for
    the share of FLOPs in the modules it owns (precision=fp8: float8 and bf16 blended).
    (None, None) where the profile knows no peak (the count is skipped)."""
    if not prec.peak_tflops(hw.peak_tflops, 0.0):
        return None, None
    total, owned = perf.train_flops(model, data.input_shape, data.num_classes, device,
                                    prec.autocast, set(prec.owned()))
    return total, prec.peak_tflops(hw.peak_tflops, owned / total if total else 0.0)


def _plan(c: TrainConfig, micro_batches_per_epoch: int, layout: Layout) -> loop.Plan:
    steps_per_epoch = micro_batches_per_epoch // layout.accum
    if micro_batches_per_epoch < 1:  # no epoch would ever yield a step
        raise ConfigError(f"batch={layout.batch}: data={c.data.name} holds fewer training "
                          f"samples per process than one micro-batch of {layout.batch}; lower "
                          "batch (or use fewer processes)")
    if steps_per_epoch < 1:
        raise ConfigError(f"accum={layout.accum}: one optimizer step needs {layout.accum} "
                          f"micro-batches of {layout.batch} but an epoch of data={c.data.name} "
                          f"holds {micro_batches_per_epoch}; lower batch or accum")
    t = c.trainer
    if t.max_steps is not None:  # as many epochs as it takes (skipped steps take batches too)
        total, epochs = t.max_steps, sys.maxsize
    else:
        epochs = max(t.epochs, math.ceil(t.min_steps / steps_per_epoch))
        total = epochs * steps_per_epoch
        if epochs > t.epochs:
            log.info("trainer.min_steps=%d: %d epochs of %d optimizer steps instead of %d (a "
                     "batch of %d leaves few steps per epoch)", t.min_steps, epochs,
                     steps_per_epoch, t.epochs, layout.effective)
    if total < t.min_steps:
        log.warning("this run takes only %d optimizer steps (trainer.min_steps=%d): its accuracy "
                    "says little; train longer", total, t.min_steps)
    return loop.Plan(total, epochs, layout.accum, t.log_every, layout.effective,
                     t.clip_grad_norm, c.ckpt.every_steps, t.settle_late)


def _layout(c: TrainConfig, hw, device: torch.device, world: int) -> Layout:
    """The micro-batch, accum and world from batch / accum / effective_batch (batch=auto
    searches the largest micro-batch that trains)."""
    layout = Layout(c.batch, c.accum, world)
    if c.batch == "auto":
        layout.batch, layout.max_batch = _auto_batch(c, hw, device)
    if c.effective_batch is None:
        return layout
    if layout.max_batch is not None:
        layout.batch, layout.accum, note = batch_size.split_effective(
            c.effective_batch, layout.batch, world)
        if note:
            log.warning(note)
    else:
        layout.accum, rest = divmod(c.effective_batch, layout.batch * world)
        if rest or layout.accum < 1:
            raise ConfigError(f"effective_batch={c.effective_batch} is not a multiple of batch="
                              f"{layout.batch} x world size {world}; pick a batch that divides "
                              "it, or batch=auto to choose one")
    log.info("effective_batch=%d: micro-batch %d x accum %d x world %d", c.effective_batch,
             layout.batch, layout.accum, world)
    return layout


def _auto_batch(c: TrainConfig, hw, device: torch.device) -> tuple[int, int]:
    """(micro-batch to use, the largest that trained), searched with real training steps on
    models built as training builds them (assemble), unwrapped: a probe that runs out of memory
    on one rank must not leave the others waiting in a DDP all-reduce."""
    if device.type != "cuda":
        raise ConfigError("batch=auto searches GPU memory and needs a CUDA device; on the CPU "
                          "give batch=<int>")
    num_classes, shape = datasets.spec(c.data)

    def new_learner(b: int) -> loop.Learner:
        prec = new_precision(c, device)
        model, opt = assemble(c, prec, Spec(num_classes, shape, b), device, distributed.Dist(),
                              1e-6)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        return loop.Learner(model, opt, sched, prec)

    def inputs(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return example(c, shape, device, b), torch.randint(0, num_classes, (b,), device=device)

    probe = batch_size.probe_with(new_learner, inputs, c.batch_search.probe_steps,
                                  c.trainer.clip_grad_norm)
    key = memory_key(c, new_precision(c, device), (num_classes, *shape),
                     torch.cuda.get_device_name(device), hw.memory_gib)
    return batch_size.find(probe, c.batch_search, key,
                           hardware.memory_limit(device, hw.memory_gib))


def memory_key(c: TrainConfig, prec: precision.Precision, data_spec: tuple, gpu: str,
               memory_gib: float | None) -> dict:
    """batch=auto's cache key, from the resolved objects: everything that changes how much
    memory a training step takes (the model and its switches, what the precision does, the
    optimizer's kernels, clipping), and where (GPU, cap, torch)."""
    opt = c.optimizer
    return {"model": dataclasses.asdict(c.model), "precision": prec.memory_key(),
            "data": list(data_spec), "optimizer": [opt.name, opt.fused, opt.foreach],
            "clip": c.trainer.clip_grad_norm is not None, "gpu": gpu, "memory_gib": memory_gib,
            "torch": torch.__version__, "resolution": c.batch_search.resolution}


def audit_inputs(c: TrainConfig) -> tuple[torch.nn.Module, torch.Tensor, precision.Precision]:
    """(model, example batch, precision) for `python -m mixprec.diagnose` (no data, no training)."""
    hw = resolve_hardware(c)
    device = hardware.setup(hw)
    process.apply(process_settings(c, hw), device)
    prec = new_precision(c, device)
    num_classes, shape = datasets.spec(c.data)
    model = prec.convert(models.build(c.model, num_classes, shape, device))
    return model, example(c, shape, device), prec


def example(c: TrainConfig, input_shape, device, n: int = 2) -> torch.Tensor:
    """A random input batch in the model's memory format."""
    fmt = torch.channels_last if c.model.channels_last else torch.contiguous_format
    return torch.randn(n, *input_shape, device=device).contiguous(memory_format=fmt)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def announce(p: Parts) -> None:
    c, prec, device = p.config, p.learner.precision, p.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    log.info("hardware=%s (%s), torch %s", p.hw.name, gpu, torch.__version__)
    log.info(prec.describe())
    for warning in prec.advice(compiled=c.model.compile):
        log.warning(warning)
    log.info("model=%s data=%s batch=%d accum=%d world=%d -> effective batch %d; lr %.4g (%s "
             "scaling from %.4g at %d); %d optimizer steps", c.model.name, c.data.name,
             p.layout.batch, p.layout.accum, p.layout.world, p.layout.effective, p.lr,
             c.optimizer.scale_lr, c.optimizer.lr, c.optimizer.base_batch, p.plan.total_steps)

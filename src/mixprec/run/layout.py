"""How each optimizer step's samples are laid out (Layout: the micro-batch, accum, world), with
batch=auto's search for the micro-batch and its cache key, and how long a run is (the Plan)."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from dataclasses import dataclass

import torch

from mixprec import data as datasets
from mixprec.core import hardware
from mixprec.core.errors import ConfigError
from mixprec.parallel import strategy
from mixprec.precision import base as precision
from mixprec.run.config import TrainConfig
from mixprec.training import batch_size, loop

log = logging.getLogger("mixprec.run.build")


@dataclass
class Layout:
    """How each optimizer step's samples are laid out over micro-batches and processes."""

    batch: int  # micro-batch per process
    accum: int  # micro-batches per optimizer step
    world: int  # data-parallel ranks (the strategy's data_parallel size: the world for DDP/FSDP2)
    max_batch: int | None = None  # the largest micro-batch that trained (batch=auto)
    why: dict | None = None  # batch=auto: per-sample and fixed memory (batch_size.explain)

    @property
    def effective(self) -> int:
        return self.batch * self.accum * self.world

    def as_dict(self) -> dict:
        return {"batch": self.batch, "accum": self.accum, "world": self.world}


def resolve(c: TrainConfig, hw, device: torch.device, world: int, prec, probes) -> Layout:
    """The micro-batch, accum and world from batch / accum / effective_batch (batch=auto
    searches the largest micro-batch that trains)."""
    layout = Layout(c.batch, c.accum, world)
    if c.batch == "auto":
        layout.batch, layout.max_batch, layout.why = auto_batch(c, hw, device, prec, probes)
        if world > 1 and strategy.of(c.parallel).shards:
            log.warning(
                "batch=auto probed FSDP2 over each rank alone (a probe that ran out of memory "
                "inside a collective would leave the other ranks waiting): all of the state "
                "where a rank of %d holds a share, so batch %d leaves room that sharding "
                "frees; give batch=<int> to use it",
                world,
                layout.batch,
            )
    if c.effective_batch is None:
        return layout
    if layout.max_batch is not None:
        layout.batch, layout.accum, note = batch_size.split_effective(
            c.effective_batch, layout.batch, world
        )
        if note:
            log.warning(note)
    else:
        layout.accum, rest = divmod(c.effective_batch, layout.batch * world)
        if rest or layout.accum < 1:
            raise ConfigError(
                f"effective_batch={c.effective_batch} is not a multiple of batch="
                f"{layout.batch} x world size {world}; pick a batch that divides "
                "it, or batch=auto to choose one"
            )
    log.info(
        "effective_batch=%d: micro-batch %d x accum %d x world %d",
        c.effective_batch,
        layout.batch,
        layout.accum,
        world,
    )
    return layout


def auto_batch(c: TrainConfig, hw, device: torch.device, prec, probes) -> tuple:
    """(micro-batch to use, the largest that trained, batch_size.explain()'s why), searched
    with real training steps on models built as training builds them (`probes()`:
    build.probes, a learner and an input batch for a micro-batch size)."""
    if device.type != "cuda":
        raise ConfigError(
            "batch=auto searches GPU memory and needs a CUDA device; on the CPU give batch=<int>"
        )
    new_learner, inputs = probes()
    probe = batch_size.probe_with(
        new_learner, inputs, c.batch_search.probe_steps, c.trainer.clip_grad_norm
    )
    num_classes, shape = datasets.spec(c.data)
    gpu = torch.cuda.get_device_name(device)
    key = memory_key(c, prec, (num_classes, *shape), gpu, hw.memory_gib)
    return batch_size.find(probe, c.batch_search, key, hardware.memory_limit(device, hw.memory_gib))


def memory_key(
    c: TrainConfig, prec: precision.Precision, data_spec: tuple, gpu: str, memory_gib: float | None
) -> dict:
    """batch=auto's cache key, from the resolved objects: everything that changes how much
    memory a training step takes (the model and its switches, what the precision does, the
    optimizer's kernels, clipping), and where (GPU, cap, torch)."""
    opt = c.optimizer
    return {
        "model": dataclasses.asdict(c.model),
        "precision": prec.memory_key(),
        "data": list(data_spec),
        "optimizer": [opt.name, opt.fused, opt.foreach],
        "clip": c.trainer.clip_grad_norm is not None,
        "gpu": gpu,
        "memory_gib": memory_gib,
        "torch": torch.__version__,
        "resolution": c.batch_search.resolution,
    }


def plan(c: TrainConfig, micro_batches_per_epoch: int, layout: Layout) -> loop.Plan:
    steps_per_epoch = micro_batches_per_epoch // layout.accum
    if micro_batches_per_epoch < 1:  # no epoch would ever yield a step
        raise ConfigError(
            f"batch={layout.batch}: data={c.data.name} holds fewer training "
            f"samples per process than one micro-batch of {layout.batch}; lower "
            "batch (or use fewer processes)"
        )
    if steps_per_epoch < 1:
        raise ConfigError(
            f"accum={layout.accum}: one optimizer step needs {layout.accum} "
            f"micro-batches of {layout.batch} but an epoch of data={c.data.name} "
            f"holds {micro_batches_per_epoch}; lower batch or accum"
        )
    t = c.trainer
    if t.max_steps is not None:  # as many epochs as it takes (skipped steps take batches too)
        total, epochs = t.max_steps, sys.maxsize
    else:
        epochs = max(t.epochs, math.ceil(t.min_steps / steps_per_epoch))
        total = epochs * steps_per_epoch
        if epochs > t.epochs:
            log.info(
                "trainer.min_steps=%d: %d epochs of %d optimizer steps instead of %d (a "
                "batch of %d leaves few steps per epoch)",
                t.min_steps,
                epochs,
                steps_per_epoch,
                t.epochs,
                layout.effective,
            )
    if total < t.min_steps:
        log.warning(
            "this run takes only %d optimizer steps (trainer.min_steps=%d): its accuracy "
            "says little; train longer",
            total,
            t.min_steps,
        )
    return loop.Plan(
        total,
        epochs,
        layout.accum,
        t.log_every,
        layout.effective,
        t.clip_grad_norm,
        c.ckpt.every_steps,
        t.settle_late and not c.debug.locate,  # the doctor re-runs a step before the next one
        t.val_every,
    )

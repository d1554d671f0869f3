"""The one builder: turns the validated config into the parts of a run (device, batch layout,
data, model, optimizer, schedule, loop plan) and says what it built. With session.py (which
calls it), the only reader of the config (run/): everything it builds gets plain objects and
numbers."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mixprec import data as datasets
from mixprec import models
from mixprec.checkpoint import store as checkpoint
from mixprec.compile import compiling
from mixprec.core import early, hardware, process, targets, tasks
from mixprec.core.errors import ConfigError, check
from mixprec.diagnostics import dtype_plan
from mixprec.models import flops
from mixprec.optim import optimizers as optim
from mixprec.optim import states as optim_states
from mixprec.parallel import distributed, strategy
from mixprec.precision import base as precision
from mixprec.precision import fp32_layers
from mixprec.run import config, rundir
from mixprec.run import layout as layouts
from mixprec.run.config import TrainConfig
from mixprec.training import loop, perf
from mixprec.training.callbacks import Callbacks

log = logging.getLogger("mixprec")


@dataclass
class Parts:
    """Everything a run is made of, built and checked."""

    config: TrainConfig
    hw: hardware.HardwareConfig  # the resolved profile (never `auto`)
    dist: distributed.Dist
    device: torch.device
    layout: layouts.Layout
    data: datasets.Data
    learner: loop.Learner
    plan: loop.Plan
    lr: float  # the learning rate that runs (after LR scaling)
    flops_per_sample: int | None  # training FLOPs (for MFU; counted where a peak is known)
    peak_tflops: float | None  # the dense peak this run's FLOPs could reach (for MFU)

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)

    def example(self, n: int = 2) -> torch.Tensor:
        """A random input batch of this run's kind (for the dtype audit)."""
        d = self.data
        return example(self.config, d.input_shape, self.device, n, d.num_classes, d.task)

    def meter(self) -> perf.Throughput:
        """The throughput meter: its warm-up, MFU against this run's peak, tokens per sample."""
        peak, per_sample, world = self.peak_tflops, self.flops_per_sample, self.dist.world
        return perf.Throughput(
            self.device,
            self.config.trainer.perf_warmup_steps,
            mfu=lambda sps: flops.mfu(per_sample, sps, peak, world),
            tokens_per_sample=self.data.task.tokens(self.data.input_shape),
        )


def resolve_hardware(c: TrainConfig) -> hardware.HardwareConfig:
    return hardware.resolve(c.hardware, config.hardware_profiles())


@dataclass(frozen=True)
class Spec:
    """What the model is built for: the data's classes and input shape, and the micro-batch
    (CUDA graphs are captured for that one shape)."""

    num_classes: int
    input_shape: tuple[int, ...]
    batch: int
    task: tasks.Task = tasks.CLASSIFY


def build(c: TrainConfig, hw: hardware.HardwareConfig, dd: distributed.Dist) -> Parts:
    device = hardware.setup(hw, dd.local_rank)
    if c.needs_gpu and device.type != "cuda":
        raise ConfigError(
            f"experiment={c.name} is sized for a GPU (needs_gpu=true) and this run "
            "would train on the CPU; run it on a CUDA machine, or try the "
            "pipeline on the CPU with a small shape, e.g. `needs_gpu=false "
            "model=resnet18 data.shape=[3,32,32] batch=8 trainer.max_steps=20` (a language "
            "model: `model=llama_tiny data.seq_len=64`)"
        )
    process.apply(process_settings(c, hw), device)
    seed_everything(c.seed + dd.rank)  # DDP copies rank 0's initial weights to every rank
    prec = new_precision(c, device)
    dp_rank, dp_size = strategy.of(c.parallel).data_parallel(dd)  # who sees which samples
    layout = layouts.resolve(c, hw, device, dp_size, prec, lambda: probes(c, device))
    if saved_plan(c) is None:
        prec.warm_up(device, c.model.compile)  # fp8_auto: its timing processes, meanwhile
    early.release()  # what train.py started early (core/early.py), if warm_up did not claim it
    if c.model.compile:
        compiling.load_cache(c.model.compile_cache)  # before anything compiles
    load = lambda batch: datasets.build(  # noqa: E731
        c.data,
        datasets.Context(
            batch,
            device,
            c.seed,
            c.model.channels_last,
            dp_rank,
            dp_size,
            datasets.Workers(hw.num_workers, hw.pin_memory, hw.persistent_workers),
            convert=prec.convert_input,
        ),
    )
    data = fit_auto_batch_to_data(layout, load(layout.batch), load)
    lr = optim.scaled_lr(c.optimizer, layout.effective)
    counted: list = []
    model, optimizer = assemble(
        c,
        prec,
        Spec(data.num_classes, data.input_shape, layout.batch, data.task),
        device,
        dd,
        lr,
        inspect=lambda m: counted.extend(_flops_and_peak(m, data, hw, prec, device)),
    )
    plan = layouts.plan(c, len(data.train), layout)
    beyond_the_study(c, plan.total_steps)
    scheduler = optim.build_scheduler(c.scheduler, optimizer, plan.total_steps)
    learner = make_learner(c, model, optimizer, scheduler, prec, data.task)
    parts = Parts(c, hw, dd, device, layout, data, learner, plan, lr, *counted)
    announce(parts)
    return parts


def beyond_the_study(c: TrainConfig, total_steps: int) -> None:
    """A study preset's answer was measured at one length (study.measured_to): the convergence
    ratio changes with it (round 5's 1,200-step study gave fp8 1.13x, the 500-step one 1.31x),
    so a longer run is told the answer may not carry."""
    horizon = c.study.measured_to
    if horizon is not None and total_steps > horizon:
        log.warning(
            "this run takes %d optimizer steps; the study answer this preset gives "
            "(docs/time-to-quality.md) was measured at %d (study.measured_to): its convergence "
            "ratio, and so its speedup, may not carry to this length",
            total_steps,
            horizon,
        )


def fit_auto_batch_to_data(layout: layouts.Layout, data, load):
    """batch=auto measures memory, not data: a small model on a small dataset (yours, say) fits a
    micro-batch larger than the samples a process reads per epoch. Then the batch is those samples
    (a multiple of 8 where there are 8), and the data is loaded again at that batch."""
    samples = getattr(data.train, "samples", 0)
    if layout.max_batch is None or layout.accum != 1 or len(data.train) >= 1 or not samples:
        return data  # layouts.plan refuses what is left, naming the batch
    batch = samples - samples % 8 if samples >= 8 else samples
    log.warning(
        "batch=auto: memory takes micro-batches of %d, but this process reads %d samples per "
        "epoch; using batch %d",
        layout.batch,
        samples,
        batch,
    )
    data.close()
    layout.batch = batch
    return load(batch)


def process_settings(c: TrainConfig, hw: hardware.HardwareConfig) -> process.Settings:
    blocks = c.model.compile and c.model.compile_scope == "blocks"
    return process.Settings(
        tf32=c.precision.tf32,
        cudnn_benchmark=hw.cudnn_benchmark,
        memory_gib=hw.memory_gib,
        profile=hw.name,
        recompile_limit=compiling.BLOCK_RECOMPILE_LIMIT if blocks else None,
        detect_anomaly=c.debug.detect_anomaly,
        cpu_fp16=c.precision.autocast == "float16",  # (process.set_onednn: CPUs only)
        deterministic=c.trainer.deterministic,
    )


def new_precision(c: TrainConfig, device: torch.device) -> precision.Precision:
    # torch: CUDA graphs need autocast's weight-cast cache off
    return precision.build(c.precision, c.scaler, device, cache=not c.model.cuda_graphs)


def assemble(
    c: TrainConfig,
    prec: precision.Precision,
    spec: Spec,
    device: torch.device,
    dd: distributed.Dist,
    lr: float,
    inspect=lambda model: None,
    probing: bool = False,
) -> tuple:
    """(model, optimizer) in the one build order: the model, the precision's conversion, the
    parallel wrap, compile (or CUDA graphs), then the optimizer. Sharding (FSDP2) replaces the
    parameters in the wrap, so the optimizer must come after it; torch.compile wraps the
    parallel module, as torch recommends for DDP. `inspect` sees the converted, unwrapped model
    (the FLOP count). Training and every batch=auto probe are built here (`probing`: a probe,
    which gives the precision no micro-batch to measure with)."""
    if not probing:
        check_memory(c, spec, device, dd)
    model = models.build(c.model, spec.num_classes, spec.input_shape, device, spec.task)
    prec.check_model(model, f"{c.model.key}={c.model.label!r}")
    example_batch = lambda: example(  # noqa: E731
        c, spec.input_shape, device, spec.batch, spec.num_classes, spec.task
    )
    parallel = strategy.of(c.parallel)
    ctx = precision.Context(
        sharded=dd.grouped and parallel.shards,  # a world of one too
        example=None if probing else example_batch,
        compiled=c.model.compile,
        saved_plan=None if probing else saved_plan(c),
    )
    prec.prepare(ctx)
    model = prec.convert(model)
    optim_states.to_weights(c.optimizer, model)  # optimizer.state=bf16: bf16 weights
    prec.kept = fp32_layers.keep(model, c.precision.keep_fp32, device.type, set(prec.owned()))
    inspect(model)
    parallel.check(prec, c.model, c.optimizer)
    model = parallel.wrap(model, prec, models.blocks_of(model), dd, device)
    if c.model.cuda_graphs:  # a fixed batch shape: the one every training step has
        check(
            not spec.task.takes_kwargs,
            "model.cuda_graphs",
            True,
            "false with data.input_key naming several entries or '**' (a captured graph "
            "takes one input tensor, not keyword arguments)",
        )
        x = example(c, spec.input_shape, device, spec.batch, spec.num_classes, spec.task)
        compiling.capture_graphs(models.unwrap(model), x, prec)
    model = compiling.compiled(model, c.model)
    clipping = c.trainer.clip_grad_norm is not None
    optim_states.check_run(c.optimizer, prec, device, dd.world, clipping)
    return model, optim.build_optimizer(c.optimizer, models.unwrap(model), lr, device)


def make_learner(c: TrainConfig, model, optimizer, scheduler, prec, task) -> loop.Learner:
    """The learner, with the loss model.loss names: the task's, the model's own, or the user's
    function (package.module:fn, found like model.target)."""
    loss = c.model.loss
    user = None
    if loss not in ("task", "own"):
        user = tasks.UserLoss(loss, targets.load("model.loss", loss, c.model.path))
    built = {n: targets.instance(f"callbacks.{n}", node) for n, node in c.callbacks.items()}
    callbacks = Callbacks(built)
    return loop.Learner(model, optimizer, scheduler, prec, task, loss == "own", user, callbacks)


def check_memory(c: TrainConfig, spec: Spec, device: torch.device, dd) -> None:
    """Refuse, before anything is allocated, a model whose weights, gradients and optimizer
    state alone exceed the memory this process has (the kernel's OOM killer, minutes later and
    without a word, on a CPU): its parameters are counted on the meta device."""
    n = models.count_on_meta(c.model, spec.num_classes, spec.input_shape, spec.task)
    free = hardware.available_bytes(device, c.hardware.memory_gib)
    if not n or free is None:
        return
    each = optim_states.bytes_per_param(c.optimizer)
    shards = dd.world if dd.grouped and strategy.of(c.parallel).shards else 1
    need = n * each / shards
    if need <= free:
        return
    where = "this GPU has" if device.type == "cuda" else "this machine has"
    raise ConfigError(
        f"{c.model.key}={c.model.label!r} has {n / 1e9:.2f} B parameters (with the data's "
        f"{spec.num_classes} {'tokens' if spec.task.name == 'lm' else 'classes'}): its weights, "
        f"gradients and optimizer state need at least {need / 2**30:.1f} GiB ({each} bytes a "
        f"parameter with optimizer={c.optimizer.name} optimizer.state={c.optimizer.state}"
        f"{f', sharded over {shards}' if shards > 1 else ''}; activations come on top) and "
        f"{where} {free / 2**30:.1f} GiB available. Try a smaller model (model.hf.overrides, "
        "model.kwargs, or a smaller preset such as model=hf_llama_tiny), optimizer.state=8bit, "
        "parallel=fsdp over more GPUs, or a machine with more memory"
    )


def _flops_and_peak(model, data, hw, prec, device) -> tuple[int | None, float | None]:
    """Training FLOPs per sample and the dense peak they could reach: the precision's peak for
    the share of FLOPs in the modules it owns (precision=fp8: float8 and bf16 blended).
    (None, None) where the profile knows no peak (the count is skipped)."""
    if not prec.peak_tflops(hw.peak_tflops, 0.0):
        return None, None
    count = lambda names: flops.train_flops(  # noqa: E731
        model, data.input_shape, data.num_classes, device, prec.autocast, names, data.task
    )
    total, owned = count(set(prec.owned()))
    if not total:  # the counter could not count this model (flops.train_flops said why)
        return None, None
    peak = prec.peak_tflops(hw.peak_tflops, owned / total if total else 0.0)
    if prec.kept and total:  # precision.keep_fp32: their FLOPs run at the fp32 (or TF32) peak
        kept_share = count(set(prec.kept))[1] / total
        fp32 = hw.peak_tflops.get("tf32" if prec.tf32 else "fp32")
        peak = flops.blended_peak(peak, fp32, kept_share)
    return total, peak


def probes(c: TrainConfig, device: torch.device) -> tuple:
    """batch=auto's probes: (a fresh learner for a micro-batch size, an input batch of that
    size), built by assemble like training, but on no other rank (distributed.probe_dist:
    unwrapped, or parallel=fsdp sharded over this rank alone). Called on every rank."""
    num_classes, shape = datasets.spec(c.data)
    task = datasets.task(c.data)
    alone = distributed.probe_dist(strategy.of(c.parallel), device.type)

    def new_learner(b: int) -> loop.Learner:
        prec = new_precision(c, device)
        spec = Spec(num_classes, shape, b, task)
        model, opt = assemble(c, prec, spec, device, alone, 1e-6, probing=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        return make_learner(c, model, opt, sched, prec, task)

    def inputs(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = example(c, shape, device, b, num_classes, task)
        return x, task.targets(b, shape, num_classes, device)

    return new_learner, inputs


def saved_plan(c: TrainConfig) -> dict | None:
    """The precision plan of the run this one resumes: precision_plan.json in the run dir of
    the checkpoint it continues (None: a new run, or that run kept none)."""
    if not c.resume:
        return None
    try:
        found = checkpoint.find(c.resume, Path(c.run_dir))
    except ConfigError:
        return None  # the resume itself says what is wrong, later
    if found is None:
        return None
    path = found.parent.parent / rundir.PLAN_FILE  # <run dir>/checkpoints/last.pt
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        log.warning("%s cannot be read; the precision plans again", path)
        return None


def dtype_promise(c: TrainConfig, p: Parts) -> dtype_plan.Promise:
    """What this config promises about the run's tensors (checked after its first step)."""
    prec, parallel = p.learner.precision, strategy.of(c.parallel).promised(p.learner.precision)
    promised = {**precision.Precision.promised(prec), **prec.promised()}  # compute, weights
    weights = ["bfloat16" if c.optimizer.state == "bf16" else "float32"]
    weights += promised.get("weights", [])  # a plugin that keeps weights in bf16
    gathered = parallel.get("forward_weights")  # FSDP2 gathers them in its param_dtype
    return dtype_plan.Promise(
        weights=weights,
        compute=promised["compute"],
        state=c.optimizer.state,
        state_device="cpu" if c.optimizer.offload == "cpu" else p.device.type,
        forward_weights=[gathered] if gathered else weights,
        reduce=parallel.get("reduce"),
    )


def _standalone(c: TrainConfig) -> tuple:
    """(device, precision, (classes, input shape, task)) for a command that builds the model
    without data or training (diagnose, fp8_plan), set up as a run would be."""
    hw = resolve_hardware(c)
    device = hardware.setup(hw)
    process.apply(process_settings(c, hw), device)
    return device, new_precision(c, device), (*datasets.spec(c.data), datasets.task(c.data))


def audit_inputs(c: TrainConfig) -> tuple[torch.nn.Module, torch.Tensor, precision.Precision]:
    """(model, example batch, precision) for `python -m mixprec.diagnose` (no data, no training)."""
    device, prec, (num_classes, shape, task) = _standalone(c)
    prec.prepare(precision.Context(compiled=c.model.compile))
    model = prec.convert(models.build(c.model, num_classes, shape, device, task))
    prec.kept = fp32_layers.keep(model, c.precision.keep_fp32, device.type, set(prec.owned()))
    return model, example(c, shape, device, 2, num_classes, task), prec


def planned_precision(c: TrainConfig) -> precision.Precision:
    """`python -m mixprec.fp8_plan`: the precision after it planned the model of `c` at its
    micro-batch (`batch`), on the run's device, as training would (no data, no training)."""
    if c.batch == "auto":
        raise ConfigError("batch=auto: the plan is per micro-batch shape; give batch=N")
    device, prec, (num_classes, shape, task) = _standalone(c)
    x = lambda: example(c, shape, device, c.batch, num_classes, task)  # noqa: E731
    prec.prepare(precision.Context(example=x, compiled=c.model.compile))
    prec.convert(models.build(c.model, num_classes, shape, device, task))
    return prec


def example(
    c: TrainConfig, input_shape, device, n: int = 2, num_classes: int = 2, task=tasks.CLASSIFY
) -> torch.Tensor:
    """A random input batch of the task's kind (images in the model's memory format, or
    token ids)."""
    fmt = torch.channels_last if c.model.channels_last else torch.contiguous_format
    return task.inputs(n, input_shape, num_classes, device, fmt)


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
    total, trainable = models.parameter_counts(p.learner.model)
    log.info(
        "model=%s (%s parameters, %s trainable) data=%s batch=%d accum=%d world=%d -> effective "
        "batch %d; lr %.4g (%s scaling from %.4g at %d); %d optimizer steps",
        c.model.label,
        models.count(total),
        models.count(trainable),
        c.data.name,
        p.layout.batch,
        p.layout.accum,
        p.layout.world,
        p.layout.effective,
        p.lr,
        c.optimizer.scale_lr,
        c.optimizer.lr,
        c.optimizer.base_batch,
        p.plan.total_steps,
    )

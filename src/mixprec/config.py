"""Structured configs: one dataclass per config group, validated on construction.

Hydra merges the YAML files in ``conf/`` onto these schemas (so unknown keys and wrong types fail
at compose time); ``validate()`` then builds the dataclasses, which runs every ``__post_init__``
check. Errors name the key and the allowed values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

PRECISIONS = ("fp32", "tf32", "amp", "amp_accum", "bf16")
AUTOCAST_DTYPES = ("float16", "bfloat16")
OPTIMIZERS = ("sgd", "adamw")
LR_SCALING = ("linear", "sqrt", "none")
SCHEDULERS = ("cosine", "step", "onecycle", "constant")
DEVICES = ("auto", "cpu", "cuda")
DATASETS = ("digits", "synthetic", "imagenet", "cifar10")
LOGGERS = ("wandb", "none")
PEAK_KEYS = ("fp32", "tf32", "fp16", "bf16")
OBJECTIVES = ("val_acc1", "val_loss", "samples_per_s", "peak_mem_gib", "train_loss", "mfu")


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key and what is allowed."""


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed; {key} must be {allowed}")


def _one_of(key: str, value: Any, options: tuple) -> None:
    _check(value in options, key, value, "one of " + ", ".join(map(str, options)))


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # the group option that chose this (fp32, tf32, amp, amp_accum, bf16)
    autocast: Optional[str] = None  # autocast dtype: null (off), float16 or bfloat16
    tf32: bool = False  # TF32 tensor cores for fp32 matmuls/convs (Ampere and later)
    accum: int = 1  # default micro-batches per optimizer step (the top-level `accum` reads it)

    def __post_init__(self) -> None:
        _one_of("precision", self.name, PRECISIONS)
        _check(self.autocast is None or self.autocast in AUTOCAST_DTYPES, "precision.autocast",
               self.autocast, "null, float16 or bfloat16")
        _check(self.accum >= 1, "precision.accum", self.accum, "an int >= 1")


@dataclass
class ScalerConfig:
    name: str = "dynamic"  # the group option (dynamic, conservative, static, off)
    enabled: bool = True  # only takes effect with float16 autocast
    init_scale: float = 65536.0  # first loss scale (2^16 in the seeds; 2^12 is the cautious start)
    growth_factor: float = 2.0  # scale *= this after growth_interval overflow-free steps
    backoff_factor: float = 0.5  # scale *= this on an overflow (and the step is skipped)
    growth_interval: int = 2000  # overflow-free steps before the scale grows
    static: bool = False  # keep init_scale fixed forever (overflowing steps are still skipped)
    guard_bn_stats: bool = True  # undo BatchNorm's running-stat update of an overflowing forward

    def __post_init__(self) -> None:
        _check(self.init_scale > 0, "scaler.init_scale", self.init_scale, "> 0")
        _check(self.growth_factor > 1.0, "scaler.growth_factor", self.growth_factor, "> 1.0")
        _check(0.0 < self.backoff_factor < 1.0, "scaler.backoff_factor", self.backoff_factor,
               "in (0, 1)")
        _check(self.growth_interval >= 1, "scaler.growth_interval", self.growth_interval, ">= 1")


@dataclass
class OptimizerConfig:
    name: str = "sgd"  # sgd or adamw
    lr: float = 0.1  # base learning rate at base_batch; scaled by scale_lr
    base_batch: int = 256  # the effective batch that `lr` was tuned for
    scale_lr: str = "linear"  # linear: lr*eff/base (Goyal et al.), sqrt, or none
    weight_decay: float = 5e-5  # not applied to biases and norm layers (timm's filter)
    momentum: float = 0.9  # sgd only
    nesterov: bool = True  # sgd only
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw only
    eps: float = 1e-8  # adamw only
    fused: Optional[bool] = None  # null = fused kernels on CUDA where torch has them
    foreach: Optional[bool] = None  # null = torch's choice

    def __post_init__(self) -> None:
        _one_of("optimizer", self.name, OPTIMIZERS)
        _check(self.lr > 0, "optimizer.lr", self.lr, "> 0")
        _check(self.base_batch >= 1, "optimizer.base_batch", self.base_batch, "an int >= 1")
        _one_of("optimizer.scale_lr", self.scale_lr, LR_SCALING)
        _check(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, ">= 0")
        _check(len(self.betas) == 2, "optimizer.betas", self.betas, "a list of two floats")
        _check(not (self.fused and self.foreach), "optimizer.fused", self.fused,
               "false or null when optimizer.foreach=true (torch allows only one)")


@dataclass
class SchedulerConfig:
    name: str = "cosine"  # cosine, step, onecycle or constant; counts real optimizer steps
    warmup_steps: int = 0  # linear warm-up from warmup_start to the full lr (cosine, step)
    warmup_start: float = 0.1  # lr factor at step 0 of the warm-up
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of the lr
    step_size: int = 1000  # step: multiply by gamma every step_size optimizer steps
    gamma: float = 0.1  # step: decay factor
    pct_start: float = 0.25  # onecycle: fraction of steps spent increasing the lr

    def __post_init__(self) -> None:
        _one_of("scheduler", self.name, SCHEDULERS)
        _check(self.warmup_steps >= 0, "scheduler.warmup_steps", self.warmup_steps, ">= 0")
        _check(0 < self.warmup_start <= 1, "scheduler.warmup_start", self.warmup_start, "in (0, 1]")
        _check(0 <= self.min_lr_ratio <= 1, "scheduler.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        _check(self.step_size >= 1, "scheduler.step_size", self.step_size, ">= 1")
        _check(0 < self.gamma <= 1, "scheduler.gamma", self.gamma, "in (0, 1]")
        _check(0 < self.pct_start < 1, "scheduler.pct_start", self.pct_start, "in (0, 1)")


@dataclass
class HardwareConfig:
    name: str = "auto"  # the profile (auto, cpu, rtx3090, a100, h100, h200)
    device: str = "auto"  # auto, cpu or cuda
    gpu_match: Optional[str] = None  # substring of torch.cuda.get_device_name() this profile is for
    memory_gib: Optional[float] = None  # the card's memory; caps this process (emulates the card)
    peak_tflops: Dict[str, float] = field(default_factory=dict)  # dense peak per dtype, for MFU
    cudnn_benchmark: bool = True  # let cuDNN time its conv algorithms (static shapes)
    num_workers: int = 0  # DataLoader worker processes for on-disk datasets
    pin_memory: bool = False  # page-locked host batches for async host->device copies
    persistent_workers: bool = False  # keep loader workers alive across epochs

    def __post_init__(self) -> None:
        _one_of("hardware.device", self.device, DEVICES)
        _check(self.memory_gib is None or self.memory_gib > 0, "hardware.memory_gib",
               self.memory_gib, "null or > 0")
        bad = sorted(set(self.peak_tflops) - set(PEAK_KEYS))
        _check(not bad, "hardware.peak_tflops", bad, "keyed by " + ", ".join(PEAK_KEYS))
        _check(self.num_workers >= 0, "hardware.num_workers", self.num_workers, ">= 0")


@dataclass
class ModelConfig:
    name: str = "mixprec_digits_cnn"  # any timm model name (timm.list_models())
    channels_last: bool = False  # NHWC memory format (faster convs on tensor cores)
    compile: bool = False  # torch.compile the model
    compile_mode: Optional[str] = None  # torch.compile mode: null, reduce-overhead, max-autotune
    compile_options: Dict[str, Any] = field(default_factory=dict)  # inductor options on top of the mode
    cuda_graphs: bool = False  # capture forward+backward once, replay it (static shapes, GPU only)
    grad_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% more compute
    kwargs: Dict[str, Any] = field(default_factory=dict)  # extra timm.create_model arguments

    def __post_init__(self) -> None:
        _check(bool(self.name), "model.name", self.name, "a timm model name")
        modes = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        _one_of("model.compile_mode", self.compile_mode, modes)
        _check(self.compile or not self.compile_options, "model.compile_options",
               dict(self.compile_options), "{} unless model.compile=true")
        _check(not (self.cuda_graphs and (self.compile or self.grad_checkpointing)),
               "model.cuda_graphs", self.cuda_graphs, "false with model.compile or "
               "model.grad_checkpointing (compile_mode=reduce-overhead graphs a compiled model)")


@dataclass
class DataConfig:
    name: str = "digits"  # digits (bundled with scikit-learn) or synthetic
    val_fraction: float = 0.2  # digits: held-out share (stratified, fixed by data_seed)
    data_seed: int = 0  # digits: the split does not move with `seed`
    shape: List[int] = field(default_factory=lambda: [3, 224, 224])  # synthetic: C, H, W
    num_classes: int = 1000  # synthetic: label range
    steps_per_epoch: int = 100  # synthetic: micro-batches per epoch
    val_steps: int = 2  # synthetic: evaluation micro-batches
    root: Optional[str] = None  # imagenet: holds train/<class>/ and val/<class>/; cifar10: the data dir
    image_size: int = 224  # imagenet: training crop and evaluation centre crop
    eval_resize: int = 256  # imagenet: resize before the evaluation centre crop
    subset: Optional[int] = None  # imagenet/cifar10: use this many samples per split (quick runs)
    download: bool = False  # cifar10: download when missing (needs a network)
    bad_images: str = "fail"  # imagenet: an unreadable image stops the run (fail) or is skipped
    decode: str = "workers"  # imagenet: JPEGs decoded by loader workers, or on the device (nvJPEG)

    def __post_init__(self) -> None:
        _one_of("data", self.name, DATASETS)
        _check(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "in (0, 1)")
        _check(len(self.shape) == 3 and min(self.shape) >= 1, "data.shape", self.shape,
               "[C, H, W] with every size >= 1")
        _check(self.num_classes >= 2, "data.num_classes", self.num_classes, ">= 2")
        _check(self.steps_per_epoch >= 1, "data.steps_per_epoch", self.steps_per_epoch, ">= 1")
        _check(self.val_steps >= 1, "data.val_steps", self.val_steps, ">= 1")
        _one_of("data.bad_images", self.bad_images, ("fail", "skip"))
        _one_of("data.decode", self.decode, ("workers", "device"))
        _check(self.subset is None or self.subset >= 1, "data.subset", self.subset, "null or >= 1")
        _check(self.name not in ("imagenet", "cifar10") or bool(self.root), "data.root", self.root,
               f"a directory for data={self.name}")


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb or none (local files are always written)
    project: str = "mixprec"
    entity: Optional[str] = None
    mode: Optional[str] = None  # null: WANDB_MODE, else online with credentials, else offline
    group: Optional[str] = None  # null: the sweep (multirun) or the experiment name
    tags: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _one_of("logger", self.name, LOGGERS)
        _one_of("logger.mode", self.mode, (None, "online", "offline", "disabled"))


@dataclass
class TrainerConfig:
    epochs: int = 1  # passes over the training data
    max_steps: Optional[int] = None  # cap on optimizer steps; null = run by epochs
    log_every: int = 10  # optimizer steps between log events (each reads the loss scale: a sync)
    clip_grad_norm: Optional[float] = None  # max global grad norm of the true (unscaled) grads
    perf_warmup_steps: int = 5  # steps excluded from the summary's samples_per_s

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "trainer.epochs", self.epochs, "an int >= 1")
        _check(self.max_steps is None or self.max_steps >= 1, "trainer.max_steps",
               self.max_steps, "null or an int >= 1")
        _check(self.log_every >= 1, "trainer.log_every", self.log_every, "an int >= 1")
        _check(self.clip_grad_norm is None or self.clip_grad_norm > 0, "trainer.clip_grad_norm",
               self.clip_grad_norm, "null (off) or > 0")
        _check(self.perf_warmup_steps >= 0, "trainer.perf_warmup_steps", self.perf_warmup_steps,
               ">= 0")


@dataclass
class CkptConfig:
    every_steps: Optional[int] = None  # write checkpoints/last.pt every N optimizer steps; null = end only
    keep: int = 1  # how many step-numbered checkpoints to keep beside last.pt

    def __post_init__(self) -> None:
        _check(self.every_steps is None or self.every_steps >= 1, "ckpt.every_steps",
               self.every_steps, "null or an int >= 1")
        _check(self.keep >= 1, "ckpt.keep", self.keep, "an int >= 1")


@dataclass
class BatchSearchConfig:
    start: int = 16  # first probe of batch=auto
    growth: float = 1.5  # grow by this factor when no memory reading guides it (the seeds' +50 %)
    aim: float = 0.97  # guided growth jumps to this fraction of the batch predicted to fill memory
    resolution: int = 8  # then bisect until the bracket is this narrow
    margin: float = 0.05  # use (1 - margin) of the largest batch that trained
    probe_steps: int = 3  # full training steps per probe
    cache: Optional[str] = None  # JSON cache of results; null = no cache

    def __post_init__(self) -> None:
        _check(self.start >= 1, "batch_search.start", self.start, ">= 1")
        _check(self.growth > 1, "batch_search.growth", self.growth, "> 1")
        _check(0 < self.aim <= 1, "batch_search.aim", self.aim, "in (0, 1]")
        _check(self.resolution >= 1, "batch_search.resolution", self.resolution, ">= 1")
        _check(0 <= self.margin < 1, "batch_search.margin", self.margin, "in [0, 1)")
        _check(self.probe_steps >= 1, "batch_search.probe_steps", self.probe_steps, ">= 1")


@dataclass
class DebugConfig:
    detect_anomaly: bool = False  # autograd anomaly mode: names the op that made a NaN (slow)
    max_bad_steps: int = 3  # stop after this many consecutive non-finite losses
    min_loss_scale: float = 1.0  # stop when the fp16 loss scale collapses below this

    def __post_init__(self) -> None:
        _check(self.max_bad_steps >= 1, "debug.max_bad_steps", self.max_bad_steps, ">= 1")
        _check(self.min_loss_scale > 0, "debug.min_loss_scale", self.min_loss_scale, "> 0")


@dataclass
class TrainConfig:
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    batch_search: BatchSearchConfig = field(default_factory=BatchSearchConfig)
    name: str = "default"  # experiment name: W&B group and tag
    batch: Any = 64  # micro-batch per device: an int >= 1, or auto (the largest that trains)
    accum: int = 1  # micro-batches per optimizer step
    effective_batch: Optional[int] = None  # target batch*accum*world: derives accum (and batch if auto)
    seed: int = 0
    objective: str = "val_acc1"  # the summary value train.py returns (what a sweeper optimises)
    diagnose: bool = False  # dtype audit + tensor-core alignment before training, grad histograms
    resume: Optional[str] = None  # null, auto (this run dir's last.pt) or a run dir / checkpoint
    run_dir: str = "."  # where the run writes; train.yaml points it at Hydra's output dir

    def __post_init__(self) -> None:
        ok = self.batch == "auto" or (isinstance(self.batch, int) and not isinstance(self.batch, bool)
                                      and self.batch >= 1)
        _check(ok, "batch", self.batch, "an int >= 1 or auto")
        _check(isinstance(self.accum, int) and self.accum >= 1, "accum", self.accum, "an int >= 1")
        _one_of("objective", self.objective, OBJECTIVES)
        _check(self.effective_batch is None or self.effective_batch >= 1, "effective_batch",
               self.effective_batch, "null or an int >= 1")


def register_configs() -> None:
    """Make the schema known to Hydra; conf/train.yaml lists `train_schema` first."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def validate(cfg: DictConfig) -> TrainConfig:
    """Build the dataclasses from a composed config (runs every __post_init__ check)."""
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as e:  # __post_init__ errors arrive wrapped
        cause = e.__cause__
        raise (cause if isinstance(cause, ConfigError) else ConfigError(str(e))) from None

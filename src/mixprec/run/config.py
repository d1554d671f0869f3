"""The config schema: the root (TrainConfig) over one dataclass per group, each kept in the module
of its concern (precision/base.py holds PrecisionConfig and ScalerConfig, data/<name>.py its
dataset's Config, ...). Values live in conf/*.yaml only: a field here has a type, a one-line
meaning and its checks, never a default of its own (MISSING), so a default lives in one place.

The data, precision, parallel and logger groups are plugins (data.plugin,
precision.plugin, parallel.plugin, logger.sinks.<name>): their nodes are parsed by their own
Config. Hydra merges conf/ onto this schema (wrong types fail at compose time); validate()
builds the dataclasses, which runs every __post_init__ check, and refuses keys that match no
field (a typo added with `+`) and non-finite numbers. Errors name the key and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from mixprec import data as datasets
from mixprec import sinks
from mixprec.checkpoint.store import CkptConfig
from mixprec.core import launch, metrics
from mixprec.core.early import CONF_DIR
from mixprec.core.errors import ConfigError, check, nearest, one_of
from mixprec.core.hardware import HardwareConfig, Profiles
from mixprec.models import ModelConfig
from mixprec.optim.optimizers import OptimizerConfig, SchedulerConfig
from mixprec.parallel import strategy
from mixprec.precision import base as precisions
from mixprec.precision.base import ScalerConfig
from mixprec.report.quality import StudyConfig
from mixprec.training.batch_size import BatchSearchConfig
from mixprec.training.perf import MIN_TIMED_STEPS
from mixprec.training.safety import DebugConfig


@dataclass
class TrainerConfig:
    """trainer.* in conf/train.yaml"""

    epochs: int = MISSING  # passes over the training data
    min_steps: int = MISSING  # epochs are added until the run has at least this many steps
    max_steps: Optional[int] = MISSING  # run exactly this many optimizer steps; null = by epochs
    log_every: int = MISSING  # optimizer steps between log events (each reads the loss scale)
    val_every: Optional[int] = MISSING  # optimizer steps between evaluations; null: epoch ends
    clip_grad_norm: Optional[float] = MISSING  # max global norm of the true (unscaled) grads
    perf_warmup_steps: int = MISSING  # steps excluded from the summary's samples_per_s
    settle_late: bool = MISSING  # settle each step one step late (no host sync per fp16 step)
    stop_grace_s: float = MISSING  # after a stop signal: exit without a checkpoint after this
    deterministic: bool = MISSING  # torch's deterministic algorithms (and cuBLAS's workspace)

    def __post_init__(self) -> None:
        check(self.epochs >= 1, "trainer.epochs", self.epochs, "an int >= 1")
        check(self.min_steps >= 0, "trainer.min_steps", self.min_steps, "an int >= 0")
        check(
            self.max_steps is None or self.max_steps >= 1,
            "trainer.max_steps",
            self.max_steps,
            "null or an int >= 1",
        )
        check(self.log_every >= 1, "trainer.log_every", self.log_every, "an int >= 1")
        check(
            self.val_every is None or self.val_every >= 1,
            "trainer.val_every",
            self.val_every,
            "null (at epoch ends only) or an int >= 1",
        )
        check(
            self.clip_grad_norm is None or self.clip_grad_norm > 0,
            "trainer.clip_grad_norm",
            self.clip_grad_norm,
            "null (off) or > 0",
        )
        check(
            self.perf_warmup_steps >= 0, "trainer.perf_warmup_steps", self.perf_warmup_steps, ">= 0"
        )
        check(self.stop_grace_s > 0, "trainer.stop_grace_s", self.stop_grace_s, "> 0")


@dataclass
class TrainConfig:
    """conf/train.yaml: the groups, then the run's own keys."""

    precision: Any = MISSING  # the chosen precision plugin's own Config (precision/)
    scaler: ScalerConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    hardware: HardwareConfig = MISSING
    model: ModelConfig = MISSING
    data: Any = MISSING  # the chosen dataset's own Config (mixprec/data/<name>.py)
    logger: Any = MISSING  # the chosen sinks, each with its own Config (sinks/)
    trainer: TrainerConfig = MISSING
    ckpt: CkptConfig = MISSING
    debug: DebugConfig = MISSING
    parallel: Any = MISSING  # the chosen strategy plugin's own Config (parallel/)
    batch_search: BatchSearchConfig = MISSING
    study: StudyConfig = MISSING  # a sweep of precisions x seeds matched at one loss (study.py)
    name: str = MISSING  # experiment name: W&B group and tag
    batch: Any = MISSING  # micro-batch per device: an int >= 1, or auto (the largest that trains)
    accum: int = MISSING  # micro-batches per optimizer step
    effective_batch: Optional[int] = MISSING  # target batch*accum*world: derives accum
    seed: int = MISSING  # python, numpy and torch seed (rank r uses seed + r)
    objective: str = MISSING  # the summary value train.py returns (what a sweeper optimises)
    diagnose: bool = MISSING  # dtype audit + tensor-core alignment before training, histograms
    resume: Optional[str] = MISSING  # null, auto (this run dir's last.pt) or a run dir / .pt
    overwrite: bool = MISSING  # a run dir that already holds a run: start it over (else refuse)
    needs_gpu: bool = MISSING  # the preset is sized for a GPU: refuse to start on a CPU
    run_dir: str = MISSING  # where the run writes; train.yaml points it at Hydra's output dir
    callbacks: Any = MISSING  # {name: {_target_: pkg.mod.Class, its arguments}} (callbacks.py)

    def __post_init__(self) -> None:
        ok = self.batch == "auto" or (
            isinstance(self.batch, int) and not isinstance(self.batch, bool) and self.batch >= 1
        )
        check(ok, "batch", self.batch, "an int >= 1 or auto")
        check(isinstance(self.accum, int) and self.accum >= 1, "accum", self.accum, "an int >= 1")
        check(0 <= self.seed < 2**31, "seed", self.seed, "an int in [0, 2^31)")
        one_of("objective", self.objective, metrics.objectives())
        check(
            self.effective_batch is None or self.effective_batch >= 1,
            "effective_batch",
            self.effective_batch,
            "null or an int >= 1",
        )

    def check_objective(self) -> None:
        """For a sweep: a rate objective needs steps to time after the warm-up; a sweep over
        runs too short to time would have no trial to compare (a config error, not N nulls)."""
        t = self.trainer
        if self.objective not in ("samples_per_s", "mfu") or t.max_steps is None:
            return
        timed = t.max_steps - t.perf_warmup_steps
        if timed < MIN_TIMED_STEPS:
            raise ConfigError(
                f"objective={self.objective} with trainer.max_steps={t.max_steps} and "
                f"trainer.perf_warmup_steps={t.perf_warmup_steps} leaves {max(timed, 0)} timed "
                f"steps; it needs at least {MIN_TIMED_STEPS} to measure: raise "
                "trainer.max_steps or lower trainer.perf_warmup_steps"
            )


def register_configs() -> None:
    """Make the schema known to Hydra; conf/train.yaml lists `train_schema` first."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("mixprec.job"):  # hydra.sweep.subdir's job folder names
        OmegaConf.register_new_resolver("mixprec.job", launch.job_dirname)


def validate(cfg: DictConfig) -> TrainConfig:
    """Build the dataclasses from a composed config (runs every __post_init__ check)."""
    if OmegaConf.is_missing(cfg, "logger"):  # logger=[]: no logger option chosen, as logger=none
        with open_dict(cfg):
            cfg.logger = {"sinks": {}}
    _known_keys(cfg, TrainConfig, "")
    _finite(cfg, "")
    _strict_bools(cfg, launch.task_overrides())
    try:
        data = datasets.parse(OmegaConf.to_container(cfg.data, resolve=True))
        prec = precisions.parse(OmegaConf.to_container(cfg.precision, resolve=True))
        logger = sinks.parse(OmegaConf.to_container(cfg.logger, resolve=True))
        parallel = strategy.parse(OmegaConf.to_container(cfg.parallel, resolve=True))
        c: TrainConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as e:  # __post_init__ errors arrive wrapped
        cause = e.__cause__
        raise (cause if isinstance(cause, ConfigError) else ConfigError(str(e))) from None
    c.data, c.precision, c.logger, c.parallel = data, prec, logger, parallel
    check(
        not c.ckpt.sharded or strategy.of(parallel).shards,
        "ckpt.sharded",
        c.ckpt.sharded,
        f"false unless the strategy shards (parallel=fsdp); parallel={parallel.strategy} does not",
    )
    return c


def _strict_bools(cfg: DictConfig, overrides: list[str]) -> None:
    """A true/false key given anything but true or false on the command line: OmegaConf reads
    `debug.memory=2` (or `yes`) as true, where the user meant something else."""
    for override in overrides:
        key, eq, value = override.lstrip("+~").partition("=")
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        if not eq or not isinstance(node, DictConfig) or leaf not in node:
            continue
        if OmegaConf.get_type(node, leaf) is bool and value.strip().lower() not in BOOLS:
            raise ConfigError(f"{key}={value}: a key that is true or false (allowed: true, false)")


BOOLS = ("true", "false")


def _known_keys(node: DictConfig, schema: type, prefix: str) -> None:
    """Every key matches a field: `+trainer.max_step=5` is a typo, not a new setting."""
    fields = {f.name for f in dataclasses.fields(schema)}
    for key in node:
        if key not in fields:
            raise ConfigError(
                f"{prefix}{key} is not a config key{nearest(str(key), fields)} "
                f"(the keys of {prefix.rstrip('.') or 'the config'}: "
                f"{', '.join(sorted(fields))})"
            )
        child = OmegaConf.get_type(node, key)
        if dataclasses.is_dataclass(child) and isinstance(node[key], DictConfig):
            _known_keys(node[key], child, f"{prefix}{key}.")


def _finite(node: Any, prefix: str) -> None:
    """No inf or nan anywhere: `optimizer.lr=inf` would pass every range check."""
    items = (
        node.items_ex(resolve=True)
        if isinstance(node, DictConfig)
        else enumerate(node)
        if isinstance(node, ListConfig)
        else ()
    )
    for key, value in items:
        if isinstance(value, (DictConfig, ListConfig)):
            _finite(value, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{key}={value} is not allowed; it must be a finite number")


def compose_config(overrides: list[str] = ()) -> DictConfig:
    """The config train.py would compose for these overrides, for scripts and notebooks (train.py
    itself goes through @hydra.main). Hydra stays initialised with conf/ afterwards."""
    if not GlobalHydra.instance().is_initialized():
        register_configs()
        initialize_config_dir(str(CONF_DIR), version_base="1.3")
    return compose("train", overrides=["run_dir=.", *overrides])


def _hydra() -> GlobalHydra:
    hydra = GlobalHydra.instance()
    if not hydra.is_initialized():
        raise ConfigError(
            "Hydra is not initialized: run through train.py, or compose with "
            "mixprec.run.config.compose_config() first"
        )
    return hydra


def load_option(group: str, option: str) -> DictConfig:
    """conf/<group>/<option>.yaml as Hydra composes it (search path, defaults lists)."""
    _hydra()
    return compose(f"{group}/{option}")[group]


_HARDWARE: dict[str, HardwareConfig] = {}  # hardware_profiles' loads: conf/ is read once


def hardware_profiles() -> Profiles:
    """The conf/hardware options, loaded through Hydra and validated, each once a process (a
    Hydra composition each: 0.3 s of every in-process sweep job's start)."""
    names = _hydra().config_loader().get_group_options("hardware")
    schema, loaded = OmegaConf.structured(HardwareConfig), _HARDWARE

    def load(name: str) -> HardwareConfig:
        if name not in loaded:
            loaded[name] = OmegaConf.to_object(
                OmegaConf.merge(schema, load_option("hardware", name))
            )
        return copy.deepcopy(loaded[name])  # (a run may change its own: not the cached one)

    return Profiles(names, load)

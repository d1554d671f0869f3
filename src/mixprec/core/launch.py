"""What Hydra tells a job about how it was launched: single run or multirun, the sweep dir,
the overrides typed, and whether the job has a process of its own (a submitit job). Read here
only, so the rest of mixprec works the same from a script or a notebook (no Hydra: a single run
with no overrides)."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from mixprec.core import files
from mixprec.core.errors import ConfigError, Unwritable


def hydra_config():
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def multirun() -> bool:
    hc = hydra_config()
    return hc is not None and str(hc.mode) == "RunMode.MULTIRUN"


def own_process() -> bool:
    """This job runs in a process of its own (a submitit job: SLURM, or hydra/launcher=local)."""
    return "SUBMITIT_EXECUTOR" in os.environ


def sweep_dir() -> Path | None:
    hc = hydra_config()
    return Path(hc.sweep.dir) if multirun() else None


def job_name(run_dir: Path) -> str:
    """What tells the job apart in its sweep: its values of the keys the sweep varies
    (`precision=bf16,seed=2`), not every override (`data.path=<your folder>,...` made W&B's run
    names unreadable: the rest is in the run's config); else its overrides as one string, else
    its run dir's name."""
    hc = hydra_config()
    if hc is None:
        return Path(run_dir).name
    return ",".join(swept_overrides(hc)) or hc.job.override_dirname or Path(run_dir).name


def job_dirname(num) -> str:
    """A sweep job's folder (conf/train.yaml: hydra.sweep.subdir): its number, then its values
    of the keys the sweep varies (`3_precision=bf16,seed=1`), so that a listing of the sweep
    says which job is which; `/` in a value becomes `_`. The number alone outside a sweep, or
    where nothing is swept. The same job gets the same folder every time (a sweep resumed with
    resume=auto finds its jobs' checkpoints)."""
    hc = hydra_config()
    if hc is None or not multirun():
        return str(num)
    name = ",".join(swept_overrides(hc)).replace("/", "_").replace(os.sep, "_")
    return f"{num}_{name}"[:200] if name else str(num)


def swept_overrides(hc) -> list[str]:
    """This job's overrides of the keys its sweep varies, as typed (`precision=bf16`)."""
    swept = swept_keys()
    return [o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") in swept]


def swept_keys() -> set[str]:
    """The keys this multirun varies: a sweep on the command line (`precision=fp32,bf16`,
    `range(...)`) or in the sweeper's params (the study presets'), read from the sweep's
    multirun.yaml, which Hydra writes before the first job."""
    saved = sweep_overrides()
    if saved is None:
        return set()
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides(saved[0])
    except Exception:  # noqa: BLE001 (a file Hydra wrote; unreadable: the names stay long)
        return set()
    return {o.key_or_group for o in overrides if o.is_sweep_override()} | saved[1]


def sweep_overrides() -> tuple[list[str], set[str]] | None:
    """This multirun's command-line overrides as typed (sweeps included) and its sweeper's
    param keys, from the sweep's multirun.yaml; None outside a multirun or where unreadable."""
    sweep = sweep_dir()
    if not multirun() or sweep is None or not (sweep / "multirun.yaml").is_file():
        return None
    try:
        saved = OmegaConf.load(sweep / "multirun.yaml").hydra
        return list(saved.overrides.task), set(saved.sweeper.get("params") or {})
    except Exception:  # noqa: BLE001 (a file Hydra wrote)
        return None


def task_overrides() -> list[str]:
    hc = hydra_config()
    return list(hc.overrides.task) if hc else []


class ConsoleFormatter(logging.Formatter):
    """The console's lines (conf/hydra/job_logging/mixprec.yaml): `[21:04:05] step 40/500 ...`,
    and `[21:04:05] WARNING: ...` where it is one. Hydra's default prefix (the date, the
    logger's dotted name, the level) took 50 columns and wrapped every step line."""

    def __init__(self) -> None:
        super().__init__("[%(asctime)s] %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            stamp = f"[{self.formatTime(record, self.datefmt)}] "
            text = f"{stamp}{record.levelname}: {text.removeprefix(stamp)}"
        return text


def hydra_files(cfg) -> dict[str, str]:
    """What Hydra writes into `.hydra/` (config.yaml, hydra.yaml, overrides.yaml), as text;
    empty outside Hydra (a script, or torchrun's other ranks)."""

    hc = hydra_config()
    if hc is None:
        return {}
    return {
        "config.yaml": OmegaConf.to_yaml(cfg),
        "hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hc})),
        "overrides.yaml": OmegaConf.to_yaml(OmegaConf.create(list(hc.overrides.task))),
    }


@contextmanager
def config_errors_exit_2() -> Iterator[None]:
    """Hydra's own config errors (a type: `seed=1.5`; an unknown option: `precision=fp9`; an
    override it cannot parse) exit with mixprec's config-error code, 2, not Hydra's 1. Hydra
    prints them and calls sys.exit(1) while handling them, so the SystemExit carries the error
    as its __context__; with HYDRA_FULL_ERROR=1 the error itself arrives."""
    from hydra.errors import CompactHydraException

    try:
        yield
    except SystemExit as stop:
        if stop.code == 1 and isinstance(stop.__context__, CompactHydraException):
            raise SystemExit(ConfigError.exit_code) from None
        raise
    except CompactHydraException:
        traceback.print_exc()
        sys.exit(ConfigError.exit_code)


class WritableRunDir(Callback):
    """Before Hydra makes the run dir (or a multirun's sweep dir) and writes its .hydra/ and
    train.log there: a dir that cannot be written (a read-only filesystem, a file where the folder
    should be, no permission) is one line and exit 9, not Hydra's traceback and exit 1."""

    def on_run_start(self, config, **kwargs) -> None:
        _check_dir("hydra.run.dir", config.hydra.run.dir)

    def on_multirun_start(self, config, **kwargs) -> None:
        _check_dir("hydra.sweep.dir", config.hydra.sweep.dir)


def _check_dir(key: str, path: str) -> None:
    why = files.writable_dir(Path(path))
    if why:
        print(f"{Unwritable.label}: {key}={path}: {why}", file=sys.stderr)
        sys.exit(Unwritable.exit_code)

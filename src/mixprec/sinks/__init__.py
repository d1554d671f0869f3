"""Where a run's metrics go: sinks, one module each, like datasets (data/) and precisions.

`logger=<name>` picks conf/logger/<name>.yaml, which switches its sink on (`logger.sinks.<name>:
true`) and holds its settings as `logger.<key>`; `logger=[wandb,tensorboard]` (Hydra's
multi-select) switches on both, `logger=none` none. A sink module has a `Config` (its keys, which
it alone reads), a `Sink` (the class the Tracker writes to) and `FILES` (what it keeps in the
run dir). Adding a backend is one module here and one YAML in conf/logger/ — or, for a logger
of your own outside mixprec, a YAML whose sink names its module (`sinks: {mine: pkg.module}`:
an importable path instead of `true`), as `precision.plugin` names a precision's. The local files
(metrics.jsonl, summary.json: sinks/local.py) are written always: they are the contract.

May import: core, optim (describe.py: what ran, as the dashboards' config).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from mixprec.core import targets
from mixprec.core.errors import ConfigError, nearest
from mixprec.core.schema import structured
from mixprec.sinks.tracking import dropped

ALWAYS = "local"  # metrics.jsonl and summary.json: on whatever logger= says


@dataclass(frozen=True)
class Context:
    """What a sink knows about the run it logs."""

    run_dir: Path
    config: dict  # what ran (resolved values, only the keys that apply: describe.what_ran)
    experiment: str  # the experiment's name (W&B group, tag)
    tags: tuple[str, ...]  # precision, model, hardware, experiment
    resume_step: int | None  # continuing this run dir's own run from this step, else None
    resume_evaluated: bool = False  # that checkpoint holds its step's evaluation (not re-run)


@dataclass
class LoggerConfig:
    """The composed `logger` node: the sinks switched on, each with its own Config."""

    sinks: dict[str, Any]  # sink name -> its Config
    modules: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> its module path

    @property
    def names(self) -> list[str]:
        return list(self.sinks)


def names() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.iter_modules(__path__)
        if m.name != ALWAYS and hasattr(_module(m.name), "Sink")
    )


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def _plugin(name: str, path: str) -> ModuleType:
    """A sink of the user's: `logger.sinks.<name>: <module path>`, checked."""
    return targets.plugin(
        f"logger.sinks.{name}",
        path,
        ("Config", "Sink"),
        "logger",
        "Config (a dataclass of its keys) and Sink (log, table, histograms, summary, close, label)",
        " (true instead of a path: one of mixprec's own loggers)",
    )


def run_files() -> tuple[str, ...]:
    """Every file or folder a sink may keep in a run dir (overwrite=true removes them)."""
    return tuple(f for name in (ALWAYS, *names()) for f in _module(name).FILES)


def parse(node: dict) -> LoggerConfig:
    """The sinks switched on and their Configs; a key that no chosen sink reads is an error."""
    switched = {k: v for k, v in (node.get("sinks") or {}).items() if v}
    chosen = list(switched)
    paths = {k: v for k, v in switched.items() if isinstance(v, str)}  # a user's logger
    for name in chosen:
        if name not in names() and name not in paths:
            raise ConfigError(
                f"logger={name!r} is not a logger{nearest(name, names())} "
                f"(allowed: {', '.join(names())} or none; a logger of your own: "
                f"logger.sinks.{name}=<its module>)"
            )
    modules = {n: paths[n] if n in paths else f"{__name__}.{n}" for n in chosen}
    schemas = {n: (_plugin(n, paths[n]) if n in paths else _module(n)).Config for n in chosen}
    known = {f.name: name for name, s in schemas.items() for f in dataclasses.fields(s)}
    for key in node:
        if key != "sinks" and key not in known:
            raise ConfigError(
                f"logger.{key} is not read by the chosen loggers "
                f"({', '.join(chosen) or 'none'}){nearest(key, known)}"
            )
    out = {}
    for name, schema in schemas.items():
        mine = {f.name: node[f.name] for f in dataclasses.fields(schema) if f.name in node}
        out[name] = structured(schema, mine, "logger")
    return LoggerConfig(out, modules)


def build(cfg: LoggerConfig, ctx: Context) -> list:
    """The local sink, then the chosen ones, in the order logger= named them. A chosen sink
    that cannot start (W&B unreachable) is left out with a warning; training goes on."""

    out = [_module(ALWAYS).Sink(ctx)]
    for name, cfg_ in cfg.sinks.items():
        module = importlib.import_module(cfg.modules.get(name) or f"{__name__}.{name}")
        try:
            out.append(module.Sink(cfg_, ctx))
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001  (a dashboard never stops training)
            dropped(module.Sink.label, "init", e)
    return out


def reporting(run_dirs: list[Path]) -> list[tuple[str, ModuleType]]:
    """The sinks that take a sweep's report: each sink these runs' configs switched on whose
    module defines `log_report` (W&B's: a report run beside its jobs; a sink of your own may
    too) and, where it defines `logged(run_dirs)`, says the runs logged to it. A sink module
    that cannot be imported here (a user's, off this process's path) is skipped with a
    warning: the report's files are written all the same."""
    import logging

    from mixprec.sinks.local import run_config

    found: dict[str, str] = {}
    for d in run_dirs:
        cfg = run_config(d) or {}  # (an unreadable one: named by the report already)
        logger = cfg.get("logger")
        chosen = logger.get("sinks") if isinstance(logger, dict) else None
        for name, how in (chosen if isinstance(chosen, dict) else {}).items():
            found.setdefault(name, how if isinstance(how, str) else f"{__name__}.{name}")
    out = []
    for name, path in found.items():
        try:
            module = importlib.import_module(path)
        except ImportError as e:
            logging.getLogger(__name__).warning(
                "report: logger.sinks.%s=%r cannot be imported here (%s); the report does not "
                "go to it",
                name,
                path,
                e,
            )
            continue
        if hasattr(module, "log_report") and getattr(module, "logged", lambda r: True)(run_dirs):
            out.append((name, module))
    return out

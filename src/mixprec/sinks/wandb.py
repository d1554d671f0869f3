"""logger=wandb: Weights & Biases. It never prompts and never stops training: online only when
wandb itself finds credentials, init and finish bounded in time, any failure warns once and the
local files go on. The sink owns its settings (logger.project, ...), its files in the run dir
(`wandb/`, the offline runs; `wandb.json`, the run's id and settings) and its resume: a run that
continues this run dir's own checkpoint continues the W&B run named in wandb.json; a run started
from another run's checkpoint is a new W&B run."""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from omegaconf import MISSING

from mixprec.core import files, launch
from mixprec.core.errors import check, one_of

log = logging.getLogger(__name__)
FILES = ("wandb", "wandb.json")


@dataclass
class Config:
    """conf/logger/wandb.yaml"""

    project: str = MISSING  # the W&B project
    entity: Optional[str] = None  # null = your default entity
    mode: Optional[str] = None  # null = WANDB_MODE, else online with credentials, else offline
    group: Optional[str] = None  # null = <name>-<date>, or <name>-<sweep dir> in a multirun
    tags: List[str] = field(default_factory=list)  # extra tags
    timeout_s: float = MISSING  # the most init or finish may take before W&B is dropped

    def __post_init__(self) -> None:
        one_of("logger.mode", self.mode, (None, "online", "offline", "disabled"))
        check(
            self.timeout_s is not None and self.timeout_s > 0,
            "logger.timeout_s",
            self.timeout_s,
            "> 0 (seconds)",
        )


def has_credentials() -> bool:
    """wandb's own answer (env key, settings, netrc, identity token), without a prompt."""
    import wandb

    try:
        return bool(wandb.login(prompt=False, verify=False))
    except Exception as e:  # a broken settings file must not stop training
        log.warning("W&B: could not check for credentials (%s); running offline", e)
        return False


def wandb_mode(configured: str | None) -> str:
    """offline unless WANDB_MODE or logger.mode asks otherwise and there are credentials: an
    online run without them would stop at wandb's interactive login prompt."""
    mode = configured or os.environ.get("WANDB_MODE") or ""
    if mode in ("offline", "disabled", "dryrun"):
        return "offline" if mode == "dryrun" else mode
    if has_credentials():
        return "online"
    if mode == "online":
        log.warning(
            "W&B: mode online was asked for but wandb finds no credentials (WANDB_API_KEY "
            "or `wandb login`); logging offline instead (sync later with wandb sync)"
        )
    return "offline"


def group(cfg: Config, experiment: str) -> str:
    """logger.group, else `<name>-<sweep>` for a multirun (its dated sweep dir) and
    `<name>-<date>` for a single run."""
    if cfg.group:
        return cfg.group
    sweep = launch.sweep_dir()
    if sweep is not None:
        dated = re.fullmatch(r"\d{4}-\d{2}-\d{2}", sweep.parent.name)
        return f"{experiment}-{sweep.parent.name + '_' if dated else ''}{sweep.name}"
    return f"{experiment}-{datetime.date.today().isoformat()}"


def bounded(fn, timeout_s: float, what: str):
    """fn() in a thread, given up after timeout_s (wandb has no deadline of its own on finish)."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller)
            box["error"] = e

    t = threading.Thread(target=target, name=f"mixprec-wandb-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _own_id(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "wandb.json").read_text()).get("id")
    except (OSError, ValueError, AttributeError):
        return None


class Sink:
    label = "W&B"
    essential = False  # a failure warns and drops W&B; the local files go on

    def __init__(self, cfg: Config, ctx) -> None:
        import wandb

        self.wandb, self.timeout_s = wandb, cfg.timeout_s
        settings = dict(
            project=cfg.project,
            entity=cfg.entity,
            group=group(cfg, ctx.experiment),
            name=launch.job_name(ctx.run_dir),
            tags=sorted({*ctx.tags, *cfg.tags}),
            mode=wandb_mode(cfg.mode),
        )
        run_id = _own_id(ctx.run_dir) if ctx.resume_step is not None else None
        self.run = bounded(
            lambda: wandb.init(
                dir=str(ctx.run_dir),
                config=ctx.config,
                id=run_id,
                resume="allow" if run_id else None,
                reinit="finish_previous",
                # silent: W&B's own ~30 console lines per run; mixprec says where the run is
                settings=wandb.Settings(init_timeout=cfg.timeout_s, silent=True),
                **settings,
            ),
            cfg.timeout_s + 5,
            "init",
        )
        # x-axis `step`; no summary from history: the run's summary is summary.json, exactly
        self.run.define_metric("step", summary="none")
        self.run.define_metric("*", step_metric="step", summary="none")
        files.write_json(
            ctx.run_dir / "wandb.json", {**settings, "id": self.run.id, "timeout_s": cfg.timeout_s}
        )
        self.mode, self.run_dir = settings["mode"], ctx.run_dir

    def log(self, row: dict) -> None:
        self.run.log(row)

    def summary(self, summary: dict) -> None:
        self.run.summary.update(summary)

    def table(self, name: str, rows: list[dict]) -> None:
        cols = list(rows[0])
        self.run.log(
            {
                name: self.wandb.Table(
                    columns=cols,
                    data=[
                        [str(r[c]) if isinstance(r[c], list) else r[c] for c in cols] for r in rows
                    ],
                )
            }
        )

    def histograms(self, values: dict, step: int) -> None:
        self.run.log(
            {
                "step": step,
                **{
                    k: self.wandb.Histogram(v.numpy()) if hasattr(v, "numpy") else v
                    for k, v in values.items()
                },
            }
        )

    def close(self, status: str) -> None:
        if status == "preempted":
            self.run.mark_preempting()
        bounded(
            lambda: self.run.finish(exit_code=0 if status == "completed" else 1),
            self.timeout_s,
            "finish",
        )
        if self.mode == "offline":
            log.info(
                "W&B: offline run in %s/wandb; upload it with python -m mixprec.sync %s",
                self.run_dir,
                self.run_dir,
            )


def log_report(
    columns: list[str],
    table: list[dict],
    images: list[Path],
    out_dir: Path,
    run_dirs: list[Path],
    extra: dict | None = None,
) -> None:
    """A sweep's report as one W&B run (job_type=report) in the project, entity, mode and group
    of its jobs, holding the table and the plots. Its id comes from the sweep dir, so a rebuilt
    report updates that run instead of adding another."""
    settings = next(
        (
            json.loads((d / "wandb.json").read_text())
            for d in run_dirs
            if (d / "wandb.json").exists()
        ),
        None,
    )
    if settings is None:  # no job reached W&B: nothing to group the report with
        log.info("report: no job of %s logged to W&B; the report stays local", out_dir)
        return
    try:
        import wandb

        run_id = "report-" + hashlib.sha1(str(out_dir.resolve()).encode()).hexdigest()[:12]
        run = wandb.init(
            project=settings["project"],
            entity=settings["entity"],
            group=settings["group"],
            mode=settings["mode"],
            job_type="report",
            dir=str(out_dir),
            id=run_id,
            resume="allow",
            name=f"report-{out_dir.name}",
            reinit="finish_previous",
            settings=wandb.Settings(init_timeout=settings["timeout_s"], silent=True),
        )
        run.log(
            {
                "report": wandb.Table(
                    columns=columns, data=[[row[c] for c in columns] for row in table]
                ),
                **{p.stem: wandb.Image(str(p)) for p in images},
                **{
                    name: wandb.Table(columns=t[0], data=[[r[c] for c in t[0]] for r in t[1]])
                    for name, t in (extra or {}).items()
                    if name != "summary"
                },
            }
        )
        run.summary.update((extra or {}).get("summary", {}))
        run.finish()
    except Exception as e:  # the local report is what matters
        log.warning("report: W&B logging failed (%s); local files are written", e)


def logged(run_dirs: list[Path]) -> bool:
    """Whether any of these runs logged to W&B (the report then goes there too)."""
    return any((d / "wandb").is_dir() for d in run_dirs)

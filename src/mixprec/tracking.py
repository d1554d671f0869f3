"""Where metrics go: metrics.jsonl and summary.json in the run dir (always) and Weights & Biases
(logger=wandb). W&B never prompts and never stops training: online only when wandb itself finds
credentials, init and finish bounded in time, any failure warns once and the local files go on."""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING

from .errors import check, one_of

log = logging.getLogger(__name__)


@dataclass
class LoggerConfig:
    """conf/logger/*.yaml"""

    name: str = MISSING  # wandb or none (local files are always written)
    project: Optional[str] = None  # wandb
    entity: Optional[str] = None  # wandb: null = your default entity
    mode: Optional[str] = None  # wandb: null = WANDB_MODE, else online with credentials, else offline
    group: Optional[str] = None  # wandb: null = <name>-<date>, or <name>-<sweep dir> in a multirun
    tags: List[str] = field(default_factory=list)  # wandb: extra tags
    timeout_s: Optional[float] = None  # wandb: the most init or finish may take before W&B is dropped

    def __post_init__(self) -> None:
        one_of("logger", self.name, ("wandb", "none"))
        one_of("logger.mode", self.mode, (None, "online", "offline", "disabled"))
        check(self.timeout_s is None or self.timeout_s > 0, "logger.timeout_s", self.timeout_s,
              "> 0")


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_plain) + "\n")
    os.replace(tmp, path)


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else str(v)


def _finite(v: Any) -> Any:
    """JSON has no inf/nan: write them as strings so every line stays valid JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a torn line (a crash, power loss or full disk mid-write) is
    skipped with a warning instead of making the whole file unreadable."""
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s line %d is torn (not JSON); skipped", path, n)
    return rows


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
        log.warning("W&B: mode online was asked for but wandb finds no credentials (WANDB_API_KEY "
                    "or `wandb login`); logging offline instead (sync later with wandb sync)")
    return "offline"


def _bounded(fn, timeout_s: float, what: str):
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


class _WandbSink:
    def __init__(self, run_dir: Path, settings: dict, config: dict, run_id: str | None,
                 timeout_s: float) -> None:
        import wandb

        self.wandb, self.timeout_s = wandb, timeout_s
        self.run = _bounded(lambda: wandb.init(
            dir=str(run_dir), config=config, id=run_id, resume="allow" if run_id else None,
            reinit="finish_previous", settings=wandb.Settings(init_timeout=timeout_s),
            **settings), timeout_s + 5, "init")
        # x-axis `step`; no summary from history: the run's summary is summary.json, exactly
        self.run.define_metric("step", summary="none")
        self.run.define_metric("*", step_metric="step", summary="none")

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, metrics: dict) -> None:
        self.run.log(metrics)

    def summary(self, summary: dict) -> None:
        self.run.summary.update(summary)

    def table(self, name: str, rows: list[dict]) -> None:
        cols = list(rows[0])
        self.run.log({name: self.wandb.Table(columns=cols, data=[[str(r[c]) if isinstance(
            r[c], list) else r[c] for c in cols] for r in rows])})

    def histograms(self, values: dict, step: int) -> None:
        self.run.log({"step": step, **{k: self.wandb.Histogram(v.numpy()) if hasattr(v, "numpy")
                                       else v for k, v in values.items()}})

    def close(self, exit_code: int, preempted: bool) -> None:
        if preempted:
            self.run.mark_preempting()
        _bounded(lambda: self.run.finish(exit_code=exit_code), self.timeout_s, "finish")


class Tracker:
    """One per run: `log()` per event, `summary()` at the end, `close()` always (in finally).
    Rank 0 alone writes; other ranks hold a Tracker that does nothing."""

    def __init__(self, run_dir: Path, wandb_settings: dict | None, config: dict,
                 run_id: str | None = None, rank0: bool = True,
                 resume_step: int | None = None) -> None:
        self.run_dir, self.rank0, self.sink = run_dir, rank0, None
        if not rank0:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        if resume_step is not None and path.exists():
            _drop_rows_after(path, resume_step)  # a killed run logged past its last checkpoint
        self.metrics = open(path, "a", buffering=1)
        if wandb_settings is not None:
            settings = dict(wandb_settings)
            timeout_s = settings.pop("timeout_s")
            self._guard(lambda: setattr(self, "sink", _WandbSink(
                run_dir, settings, config, run_id, timeout_s)), "init")
            if self.sink:
                write_json_atomic(run_dir / "wandb.json", {**settings, "id": self.sink.run_id,
                                                           "timeout_s": timeout_s})

    @property
    def run_id(self) -> str | None:
        return self.sink.run_id if self.sink else None

    def _guard(self, fn, what: str) -> None:
        try:
            fn()
        except Exception as e:  # never let the dashboard kill a training run
            warnings.warn(f"W&B {what} failed ({type(e).__name__}: {e}); W&B logging is off "
                          "for the rest of this run, local metrics.jsonl/summary.json go on",
                          RuntimeWarning, stacklevel=3)
            self.sink = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One event; keys whose value is None (not measured) are left out of the row."""
        if not self.rank0:
            return
        row = {"step": step, **{k: v for k, v in metrics.items() if v is not None}}
        self.metrics.write(json.dumps({k: _finite(v) for k, v in row.items()}) + "\n")
        if self.sink:
            self._guard(lambda: self.sink.log(row), "log")

    def table(self, name: str, rows: list[dict]) -> None:
        """A table to W&B (local copies are the caller's business)."""
        if self.rank0 and self.sink and rows:
            self._guard(lambda: self.sink.table(name, rows), "table")

    def histograms(self, values: dict[str, Any], step: int) -> None:
        """Tensors become W&B histograms; plain numbers also go to metrics.jsonl."""
        if not self.rank0:
            return
        scalars = {k: v for k, v in values.items() if not hasattr(v, "numpy")}
        if scalars:
            self.metrics.write(json.dumps({"step": step, **scalars}) + "\n")
        if self.sink:
            self._guard(lambda: self.sink.histograms(values, step), "histogram")

    def summary(self, summary: dict[str, Any]) -> None:
        """summary.json, and the same values as the W&B run's summary."""
        if not self.rank0:
            return
        write_json_atomic(self.run_dir / "summary.json", {k: _finite(v) for k, v in summary.items()})
        if self.sink:
            self._guard(lambda: self.sink.summary(summary), "summary")

    def close(self, status: str) -> None:
        if not self.rank0:
            return
        self.metrics.close()
        if self.sink:
            self._guard(lambda: self.sink.close(0 if status == "completed" else 1,
                                                status == "preempted"), "finish")


def _drop_rows_after(path: Path, step: int) -> None:
    def keep(row: dict) -> bool:  # evaluation at the checkpoint's step runs again after resume
        return row.get("step", 0) < step or (row.get("step") == step and "val/acc1" not in row)

    rows = [row for row in read_jsonl(path) if keep(row)]
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)

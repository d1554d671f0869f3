"""Where metrics go: metrics.jsonl and summary.json in the run dir (always) and Weights & Biases
(logger=wandb). A W&B failure never stops training: it warns once and the local files go on."""
from __future__ import annotations

import json
import logging
import math
import netrc
import os
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# W&B summary aggregation for the contract's metrics (the runs table compares these directly).
SUMMARY_RULES = {"val/acc1": "max", "val/loss": "min", "train/loss": "last",
                 "perf/samples_per_s": "mean", "mem/peak_gib": "max", "amp/loss_scale": "last",
                 "amp/skipped_steps": "last"}


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_plain) + "\n")
    os.replace(tmp, path)


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else str(v)


def _finite(v: Any) -> Any:
    """JSON has no inf/nan: write them as strings so every line stays valid JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def wandb_mode(configured: str | None) -> str:
    """offline unless WANDB_MODE or credentials say otherwise (there may be no network)."""
    if configured:
        return configured
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


class _WandbSink:
    def __init__(self, run_dir: Path, settings: dict, config: dict, run_id: str | None) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(dir=str(run_dir), config=config, id=run_id, resume="allow",
                              reinit="finish_previous", **settings)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        for key, rule in SUMMARY_RULES.items():
            self.run.define_metric(key, step_metric="step", summary=rule)

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

    def close(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)


class Tracker:
    """One per run: `log()` per event, `summary()` at the end, `close()` always (in finally)."""

    def __init__(self, run_dir: Path, logger_settings: dict | None, config: dict,
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
        if logger_settings is not None:
            self._guard(lambda: setattr(self, "sink", _WandbSink(run_dir, logger_settings, config,
                                                                 run_id)), "init")

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
        if not self.rank0:
            return
        row = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
        self.metrics.write(json.dumps(row) + "\n")
        if self.sink:
            self._guard(lambda: self.sink.log({"step": step, **metrics}), "log")

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
        if not self.rank0:
            return
        write_json_atomic(self.run_dir / "summary.json", {k: _finite(v) for k, v in summary.items()})
        if self.sink:
            self._guard(lambda: self.sink.summary(summary), "summary")

    def close(self, status: str) -> None:
        if not self.rank0:
            return
        self.metrics.close()
        if self.sink and status == "preempted":
            self._guard(self.sink.run.mark_preempting, "mark_preempting")
        if self.sink:
            self._guard(lambda: self.sink.close(0 if status == "completed" else 1), "finish")


def _drop_rows_after(path: Path, step: int) -> None:
    def keep(row: dict) -> bool:  # evaluation at the checkpoint's step runs again after resume
        return row.get("step", 0) < step or (row.get("step") == step and "val/acc1" not in row)

    rows = [line for line in path.read_text().splitlines() if line.strip() and keep(json.loads(line))]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    os.replace(tmp, path)

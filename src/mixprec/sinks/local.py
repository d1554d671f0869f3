"""The local files every run writes, whatever logger= says: metrics.jsonl (one JSON object per
log event, W&B's slash-style keys) and summary.json (how the run ended). They are the contract
that the report, the tests and downstream scripts read."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from mixprec.core import files
from mixprec.core.errors import MixprecError

log = logging.getLogger(__name__)
FILES = ("metrics.jsonl", "summary.json")


# summary.json: its keys, and the one way it is made, written and read (run/summary.py fills it)
CONTRACT = (
    "status",
    "precision",
    "batch",
    "accum",
    "effective_batch",
    "world_size",
    "steps",
    "samples_per_s",
    "peak_mem_gib",
    "val_acc1",
    "skipped_steps",
    "loss_scale",
    "mfu",
    "wall_s",
)


def make(error: MixprecError | None = None, /, **values: Any) -> dict:
    """The summary: the contract's keys first (null where unknown), then the rest; a run that
    ended with an error carries its message and exit code."""
    out = {k: values.pop(k, None) for k in CONTRACT}
    out.update(values)
    if error is not None:
        out.update(error=str(error), exit_code=error.exit_code)
    return out


def write(run_dir: Path, summary: dict) -> None:
    files.write_json(run_dir / "summary.json", summary)


def read(run_dir: Path) -> dict:
    """A run dir's summary; for a job that never wrote one (it failed before training, or the
    file is torn or not a summary), a failed summary from its Hydra config."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        summary, why = None, "no summary.json (see the job's train.log)"
    else:
        why = f"{path} holds a {type(summary).__name__}, not a summary"
    if isinstance(summary, dict):
        return summary
    if files.locked(run_dir / files.RUN_LOCK):  # no summary yet: another process is training it
        why = "still running (its run dir is locked by a live process)"
    cfg = run_config(run_dir) or {}
    precision = cfg.get("precision")
    return make(
        status="running" if why.startswith("still running") else "failed",
        precision=precision.get("name") if isinstance(precision, dict) else None,
        batch=cfg.get("batch"),
        error=why,
    )


def run_config(run_dir: Path) -> dict | None:
    """The job's .hydra/config.yaml as a dict; None (with a warning naming it) where it is
    missing, not YAML or not a mapping."""
    import yaml

    path = run_dir / ".hydra" / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        log.warning("%s cannot be read (%s); its run is left out", path, type(e).__name__)
        return None
    if not isinstance(cfg, dict):
        log.warning("%s is not a config (a %s); its run is left out", path, type(cfg).__name__)
        return None
    return cfg


def number(v: Any) -> float | None:
    """A summary value as a finite float, else None (null, "nan" strings, text)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class Sink:
    label = "local files"
    essential = True  # a failure here (a full disk) is the run's failure, not a warning

    def __init__(self, ctx) -> None:
        self.run_dir = ctx.run_dir
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        # (a resume trims the rows a killed run logged past its checkpoint first: run/rundir.py)
        self.metrics = open(ctx.run_dir / "metrics.jsonl", "a", buffering=1)

    def log(self, row: dict[str, Any]) -> None:
        with files.space_checked(Path(self.metrics.name)):
            self.metrics.write(json.dumps(files.finite(row)) + "\n")

    def histograms(self, values: dict[str, Any], step: int) -> None:
        scalars = {k: v for k, v in values.items() if not hasattr(v, "numpy")}
        if scalars:
            self.log({"step": step, **scalars})

    def table(self, name: str, rows: list[dict]) -> None:
        pass  # tables are written into the run dir by whoever makes them (diagnose.md)

    def summary(self, summary: dict[str, Any]) -> None:
        files.write_json(self.run_dir / "summary.json", summary)

    def close(self, status: str) -> None:
        try:
            self.metrics.close()
        except OSError:  # its last buffered bytes on a full disk: the run already said so
            pass


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl (or numerics.jsonl): JSON objects with an integer step. A
    torn line (a crash, power loss or full disk mid-write) or a row of another shape is skipped
    with a warning instead of making the whole file unreadable."""
    rows, torn, odd = [], [], []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            torn.append(n)
            continue
        if isinstance(row, dict) and type(row.get("step")) is int:
            rows.append(row)
        else:
            odd.append(n)
    if torn:
        log.warning("%s line %s is torn (not JSON); skipped", path, _lines(torn))
    if odd:
        log.warning("%s line %s is not a row with a step; skipped", path, _lines(odd))
    return rows


def _lines(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers[:5])) + (
        f" (+{len(numbers) - 5} more)" if numbers[5:] else ""
    )


def drop_rows_after(path: Path, step: int, evaluated: bool = False) -> None:
    """Rows past the checkpoint's step go; at its step, an evaluation row goes too unless the
    checkpoint holds that evaluation (then it is not run again after the resume)."""

    def keep(row: dict) -> bool:
        return row.get("step", 0) < step or (
            row.get("step") == step and (evaluated or not any(k.startswith("val/") for k in row))
        )

    rows = [row for row in read_jsonl(path) if keep(row)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if text.encode() != path.read_bytes():  # a resume that drops nothing touches nothing
        files.write_atomic(path, text)

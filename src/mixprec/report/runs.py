"""The runs a report compares: the run dirs under the given dirs, each read as its summary, its
metrics and the overrides that tell it apart from the others."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixprec.sinks import local
from mixprec.sinks.local import read_jsonl

_num = local.number


def find_runs(paths: list[Path]) -> list[Path]:
    """Run dirs: the given dirs themselves if they are runs, else their job subdirs."""
    runs: list[Path] = []
    for p in paths:
        if (p / ".hydra").is_dir():
            runs.append(p)
        else:
            jobs = [d for d in p.iterdir() if d.is_dir() and (d / ".hydra").is_dir()]
            runs += sorted(jobs, key=lambda d: (len(d.name), d.name))
    return runs


def _overrides(run: Path) -> list[str]:
    path = run / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    import yaml

    return [
        o
        for o in yaml.safe_load(path.read_text()) or []
        if not o.startswith(("hydra.", "run_dir", "logger", "resume="))
    ]


def _labels(run_dirs: list[Path]) -> list[str]:
    """Each run named by the overrides that tell it apart from the others."""
    overrides = [_overrides(d) for d in run_dirs]
    common = set.intersection(*map(set, overrides)) if len(overrides) > 1 else set()
    return [
        ",".join(o for o in ov if o not in common) or d.name for ov, d in zip(overrides, run_dirs)
    ]


def read_run(run: Path, label: str) -> dict[str, Any]:
    row = local.read(run)
    row["run"] = label
    row["dir"] = str(run)
    row["overrides"] = _overrides(run)
    path = run / "metrics.jsonl"
    row["curves"] = read_jsonl(path) if path.exists() else []
    row["samples_per_s_spread"] = spread(row["curves"])
    return row


def spread(curves: list[dict]) -> float | None:
    """How much the run's own throughput moved: the standard deviation of its logged windows'
    samples/s over their mean (the first window, warm-up and compile, left out); None with fewer
    than 3 windows."""
    import statistics

    rates = [r["perf/samples_per_s"] for r in curves if _num(r.get("perf/samples_per_s"))][1:]
    if len(rates) < 3:
        return None
    return statistics.stdev(rates) / statistics.mean(rates)


def read_runs(run_dirs: list[Path]) -> list[dict[str, Any]]:
    return [read_run(d, label) for d, label in zip(run_dirs, _labels(run_dirs))]

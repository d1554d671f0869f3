"""Compare runs: `python -m mixprec.report <sweep dir or run dirs...>`.

Reads every job's summary.json and metrics.jsonl and writes, into the (first) directory given:
report.md and report.csv (one row per job, failed jobs included) and two PNGs: report_bars.png
(throughput and peak memory per configuration) and report_curves.png (loss, loss scale and val
accuracy over steps). The same table goes to the console and, with logger=wandb, to W&B as a
wandb.Table. A Hydra callback (sweep.ReportCallback) keeps it up to date as each multirun job
ends.
"""

from __future__ import annotations

import argparse
import csv
import logging
from pathlib import Path
from typing import Any

from . import metrics, summary
from .sinks import wandb as wandb_sink
from .sinks.local import read_jsonl

log = logging.getLogger(__name__)
RATIOS = {
    "samples_per_s": "speedup_vs_fp32",
    "peak_mem_gib": "mem_saving_vs_fp32",
    "max_batch": "max_batch_vs_fp32",
}  # the column after which each ratio to fp32 stands
COLUMNS = [
    "run",
    "status",
    "precision",
    "batch",
    "accum",
    "effective_batch",
    *(c for m in metrics.report_columns() for c in (m, RATIOS.get(m)) if c),
    "error",
]


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
        if not o.startswith(("hydra.", "run_dir", "logger"))
    ]


def _labels(run_dirs: list[Path]) -> list[str]:
    """Each run named by the overrides that tell it apart from the others."""
    overrides = [_overrides(d) for d in run_dirs]
    common = set.intersection(*map(set, overrides)) if len(overrides) > 1 else set()
    return [
        ",".join(o for o in ov if o not in common) or d.name for ov, d in zip(overrides, run_dirs)
    ]


def read_run(run: Path, label: str) -> dict[str, Any]:
    row = summary.read(run)
    row["run"] = label
    row["dir"] = str(run)
    row["overrides"] = _overrides(run)
    metrics = run / "metrics.jsonl"
    row["curves"] = read_jsonl(metrics) if metrics.exists() else []
    return row


_num = summary.number


def _baseline(r: dict, runs: list[dict]) -> dict | None:
    """The completed fp32 run with the same settings but precision (same model, batch, seed,
    ...), or None: a speed-up is only a ratio between runs that differ in precision alone."""

    def rest(run: dict) -> tuple:
        return (
            tuple(sorted(o for o in run.get("overrides", []) if not o.startswith("precision="))),
            run.get("model"),
            run.get("batch"),
            run.get("world_size"),
        )

    return next(
        (
            b
            for b in runs
            if b.get("precision") == "fp32"
            and b.get("status") == "completed"
            and _num(b.get("samples_per_s"))
            and rest(b) == rest(r)
        ),
        None,
    )


def build_table(runs: list[dict]) -> list[dict]:
    table = []
    for r in runs:
        base = _baseline(r, runs)
        row = {c: r.get(c) for c in COLUMNS}
        sps, mem = _num(r.get("samples_per_s")), _num(r.get("peak_mem_gib"))
        if base and sps:
            row["speedup_vs_fp32"] = sps / base["samples_per_s"]
        if base and mem and _num(base.get("peak_mem_gib")):
            row["mem_saving_vs_fp32"] = 1 - mem / base["peak_mem_gib"]
        if base and _num(r.get("max_batch")) and _num(base.get("max_batch")):
            row["max_batch_vs_fp32"] = r["max_batch"] / base["max_batch"]
        table.append(row)
    return table


def seed_groups(runs: list[dict]) -> list[dict]:
    """Runs that differ only in `seed=`, pooled: val top-1 and samples/s as mean +- std."""
    import statistics

    groups: dict[str, list[dict]] = {}
    for r in runs:
        if r.get("status") == "completed":
            key = ",".join(p for p in r["run"].split(",") if not p.startswith("seed=")) or "all"
            groups.setdefault(key, []).append(r)
    out = []
    for key, rs in groups.items():
        if len(rs) < 2:
            continue
        row = {"config": key, "n": len(rs)}
        for k in ("val_acc1", "samples_per_s"):
            vals = [_num(r.get(k)) for r in rs if _num(r.get(k)) is not None]
            row[k] = (statistics.mean(vals), statistics.stdev(vals)) if len(vals) > 1 else None
        out.append(row)
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def markdown(table: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(row[c]) for c in COLUMNS) + " |" for row in table]
    return "\n".join(lines) + "\n"


def console(table: list[dict]) -> str:
    cells = [COLUMNS] + [[_fmt(row[c]) for c in COLUMNS] for row in table]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    out = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def draw(runs: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if _num(r.get("samples_per_s"))]
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * max(4, len(runs)) + 1))
    for ax, key, title in (
        (axes[0], "samples_per_s", "throughput (samples/s)"),
        (axes[1], "peak_mem_gib", "peak memory (GiB)"),
    ):
        labels = [r["run"] for r in runs]
        values = [_num(r.get(key)) or 0.0 for r in runs]
        colors = ["tab:blue" if r.get("status") == "completed" else "tab:red" for r in runs]
        ax.barh(labels, values, color=colors)
        ax.set_title(title + ("" if len(done) == len(runs) else "  (red: failed)"))
        ax.invert_yaxis()
    fig.tight_layout()
    paths.append(out_dir / "report_bars.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, key, title in (
        (axes[0], "train/loss", "train loss"),
        (axes[1], "amp/loss_scale", "loss scale"),
        (axes[2], "val/acc1", "val top-1"),
    ):
        for r in runs:
            pts = [
                (m["step"], _num(m.get(key))) for m in r["curves"] if _num(m.get(key)) is not None
            ]
            if pts:
                ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None, label=r["run"])
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        if key == "amp/loss_scale":
            ax.set_yscale("log", base=2)
    axes[2].legend(fontsize=7, loc="best")
    fig.tight_layout()
    paths.append(out_dir / "report_curves.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write(
    paths: list[Path], out_dir: Path | None = None, to_wandb: bool | None = None, plots: bool = True
) -> dict:
    """Build the report for these sweep/run dirs (the PNGs too unless `plots` is false);
    returns {'table': ..., 'files': [...]}."""
    run_dirs = find_runs(paths)
    if not run_dirs:
        raise SystemExit(f"no run directories (with .hydra/) under {', '.join(map(str, paths))}")
    out_dir = out_dir or paths[0]
    runs = [read_run(d, label) for d, label in zip(run_dirs, _labels(run_dirs))]
    table = build_table(runs)
    text = markdown(table)
    pooled = seed_groups(runs)
    if pooled:
        text += (
            "\n## Over seeds (mean ± std)\n\n| config | runs | val top-1 | samples/s |\n"
            "|---|---|---|---|\n"
        )
        text += "".join(
            f"| {g['config']} | {g['n']} | "
            + " | ".join(
                f"{g[k][0]:.4f} ± {g[k][1]:.4f}" if g[k] else "-"
                for k in ("val_acc1", "samples_per_s")
            )
            + " |\n"
            for g in pooled
        )
    (out_dir / "report.md").write_text(text)
    with open(out_dir / "report.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(table)
    files = [out_dir / "report.md", out_dir / "report.csv", *(draw(runs, out_dir) if plots else [])]
    print(console(table))
    print("wrote " + ", ".join(str(p) for p in files))
    if to_wandb if to_wandb is not None else wandb_sink.logged(run_dirs):
        wandb_sink.log_report(
            COLUMNS, table, [p for p in files if p.suffix == ".png"], out_dir, run_dirs
        )
    return {"table": table, "files": files}


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m mixprec.report", description=__doc__.split("\n")[0]
    )
    ap.add_argument("dirs", nargs="+", type=Path, help="a multirun sweep dir, or run dirs")
    ap.add_argument("--out", type=Path, help="where to write (default: the first dir)")
    ap.add_argument("--no-wandb", action="store_true", help="do not log the table to W&B")
    a = ap.parse_args()
    missing = [str(d) for d in a.dirs if not d.is_dir()]
    if missing:
        raise SystemExit(f"not a directory: {', '.join(missing)}")
    write(a.dirs, a.out, to_wandb=False if a.no_wandb else None)


if __name__ == "__main__":
    main()

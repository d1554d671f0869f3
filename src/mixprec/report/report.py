"""Compare runs: `python -m mixprec.report <sweep dir or run dirs...>`.

Reads every job's summary.json and metrics.jsonl and writes, into the (first) directory given:
report.md and report.csv (one row per job, failed jobs included) and two PNGs: report_bars.png
(throughput and peak memory per configuration) and report_curves.png (loss, loss scale and val
accuracy over steps). The same table goes to the console and to every logger the runs used whose
sink takes a report (`log_report`: with logger=wandb, W&B as a wandb.Table). A Hydra callback
(sweep.ReportCallback) keeps it up to date as each multirun job ends.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import time
from pathlib import Path
from typing import Any

from mixprec import sinks
from mixprec.core import files, metrics
from mixprec.report.plots import draw
from mixprec.report.runs import find_runs, read_runs
from mixprec.sinks import local

log = logging.getLogger(__name__)
RATIOS = {  # the columns after each metric's: its spread, its ratio to the fp32 run
    "samples_per_s": ("samples_per_s_spread", "speedup_vs_fp32", "speedup_resolved"),
    "peak_mem_gib": ("memory", "mem_saving_vs_fp32"),
    "max_batch": ("max_batch_vs_fp32",),
}
COLUMNS = [
    "run",
    "status",
    "precision",
    "batch",
    "accum",
    "effective_batch",
    *(c for m in metrics.report_columns() for c in (m, *RATIOS.get(m, ()))),
    "error",
]


_num = local.number


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


def _config(run: dict) -> tuple:
    """What a run is a repeat of: its settings less the seed (runs that differ in seed alone,
    or the same command run again, are repeats of one configuration)."""
    overrides = tuple(sorted(o for o in run.get("overrides", []) if not o.startswith("seed=")))
    return overrides, run.get("model"), run.get("batch"), run.get("world_size")


def resolved(run: dict, base: dict, runs: list[dict]) -> bool | None:
    """Whether the run's configuration differs in samples/s from its fp32 baseline's, judged
    against how much runs of one configuration differ: the 95 % Welch interval on the ratio
    of their geometric means excludes 1. None ("not yet resolved") with fewer than two
    completed runs of either: a run's own throughput windows say nothing of how much another
    run of the same configuration would differ (on a CPU, tf32, a no-op there, read 1.23x
    faster than fp32 from one run each)."""
    from mixprec.report.curves import ratio_interval

    rates = lambda key: [  # noqa: E731
        _num(x.get("samples_per_s"))
        for x in runs
        if x.get("status") == "completed" and _num(x.get("samples_per_s")) and _config(x) == key
    ]
    mine, theirs = rates(_config(run)), rates(_config(base))
    if len(mine) < 2 or len(theirs) < 2:
        return None
    _, interval = ratio_interval(mine, theirs)
    return interval is not None and not interval[0] <= 1 <= interval[1]


def build_table(runs: list[dict]) -> list[dict]:
    table = []
    for r in runs:
        base = _baseline(r, runs)
        row = {c: r.get(c) for c in COLUMNS}
        sps, mem = _num(r.get("samples_per_s")), _num(r.get("peak_mem_gib"))
        if base and sps:
            row["speedup_vs_fp32"] = sps / base["samples_per_s"]
            if _config(base) != _config(r):  # (the baseline is not compared with itself)
                row["speedup_resolved"] = resolved(r, base, runs)
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
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def _cell(v: Any) -> str:
    return escape(_fmt(v))


def escape(text: Any) -> str:
    """Text from a run (its name, precision, error) inside a markdown table or list: a `|`
    would end the cell, HTML would render, a newline would end the row."""
    return (
        str(text)
        .replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace("|", "\\|")
        .replace("\n", " ")
    )


def shown(table: list[dict]) -> list[str]:
    """The columns with a value in some row (a CPU sweep has no MFU, loss scale or max batch)."""
    return [
        c for c in COLUMNS if c in ("run", "status") or any(r.get(c) is not None for r in table)
    ]


def markdown(table: list[dict]) -> str:
    cols = [c for c in shown(table) if c != "speedup_resolved"]  # (said in the speedup's cell)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_md_cell(row, c) for c in cols) + " |" for row in table]
    return "\n".join(lines) + "\n"


MARKS = {None: " (unresolved)", False: " (no difference)"}  # a speed-up not resolved from 1


def _md_cell(row: dict, col: str) -> str:
    """A cell; a speed-up says in its own cell whether it is resolved: bold where its 95 %
    interval excludes 1, marked where it does not or where its configurations ran once."""
    if col != "speedup_vs_fp32" or row.get(col) is None or row.get("precision") == "fp32":
        return _cell(row[col])  # (fp32's own 1.0 is the baseline, nothing to resolve)
    resolved = row["speedup_resolved"]
    return f"**{_cell(row[col])}**" if resolved else _cell(row[col]) + MARKS[resolved]


def notes(runs: list[dict]) -> str:
    """What a reader must know before comparing the numbers."""
    out = []
    if any(r.get("device") == "cpu" for r in runs):
        out.append(
            "These runs ran on a CPU: speed ratios between precisions there are not what "
            "a GPU shows (float16 is emulated, TF32 does nothing), and memory is the "
            "process's resident memory (RSS), not GPU memory."
        )
    compared = [
        r for r in runs if r.get("speedup_vs_fp32") is not None and "fp32" != r.get("precision")
    ]
    if any(r.get("speedup_resolved") is None for r in compared):
        out.append(
            "speedup_vs_fp32 is bold where its 95 % interval over repeated runs excludes 1; "
            "(unresolved): a configuration ran once, and one run says nothing of how much the "
            "next differs (identical CPU sweeps have given bf16 0.59x to 3.62x). Repeat it: "
            "add seed=0,1,2 to the sweep."
        )
    return "".join(f"> {line}\n>\n" for line in out).rstrip(">\n") + ("\n\n" if out else "")


def console(table: list[dict]) -> str:
    cols = shown(table)
    cells = [cols] + [[_fmt(row[c]) for c in cols] for row in table]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    out = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def memory_table(runs: list[dict]) -> str:
    """debug.memory's parts per run (GiB), or '' when no run measured them."""
    from mixprec.diagnostics.memory import PARTS

    rows = [r for r in runs if (r.get("memory_breakdown") or {}).get("peak") is not None]
    if not rows:
        return ""
    head = ["run", "peak", *(p.replace("_", " ") for p in PARTS), "reserve", "peak in"]
    text = "\n## Where the peak goes (GiB, debug.memory)\n\n| " + " | ".join(head) + " |\n"
    text += "|" + "---|" * len(head) + "\n"
    for r in rows:
        b = r["memory_breakdown"]
        cells = [f"{_num(b.get(k)) or 0.0:.2f}" for k in ("peak", *PARTS, "reserve")]
        text += f"| {escape(r['run'])} | " + " | ".join(cells) + f" | {escape(b.get('phase'))} |\n"
    return text


def write(
    paths: list[Path],
    out_dir: Path | None = None,
    to_sinks: bool | None = None,
    plots: bool = True,
    echo: bool = True,
) -> dict:
    """Build the report for these sweep/run dirs (the PNGs too unless `plots` is false; the
    table on the console if `echo`); returns {'table': ..., 'files': [...]}."""
    run_dirs = find_runs(paths)
    if not run_dirs:
        raise SystemExit(f"no run directories (with .hydra/) under {', '.join(map(str, paths))}")
    out_dir = out_dir or default_out(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = read_runs(run_dirs)
    table = build_table(runs)
    text = notes([{**r, **t} for r, t in zip(runs, table)]) + markdown(table)
    pooled = seed_groups(runs)
    if pooled:
        text += (
            "\n## Over seeds (mean ± std)\n\n| config | runs | val top-1 | samples/s |\n"
            "|---|---|---|---|\n"
        )
        text += "".join(
            f"| {escape(g['config'])} | {g['n']} | "
            + " | ".join(
                f"{g[k][0]:.4f} ± {g[k][1]:.4f}" if g[k] else "-"
                for k in ("val_acc1", "samples_per_s")
            )
            + " |\n"
            for g in pooled
        )
    text += memory_table(runs)
    studied = out_dir / "study.json"
    if studied.exists():  # a time-to-quality study of this sweep (study.py): its answer first
        text = (out_dir / "study.md").read_text() + "\n" + text
    sheet = io.StringIO(newline="")
    w = csv.DictWriter(sheet, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(table)
    files.write_together({out_dir / "report.md": text, out_dir / "report.csv": sheet.getvalue()})
    plotted = draw(runs, out_dir) if plots else []
    written = [out_dir / "report.md", out_dir / "report.csv", *plotted]
    if studied.exists() and (out_dir / "study.png").exists():
        written.append(out_dir / "study.png")
    if echo:
        print(console(table))
        print("wrote " + ", ".join(str(p) for p in written))
    for name, sink in sinks.reporting(run_dirs) if to_sinks is not False else ():
        images = [p for p in written if p.suffix == ".png"]
        try:  # a sink's failure costs its copy of the report, not the report
            sink.log_report(COLUMNS, table, images, out_dir, run_dirs, extra=study_tables(studied))
        except Exception as e:  # noqa: BLE001 (a sink of the user's may raise anything)
            log.warning(
                "report: logger %s could not take the report (%s: %s)", name, type(e).__name__, e
            )
    return {"table": table, "files": written}


def study_tables(path: Path) -> dict:
    """The study's rows as a W&B table, and its numbers as the report run's summary."""
    if not path.exists():
        return {}
    result = json.loads(path.read_text())
    cols = ["precision", "seeds", "rate_vs_ref", "steps_to", "speedup", "interval", "verdict"]
    rows = [{**r, "interval": str(r["interval"])} for r in result["rows"]]
    summary = {
        f"study/{r['precision']}/speedup": r["speedup"] for r in result["rows"] if r["speedup"]
    }
    return {"study": (cols, rows), "summary": {**summary, "study/target": result["target"]}}


def default_out(paths: list[Path]) -> Path:
    """One sweep or run dir: the report goes into it. Several dirs: a report dir of its own
    (outputs/reports/<date>_<time>), not into one of the runs."""
    if len(paths) == 1:
        return paths[0]
    return Path("outputs") / "reports" / time.strftime("%Y-%m-%d_%H-%M-%S")


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m mixprec.report", description=__doc__.split("\n")[0]
    )
    ap.add_argument("dirs", nargs="+", type=Path, help="a multirun sweep dir, or run dirs")
    ap.add_argument(
        "--out",
        type=Path,
        help="where to write (default: the dir given; with several, outputs/reports/<date>_<time>)",
    )
    ap.add_argument(
        "--no-sinks",
        "--no-wandb",
        dest="no_wandb",
        action="store_true",
        help="the files only: the report goes to no logger (W&B's report run, yours)",
    )
    a = ap.parse_args()
    missing = [str(d) for d in a.dirs if not d.is_dir()]
    if missing:
        ap.error(f"not a directory: {', '.join(missing)}")  # exit 2
    with files.cli_errors(a.out or default_out(a.dirs)):
        write(a.dirs, a.out, to_sinks=False if a.no_wandb else None)


if __name__ == "__main__":
    main()

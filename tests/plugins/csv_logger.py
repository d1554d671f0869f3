"""A logger defined outside mixprec, as a user would write one (tests/test_seams.py trains with
it): each log row into a CSV file of the run dir. One module (this) and one YAML
(conf/logger/csv.yaml on Hydra's search path, `sinks: {csv: csv_logger}`) are the whole of it."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass

FILES = ("metrics.csv",)


@dataclass
class Config:
    csv_file: str = "metrics.csv"  # the file in the run dir


class Sink:
    label = "CSV"

    def __init__(self, cfg: Config, ctx) -> None:
        self.path = ctx.run_dir / cfg.csv_file
        self.rows: list[dict] = []

    def log(self, row: dict) -> None:
        self.rows.append(row)

    def table(self, name: str, rows: list[dict]) -> None:
        pass

    def histograms(self, values: dict, step: int) -> None:
        pass

    def summary(self, summary: dict) -> None:
        (self.path.with_suffix(".summary.json")).write_text(json.dumps(summary, default=str))

    def close(self, status: str) -> None:
        keys = sorted({k for r in self.rows for k in r})
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)


def log_report(columns, table, images, out_dir, run_dirs, extra=None) -> None:
    """Optional: a sweep's report, given to every sink its runs used that defines this. Here the
    report's table as one more CSV beside report.csv."""
    with open(out_dir / "report.csv_logger.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)

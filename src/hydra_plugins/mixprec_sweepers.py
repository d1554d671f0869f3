"""mixprec's sweeper plugin (Hydra finds sweepers in the hydra_plugins namespace only):
hydra-optuna-sweeper's sweeper, with a study that ends in a clear message when no trial
completed (every trial failed: out of memory, a config error, a run too short to time) instead
of Optuna's `ValueError: No trials are completed yet` traceback, and Optuna's own logging kept to
warnings (its per-trial lines repeat what each job's log says). conf/experiment/
optuna_throughput.yaml names it as the sweeper's _target_. Optuna is imported only when the
sweeper is made (the `sweep` extra), not when Hydra scans its plugins."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from hydra.plugins.sweeper import Sweeper

log = logging.getLogger(__name__)


class OptunaSweeper(Sweeper):
    def __init__(self, **kwargs) -> None:
        import optuna
        from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper as Optunas

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.inner = Optunas(**kwargs)
        self.sweep_dir: Path | None = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self.inner.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        try:
            return self.inner.sweep(arguments)
        except ValueError as e:
            if "No trials are completed yet" not in str(e):
                raise
        from mixprec.report import sweep

        failed = sweep.failures(self.sweep_dir)
        sweep.ReportCallback.write_report(self.sweep_dir)
        for job, code, error in failed:
            log.error("trial %s failed (exit %d): %s", job, code, error)
        log.error(
            "no trial of the study completed, so it has no best value; report: %s",
            self.sweep_dir / "report.md",
        )
        sys.exit(failed[0][1] if failed else 1)

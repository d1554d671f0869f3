"""What a multirun does beside its jobs: keep the sweep's report up to date, and exit with the
first failed job's code once every job has run (train.yaml: hydra.callbacks.report)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from mixprec.report import quality
from mixprec.report.report import write
from mixprec.report.runs import find_runs, read_run

log = logging.getLogger(__name__)


FAILED: dict[str, tuple[int, str]] = {}  # job dir name -> (exit code, error), from run.main


def job_failed(cfg, e) -> None:
    """run.main's word that a job of this sweep failed (its summary.json may be an earlier
    run's, kept because the job was refused from a dir that holds one)."""
    from omegaconf import OmegaConf

    run_dir = OmegaConf.select(cfg, "run_dir", default=None, throw_on_missing=False)
    if run_dir:
        FAILED[Path(run_dir).name] = (e.exit_code, str(e))


class ReportCallback(Callback):
    """Keeps report.md/.csv/.png in the sweep dir up to date as each multirun job ends (so a sweep
    that Hydra ends with a job's unexpected error still has its report), logs the final table to
    W&B when the multirun ends, and then exits with the first failed job's code, if any."""

    def __init__(self) -> None:
        self.failed: dict[str, tuple[int, str]] = {}  # jobs run in this process that failed

    def on_multirun_start(self, config, **kwargs) -> None:
        """A sweep sized for a GPU (needs_gpu=true) on a machine without one: one message and
        exit 2 before any job starts or anything is written (not one failure per job)."""
        if config.get("needs_gpu") and not _cuda():
            log.error(
                "config error: experiment=%s is sized for a GPU (needs_gpu=true) and no CUDA GPU "
                "is visible, so none of its jobs can run here. Run it on a CUDA machine, or try "
                "its jobs small on this CPU: needs_gpu=false hardware=cpu batch=8 %s "
                "trainer.max_steps=20",
                config.get("name"),
                "hydra.sweeper.params.model=llama_tiny data.seq_len=64"
                if config.get("data", {}).get("name") in ("text", "tokens")
                else "data.shape=[3,32,32]",
            )
            sys.exit(2)

    def on_job_end(self, config, job_return=None, **kwargs) -> None:
        if str(config.hydra.mode) != "RunMode.MULTIRUN":
            return
        job = Path(config.hydra.runtime.output_dir).name
        if job in FAILED:  # a mixprec error: refused or stopped
            self.failed[job] = FAILED.pop(job)
        elif str(getattr(job_return, "status", "")) == "JobStatus.FAILED":  # an unexpected error
            self.failed[job] = (1, "see the job's train.log")
        self._write(Path(config.hydra.sweep.dir), to_sinks=False, plots=False, echo=False)

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            self._end(config, sweep_dir)
        except KeyboardInterrupt:  # each file is replaced whole: what is there is consistent
            log.error(
                "interrupted while writing the sweep's study and report; the jobs are done. "
                "Write them again: python -m mixprec.study %s (a study preset), "
                "python -m mixprec.report %s",
                sweep_dir,
                sweep_dir,
            )
            sys.exit(130)

    def _end(self, config, sweep_dir: Path) -> None:
        study_cfg = config.get("study") or {}
        if study_cfg.get("reference") and sweep_dir.is_dir():
            try:  # study.md/json/png first: the report carries the study's table
                quality.write(
                    sweep_dir,
                    study_cfg["reference"],
                    study_cfg.get("target"),
                    study_cfg.get("budget"),
                    study_cfg.get("smooth") or "none",
                    study_cfg.get("fit_from"),
                )
            except Exception as e:  # never turn a finished sweep into a failure
                log.warning("study for %s failed: %s", sweep_dir, e)
        self._write(sweep_dir, to_sinks=None)
        failed = failures(sweep_dir)
        seen = {run for run, _, _ in failed}
        failed += [(job, *why) for job, why in self.failed.items() if job not in seen]
        if failed:
            for run, code, error in failed:
                log.error("job %s failed (exit %d): %s", run, code, error)
            log.error(
                "%d job(s) of the sweep failed; report: %s", len(failed), sweep_dir / "report.md"
            )
            sys.exit(failed[0][1])

    @staticmethod
    def write_report(sweep_dir: Path) -> None:
        ReportCallback._write(sweep_dir, to_sinks=None)

    @staticmethod
    def _write(
        sweep_dir: Path, to_sinks: bool | None, plots: bool = True, echo: bool = True
    ) -> None:
        if sweep_dir.is_dir() and find_runs([sweep_dir]):
            try:
                write([sweep_dir], to_sinks=to_sinks, plots=plots, echo=echo)
            except Exception as e:  # never turn a finished job or sweep into a failure
                log.warning("report for %s failed: %s", sweep_dir, e)


def interrupted() -> None:
    """A stop signal ended the sweep in one of its jobs: the report of the jobs that ran (the
    stopped one preempted) is written now, as the sweep's end would have; the job's final line
    gave the one command that finishes the sweep (messages.sweep_resume_command)."""
    from mixprec.core import launch

    sweep_dir = launch.sweep_dir()
    if sweep_dir is not None:
        ReportCallback.write_report(sweep_dir)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def failures(sweep_dir: Path) -> list[tuple[str, int, str]]:
    """(job dir name, exit code, error) of the jobs whose summary says they failed."""
    out = []
    for run in find_runs([sweep_dir]) if sweep_dir.is_dir() else []:
        row = read_run(run, run.name)
        if row.get("status") not in ("completed", "running"):  # (running: another process's)
            out.append(
                (run.name, int(row.get("exit_code") or 1), row.get("error") or row["status"])
            )
    return out

"""One training job: validate the config, build its parts (build.py), then a Session trains in
its run dir and always writes the summary and closes the logger. main() turns how a run ended
into one clear message and its exit code (errors.py)."""

from __future__ import annotations

import gc
import json
import logging
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

from mixprec import sinks
from mixprec.checkpoint import store as checkpoint
from mixprec.checkpoint.dcp import step_of
from mixprec.compile import compiling
from mixprec.core import files, hardware, launch, metrics, process
from mixprec.core.errors import (
    CheckpointError,
    ConfigError,
    DiskFull,
    Diverged,
    MixprecError,
    OutOfMemory,
    Preempted,
    RunDirBusy,
)
from mixprec.diagnostics import audit, dtype_plan, memory
from mixprec.diagnostics.doctor import Doctor
from mixprec.diagnostics.numerics import Numerics
from mixprec.optim import optimizers as optim
from mixprec.parallel import distributed, strategy
from mixprec.report import plots as report_plots
from mixprec.report import sweep
from mixprec.run import build, messages, rundir, summary
from mixprec.run.config import validate
from mixprec.run.footprint import Footprint
from mixprec.sinks import describe
from mixprec.sinks.tracking import Tracker
from mixprec.training import batch_size, loop, perf
from mixprec.training.ledger import Hooks
from mixprec.training.safety import DivergenceGuard, StopSignals, signals_held

log = logging.getLogger("mixprec")


def main(cfg: DictConfig) -> float | None:
    """Hydra's task function: returns the objective (for sweepers such as Optuna). In a multirun
    a failed job returns None (a failed trial) and the sweep goes on; its row in report.md says
    why, and the multirun exits with the first failed job's code (sweep.ReportCallback)."""
    try:
        result = run(cfg)
        value = result[cfg.objective]
    except MixprecError as e:
        if left_to_another(e, cfg):  # a study spread over processes: another one trains it
            log.info("%s; it is left to that process", e)
            return None
        # a stop signal ends an in-process sweep; a job in its own process (SLURM) just ends
        if launch.multirun() and (launch.own_process() or not isinstance(e, Preempted)):
            summary.record_refusal(cfg, e)
            sweep.job_failed(cfg, e)
            return None
        if launch.multirun():  # a stop ends the in-process sweep: its report of what ran
            sweep.interrupted()
        raise SystemExit(e.exit_code) from None
    except Exception as e:  # a bug, or the user's own code raising
        if not launch.multirun():
            raise  # Hydra prints the traceback; exit 1
        # in a sweep it is this job's failure: the other jobs, the study and the report go on
        # (Hydra would re-raise it once every job ran, before the sweep's end: no study, no plots)
        log.exception("the job failed with an unexpected error (exit 1 at the sweep's end)")
        failed = MixprecError(f"{type(e).__name__}: {e}"[:500])
        summary.record_refusal(cfg, failed)
        sweep.job_failed(cfg, failed)
        return None
    if value is None and launch.multirun():
        task = result.get("task")
        why = (
            f"{task} data has no such metric; objective=val_loss is its quality"
            if metrics.not_measured_for(cfg.objective, task)
            else "not measured: e.g. too few steps after the warm-up to time"
        )
        log.warning(
            "objective=%s is null for this run (%s); a sweeper counts it as a failed trial",
            cfg.objective,
            why,
        )
    return value


def run(cfg: DictConfig) -> dict:
    """Train as configured; returns the summary (also written to summary.json). Until the run
    is accepted (its config valid, its run dir locked and its own, a resume fitted) it writes
    nothing: a refused run leaves no trace in the dir it was refused from (rundir.Journal)."""
    process.quiet_known_noise()  # torchao's import notices (core/process.py)
    if not perf.job_started():  # the first job of a process has nothing earlier to free
        release_earlier_jobs()  # (a full collection of torch's heap: 0.3-0.6 s on 2 cores)
    journal = rundir.Journal()
    run_dir = Path(OmegaConf.select(cfg, "run_dir", default=".", throw_on_missing=False) or ".")
    try:
        if launch.multirun() and not rundir.holds_a_run(run_dir) and not rundir.busy(run_dir):
            journal.accept(run_dir, cfg)  # a new job's dir: the report reads it, failed or not
        return _run(cfg, journal)
    except MixprecError as e:
        # (a run that trained reported it above its result)
        if not getattr(e, "reported", False) and not left_to_another(e, cfg):
            log.error("%s: %s", e.label, e)
        raise
    finally:
        journal.close(run_dir)


def left_to_another(e: MixprecError, cfg) -> bool:
    """A job of a sweep with resume=auto whose run dir another live process holds: the same
    study run by several processes side by side (two GPUs, two sessions), each taking the jobs
    the others have not; not this process's failure."""
    return isinstance(e, RunDirBusy) and launch.multirun() and cfg.get("resume") == "auto"


def release_earlier_jobs() -> None:
    """Free what an earlier job of this process left: a finished run's model and optimizer
    are held in reference cycles that only the cyclic collector frees, so an in-process sweep's
    next job built and trained beside them (experiment=lm_table's later jobs peaked 9.8 GiB
    higher on the 8B slice: benchmarks/RESULTS.md)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # the freed blocks back to the device: reserved is this job's


def _run(cfg: DictConfig, journal: rundir.Journal) -> dict:
    c = validate(cfg)
    if launch.multirun():  # what the sweeper compares must be measurable
        c.check_objective()
    hw = build.resolve_hardware(c)
    dd = distributed.init(hw.device, strategy.of(c.parallel))  # torchrun/SLURM/1
    try:
        c.run_dir = distributed.broadcast_str(c.run_dir, dd)  # rank 0's Hydra run dir
        run_dir = Path(c.run_dir)
        with rundir.RunDirLock(run_dir) if dd.main else nullcontext() as lock:
            aside = rundir.prepare(run_dir, c.resume, c.overwrite) if dd.main else None
            # what the dir holds before this run writes (a multirun job's row reads its dir)
            names = (*rundir.made_by_a_run(), *rundir.JOURNAL)
            found = Footprint(run_dir, names) if dd.main and not launch.multirun() else None
            accept = (lambda: journal.accept(run_dir, cfg)) if dd.main else (lambda: None)
            resolved = OmegaConf.to_container(cfg, resolve=True)
            try:
                session = Session(build.build(c, hw, dd), resolved, accept)
                session.before_save = aside.drop if aside else session.before_save
                return session.train()
            except ConfigError as e:  # refused at the first step: as if refused before it
                if found is not None and getattr(e, "untrained", False):
                    journal.close(None)  # train.log closed, then withdrawn with the lock held
                    found.withdraw()
                    e.withdrawn = True
                    lock.remove_empty_dir = run_dir != Path(".")  # (Hydra made it for this run)
                    log.info("nothing of the refused run is kept in %s", run_dir)
                raise
            finally:  # overwrite=true: the previous run back where nothing of this one stays
                refused = getattr(sys.exc_info()[1], "withdrawn", False) or not journal.accepted
                if aside is not None:
                    aside.put_back() if refused else aside.drop()
    finally:
        distributed.close()


class Session:
    """One run's life in its run dir: resume, train, and how it ended (summary.json, W&B,
    the final line)."""

    def __init__(self, parts: build.Parts, resolved: dict, accept=lambda: None) -> None:
        self.p, self.resolved, self.accept = parts, resolved, accept
        self.state = loop.TrainState(layout=parts.layout.as_dict())
        self.status, self.error, self.t0 = "failed", None, time.perf_counter()
        self.summary: dict = {}
        self.ckpt = parts.run_dir / "checkpoints" / "last.pt"
        self.found: Path | None = None  # the checkpoint this run resumed from
        self.state_at_resume = 0.0  # wall seconds of the run before that checkpoint
        self.train_s_at_resume = 0.0  # seconds in training steps before it
        self.resumed_step = 0
        self.before_save = lambda: None  # overwrite=true: the previous run goes before a checkpoint
        self.hooks: Hooks | None = None
        self.phases = hardware.PhaseMemory(
            parts.learner.model, parts.learner.optimizer, parts.device
        )
        c, prec = parts.config, parts.learner.precision
        self.memory = (  # debug.memory: the peak's parts, on step 3
            memory.Breakdown(
                parts.learner,
                parts.device,
                cached_casts=not c.model.compile and prec.dtype is not None and prec.cache,
            )
            if c.debug.memory
            else memory.Breakdown()
        )

    def train(self) -> dict:
        p = self.p
        done = self._completed_without_checkpoint()
        if done is not None:
            return done
        blob = self._resume()
        st = self.state
        self.resumed_step = st.step  # a refusal before any step of its own is withdrawn
        # (a stop during the final evaluation: the last step is checkpointed, its evaluation
        # runs on resume; a checkpoint of before val_step was kept has val and step -1)
        evaluated = st.val_step == st.step or (st.val_step == -1 and bool(st.val))
        if blob is not None and st.step >= p.plan.total_steps and evaluated:
            return self._already_done()
        self.accept()  # from here on the run dir is this run's: .hydra/, train.log
        self._write_plan()
        self.tracker = Tracker(self._sinks(blob) if p.dist.main else [], self.clock)
        self.hooks = hooks = self._hooks()
        try:
            with hooks.stop, logging_redirect_tqdm() if hooks.progress else nullcontext():
                loop.train(p.learner, p.data, self.state, p.plan, hooks)
            self._finish_healthy(hooks)
        except Preempted as e:
            self.status, self.error = "preempted", e
            raise
        except torch.OutOfMemoryError:  # not re-raised here: its traceback would pin the tensors
            self.error = OutOfMemory(messages.oom_advice(p))
        except MixprecError as e:
            self.error = e
            e.untrained = self.state.step == self.resumed_step  # it made no step: nothing to keep
            raise
        finally:
            self._close(hooks)
        if self.error is not None:  # an OOM (its step's memory freed), or no room for the summary
            batch_size.release()
            raise self.error
        return self.summary

    def _resume(self) -> dict | None:
        p, c = self.p, self.p.config
        found = checkpoint.find(c.resume, p.run_dir) if c.resume else None
        if c.resume == "auto" and found is None:
            left = checkpoint.leftovers(self.ckpt.parent)
            if left:  # a run was here: never start it over silently
                raise CheckpointError(
                    f"resume=auto: {self.ckpt.parent} holds {', '.join(left[:4])} but no whole "
                    "checkpoint to continue from; nothing was changed. Resume from one of them "
                    "(resume=PATH), or start the run over with overwrite=true"
                )
            log.info(
                "resume=auto: no checkpoint in %s yet; starting from scratch", self.ckpt.parent
            )
            if p.dist.main:  # a run killed before its first checkpoint: its rows start over
                rundir.restart_appended(p.run_dir)
        if found is None:
            return None
        self.found, blob = found, checkpoint.load(found)
        checkpoint.check_fits(blob, found, p.layout.as_dict())
        checkpoint.check_config(blob, found, self.resolved)
        saved = checkpoint.restore(blob, found, p.learner)
        try:
            self.state = loop.TrainState.restored(saved, p.layout.as_dict())
        except TypeError as e:  # another mixprec version's loop state
            raise CheckpointError(
                f"checkpoint {found}: its loop state does not fit this mixprec ({e})"
            ) from None
        optim.continue_at_lr(p.learner, p.lr, found, self.state.step)
        if self._continues_own_run():  # a run from another run's checkpoint is a new run
            self.state_at_resume = self.state.elapsed_s
            self.train_s_at_resume = self.state.train_s
            if p.dist.main:
                evaluated = self.state.val_step == self.state.step
                rundir.continue_appended(p.run_dir, self.state.step, evaluated)
        log.info(
            "resumed from %s at step %d (epoch %d, micro-batch %d)",
            found,
            self.state.step,
            self.state.epoch,
            self.state.batch_in_epoch,
        )
        return blob

    def _completed_without_checkpoint(self) -> dict | None:
        """resume=auto of a run whose summary says completed and that left no checkpoint of its
        end (ckpt.at_end=false: the table and study presets; a checkpoint a stop signal wrote
        mid-run, older than the step it completed at, is no end): its summary is the proof that
        it finished, so there is nothing to do (training it again would replace its results; a
        study run again skips it)."""
        p = self.p
        path = p.run_dir / "summary.json"
        if p.config.resume != "auto" or not path.exists():
            return None
        try:
            done = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(done, dict) or done.get("status") != "completed":
            return None
        if checkpoint.latest(self.ckpt.parent) or checkpoint.leftovers(self.ckpt.parent):
            written = [step_of(c) for c in self.ckpt.parent.glob("*step_*")]
            if not written or max(written) >= (done.get("steps") or 0):
                return None  # a checkpoint of its end, or only leftovers to refuse: _resume's
        log.info(
            "resume=auto: %s says this run completed (step %s) and it kept no checkpoint of "
            "its end (ckpt.at_end=false); nothing to do",
            path,
            done.get("steps"),
        )
        p.data.close()
        return done

    def _already_done(self) -> dict:
        path = self.p.run_dir / "summary.json"
        log.info(
            "resume: the checkpoint is at step %d of %d; nothing left to train (summary "
            "unchanged: %s)",
            self.state.step,
            self.p.plan.total_steps,
            path,
        )
        self.p.data.close()
        if path.exists():
            return json.loads(path.read_text())
        return summary.of_state(self.state, self.p.config.precision.name)  # it went missing

    def _sinks(self, blob: dict | None) -> list:
        """The logger's sinks; a run that continues this run dir's own checkpoint continues
        their runs (a run started from another run's checkpoint is a new run)."""
        p, c = self.p, self.p.config
        own = blob is not None and self._continues_own_run()
        tags = (c.precision.name, c.model.label, p.hw.name, c.name)
        ctx = sinks.Context(
            p.run_dir,
            describe.what_ran(p),
            c.name,
            tags,
            resume_step=self.state.step if own else None,
            resume_evaluated=own and self.state.val_step == self.state.step,
        )
        return sinks.build(c.logger, ctx)

    def _hooks(self) -> Hooks:
        p, c = self.p, self.p.config
        if p.layout.max_batch is not None:
            self.tracker.log({"mem/max_batch": p.layout.max_batch}, self.state.step)
        if c.diagnose:
            audit.on_run(p, self.tracker)
        meter = p.meter()
        guard = DivergenceGuard(
            p.device,
            c.debug.max_bad_steps,
            c.debug.min_loss_scale,
            reduce=p.dist.reduce,
            advice=p.learner.precision.on_divergence(),
            model=p.learner.model,
            max_skipped=c.debug.max_skipped_steps,
        )
        hardware.reset_peak(p.device)
        stop = StopSignals(c.trainer.stop_grace_s, on_forced=self._forced)
        return Hooks(
            self.tracker,
            meter,
            guard,
            lambda: hardware.memory_stats(p.device),
            self._save,
            stop,
            p.dist,
            progress=sys.stderr.isatty() and p.dist.main,
            grad_histograms=c.diagnose,
            doctor=Doctor(p.learner, c.debug.locate, rerun=not c.model.cuda_graphs),
            numerics=Numerics(p.learner, p.run_dir, rerun=not c.model.cuda_graphs)
            if c.debug.numerics and p.dist.main
            else Numerics(),
            dtype_plan=dtype_plan.Watch(
                p.learner,
                build.dtype_promise(c, p),
                c.debug.dtype_plan,
                rerun=not c.model.cuda_graphs,  # a captured forward is not re-run
            ),
        )

    def _write_plan(self) -> None:
        """The precision's plan (fp8_auto's per-layer choices) in the run dir: a
        resume from this run dir keeps it (build.saved_plan)."""
        plan = self.p.learner.precision.plan()
        if plan is not None and self.p.dist.main:
            files.write_json(self.p.run_dir / rundir.PLAN_FILE, plan)

    def _save(self, state: loop.TrainState) -> None:
        self.before_save()
        state.elapsed_s = self.wall_s  # a resumed run's wall_s counts the earlier parts too
        state.train_s = self.train_s
        c = self.p.config  # every rank is here: gathering or writing shards are collectives
        by_name = strategy.of(c.parallel).checkpoints_by_name  # they fit any world
        args = (self.resolved, c.ckpt.keep, by_name, c.ckpt.sharded)
        checkpoint.write(self.ckpt, self.p.learner, state, *args)

    def _finish_healthy(self, hooks: Hooks) -> None:
        """`completed` only with finite weights, buffers and loss: a divergence inside the last
        steps (between two checks) is a failure, not a result."""
        learner, state = self.p.learner, self.state
        loss_ok = state.last_loss is None or math.isfinite(state.last_loss)
        if not (loss_ok and hooks.guard.healthy(learner.model)):
            why = messages.diverged(state.step, learner.precision.on_divergence())
            raise Diverged(why + hooks.doctor.on_divergence(state.step))
        if self.p.config.ckpt.at_end:
            self._save(state)
        self.status = "completed"
        if self.p.config.model.compile and self.p.dist.main:
            compiling.save_cache(self.p.config.model.compile_cache)

    def _forced(self, signum: int) -> None:
        """A stop signal with no step boundary in time: the summary, then the process exits."""
        self.status = "preempted"
        self.error = Preempted(signum, checkpointed=False)
        self.summary = summary.of_session(self)
        self.tracker.summary(self.summary)

    def _close(self, hooks: Hooks) -> None:
        self.p.data.close()  # stop loader workers now, not at interpreter exit
        unexpected = sys.exc_info()[1]  # in flight when a bug or a peer's death ends the run
        if self.status == "failed" and self.error is None and isinstance(unexpected, Exception):
            self.error = MixprecError(f"{type(unexpected).__name__}: {unexpected}")
        self.summary = summary.of_session(self)
        try:
            with signals_held():  # a stop now (torchrun's, as a peer died) waits for the record
                self.tracker.summary(self.summary)
        except DiskFull as e:  # no summary.json: the run cannot say it completed
            if self.error is not None:
                log.error("summary.json could not be written either: %s", e)
            self.status, self.error = "failed", self.error or e
        if hooks.doctor.findings:
            self.tracker.table("doctor/findings", hooks.doctor.findings)
        if self.memory.result is not None:
            parts = self.memory.result
            self.tracker.table(
                "memory_breakdown", [{"part": k, "gib": parts[k]} for k in memory.PARTS]
            )
        plan = hooks.dtype_plan.result
        if plan is not None:
            self.tracker.table("dtype_plan", dtype_plan.rows(plan))
        self.tracker.close(self.status)
        if self.p.config.diagnose and self.p.dist.main:
            report_plots.loss_scale_plot(self.p.run_dir)
        if self.p.dist.main:
            if self.error is not None and not isinstance(self.error, Preempted):
                log.error("%s: %s", self.error.label, self.error)  # the why, then the result
            if self.error is not None:
                self.error.reported = True
            log.info(messages.final_line(self))  # the last line: how the run ended
        if self.status == "preempted":  # last: submitit's handler requeues the job and exits
            hooks.stop.forward()

    @property
    def train_s(self) -> float:
        """Seconds in training steps of the whole run (perf.Throughput.train_s), resumed
        parts included."""
        meter = self.hooks.meter if self.hooks is not None else None
        return self.train_s_at_resume + (meter.train_s() if meter is not None else 0.0)

    def clock(self) -> dict:
        """The time keys of every log row: loss against time can be drawn from any run dir."""
        return {"time/elapsed_s": round(self.wall_s, 3), "time/train_s": round(self.train_s, 3)}

    @property
    def wall_s(self) -> float:
        """Wall seconds of the whole run: this part, and the parts before a resume."""
        return self.state_at_resume + time.perf_counter() - self.t0

    def _continues_own_run(self) -> bool:
        """Resumed from this run dir's own checkpoint (not from another run's)."""
        run_dir = self.p.run_dir.resolve()
        return self.found is not None and self.found.resolve().parent.parent == run_dir

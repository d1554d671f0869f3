"""The bookkeeping around each optimizer step (StepLedger) and the loop's outside world (Hooks)."""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from tqdm.auto import tqdm

from mixprec.core.errors import Diverged, Preempted
from mixprec.diagnostics.doctor import Doctor
from mixprec.diagnostics.dtype_plan import Watch
from mixprec.diagnostics.numerics import Numerics
from mixprec.parallel.distributed import Dist
from mixprec.sinks.tracking import Tracker
from mixprec.training.perf import Throughput
from mixprec.training.safety import DivergenceGuard, StopSignals

log = logging.getLogger(__name__)


@dataclass
class Hooks:
    """What the loop tells and asks the world outside it. Every part is a working object, also
    when it does nothing (a StopSignals never entered receives nothing, a world of one reduces
    nothing), so the loop never branches on what is switched on."""

    tracker: Tracker  # log rows
    meter: Throughput  # samples/s, warm-up excluded
    guard: DivergenceGuard  # non-finite losses, collapsed loss scale
    memory: Callable[[], dict]  # the mem/* keys of a log row
    save: Callable = lambda state: None  # write a checkpoint of this state
    stop: StopSignals = field(default_factory=StopSignals)
    dist: Dist = field(default_factory=Dist)  # no_sync, reduce and the world size
    progress: bool = False  # a progress bar on the terminal
    grad_histograms: bool = False  # histograms of the true gradients on logged steps (diagnose)
    doctor: Doctor = field(default_factory=Doctor)  # names the layer that overflowed
    numerics: Numerics = field(default_factory=Numerics)  # per-layer casts (debug.numerics)
    dtype_plan: Watch = field(default_factory=Watch)  # the live dtypes after step 1


class StepLedger:
    """Settles each attempted optimizer step: counters, LR schedule, divergence checks, log rows,
    checkpoints and stop signals.

    Whether GradScaler skipped a step is known on the GPU only (fused optimizers skip inside the
    kernel), so reading it is a host sync. With `plan.settle_late` a step is settled one step
    late, from train_step's `before_step` hook: after the next step's forward and backward are
    queued, so the GPU never idles on the read. The ordering rule: step N-1 is settled before
    step N's optimizer.step() (its scheduler step sets step N's LR). A step is settled at once,
    before the next forward, when it may be the last one, be checkpointed or stopped at (the next
    forward would already move BatchNorm's running statistics), or come just before a logged step
    (which computes the grad norm and must know the step count exactly).
    """

    def __init__(self, learner, state, plan, hooks: Hooks) -> None:
        self.learner, self.state, self.plan, self.hooks = learner, state, plan, hooks
        self.pending = None  # the attempted step not yet settled
        self.last = None  # the last settled step
        self.window_loss = torch.zeros((), device=hooks.meter.device)
        self.window_steps = 0
        self.bar = tqdm(
            total=plan.total_steps,
            initial=state.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not hooks.progress,
            leave=False,
        )
        self.started = time.perf_counter()
        self.evaluate: Callable = lambda stop: {}  # loop.train sets it: the val metrics
        self.latest: list | None = None  # the micro-batches of the latest step
        if learner.bn_guard.enabled:
            log.info(
                "scaler.guard_bn_stats: %d BatchNorm running-stat tensors are put back after "
                "any forward whose loss is inf/nan",
                len(learner.bn_guard.stats),
            )
        hooks.meter.start(state.step)

    def batches(self, loader, epoch: int) -> Iterator[list]:
        """This epoch's micro-batches, `accum` at a time, from where the state left off; ends at
        the epoch's end (a ragged tail of < accum micro-batches is dropped) or the last step."""
        loader.set_epoch(epoch, skip=self.state.batch_in_epoch)
        source = iter(loader)
        while True:
            if self._settle_now():
                self.settle_pending()
            if self.done():
                return
            micro_batches = list(itertools.islice(source, self.plan.accum))
            if len(micro_batches) < self.plan.accum:
                return
            self.hooks.doctor.remember(micro_batches)
            self.latest = micro_batches
            yield micro_batches

    def wants_grad_norm(self) -> bool:
        """The next step is a logged one (no step is left pending before one)."""
        return self.pending is None and (self.state.step + 1) % self.plan.log_every == 0

    def record(self, out) -> None:
        self.pending = out
        if self.hooks.dtype_plan.due():  # once, after the first step that ran
            with self.hooks.meter.paused():
                self.hooks.dtype_plan.after_first_step(self.latest)
        if self.started is not None:  # one sync: how long compile / autotuning / capture took
            float(out.loss)
            gpu = self.hooks.meter.device.type == "cuda"
            since_start, compiled = self.hooks.meter.first_step_done()
            log.info(
                "first step took %.1fs, %.1fs after the run started (%s%s; warm-up keeps "
                "it out of samples/s)",
                time.perf_counter() - self.started,
                since_start,
                f"torch.compile {compiled:.1f}s, " if compiled else "",
                "compile, kernel tuning, cuDNN autotuning and graph capture happen here"
                if gpu
                else "compile, if on, happens here",
            )
            self.started = None

    def settle_late(self, loss: torch.Tensor) -> None:
        """train_step's before_step: the next step's forward and backward are queued (`loss`
        is theirs; debug.locate looks at it before the weights move)."""
        out, self.pending = self.pending, None
        self._settle(out, late=True)
        self.hooks.doctor.before_update(self.state.step + 1, loss)

    def settle_pending(self) -> None:
        out, self.pending = self.pending, None
        self._settle(out, late=False)

    def done(self) -> bool:
        return self.state.step >= self.plan.total_steps

    def _settle_now(self) -> bool:
        if not self.plan.settle_late:
            return True
        nxt, plan = self.state.step + 1, self.plan  # the pending step's number, if taken
        if nxt >= plan.total_steps or (plan.ckpt_every and nxt % plan.ckpt_every == 0):
            return True
        if plan.val_every and nxt % plan.val_every == 0:  # evaluated before the next forward
            return True
        if nxt % plan.log_every == 0 or (nxt + 1) % plan.log_every == 0:
            return True
        stop = self.hooks.stop
        if self.hooks.dist.world == 1:
            return bool(stop.received)
        return (self.state.attempts + 1) % plan.log_every == 0  # where ranks agree on stopping

    def _settle(self, out, late: bool) -> None:
        if out is None:
            return
        stepped = out.stepped  # the one wait for the GPU's answer
        state, plan, hooks = self.state, self.plan, self.hooks
        hooks.guard.update(out.loss)
        hooks.guard.stepped(stepped)
        state.batch_in_epoch += plan.accum
        state.attempts += 1
        self.window_loss += out.loss
        self.window_steps += 1
        self.last = out
        hooks.meter.count(plan.samples_per_step)
        state.skipped_steps += not stepped  # overflow: the scaler backed off; weights, LR stay
        if state.attempts % plan.log_every == 0:
            self._check(out)  # divergence: one sync per log_every attempts, skipped ones included
        if stepped:
            self.learner.scheduler.step()
            state.step += 1
            self.learner.callbacks.on_step_end(self.learner, state)
            self.bar.update(1)
            hooks.meter.maybe_end_warmup(state.step)
            if state.step % plan.log_every == 0:
                self._log_row(out)
        hooks.doctor.after_step(state.step + (not stepped), stepped)
        if not late:  # the next forward has not run: the model is this step's
            self._act_on(stepped)

    def _act_on(self, stepped: bool) -> None:
        """Stop signals, evaluations and checkpoints, at a step boundary."""
        signum = self._stop_signal()
        if signum:
            self.hooks.stop.acknowledge()
            raise Preempted(signum, checkpointed=self._save())
        step, plan = self.state.step, self.plan
        if stepped and plan.val_every and step % plan.val_every == 0:
            self.validate()
        if stepped and plan.ckpt_every and step % plan.ckpt_every == 0:
            self._save()

    def _save(self) -> bool:
        with self.hooks.meter.paused():  # writing a checkpoint is not training time
            return save_if_healthy(
                self.hooks.save, self.state, self.hooks.guard, self.learner.model
            )

    def validate(self) -> None:
        """Evaluate on the validation set and log it, once per step. A stop signal during it
        checkpoints the last step and stops: alone, the evaluation ends at its next batch;
        in a world of several (whose ranks must finish it together) the grace waits for it."""
        st, stop = self.state, self.hooks.stop
        if st.val_step == st.step and st.val:
            return
        alone = self.hooks.dist.world == 1
        with self.hooks.meter.paused(), stop.holding():
            val = self.evaluate((lambda: bool(stop.received)) if alone else (lambda: False))
        if val is not None:
            st.val, st.val_step = val, st.step
            self.log_evaluation()
        signum = stop.received if alone else self._agreed_stop()
        if signum:
            stop.acknowledge()
            raise Preempted(signum, checkpointed=self._save())

    def _agreed_stop(self) -> int:
        """The stop signal any rank received (a collective: every rank evaluates here)."""
        received = torch.tensor(self.hooks.stop.received or 0, device=self.hooks.meter.device)
        return int(self.hooks.dist.reduce(received, "max"))

    def _stop_signal(self) -> int:
        """The stop signal every rank agrees on: checked each step alone, every log_every
        attempts under DDP (a collective, so that all ranks stop at the same step)."""
        received, dist = self.hooks.stop.received or 0, self.hooks.dist
        if dist.world == 1:
            return received
        if self.state.attempts % self.plan.log_every:
            return 0
        return int(dist.reduce(torch.tensor(received, device=self.hooks.meter.device), "max"))

    def _check(self, out) -> None:
        prec = self.learner.precision
        try:
            self.hooks.guard.check(
                self.state.step,
                float(out.loss),
                prec.loss_scale() if prec.scaling else None,
                self._lr(),
            )
        except Diverged as e:  # the doctor re-runs the latest batch once: which layer?
            e.args = (str(e) + self.hooks.doctor.on_divergence(self.state.step),)
            raise

    def _lr(self) -> float:
        return float(self.learner.optimizer.param_groups[-1]["lr"])  # torchao's: a tensor

    def _log_row(self, out) -> None:
        hooks, state = self.hooks, self.state
        mean = hooks.dist.reduce(self.window_loss / self.window_steps) / hooks.dist.world
        sps, step_ms = hooks.meter.window()
        loss = float(mean)  # the one host sync per log event (with the scale read below)
        state.last_loss = loss
        row = {
            "epoch": state.epoch,
            "train/loss": loss,
            "train/lr": self._lr(),
            "train/grad_norm": float(out.grad_norm) if out.grad_norm is not None else None,
            "amp/loss_scale": self.learner.precision.loss_scale(),
            "amp/skipped_steps": state.skipped_steps,
            "perf/samples_per_s": sps,
            "perf/tokens_per_s": hooks.meter.tokens(sps),
            "perf/step_ms": step_ms,
            "perf/mfu": hooks.meter.mfu(sps),
            **hooks.memory(),
        }
        row.update(self.learner.callbacks.keys("on_log", state.step, row))
        hooks.tracker.log(row, state.step)
        if out.grads is not None:  # a step that ran, at its real number
            hooks.tracker.histograms(
                {"grad/all": out.grads.cpu(), "grad/abs_max": float(out.grads.abs().max())},
                state.step,
            )
        self.bar.set_postfix(loss=f"{loss:.4f}", sps=f"{sps:.0f}")
        log.info(self._line(row))
        if hooks.numerics.enabled:  # debug.numerics: this step's first micro-batch, re-run
            with hooks.meter.paused():
                hooks.numerics.on_logged(state.step, self.latest, hooks.tracker)
        self.window_loss = torch.zeros((), device=hooks.meter.device)
        self.window_steps = 0

    def _line(self, row: dict) -> str:
        finite = math.isfinite(row["train/loss"])
        scale = (
            f" scale {row['amp/loss_scale']:g} skipped {row['amp/skipped_steps']}"
            if self.learner.precision.scaling
            else ""
        )
        return (
            f"step {self.state.step}/{self.plan.total_steps} loss {row['train/loss']:.4f}"
            f"{'' if finite else ' (non-finite)'} lr {row['train/lr']:.4g}{scale} "
            f"{row['perf/samples_per_s']:.1f} samples/s "
            + (f"{row['perf/tokens_per_s']:,.0f} tokens/s " if row["perf/tokens_per_s"] else "")
            + f"{row['perf/step_ms']:.1f} ms/step "
            f"peak {row['mem/peak_gib']:.2f} GiB"
            + eta(self.plan.total_steps - self.state.step, row["perf/step_ms"])
        )

    def log_evaluation(self) -> None:
        st = self.state
        extra = self.learner.callbacks.keys("on_validation_end", st.step, st.val)
        self.hooks.tracker.log({"epoch": st.epoch, **st.val, **extra}, st.step)
        log.info(
            "epoch %d step %d: %s",
            st.epoch,
            st.step,
            " ".join(f"{k} {v:.4f}" for k, v in st.val.items()),
        )

    def finish(self) -> None:
        self.bar.close()
        self.hooks.meter.stop()
        if self.last is not None:
            self._check(self.last)
        if self.window_steps:
            self.state.last_loss = float(self.window_loss / self.window_steps)
        self.learner.callbacks.on_train_end(self.learner, self.state)


def eta(steps_left: int, step_ms: float) -> str:
    """' eta 4m05s': the steps left at this window's pace (evaluations and checkpoints not
    counted), in every log line, so a log without a terminal (a file, a scheduler's) has one."""
    if steps_left <= 0 or not math.isfinite(step_ms) or step_ms <= 0:
        return ""
    secs = round(steps_left * step_ms / 1e3)
    h, rest = divmod(secs, 3600)
    m, sec = divmod(rest, 60)
    return f" eta {h}h{m:02d}m" if h else f" eta {m}m{sec:02d}s"


def save_if_healthy(save: Callable, state, guard: DivergenceGuard, model) -> bool:
    """Checkpoint only finite weights, float buffers (BatchNorm statistics) and loss: never
    overwrite the last good checkpoint. Returns whether it saved."""
    if guard.healthy(model):
        save(state)
        return True
    log.warning(
        "step %d: non-finite loss, weights or buffers (e.g. BatchNorm statistics); "
        "checkpoint not written",
        state.step,
    )
    return False

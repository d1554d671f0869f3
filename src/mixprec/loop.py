"""The training loop: train() -> train_step() -> forward/backward, and evaluate().

It reads no config: run.py hands it objects and numbers. The whole precision story is in
train_step(): autocast, scale, backward, unscale, clip, step (maybe skipped), update.

Whether GradScaler skipped a step is known on the GPU only. train() settles each step (counters,
scheduler, logs) one step late, once the next step's forward and backward are queued, so that
reading the flag never leaves the GPU idle; steps that may end the run, write a checkpoint or
act on a stop signal are settled at once, before the next forward touches the model.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_, get_total_norm
from tqdm.auto import tqdm

from .perf import Throughput
from .precision import BatchNormGuard, Precision, StepWatch
from .safety import DivergenceGuard, Preempted, StopSignals

log = logging.getLogger(__name__)


@dataclass
class LoopSettings:
    epochs: int
    max_steps: int | None  # cap on optimizer steps
    accum: int  # micro-batches per optimizer step
    log_every: int
    clip_grad_norm: float | None
    samples_per_step: int  # batch * accum * world
    ckpt_every: int | None = None
    world: int = 1  # data-parallel processes (DDP)
    guard_bn_stats: bool = True  # with a GradScaler: see precision.BatchNormGuard


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (steps GradScaler skipped do not count)
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches consumed this epoch: where a resume picks up
    skipped_steps: int = 0
    attempts: int = 0  # optimizer steps attempted, skipped ones included
    val_loss: float | None = None
    val_acc1: float | None = None
    last_loss: float | None = None


_NO_GUARD = BatchNormGuard(nn.Module(), enabled=False)


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over the micro-batches (device tensor: no sync)
    grad_norm: torch.Tensor | None  # norm of the true (unscaled) gradients, when computed
    ran: Callable[[], bool]  # asks the GPU whether the step was taken (StepWatch.pop)

    @property
    def stepped(self) -> bool:  # False when GradScaler found inf/nan gradients and skipped it
        return self.ran()


def train_step(model: nn.Module, micro_batches: list, loss_fn: Callable, optimizer,
               amp: Precision, watch: StepWatch, clip_grad_norm: float | None = None,
               want_grad_norm: bool = False, no_sync: Callable = lambda model: nullcontext(),
               before_step: Callable[[], None] = lambda: None,
               bn_guard: BatchNormGuard = _NO_GUARD) -> StepResult:
    accum, total = len(micro_batches), 0.0
    for i, (x, y) in enumerate(micro_batches):
        # DDP: all-reduce gradients on the last micro-batch only (forward must be inside no_sync)
        with no_sync(model) if i < accum - 1 else nullcontext():
            stats = bn_guard.snapshot()
            with amp.autocast():
                loss = loss_fn(model(x), y) / accum  # mean over the effective batch
            amp.scaler.scale(loss).backward()  # scale up so small fp16 grads do not flush to 0
            bn_guard.keep_if_finite(loss, stats)  # an fp16 overflow must not poison BatchNorm
        total = total + loss.detach()
    before_step()  # the loop settles the previous step here, while the GPU runs this backward
    amp.scaler.unscale_(optimizer)  # true gradients from here on: once per optimizer step
    grad_norm = None
    if clip_grad_norm is not None or want_grad_norm:  # clip the true gradients / measure them
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        grad_norm = (clip_grad_norm_(params, clip_grad_norm) if clip_grad_norm is not None
                     else get_total_norm([p.grad for p in params]))
    amp.scaler.step(optimizer)  # skipped if any gradient is inf/nan
    amp.scaler.update()  # halve the scale on overflow, grow it after growth_interval clean steps
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total, grad_norm, watch.pop())


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable, loss_fn: Callable, amp: Precision,
             reduce: Callable = lambda t, op="sum": t) -> tuple[float, float]:
    """(mean loss, top-1 accuracy) over the whole validation set."""
    model.eval()
    sums = None
    for x, y in batches:
        with amp.autocast():
            logits = model(x)
        loss = loss_fn(logits.float(), y, reduction="sum")
        batch_sums = torch.stack([loss, (logits.argmax(1) == y).sum().float(),
                                  torch.tensor(float(len(y)), device=y.device)])
        sums = batch_sums if sums is None else sums + batch_sums
    model.train()
    loss_sum, correct, n = reduce(sums).tolist()
    return loss_sum / n, correct / n


def train(model: nn.Module, data, loss_fn: Callable, optimizer, scheduler, amp: Precision,
          tracker, state: TrainState, cfg: LoopSettings, meter: Throughput,
          memory: Callable[[], dict], guard: DivergenceGuard, stop: StopSignals | None = None,
          save: Callable[[TrainState], None] = lambda s: None,
          no_sync: Callable = lambda model: nullcontext(),
          reduce: Callable = lambda t, op="sum": t,
          show_progress: bool = True) -> TrainState:
    watch = StepWatch(optimizer)
    bn_guard = BatchNormGuard(model, amp.scaler.is_enabled() and cfg.guard_bn_stats)
    if bn_guard.enabled:
        log.info("scaler.guard_bn_stats: %d BatchNorm running-stat tensors are put back after any "
                 "forward whose loss is inf/nan", len(bn_guard.stats))
    steps_per_epoch = len(data.train) // cfg.accum
    total = cfg.max_steps or steps_per_epoch * cfg.epochs
    bar = tqdm(total=total, initial=state.step, desc="train", unit="step", dynamic_ncols=True,
               disable=not show_progress, leave=False)
    window = {"loss": torch.zeros((), device=meter.device), "steps": 0, "last": None}
    lr = lambda: optimizer.param_groups[-1]["lr"]  # noqa: E731
    check = lambda out: guard.check(state.step, float(out.loss), amp.loss_scale(), lr())  # noqa: E731

    def settle(out: StepResult | None, late: bool = False) -> None:
        """One attempted step's bookkeeping. `late`: the next step's forward already ran, so
        no checkpoint and no stop here (train() settles such steps at once instead)."""
        if out is None:
            return
        stepped = out.stepped  # the one wait for the GPU's answer
        guard.update(out.loss)
        window["last"] = out
        state.batch_in_epoch += cfg.accum
        state.attempts += 1
        window["loss"] += out.loss
        window["steps"] += 1
        meter.count(cfg.samples_per_step)
        if state.attempts % cfg.log_every == 0:
            check(out)  # divergence: one sync per log_every attempts, skipped ones included
        if stepped:
            scheduler.step()
            state.step += 1
            bar.update(1)
            meter.maybe_end_warmup(state.step)
        else:  # overflow: the scaler backed off; weights and LR stay put
            state.skipped_steps += 1
        if stepped and state.step % cfg.log_every == 0:
            mean_loss = reduce(window["loss"] / window["steps"]) / cfg.world  # mean over ranks
            row = _log_row(state, optimizer, amp, out, mean_loss, meter, memory)
            tracker.log(row, state.step)
            bar.set_postfix(loss=f"{row['train/loss']:.4f}", scale=row["amp/loss_scale"],
                            sps=f"{row['perf/samples_per_s']:.0f}")
            log.info(_fmt(row, state.step, total))
            window.update(loss=torch.zeros((), device=meter.device), steps=0)
        if late:
            return
        signum = _stop_signal(stop, cfg, state, reduce, meter.device)
        if signum:
            save_if_healthy(save, state, guard, model)
            raise Preempted(signum)
        if stepped and cfg.ckpt_every and state.step % cfg.ckpt_every == 0:
            save_if_healthy(save, state, guard, model)

    meter.start(state.step)
    first, pending = time.perf_counter(), None
    for epoch in range(state.epoch, cfg.epochs):
        data.train.set_epoch(epoch, skip=state.batch_in_epoch)
        batches = iter(data.train)
        while True:
            if _settle_now(state, cfg, stop):
                settle(pending)
                pending = None
            if _done(state, cfg):
                break
            micro = list(itertools.islice(batches, cfg.accum))
            if len(micro) < cfg.accum:  # epoch over (a ragged tail of < accum micro-batches is dropped)
                break
            # the grad norm goes with every logged step; no step is left pending before one
            want_norm = pending is None and (state.step + 1) % cfg.log_every == 0
            pending = train_step(model, micro, loss_fn, optimizer, amp, watch,
                                 cfg.clip_grad_norm, want_norm, no_sync,
                                 before_step=lambda p=pending: settle(p, late=True),
                                 bn_guard=bn_guard)
            if first is not None:  # one sync: how long compile / autotuning / capture took
                float(pending.loss)
                log.info("first step took %.1fs (compile, cuDNN autotuning and graph capture "
                         "happen here; warm-up keeps them out of samples/s)",
                         time.perf_counter() - first)
                first = None
        settle(pending)
        pending = None
        _evaluate(model, data, loss_fn, amp, tracker, state, meter, reduce)  # epoch end or the cap
        if _done(state, cfg):
            break
        state.epoch, state.batch_in_epoch = epoch + 1, 0
    bar.close()
    meter.stop()
    if window["last"] is not None:
        check(window["last"])
    if window["steps"]:
        state.last_loss = float(window["loss"] / window["steps"])
    return state


def save_if_healthy(save: Callable, state: TrainState, guard: DivergenceGuard, model) -> None:
    tensors = [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]
    if guard.healthy(tensors):  # never overwrite the last good checkpoint
        save(state)
    else:
        log.warning("step %d: non-finite loss, weights or buffers (e.g. BatchNorm statistics); "
                    "checkpoint not written", state.step)


def _stop_signal(stop: StopSignals | None, cfg: LoopSettings, state: TrainState, reduce,
                 device) -> int:
    """The stop signal every rank agrees on: checked each step alone, every log_every steps
    under DDP (a collective, so that all ranks stop at the same step)."""
    if stop is None:
        return 0
    if cfg.world == 1:
        return stop.received or 0
    if state.attempts % cfg.log_every:
        return 0
    return int(reduce(torch.tensor(stop.received or 0, device=device), "max"))


def _settle_now(state: TrainState, cfg: LoopSettings, stop: StopSignals | None) -> bool:
    """Whether the pending step must be settled before the next forward: if taken, it may be
    the last one, get a checkpoint, or be where a stop signal is acted on (the next forward
    would already have moved BatchNorm's running statistics); and whether the next step may be
    a logged one, which computes the grad norm (its number depends on the pending step)."""
    nxt = state.step + 1  # the pending step's number, if it was taken
    if cfg.max_steps is not None and nxt >= cfg.max_steps:
        return True
    if cfg.ckpt_every and nxt % cfg.ckpt_every == 0:
        return True
    if nxt % cfg.log_every == 0 or (nxt + 1) % cfg.log_every == 0:
        return True
    if stop is None:
        return False
    return bool(stop.received) if cfg.world == 1 else (state.attempts + 1) % cfg.log_every == 0


def _done(state: TrainState, cfg: LoopSettings) -> bool:
    return cfg.max_steps is not None and state.step >= cfg.max_steps


def _evaluate(model, data, loss_fn, amp, tracker, state, meter, reduce) -> None:
    meter.pause()
    state.val_loss, state.val_acc1 = evaluate(model, data.val, loss_fn, amp, reduce)
    tracker.log({"epoch": state.epoch, "val/loss": state.val_loss, "val/acc1": state.val_acc1},
                state.step)
    log.info("epoch %d step %d: val/loss %.4f val/acc1 %.4f", state.epoch, state.step,
             state.val_loss, state.val_acc1)
    meter.resume()


def _log_row(state, optimizer, amp, out, mean_loss, meter, memory) -> dict:
    sps, step_ms = meter.window()
    loss = float(mean_loss)  # the one host sync per log event (with the scale read below)
    state.last_loss = loss
    return {"epoch": state.epoch, "train/loss": loss,
            "train/lr": optimizer.param_groups[-1]["lr"],
            "train/grad_norm": float(out.grad_norm) if out.grad_norm is not None else None,
            "amp/loss_scale": amp.loss_scale(), "amp/skipped_steps": state.skipped_steps,
            "perf/samples_per_s": sps, "perf/step_ms": step_ms, "perf/mfu": meter.mfu(sps),
            **memory()}


def _fmt(row: dict, step: int, total: int) -> str:
    finite = math.isfinite(row["train/loss"])
    return (f"step {step}/{total} loss {row['train/loss']:.4f}{'' if finite else ' (non-finite)'} "
            f"lr {row['train/lr']:.4g} scale {row['amp/loss_scale']:g} "
            f"skipped {row['amp/skipped_steps']} {row['perf/samples_per_s']:.1f} samples/s "
            f"{row['perf/step_ms']:.1f} ms/step peak {row['mem/peak_gib']:.2f} GiB")

"""The training loop: train() -> train_step() -> forward/backward, and evaluate().

It reads no config: run/ hands it objects and numbers. The whole precision story is in
train_step(): autocast, scale, backward, unscale, clip, step (maybe skipped), update. What
happens around each step (counters, scheduler, logs, checkpoints, stop signals) is the
StepLedger's (ledger.py), which settles a step at once or, on a GPU, one step late.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_, get_total_norm
from torch.optim.lr_scheduler import LRScheduler

from mixprec.core.errors import ConfigError
from mixprec.core.tasks import CLASSIFY, Task, call, logits_of, loss_of
from mixprec.parallel import sharding
from mixprec.precision.base import Precision
from mixprec.precision.step_guards import BatchNormGuard, StepWatch
from mixprec.training.callbacks import Callbacks
from mixprec.training.ledger import Hooks, StepLedger


@dataclass
class Learner:
    """What a training step changes, and how: the parts a checkpoint saves."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    precision: Precision
    task: Task = CLASSIFY  # the loss and the validation metrics (tasks.py)
    own_loss: bool = False  # model.loss=own: the model is given labels=y and returns its loss
    loss_fn: Callable | None = None  # model.loss=pkg.mod:fn: the user's loss of the logits
    callbacks: Callbacks = field(default_factory=Callbacks)  # callbacks: in the config

    @property
    def uses_task_loss(self) -> bool:
        """Whether the loss is the task's (what perplexity and bits per byte are derived from)."""
        return not self.own_loss and self.loss_fn is None

    def batch_loss(self, x, y, model: nn.Module | None = None) -> tuple:
        """(logits, mean loss) of one batch, whichever the loss (forward() below); `model`:
        another than the learner's (the diagnostics re-run its unwrapped copy)."""
        logits, loss = forward(self, x, y, model)
        return logits, loss if loss is not None else self.task.loss(logits, y)

    def __post_init__(self) -> None:
        self.watch = StepWatch(self.optimizer)  # was the step taken, or skipped by GradScaler?
        self.bn_guard = BatchNormGuard(self.model, self.precision.guard_bn_stats)


@dataclass
class Plan:
    """How long and how often, in numbers (run/build.py builds it from trainer.* and ckpt.*)."""

    total_steps: int  # optimizer steps in the run (steps GradScaler skips do not count)
    epochs: int  # passes over the data that may be started (enough for total_steps)
    accum: int  # micro-batches per optimizer step
    log_every: int  # optimizer steps between log rows (each reads the loss scale: a sync)
    samples_per_step: int  # batch x accum x world
    clip_grad_norm: float | None = None  # max norm of the true (unscaled) gradients
    ckpt_every: int | None = None  # optimizer steps between checkpoints
    settle_late: bool = True  # settle each step while the next one runs (StepLedger)
    val_every: int | None = None  # optimizer steps between evaluations (besides epoch ends)


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (steps GradScaler skipped do not count)
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches consumed this epoch: where a resume picks up
    skipped_steps: int = 0
    attempts: int = 0  # optimizer steps attempted, skipped ones included
    val: dict = field(
        default_factory=dict
    )  # the last evaluation: {"val/loss": ..., "val/acc1": ...}
    last_loss: float | None = None
    elapsed_s: float = 0.0  # wall seconds of the run up to this state (resumed parts included)
    train_s: float = 0.0  # seconds in training steps up to this state (perf.Throughput.train_s)
    val_step: int = -1  # the step the last evaluation saw (none is repeated at that step)
    layout: dict = field(default_factory=dict)  # batch, accum, world: what the counts are in

    @classmethod
    def restored(cls, saved: dict, layout: dict) -> TrainState:
        """The state a checkpoint saved (older checkpoints kept val_loss/val_acc1 as fields)."""
        saved = dict(saved)
        val = saved.pop("val", None) or {}
        for old in ("val_loss", "val_acc1"):
            value = saved.pop(old, None)
            if value is not None:
                val[old.replace("_", "/", 1)] = value
        return cls(**{**saved, "val": val, "layout": layout})


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over the micro-batches (device tensor: no sync)
    grad_norm: torch.Tensor | None  # norm of the true (unscaled) gradients, when computed
    ran: Callable[[], bool]  # asks the GPU whether the step was taken (StepWatch.pop)
    grads: torch.Tensor | None = None  # all true gradients, flattened (diagnose=true, logged steps)

    @property
    def stepped(self) -> bool:  # False when GradScaler found inf/nan gradients and skipped it
        return self.ran()


def train_step(
    learner: Learner,
    micro_batches: list,
    clip_grad_norm: float | None = None,
    want_grad_norm: bool = False,
    no_sync: Callable = lambda model: nullcontext(),
    before_step: Callable[[torch.Tensor], None] = lambda loss: None,
    want_grads: bool = False,
) -> StepResult:
    """One optimizer step over `accum` micro-batches, in any precision."""
    model, optimizer, prec = learner.model, learner.optimizer, learner.precision
    accum, total = len(micro_batches), 0.0
    for i, (x, y) in enumerate(micro_batches):
        # DDP: all-reduce gradients on the last micro-batch only (forward must be inside no_sync)
        with no_sync(model) if i < accum - 1 else nullcontext():
            stats = learner.bn_guard.snapshot()
            with prec.autocast():
                loss = learner.batch_loss(x, y)[1] / accum  # mean over the effective batch
            prec.scaler.scale(loss).backward()  # scale up so small fp16 grads do not flush to 0
            learner.bn_guard.keep_if_finite(loss, stats)  # an fp16 overflow must not poison BN
        total = total + loss.detach()
    before_step(total)  # the ledger settles the previous step while the GPU runs this backward
    prec.scaler.unscale_(optimizer)  # true gradients from here on: once per optimizer step
    grad_norm = grads = None
    if clip_grad_norm is not None or want_grad_norm:  # clip the true gradients / measure them
        params = [p for p in model.parameters() if p.grad is not None]  # (not offloaded ones)
        grad_norm = sharding.full(  # sharded (FSDP2): the norm over every rank's shard
            clip_grad_norm_(params, clip_grad_norm)
            if clip_grad_norm is not None
            else get_total_norm([p.grad for p in params])
        )
        if want_grads:  # the true gradients, for histograms (diagnose=true; a shard's own)
            grads = torch.cat([sharding.local(p.grad).detach().float().flatten() for p in params])
    prec.scaler.step(optimizer)  # skipped if any gradient is inf/nan
    prec.scaler.update()  # halve the scale on overflow, grow it after growth_interval clean steps
    prec.after_optimizer_step(optimizer)  # a recipe's own state (a no-op for the built-in ones)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total, grad_norm, learner.watch.pop(), grads)


@torch.no_grad()
def evaluate(
    learner: Learner,
    batches: Iterable,
    reduce: Callable = lambda t, op="sum": t,
    stop: Callable[[], bool] = lambda: False,
) -> dict[str, float] | None:
    """{"val/loss": mean loss, "val/acc1": top-1, ...}: the learner's loss and its task's
    validation metrics (metrics.py), over the whole validation set (summed over ranks), mean
    per target (an image's label, a sequence's tokens). None if `stop()` says so before a
    batch (a stop signal: the weights are the last step's, whole, and can be checkpointed)."""
    model, extra = learner.model, learner.task.evaluated()
    model.eval()
    sums = None
    for i, (x, y) in enumerate(batches):
        if stop():
            model.train()
            return None
        with learner.precision.autocast():
            logits, own = forward(learner, x, y)
        n = learner.task.count(y).float()  # its targets (padding left out)
        summed = (  # the model's own (or the user's) mean loss x its targets, or the task's sum
            own.float() * n
            if own is not None
            else learner.task.loss(logits.float(), y, reduction="sum")
        )
        even = float(i % 2 == 0)  # alternate batches: two halves of the set, the same weights
        batch = [summed, *(m.batch_sum(logits, y) for m in extra), n]
        batch += [summed * even, summed * (1 - even), n * even, n * (1 - even)]  # (no sync)
        sums = torch.stack(batch) if sums is None else sums + torch.stack(batch)
    model.train()
    *totals, n, a, b, n_a, n_b = reduce(sums).tolist()
    val = {key: total / n for key, total in zip(["val/loss", *(m.key for m in extra)], totals)}
    if n_a and n_b:  # |A - B| / 2 estimates the whole set's standard error (two equal halves)
        val["val/loss_noise"] = abs(a / n_a - b / n_b) / 2
    return {**val, **(learner.task.derived(val) if learner.uses_task_loss else {})}


def forward(learner: Learner, x, y, model: nn.Module | None = None) -> tuple:
    """(logits, loss): the logits in the model's output (a tensor, .logits or ["logits"]) for
    an input as the data gives it (a tensor, or a dict of keyword arguments), and the mean loss
    the model returns when called with labels=y (model.loss=own) or the user's function of the
    logits (model.loss=pkg.mod:fn); None for the task's loss, which the caller takes of the
    logits (a mean or a sum). `model`: another than the learner's (its unwrapped copy)."""
    model = learner.model if model is None else model
    if not learner.own_loss:
        logits = logits_of(call(model, x))
        return logits, None if learner.loss_fn is None else learner.loss_fn(logits, y)
    out = call(model, x, labels=y)
    loss = loss_of(out)
    if loss is None:
        raise ConfigError(
            "model.loss=own: the model, called with labels=<the targets>, returned "
            f"{type(out).__name__} with no loss (.loss or ['loss']); return one, or use "
            "model.loss=task (the data's loss of the logits)"
        )
    return logits_of(out), loss


def train(learner: Learner, data, state: TrainState, plan: Plan, hooks: Hooks) -> TrainState:
    """Train until plan.total_steps optimizer steps are taken or plan.epochs are done,
    evaluating every plan.val_every steps, after every epoch and after the last step."""
    ledger = StepLedger(learner, state, plan, hooks)
    learner.callbacks.on_train_start(learner, state)
    ledger.evaluate = lambda stop: evaluate(learner, data.val, hooks.dist.reduce, stop)
    if plan.val_every and state.step and state.step % plan.val_every == 0:
        ledger.validate()  # a resume from a stop during this step's evaluation: it runs now
    for epoch in range(state.epoch, plan.epochs):
        for micro_batches in ledger.batches(data.train, epoch):
            logged = ledger.wants_grad_norm()
            out = train_step(
                learner,
                micro_batches,
                plan.clip_grad_norm,
                logged,
                hooks.dist.no_sync,
                ledger.settle_late,
                logged and hooks.grad_histograms,
            )
            ledger.record(out)
        ledger.settle_pending()
        ledger.validate()
        if ledger.done():
            break
        state.epoch, state.batch_in_epoch = epoch + 1, 0
    ledger.finish()
    return state

"""Every metric a run reports, declared once: its key in metrics.jsonl and W&B, its name in
summary.json, whether a sweep may optimise it (`objective=`), whether the report shows it, and,
for validation metrics, how a batch adds to it. The loop, the summary, the config check of
`objective` and the report all read this table; a test checks that every key a run logs is here.

Adding a validation metric is one line: e.g. top-5 accuracy as an objective,
    Metric("val/acc5", "val_acc5", goal="max", batch_sum=correct(5)),
makes evaluate() compute it, the log and W&B show it, summary.json carry `val_acc5`, and
`objective=val_acc5` valid (docs/architecture.md, "Adding a metric").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


def correct(k: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Top-k correct predictions in a batch (k capped at the number of classes)."""

    def batch_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
        return (top == y.unsqueeze(-1)).any(-1).sum().float()

    return batch_sum


@dataclass(frozen=True)
class Metric:
    key: str  # metrics.jsonl / W&B key (slash style)
    summary: Optional[str] = None  # its summary.json key, if the summary carries it
    goal: Optional[str] = None  # max or min: a sweep may optimise it (objective=<summary name>)
    report: bool = False  # a column of report.md
    batch_sum: Optional[Callable] = None  # validation metrics: the batch's sum (mean over samples)
    tasks: tuple[str, ...] = ()  # a validation metric of these tasks only (tasks.py), else any


ACCURACY = ("classify", "tag")  # the tasks with a label to be right about (not the next token)

METRICS: list[Metric] = [  # the report's columns come in this order
    Metric("perf/samples_per_s", "samples_per_s", goal="max", report=True),
    Metric("perf/tokens_per_s", "tokens_per_s", goal="max", report=True),  # language models
    Metric("mem/peak_gib", "peak_mem_gib", goal="min", report=True),
    Metric("perf/mfu", "mfu", goal="max", report=True),
    Metric("amp/skipped_steps", "skipped_steps", report=True),
    Metric("amp/loss_scale", "loss_scale", report=True),
    Metric("train/loss", "train_loss", goal="min", report=True),
    Metric("val/acc1", "val_acc1", goal="max", report=True, batch_sum=correct(1), tasks=ACCURACY),
    Metric("val/bpb", "val_bpb", goal="min", report=True),  # LMs: bits per byte (tasks.py)
    Metric("mem/max_batch", "max_batch", report=True),
    Metric("val/loss", "val_loss", goal="min"),  # evaluate() sums the learner's own loss
    Metric("val/ppl", "val_ppl", goal="min"),  # LMs: exp(val/loss)
    # the evaluation's own noise: half the difference of the loss on alternate batches (the
    # same weights on two halves of the validation set), an estimate of val/loss's standard
    # error; the time-to-quality study sets it against the differences it resolves
    Metric("val/loss_noise", "val_loss_noise"),
    Metric("train/lr"),
    Metric("train/grad_norm"),
    Metric("perf/step_ms"),
    Metric("mem/allocated_gib"),
    Metric("mem/reserved_gib"),
    Metric("mem/after_forward_gib", "after_forward_gib"),
    Metric("mem/after_backward_gib", "after_backward_gib"),
    Metric("mem/after_step_gib", "after_step_gib"),
    Metric("grad/all"),
    Metric("grad/abs_max"),
    Metric("epoch"),
    Metric("time/elapsed_s"),  # every row: wall seconds since the run started (resumes included)
    Metric("time/train_s"),  # every row: seconds in training steps after the first (perf.py)
]


def objectives() -> tuple[str, ...]:
    """The summary values `objective=` may name."""
    return tuple(m.summary for m in METRICS if m.goal)


def not_measured_for(objective: str, task: str) -> bool:
    """An objective that this task never measures (val_acc1 on token data: no accuracy)."""
    m = next((m for m in METRICS if m.summary == objective), None)
    return m is not None and bool(m.tasks) and task not in m.tasks


def evaluated(task: str = "classify") -> list[Metric]:
    """The validation metrics evaluate() computes for a task, in order."""
    return [m for m in METRICS if m.batch_sum is not None and (not m.tasks or task in m.tasks)]


# families of keys named per layer (debug.numerics: numerics/<layer>/<tensor>/underflow, ...)
FAMILIES = ("numerics/",)


def keys() -> set[str]:
    return {m.key for m in METRICS}


def declared(key: str) -> bool:
    """A key of the registry, or of one of its per-layer families."""
    return key in keys() or key.startswith(FAMILIES)


def summary_name(key: str) -> str:
    return next(m.summary for m in METRICS if m.key == key)


def report_columns() -> list[str]:
    return [m.summary for m in METRICS if m.report]

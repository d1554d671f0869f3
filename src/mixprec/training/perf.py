"""Honest throughput: the GPU is synchronised at every measurement boundary (log events, the end
of warm-up, around evaluation), so a number never counts work that was only queued; a run with
too few steps after its warm-up reports no number rather than a meaningless one."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

import torch

from mixprec.internals import torch_private

log = logging.getLogger(__name__)
MIN_TIMED_STEPS = 10  # fewer steps after warm-up than this: samples_per_s is null


_IMPORTED = time.monotonic()
_JOB: dict = {}  # this job's start: its clock, and the compile and tuning seconds before it


def process_age_s() -> float:
    """Seconds since this process started (the kernel's start time: imports included), or
    since mixprec was imported where /proc is not there."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


def job_started() -> bool:
    """A run begins (run.run); True if it is the process's first. The first run of a process
    counts from the process's start (its imports are part of the wait); a later job of an
    in-process sweep from its own start, and compile and tuning seconds from zero."""
    first = not _JOB
    _JOB.update(
        t=time.monotonic() - (process_age_s() if first else 0.0),
        compile=_compile_total() or 0.0,
        tune=_tune_total() or 0.0,
    )
    return first


def since_job_start() -> float:
    return time.monotonic() - _JOB["t"] if _JOB else process_age_s()


_compile_total = torch_private.compile_seconds  # (absent in another torch: the key is null)
_tune_total = torch_private.tuning_seconds


def compile_s() -> float | None:
    """Seconds torch.compile spent in this job (dynamo and inductor, forward and backward
    graphs, torch's own counter; kernel tuning at first launch is tune_s)."""
    total = _compile_total()
    return None if total is None else round(total - _JOB.get("compile", 0.0), 2)


def tune_s() -> float | None:
    """Seconds inductor spent in this job tuning Triton kernels at their first launch
    (coordinate descent, autotuning among configs): the other cost of a compiled first step."""
    total = _tune_total()
    return None if total is None else round(total - _JOB.get("tune", 0.0), 2)


class Throughput:
    def __init__(
        self,
        device: torch.device,
        warmup_steps: int,
        mfu=lambda samples_per_s: None,
        tokens_per_sample: int = 1,
    ) -> None:
        self.device, self.warmup_steps, self.mfu = device, warmup_steps, mfu
        self.tokens_per_sample = tokens_per_sample  # a language model's sequence length
        self.samples = 0  # all samples processed (warm-up included)
        self._win_samples = self._win_attempts = 0
        self._steady = None  # (time, samples) when warm-up ended
        self._paused = 0.0  # seconds spent outside training (evaluation) since warm-up
        self.steady_rate = None
        self.timed_steps = 0  # steps attempted inside the steady-state measurement
        self.first_step_s: float | None = None  # process start -> first step done
        self.compile_first_s: float | None = None  # compile seconds by then (the rest: eval)
        self._last = 0.0  # the clock at the latest synchronised measurement
        self._train_t0: float | None = None  # when the first step ended (training time from it)
        self._excluded = 0.0  # seconds outside training (evaluation, checkpoints) since then

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._last = time.perf_counter()
        return self._last

    def train_s(self) -> float:
        """Seconds spent in training steps from the end of the first step (which holds the
        compile: first_step_s) to the latest synchronised measurement, evaluation and
        checkpoints excluded. Reads no clock of its own: a log row costs no extra sync."""
        if self._train_t0 is None:
            return 0.0
        return max(self._last - self._train_t0 - self._excluded, 0.0)

    def start(self, step: int) -> None:
        self._t_start = self._t_win = self._now()
        self._paused_win = 0.0
        if step >= self.warmup_steps:  # resumed past warm-up: measure from here
            self._steady = (self._t_start, 0)

    def count(self, samples: int) -> None:
        self.timed_steps += self._steady is not None
        self.samples += samples
        self._win_samples += samples
        self._win_attempts += 1

    def tokens(self, samples_per_s: float | None) -> float | None:
        """Tokens per second, for samples of several tokens (else None: not a token model)."""
        if self.tokens_per_sample <= 1 or samples_per_s is None:
            return None
        return samples_per_s * self.tokens_per_sample

    def first_step_done(self) -> tuple[float, float | None]:
        """Record when the first step ended (the caller synchronised): (first_step_s,
        compile_s so far)."""
        self.first_step_s, self.compile_first_s = round(since_job_start(), 2), compile_s()
        self._train_t0 = self._last = time.perf_counter()
        return self.first_step_s, self.compile_first_s

    def maybe_end_warmup(self, step: int) -> None:
        if self._steady is None and step >= self.warmup_steps:
            self._steady = (self._now(), self.samples)

    def window(self) -> tuple[float, float]:
        """(samples/s, ms per optimizer step) since the previous call."""
        now = self._now()
        dt = max(now - self._t_win - self._paused_win, 1e-9)
        rate, step_ms = self._win_samples / dt, 1000 * dt / max(self._win_attempts, 1)
        self._t_win, self._paused_win, self._win_samples, self._win_attempts = now, 0.0, 0, 0
        return rate, step_ms

    @contextmanager
    def paused(self):
        """Time spent in the block (evaluation, a checkpoint) is not training time."""
        start = self._now()
        try:
            yield
        finally:
            gap = self._now() - start
            self._paused_win += gap
            if self._steady is not None:
                self._paused += gap
            if self._train_t0 is not None:
                self._excluded += gap

    def stop(self) -> None:
        end = self._now()
        t0, s0 = self._steady if self._steady else (self._t_start, 0)
        dt = end - t0 - self._paused
        self.steady_rate = (self.samples - s0) / dt if dt > 0 and self.samples > s0 else None
        if self.steady_rate is not None and self.timed_steps < MIN_TIMED_STEPS:
            log.warning(
                "samples_per_s: only %d steps ran after the %d warm-up steps, too few to "
                "time (%d needed); it is null in the summary. Train longer "
                "(trainer.max_steps) or lower trainer.perf_warmup_steps",
                self.timed_steps,
                self.warmup_steps,
                MIN_TIMED_STEPS,
            )
            self.steady_rate = None

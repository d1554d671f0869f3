"""precision=fp8_auto (precision.fp8_layers=auto): a per-layer float8 plan measured on this GPU.

Before training, each distinct Linear GEMM the model will run (M = the rows a micro-batch feeds
it, K = in features, N = out features, bias or not) is timed on the run's GPU for bf16 and for
each candidate float8 recipe: one Linear's forward and both backward GEMMs (grad input, grad
weight) with the casts and scaling the recipe adds (torchao's own Float8Linear, compiled when
the run compiles), its GPU time replayed from a CUDA graph. Each layer gets the fastest recipe
that beats bf16 by `margin` (5 %: below that, timing noise and the casts' fusion in the whole
model decide), bf16 otherwise. When the run compiles, Linears that read one input tensor
(attention's q, k, v; SwiGLU's w1, w3) are timed together and go float8 together or not at all:
the compiled model casts their input once for all of them, which a timing of each alone charges
to each (on Llama-3-8B's layers, wk and wv alone stayed bf16 and the plan ended 1.2 % under
uniform fp8; timed with wq, every layer goes float8, as in uniform fp8: H200, 2026-12-02). The
timings are cached per (GPU, torch, torchao, shape, recipe, compiled) in one JSON file, so a
second start with the same shapes measures nothing.

The timings run in child processes on the same GPU (fp8_timing.py: how a GEMM is timed, and
the processes that time them); a run whose timings are cached starts none.

What it does not see: whole-model fusion (a cast fused into the norm before it), FSDP2's float8
all-gather, and the GPU's clocks under a whole model's load; the plan is checked end to end by
benchmarks/fp8_plan.py (train.py, fp8_auto against bf16 and uniform fp8, side by side).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from mixprec.core import files, tasks
from mixprec.core.errors import MixprecError

log = logging.getLogger(__name__)
BF16 = "bf16"


@dataclass(frozen=True)
class Gemm:
    """One Linear's GEMM: M rows (tokens or samples of a micro-batch), K in, N out."""

    m: int
    k: int
    n: int
    bias: bool

    def key(self) -> str:
        return f"{self.m}x{self.k}x{self.n}{'+bias' if self.bias else ''}"


def layer_gemms(
    model: nn.Module, x: torch.Tensor, autocast, names: list[str], groups: list | None = None
) -> dict:
    """{layer name: (Gemm, calls per forward)} from one no-grad eval forward of `x` with hooks
    on the named Linear layers (the model's mode is put back). `groups`, when given, receives
    each set of two or more of those layers that read the same input tensor (attention's q, k
    and v; SwiGLU's w1 and w3): in a compiled model they share that input's float8 cast."""
    found: dict[str, list] = {}
    inputs: list[tuple[torch.Tensor, list[str]]] = []  # (held: an id is not reused meanwhile)

    def hook_for(name: str, mod: nn.Linear):
        def hook(_mod, args, _out):
            rows = args[0].numel() // mod.in_features
            gemm = Gemm(rows, mod.in_features, mod.out_features, mod.bias is not None)
            if name not in found:
                readers = next((r for t, r in inputs if t is args[0]), None)
                if readers is None:
                    inputs.append((args[0], readers := []))
                readers.append(name)
            found.setdefault(name, [gemm, 0])[1] += 1

        return hook

    handles = [
        model.get_submodule(n).register_forward_hook(hook_for(n, model.get_submodule(n)))
        for n in names
    ]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast():
            tasks.call(model, x)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    if groups is not None:
        groups.extend(readers for _, readers in inputs if len(readers) > 1)
    return {n: tuple(v) for n, v in found.items()}


@dataclass
class Choice:
    """One layer's entry in the plan."""

    gemm: Gemm
    calls: int  # calls per forward (a layer used twice counts twice)
    us: dict  # {recipe: microseconds per forward+backward}, bf16 included
    choice: str  # bf16 or the float8 recipe it gets
    saving_us: float  # (bf16 - choice) x calls: the expected saving per micro-batch
    group: str | None = (
        None  # "wq+wk+wv": chosen with the layers that read its input; us: its share
    )

    def as_dict(self) -> dict:
        return {**asdict(self), "gemm": [self.gemm.m, self.gemm.k, self.gemm.n, self.gemm.bias]}

    @classmethod
    def from_dict(cls, d: dict) -> Choice:
        return cls(**{**d, "gemm": Gemm(*d["gemm"])})


def choose(us: dict, candidates: list[str], margin: float) -> str:
    """The fastest candidate recipe if it beats bf16 by more than `margin` (a fraction),
    else bf16."""
    best = min(candidates, key=lambda r: us[r], default=None)
    if best is None or not us[best] < us[BF16] * (1 - margin):
        return BF16
    return best


class TimingCache:
    """{key: microseconds} in one JSON file (None: nothing kept). What is read is checked: a
    file that is not a JSON object is started over, an entry that is not a timing (a string,
    null, a dict: an edited or damaged file) is timed again. Saving merges into the file as it
    is then, under a lock, so runs that time layers at once each keep what they timed; a file
    that cannot be written only warns."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(os.path.expanduser(path)) if path else None
        self.data: dict[str, float] = self._read() if self.path is not None else {}

    def _read(self) -> dict[str, float]:
        if not self.path.is_file():
            return {}
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            raw = None
        if not isinstance(raw, dict):
            log.warning("fp8 plan: %s cannot be read; measuring again", self.path)
            return {}
        good = {k: float(v) for k, v in raw.items() if _timing(v)}
        if len(good) < len(raw):
            log.warning(
                "fp8 plan: %d entries of %s are not timings; they are timed again",
                len(raw) - len(good),
                self.path,
            )
        return good

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                self.data = {**self._read(), **self.data}  # another run's timings kept
                files.write_json(self.path, dict(sorted(self.data.items())))
        except (OSError, MixprecError) as e:  # (a full disk or a read-only cache: DiskFull, ...)
            log.warning("fp8 plan: the timings could not be cached in %s (%s)", self.path, e)


def _timing(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def cache_key(
    gemms, recipe: str, compiled: bool, device: torch.device, here: str | None = None
) -> str:
    """The GPU, torch, torchao (`here`: machine(device) unless given), the shape (a Gemm, or the
    Gemms of Linears that read one input), the recipe and how it was timed: what a timing
    depends on."""
    gemms = (gemms,) if isinstance(gemms, Gemm) else tuple(gemms)
    shape = "&".join(g.key() for g in gemms)
    how = ("compiled-static" if compiled else "eager") + "+cudagraph"  # how it was timed
    return f"{here or machine(device)}|{shape}|{recipe}|{how}"


def machine(device: torch.device) -> str:
    """The GPU, torch and torchao: the start of every cache key timed on this machine."""
    import torchao

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{gpu}|torch {torch.__version__}|torchao {torchao.__version__}"


def measure(
    gemms: dict,
    candidates: list[str],
    margin: float,
    timer: Callable[[list[tuple[tuple[Gemm, ...], str]]], list[float]],
    key: Callable[[tuple[Gemm, ...], str], str],
    cache: TimingCache,
    groups: list[list[str]] = (),
) -> dict[str, Choice]:
    """The plan: the timings of each layer, or of each group of layers that read one input
    (`groups`: they go float8 together or not at all), from the cache or from `timer`, given
    every (shapes, recipe) the cache lacks at once; then each one's choice."""
    grouped = {n for g in groups for n in g}
    units = [list(g) for g in groups] + [[n] for n in gemms if n not in grouped]
    recipes = (BF16, *candidates)
    todo: dict[str, tuple[tuple[Gemm, ...], str]] = {}
    for unit in units:
        shapes = tuple(gemms[n][0] for n in unit)
        for recipe in recipes:
            if key(shapes, recipe) not in cache.data:
                todo.setdefault(key(shapes, recipe), (shapes, recipe))
    if todo:
        cache.data.update(zip(todo, timer(list(todo.values()))))
        cache.save()
    plan = {}
    for unit in units:
        shapes = tuple(gemms[n][0] for n in unit)
        us = {r: cache.data[key(shapes, r)] / len(unit) for r in recipes}  # each one's share
        pick = choose(us, candidates, margin)
        for n in unit:
            gemm, calls = gemms[n]
            group = "+".join(unit) if len(unit) > 1 else None
            plan[n] = Choice(gemm, calls, us, pick, (us[BF16] - us[pick]) * calls, group)
    return {n: plan[n] for n in gemms}


def table(plan: dict[str, Choice], candidates: list[str]) -> str:
    """The plan as a markdown table, and the expected saving per micro-batch."""
    cols = [BF16, *candidates]
    lines = [
        "| layer | M x K x N | " + " | ".join(f"{r} µs" for r in cols) + " | choice | saves µs |",
        "|---|---|" + "---|" * len(cols) + "---|---|",
    ]
    for name, c in plan.items():
        times = " | ".join(f"{c.us[r]:.1f}" for r in cols)
        choice = c.choice + (f" (with {c.group}: each its share)" if c.group else "")
        lines.append(
            f"| {name} | {c.gemm.m} x {c.gemm.k} x {c.gemm.n} | {times} | {choice} | "
            f"{c.saving_us:.1f} |"
        )
    total = sum(c.saving_us for c in plan.values())
    base = sum(c.us[BF16] * c.calls for c in plan.values())
    fp8 = sum(c.choice != BF16 for c in plan.values())
    lines.append("")
    share = 100 * total / max(base, 1e-9)
    lines.append(
        f"{fp8} of {len(plan)} layers in float8; expected saving {total / 1000:.2f} ms per "
        f"micro-batch of these layers' {base / 1000:.2f} ms in bf16 ({share:.1f}%)"
    )
    return "\n".join(lines)

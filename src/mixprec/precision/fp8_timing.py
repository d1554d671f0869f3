"""How precision=fp8_auto's plan (fp8_layers.py) times a GEMM, and the processes that time them.

A timing is one training step of a Linear (or of the Linears that read one input) under bf16
autocast, in bf16 or torchao's Float8Linear with a recipe, compiled for its shape when the run
compiles, captured in a CUDA graph and replayed (gemm_step, Captured).

The timings run in child processes on the same GPU (Child; one per 4 CPU cores, at most 4),
started on train.py's first lines (fp8_early.py) or else before the data and the model are
built, so that their imports (torch, torchao, inductor) overlap the training process's (what
that buys: benchmarks/RESULTS.md's fp8 plan rows). A float8 timing's cost is its compile (most of
it the compile stack's first use in a process; its GPU time is milliseconds), so the children
compile and capture their shares at once and then time them one after another: no timing shares
the GPU. A child compiles nothing before its share arrives: a warm-up compile made the children
slower, measured side by side. Each timing leaves memory allocated that neither
torch.compiler.reset(), the graph's reset nor gc frees in-process (benchmarks/fp8_plan_leak.py),
so a run that planned in-process peaked above bf16; in a child, that memory leaves with it.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from mixprec.core.errors import MixprecError
from mixprec.internals import torch_private
from mixprec.precision import fp8_early, fp8_layers
from mixprec.precision.fp8_layers import BF16, Gemm

log = logging.getLogger(__name__)


def gemm_step(
    gemms: tuple[Gemm, ...], recipe: str, compiled: bool, device: torch.device
) -> Callable[[], None]:
    """One training step of Linears that read one input (shapes M x K x N_i; one Gemm: a lone
    Linear) under bf16 autocast, forward and both backward GEMMs (grad input, grad weight):
    nn.Linear (recipe 'bf16': cuBLAS's GEMMs, eager) or torchao's Float8Linear with that recipe
    (compiled for this shape when the run compiles, as the run's blocks are; compiled once with
    dynamic shapes for every shape, float8 layers timed 14-29 % slower on an H200). Compiled,
    a group's input is cast to float8 once for all of them, as in the compiled model."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fan = _Fan(gemms, device)
    run = fan
    if recipe != BF16:
        config = Float8LinearConfig.from_recipe_name(recipe)
        fan = convert_to_float8_training(fan, config=config)
        run = torch.compile(fan, dynamic=False) if compiled else fan
    x = torch.randn(gemms[0].m, gemms[0].k, device=device, dtype=torch.bfloat16)
    x.requires_grad_()
    dys = [torch.randn(g.m, g.n, device=device, dtype=torch.bfloat16) for g in gemms]

    def step():  # (autocast's weight-cast cache off, as CUDA graphs require: on, it leaks)
        with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
            ys = run(x)
        torch.autograd.backward(ys, dys)  # into the .grad the warm-up made: in place

    return step


class _Fan(nn.Module):
    """Linears that read one input: their outputs, in order."""

    def __init__(self, gemms: tuple[Gemm, ...], device: torch.device) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(g.k, g.n, bias=g.bias, device=device) for g in gemms)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(layer(x) for layer in self.layers)


@dataclass
class Captured:
    """A step compiled, warmed up and captured in a CUDA graph, ready to be timed: the step
    (its tensors stay alive while the graph replays them), its replay and the graph."""

    step: Callable[[], None]
    replay: Callable[[], None]
    graph: object

    @classmethod
    def of(cls, step: Callable[[], None]) -> Captured:
        """`step` warmed up on a side stream (compile, autotuning, the allocator's first
        blocks), then captured in a CUDA graph (where capture fails: replayed as it is)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                step()
        except RuntimeError as e:
            log.warning("fp8 plan: timed without a CUDA graph (%s)", str(e).splitlines()[0][:100])
            return cls(step, step, None)
        return cls(step, graph.replay, graph)

    def us(self, run_ms: float = 15.0, most: int = 20) -> float:
        """GPU microseconds of one step: the median of three runs of replays, each run as many
        replays as fill about `run_ms` (3 to `most`; one replay first sizes them: a 9 ms step
        is replayed 3 times a run, not 20) (the host's launch overhead, amortised in a whole
        model's compiled step, is not counted); then the graph's private pool is given back."""
        one = self._replays(1)
        reps = max(3, min(most, math.ceil(run_ms * 1000 / max(one, 1.0))))
        runs = sorted(self._replays(reps) for _ in range(3))
        if self.graph is not None:
            self.graph.reset()
        return runs[1]

    def _replays(self, reps: int) -> float:
        """Microseconds of GPU time per replay, over `reps` replays."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            self.replay()
        end.record()
        end.synchronize()
        return 1000 * start.elapsed_time(end) / reps


def time_gemm(gemms: tuple[Gemm, ...], recipe: str, compiled: bool, device: torch.device) -> float:
    """Microseconds of GPU time for one gemm_step, compiled, captured and replayed at once."""
    return Captured.of(gemm_step(gemms, recipe, compiled, device)).us()


class Child:
    """A process the timings run in, on the run's GPU (fp8_early.spawn): started with train.py
    (fp8_early.start) or before the data and the model are built (Plugin.warm_up), it imports
    torch, torchao and inductor meanwhile, then waits for its share of the shapes on its stdin.
    It compiles and captures each, says "ready", and times them when told "go": the children
    compile at once, and time one after another, so no timing shares the GPU. `close()` ends
    it, and so does the training process's end (its stdin closes)."""

    def __init__(self, proc: subprocess.Popen, t0: float) -> None:
        self.proc, self.t0 = proc, t0  # t0: when it was started (time.time())
        self._finalizer = weakref.finalize(self, fp8_early.end, self.proc)

    def send(self, todo: list, compiled: bool) -> None:
        """Its share: (shapes, recipe) pairs to compile (where the run compiles) and capture."""
        job = [[[[g.m, g.k, g.n, g.bias] for g in shapes], recipe] for shapes, recipe in todo]
        self._say(json.dumps({"todo": job, "compiled": compiled}))

    def ready(self) -> None:
        """Wait until its share is compiled and captured."""
        if self._read() != "ready":
            self._failed()

    def results(self) -> list:
        """Time its share now (alone on the GPU): microseconds, in its share's order."""
        self._say("go")
        line = self._read()
        self.close()
        try:
            return json.loads(line)["us"]
        except (ValueError, KeyError, TypeError):
            self._failed()

    def _say(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):  # it ended before reading: its error is above
            self._failed()

    def _read(self) -> str:
        return self.proc.stdout.readline().strip()

    def _failed(self):
        self.close()
        raise MixprecError(
            f"precision.fp8_layers=auto: timing the layers failed in its child process "
            f"(exit {self.proc.returncode}; its error is above)"
        )

    def close(self) -> None:
        """End the child (and its compile workers) unless it has ended."""
        self._finalizer()


def start_children(device: torch.device, n: int | None = None) -> list[Child]:
    """`n` timing processes (fp8_early.processes()) on `device`: the ones train.py started for
    this GPU (fp8_early), else new ones."""
    if device.type == "cuda" and device.index is None:  # the children's GPU: this process's
        device = torch.device("cuda", torch.cuda.current_device())
    early = fp8_early.claim(device.index) if device.type == "cuda" else []
    if early:
        return [Child(proc, t0) for proc, t0 in early]
    n = n or fp8_early.processes()
    return [Child(*fp8_early.spawn(str(device), n)) for _ in range(n)]


class Timing:
    """Where fp8_auto's layer timings come from (the plugin's `timing`): child processes on the
    run's GPU, which compile and time each shape (the functions of this module). Another object
    answering these three is another source: tests give the plugin a fake GPU this way."""

    def machine(self, device: torch.device) -> str:
        """The GPU, torch and torchao: what the timing cache's keys start with."""
        return fp8_layers.machine(device)

    def start(self, device: torch.device) -> list:
        """The timing processes, started (or claimed from train.py's early start) now."""
        return start_children(device)

    def time(self, todo: list, compiled: bool, device: torch.device, children: list) -> list:
        """Microseconds for each (shapes, recipe) of `todo`, in its order."""
        return time_in_child(todo, compiled, device, children)


def deal(todo: list, n: int) -> list[list[int]]:
    """The indices of `todo` for each of `n` children: the float8 timings (each a compile)
    dealt round, then the bf16 ones (eager: a few ms), so the children end their compiles
    together."""
    order = [i for i, (_, r) in enumerate(todo) if r != BF16]
    order += [i for i, (_, r) in enumerate(todo) if r == BF16]
    return [order[k::n] for k in range(n)]


def time_in_child(
    todo: list, compiled: bool, device: torch.device, children: list | None = None
) -> list:
    """Microseconds for each (shapes, recipe) of `todo` (gemm_step), in `todo`'s order, measured
    in `children` (started early) or in children started now: they compile and capture their
    shares at once, then time them one child after another. What the timings leave allocated
    (65-130 MiB a timing that neither compiler.reset(), the CUDA graph's reset nor gc freed in
    the training process, measured on an H200) leaves with the children."""
    children = list(children or start_children(device))
    out: list = [None] * len(todo)
    try:
        shares = [(c, idx) for c, idx in zip(children, deal(todo, len(children))) if idx]
        for child, idx in shares:
            child.send([todo[i] for i in idx], compiled)
        for child, _ in shares:
            child.ready()
        for child, idx in shares:
            for i, us in zip(idx, child.results()):
                out[i] = us
    finally:
        for child in children:
            child.close()
    return out


def _child() -> None:
    """`python -m mixprec.precision.fp8_timing '{device, t0, early}'` < {todo, compiled}, go:
    compile (where the run compiles) and capture each (shapes, recipe) of the todo, print
    "ready", and on "go" time them and print {"us": [...]} (Child's other end)."""
    setup = json.loads(sys.argv[1])
    device = torch.device(setup["device"])
    if setup.get("early") and not (
        torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    ):
        return  # started on the command line's word, but there is no such GPU: warm_up decides
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # imported while the training process imports, builds its data and model: the compile
    # stack too, before the share says whether the run compiles (most fp8 runs do)
    importlib.import_module("torchao.float8")
    torch_private.import_inductor()
    since = lambda: time.time() - setup["t0"]  # noqa: E731 (seconds since it was started)
    imported = since()
    line = sys.stdin.readline()
    if not line:  # not needed after all (every timing cached; a resumed plan)
        return
    job = json.loads(line)
    todo, compiled = job["todo"], job["compiled"]
    print(  # which came last, the share or the imports: the start's cost to the plan
        f"fp8 plan: a timing process imported in {imported:.1f}s, its share came at {since():.1f}s",
        file=sys.stderr,
        flush=True,
    )
    captured = []
    for i, (shapes, recipe) in enumerate(todo):
        started = time.perf_counter()
        gemms = tuple(Gemm(*g) for g in shapes)
        torch.compiler.reset()  # each shape its own graph: no recompile limit to reach
        captured.append(Captured.of(gemm_step(gemms, recipe, compiled, device)))
        print(
            f"fp8 plan: {i + 1}/{len(todo)} {'&'.join(g.key() for g in gemms)} {recipe}: "
            f"compiled and captured in {time.perf_counter() - started:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    started = time.perf_counter()
    us = [c.us() for c in captured]
    print(
        f"fp8 plan: timed {len(us)} in {time.perf_counter() - started:.1f}s, "
        f"done at {since():.1f}s",
        file=sys.stderr,
    )
    print(json.dumps({"us": us}), flush=True)


if __name__ == "__main__":
    _child()

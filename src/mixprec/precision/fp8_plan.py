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

The timings run in child processes on the same GPU (Child; one per 4 CPU cores, at most 4),
started before the data and the model are built so that the compile stack's first use
(inductor, Triton, its workers) overlaps them. A float8 timing's cost is its compile (2.4-3.8 s
each on the 8B slice's shapes, H200, 2026-12-02; its GPU time is milliseconds), so the children
compile and capture their shares at once and then time them one after another: no timing
shares the GPU. Each timing leaves 65-130 MiB allocated that neither torch.compiler.reset(),
the graph's reset nor gc frees in-process (benchmarks/fp8_plan_leak.py shows it; measured on an
H200, 2026-12-02), and a cold-cache fp8_auto run planned in-process peaked 0.8-1.1 GiB above
bf16; in a child, that memory leaves with it. A run whose timings are cached (every later
start) starts no child.

What it does not see: whole-model fusion (a cast fused into the norm before it), FSDP2's float8
all-gather, and the GPU's clocks under a whole model's load; the plan is checked end to end by
benchmarks/fp8_plan.py (train.py, fp8_auto against bf16 and uniform fp8, side by side).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from mixprec.core import files
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
            model(x)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    if groups is not None:
        groups.extend(readers for _, readers in inputs if len(readers) > 1)
    return {n: tuple(v) for n, v in found.items()}


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

    def us(self, reps: int = 20) -> float:
        """GPU microseconds of one step: the median of three runs of `reps` replays (the host's
        launch overhead, amortised in a whole model's compiled step, is not counted); then the
        graph's private pool is given back."""
        runs = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                self.replay()
            end.record()
            end.synchronize()
            runs.append(1000 * start.elapsed_time(end) / reps)
        if self.graph is not None:
            self.graph.reset()
        return sorted(runs)[1]


def time_gemm(gemms: tuple[Gemm, ...], recipe: str, compiled: bool, device: torch.device) -> float:
    """Microseconds of GPU time for one gemm_step, compiled, captured and replayed at once."""
    return Captured.of(gemm_step(gemms, recipe, compiled, device)).us()


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
    """{key: microseconds} in one JSON file (None: nothing kept); a file that cannot be read
    is started over, one that cannot be written only warns."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(os.path.expanduser(path)) if path else None
        self.data: dict[str, float] = {}
        if self.path is not None and self.path.is_file():
            try:
                self.data = dict(json.loads(self.path.read_text()))
            except (OSError, ValueError, TypeError):
                log.warning("fp8 plan: %s cannot be read; measuring again", self.path)

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            files.write_json(self.path, dict(sorted(self.data.items())))
        except (OSError, MixprecError) as e:  # (a full disk or a read-only cache: DiskFull, ...)
            log.warning("fp8 plan: the timings could not be cached in %s (%s)", self.path, e)


def cache_key(gemms, recipe: str, compiled: bool, device: torch.device) -> str:
    """The GPU, torch, torchao, the shape (a Gemm, or the Gemms of Linears that read one input),
    the recipe and how it was timed: what a timing depends on."""
    gemms = (gemms,) if isinstance(gemms, Gemm) else tuple(gemms)
    shape = "&".join(g.key() for g in gemms)
    how = ("compiled-static" if compiled else "eager") + "+cudagraph"  # how it was timed
    return f"{machine(device)}|{shape}|{recipe}|{how}"


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


def processes() -> int:
    """How many timing processes a plan starts: one per 4 CPU cores, at most 4 (the float8
    timings' cost is compiling them, on the CPU; their GPU time is a few ms each)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class Child:
    """A process the timings run in, on the run's GPU. Started before the data and the model
    are built (Plugin.warm_up), it imports torch and torchao and compiles a throwaway float8
    Linear meanwhile (the compile stack's first-use costs: inductor, Triton, its workers),
    then waits for its share of the shapes on its stdin. It compiles and captures each, says
    "ready", and times them when told "go": the children compile at once, and time one after
    another, so no timing shares the GPU. `close()` ends it, and so does the training
    process's end (its stdin closes). A process group of its own, so its compile workers end
    with it."""

    def __init__(self, device: torch.device, compiled: bool, threads: int | None = None) -> None:
        if device.type == "cuda" and device.index is None:  # the child's GPU: this process's
            device = torch.device("cuda", torch.cuda.current_device())
        setup = json.dumps({"compiled": compiled, "device": str(device)})
        env = dict(os.environ)
        if threads:  # inductor's compile workers: the children share the cores
            env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mixprec.precision.fp8_plan", setup],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
        self._finalizer = weakref.finalize(self, _end, self.proc)

    def send(self, todo: list) -> None:
        """Its share: (shapes, recipe) pairs to compile and capture now."""
        job = [[[[g.m, g.k, g.n, g.bias] for g in shapes], recipe] for shapes, recipe in todo]
        self._say(json.dumps({"todo": job}))

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


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            stream.close()


def start_children(device: torch.device, compiled: bool, n: int | None = None) -> list[Child]:
    """`n` timing processes (processes()), inductor's compile workers shared between them."""
    n = n or processes()
    threads = max(1, (os.cpu_count() or 1) // n) if n > 1 else None
    return [Child(device, compiled, threads) for _ in range(n)]


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
    children = list(children or start_children(device, compiled))
    out: list = [None] * len(todo)
    try:
        shares = [(c, idx) for c, idx in zip(children, deal(todo, len(children))) if idx]
        for child, idx in shares:
            child.send([todo[i] for i in idx])
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
    """`python -m mixprec.precision.fp8_plan '{compiled, device}'` < {todo}, go: warm up, then
    compile and capture each (shapes, recipe) of the todo, print "ready", and on "go" time them
    and print {"us": [...]} (Child's other end)."""
    setup = json.loads(sys.argv[1])
    device, compiled = torch.device(setup["device"]), setup["compiled"]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    started = time.perf_counter()
    if compiled and device.type == "cuda":  # (skipped when the shapes came first, the plan
        _warm_up(device)  # took 19.8 s against 17.7 on the 8B slice: H200, 2026-12-03)
        print(f"fp8 plan: warmed up in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    line = sys.stdin.readline()
    if not line:  # not needed after all (every timing cached; a resumed plan)
        return
    todo = json.loads(line)["todo"]
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
    print(f"fp8 plan: timed {len(us)} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    print(json.dumps({"us": us}), flush=True)


class _Warm(nn.Module):
    """A small float8 Linear compiled before the shapes arrive: the compile stack's first-use
    costs (inductor, Triton, its worker pool, the float8 GEMM's first launch) are paid while the
    training process builds its data and model."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.layer = nn.Linear(256, 256, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _warm_up(device: torch.device) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    warm = convert_to_float8_training(
        _Warm(device), config=Float8LinearConfig.from_recipe_name("tensorwise")
    )
    run = torch.compile(warm, dynamic=False)
    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = run(x)
    y.sum().backward()
    torch.cuda.synchronize(device)


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


if __name__ == "__main__":
    _child()

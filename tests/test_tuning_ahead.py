"""Coordinate-descent tuning with its candidates compiled ahead (tuning_ahead.py): inductor's
own tuner walks a made-up timing surface; the walk must choose and time exactly what it does
without the wrapper, and every config it compiles after the baseline must have been sent
ahead. The worker side runs in real spawned processes. (The GPU run: benchmarks/startup.py.)"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from mixprec.internals import tuning_ahead, tuning_policy, tuning_workers

triton = pytest.importorskip("triton")
cd = pytest.importorskip("torch._inductor.runtime.coordinate_descent_tuner")


def beneath(method):
    """inductor's own method beneath mixprec's wrappers: a test that compiled a model in this
    process (compiling.compiled) has run tuning_ahead.apply(), and wrapping twice counts twice."""
    return inspect.unwrap(method, stop=lambda f: not getattr(f, "_mixprec_ahead", False))


def cost(config) -> float:
    """A bowl with its floor at XBLOCK=256, num_warps=8 (ms)."""
    x, w = config.kwargs["XBLOCK"], config.num_warps
    return 1.0 + (x.bit_length() - 9) ** 2 * 0.1 + (w.bit_length() - 4) ** 2 * 0.05


def walk(ahead: bool, monkeypatch, compiled: list, pool=None, scale: float = 1.0, workers=8):
    """Tune from XBLOCK=32, num_warps=1 as inductor would (timings in ms times `scale`);
    returns (best, benchmarked)."""
    tuner = cd.CoordescTuner(name="k", size_hints={"x": 1 << 16})
    benchmarked = []

    def func(config):  # inductor's benchmark_one_config: compile, then time
        benchmarked.append(tuning_ahead._key(config))
        return cost(config) * scale

    def original(self, launcher, *args, **kwargs):
        return tuner.autotune(func, launcher.config, None)

    call_func = beneath(cd.CoordescTuner.call_func)
    if ahead:
        monkeypatch.setattr(cd.CoordescTuner, "call_func", tuning_ahead._call_func(call_func))
        monkeypatch.setattr(tuning_workers, "_pool", [pool])
        monkeypatch.setattr(tuning_workers, "_workers", [workers])
        monkeypatch.setattr(tuning_ahead, "_inflight", [0])
        monkeypatch.setattr(tuning_ahead, "_waiting", {})
        monkeypatch.setattr(tuning_workers, "compile_config", lambda p, n, c: compiled.append(c))
        tuning = tuning_ahead._tuning(original)
    else:
        tuning = original
    kernel = NS(filename=__file__, inductor_meta={"kernel_name": "k"})
    start = triton.Config({"XBLOCK": 32}, num_warps=1)
    best = tuning(kernel, NS(config=start))
    return tuning_ahead._key(best), benchmarked


class Inline:
    """A pool whose workers are instant: each job is done when submitted."""

    def submit(self, fn, *args):
        future = cf.Future()
        future.set_running_or_notify_cancel()
        future.set_result(fn(*args))
        return future


def test_the_walk_is_inductors_own_and_what_it_compiles_was_sent_ahead(monkeypatch):
    best, plain = walk(False, monkeypatch, [])
    compiled: list = []
    before = dict(tuning_ahead.stats)
    best_ahead, benchmarked = walk(True, monkeypatch, compiled, Inline())
    assert best_ahead == best and benchmarked == plain  # the same choice, the same benchmarks
    assert best == tuning_ahead._key(triton.Config({"XBLOCK": 256}, num_warps=8))
    sent = [tuning_ahead._key(c) for c in compiled]
    assert len(sent) == len(set(sent))  # each config sent once
    assert set(benchmarked[1:]) <= set(sent)  # every candidate was compiled ahead
    assert tuning_ahead.stats["kernels"] == before["kernels"] + 1
    assert tuning_ahead.stats["ready"] - before["ready"] == len(benchmarked) - 1


def test_a_tiny_kernel_keeps_its_starting_config_untuned(monkeypatch):
    """A kernel under min_ms() at its starting config: only that config is benchmarked and
    none compiled ahead; the walk ends where it started. MIXPREC_TUNING_MIN_MS moves the line."""
    compiled: list = []
    scale = tuning_policy.MIN_MS / 3  # the start costs 2.35 units: under MIN_MS
    best, benchmarked = walk(True, monkeypatch, compiled, Inline(), scale)
    start = tuning_ahead._key(triton.Config({"XBLOCK": 32}, num_warps=1))
    assert best == start and benchmarked == [start] and compiled == []
    best, benchmarked = walk(True, monkeypatch, compiled, Inline(), scale * 10)
    assert best != start and len(benchmarked) > 1  # over the line: tuned
    monkeypatch.setenv(tuning_policy.MIN_MS_ENV, "0")  # tune every kernel
    best, benchmarked = walk(True, monkeypatch, [], Inline(), scale)
    assert best != start and len(benchmarked) > 1


def test_a_kernel_first_launched_while_evaluating_keeps_its_start_and_tunes_later(monkeypatch):
    """Inside untuned() (a compiled model evaluating) a kernel's first launch walks nothing and
    keeps its starting launcher; launched again outside, it walks as inductor would."""
    before = tuning_ahead.stats["untuned"]
    kernel = NS(filename=__file__, inductor_meta={"kernel_name": "k"})
    launcher = NS(config=triton.Config({"XBLOCK": 32}, num_warps=1))
    tuning = tuning_ahead._tuning(lambda *args: pytest.fail("the walk ran"))
    with tuning_policy.untuned():
        assert tuning(kernel, launcher) is launcher
    assert tuning_ahead.stats["untuned"] == before + 1
    best, benchmarked = walk(True, monkeypatch, [], Inline())
    assert best == tuning_ahead._key(triton.Config({"XBLOCK": 256}, num_warps=8))
    assert benchmarked


def test_the_tuning_line_from_the_environment(monkeypatch, caplog):
    monkeypatch.setenv(tuning_policy.MIN_MS_ENV, "0.1")
    assert tuning_policy.min_ms() == 0.1
    for bad in ("-1", "fast"):
        monkeypatch.setenv(tuning_policy.MIN_MS_ENV, bad)
        assert tuning_policy.min_ms() == tuning_policy.MIN_MS
        assert f"MIXPREC_TUNING_MIN_MS={bad!r} is not a number >= 0" in caplog.text


class OnDemand:
    """A pool whose jobs finish only when someone waits for them; it records how many were
    in flight (sent, not finished) at most."""

    def __init__(self) -> None:
        self.inflight = self.most = 0

    def submit(self, fn, *args):
        pool = self

        class Job(cf.Future):
            def result(self, timeout=None):
                if not self.done():
                    self.set_running_or_notify_cancel()
                    pool.inflight -= 1
                    self.set_result(fn(*args))
                return super().result(timeout)

        self.inflight += 1
        self.most = max(self.most, self.inflight)
        return Job()


def test_no_more_in_flight_than_workers_and_a_queued_candidate_is_compiled_by_the_walk(
    monkeypatch,
):
    """Two workers: at most two compiles are in flight; the walk waits for a candidate in
    flight, and compiles one still queued itself (not sent later); its choices stay."""
    best, plain = walk(False, monkeypatch, [])
    compiled: list = []
    pool = OnDemand()
    before = dict(tuning_ahead.stats)
    best_ahead, benchmarked = walk(True, monkeypatch, compiled, pool, workers=2)
    assert best_ahead == best and benchmarked == plain
    assert pool.most == 2
    waited = tuning_ahead.stats["ready"] - before["ready"]
    assert 0 < waited < len(benchmarked) - 1  # some found in flight, the rest compiled inline
    assert len(compiled) == waited  # a job runs only when waited for: nothing sent twice


class Recording(OnDemand):
    """OnDemand, recording the configs sent, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list = []

    def submit(self, fn, *args):
        self.sent.append(args[-1])
        return super().submit(fn, *args)


class RecordingInline(Inline):
    """Inline (workers that are instant), recording the configs sent, in order."""

    def __init__(self) -> None:
        self.sent: list = []

    def submit(self, fn, *args):
        self.sent.append(args[-1])
        return super().submit(fn, *args)


def compiled_kernel(name: str, start, launchers: int = 1, tuner_on: bool = True, tuned=False):
    """What inductor's precompile leaves: a kernel of `launchers` compiled configs."""
    start.found_by_coordesc = tuned
    meta = {"kernel_name": name, "coordinate_descent_tuning": tuner_on}
    tuner = cd.CoordescTuner(name=name, size_hints={"x": 1 << 16})
    return NS(
        filename=__file__,
        inductor_meta=meta,
        coordesc_tuner=tuner,
        launchers=[NS(config=start)] * launchers,
    )


def pool_of(monkeypatch, pool, workers: int) -> None:
    monkeypatch.setattr(tuning_workers, "compile_config", lambda p, n, c: None)
    monkeypatch.setattr(tuning_workers, "_pool", [pool])
    monkeypatch.setattr(tuning_workers, "_workers", [workers])
    monkeypatch.setattr(tuning_ahead, "_inflight", [0])
    monkeypatch.setattr(tuning_ahead, "_waiting", {})
    monkeypatch.setattr(tuning_ahead, "_current", [None])


def test_a_kernel_compiled_before_its_launch_has_its_first_round_ready_when_its_walk_begins(
    monkeypatch,
):
    """Registered when inductor compiled it, the kernel's first round (the starting config's
    neighbours) is compiled by idle workers; its walk then finds every one of them ready, and
    still chooses and times what inductor alone does."""
    best, plain = walk(False, monkeypatch, [])
    pool = RecordingInline()
    pool_of(monkeypatch, pool, 8)
    start = triton.Config({"XBLOCK": 32}, num_warps=1)
    kernel = compiled_kernel("k", start)
    tuning_ahead._register(kernel)  # compiled (instantly) before the kernel launches
    first = [tuning_ahead._key(c) for c in tuning_ahead._neighbours(kernel.coordesc_tuner, start)]
    assert first and [tuning_ahead._key(c) for c in pool.sent] == first
    before = dict(tuning_ahead.stats)
    benchmarked = []

    def func(config):
        benchmarked.append(tuning_ahead._key(config))
        return cost(config)

    monkeypatch.setattr(
        cd.CoordescTuner, "call_func", tuning_ahead._call_func(beneath(cd.CoordescTuner.call_func))
    )
    tuning = tuning_ahead._tuning(
        lambda self, launcher: self.coordesc_tuner.autotune(func, launcher.config, None)
    )
    assert tuning_ahead._key(tuning(kernel, NS(config=start))) == best and benchmarked == plain
    assert set(first) <= set(benchmarked)  # the walk used the whole first round
    assert tuning_ahead.stats["ready"] - before["ready"] == len(benchmarked) - 1
    assert len(pool.sent) == len({tuning_ahead._key(c) for c in pool.sent})  # none sent twice
    assert tuning_ahead._waiting == {}


def test_the_kernel_being_tuned_goes_first_and_first_rounds_fill_free_workers(monkeypatch):
    """Two workers, a walk with two compiles queued, a kernel compiled meanwhile: the walk's
    are sent, the new kernel's first round waits; when a worker is free it goes there."""
    pool = Recording()
    pool_of(monkeypatch, pool, 2)
    walking = tuning_ahead._Ahead(__file__, "walking")
    walking.queue = [("a", "config a"), ("b", "config b")]
    tuning_ahead._current[0] = walking
    tuning_ahead._register(compiled_kernel("next", triton.Config({"XBLOCK": 32}, num_warps=1)))
    assert pool.sent == ["config a", "config b"]
    walking.running["a"].result()  # a worker is free
    assert len(pool.sent) == 3 and pool.sent[2].kwargs["XBLOCK"] in (16, 64)
    walking.queue = [("c", "config c")]  # the walk's best moved: its next goes before the rest
    walking.running["b"].result()
    assert pool.sent[3] == "config c" and pool.most == 2


@pytest.mark.parametrize(
    "why",
    ["tuned", "two configs", "tuner off", "evaluating"],
    ids=["warm", "autotuned", "off", "evaluating"],
)
def test_a_kernel_that_will_not_walk_queues_nothing(monkeypatch, why):
    """A kernel whose tuned config came from the cache (a warm start), one of several configs
    (autotuning picks the start at launch), with the tuner off, or compiled for an evaluation
    (its launches are untuned): nothing queued or sent. The last one started 14 idle workers
    in a warm run on the H200, whose evaluation kernels were loaded untuned from the cache."""
    pool = Recording()
    pool_of(monkeypatch, pool, 4)
    start = triton.Config({"XBLOCK": 32}, num_warps=1)
    kwargs = {"tuned": {"tuned": True}, "two configs": {"launchers": 2}}.get(why, {})
    kernel = compiled_kernel("k", start, tuner_on=why != "tuner off", **kwargs)
    if why == "evaluating":
        with tuning_policy.untuned():
            tuning_ahead._register(kernel)
    else:
        tuning_ahead._register(kernel)
    assert tuning_ahead._waiting == {} and pool.sent == []


@pytest.mark.slow
def test_the_pool_starts_when_inductor_lowers_a_graph_with_the_tuner_on(monkeypatch, tmp_path):
    """A cache miss (inductor lowers the graph) with coordinate-descent tuning on starts the
    workers; the tuner off, or the same graph from inductor's cache (a warm start), does not."""
    import torch
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    started: list = []
    monkeypatch.setattr(tuning_workers, "start", lambda then=None: started.append(then))
    hooked = tuning_ahead._lowering(beneath(GraphLowering.__init__), config)
    monkeypatch.setattr(GraphLowering, "__init__", hooked)

    def compile_once(tuner_on: bool, scale: float) -> None:
        torch._dynamo.reset()
        fn = torch.compile(
            lambda x: (x * scale).relu(), options={"coordinate_descent_tuning": tuner_on}
        )
        fn(torch.ones(8))

    compile_once(False, 2.0)
    assert started == []  # tuner off
    with tuning_policy.untuned():
        compile_once(True, 4.0)
    assert started == []  # lowered for an evaluation: its kernels will not walk
    compile_once(True, 3.0)
    assert started == [tuning_ahead._pump]
    compile_once(True, 3.0)  # the same graph again: from the cache, nothing lowered
    assert started == [tuning_ahead._pump]


def test_workers_from_the_environment(monkeypatch, caplog):
    monkeypatch.setenv(tuning_workers.ENV, "3")
    assert tuning_workers.workers() == 3
    monkeypatch.setenv(tuning_workers.ENV, "0")
    assert tuning_workers.workers() == 0
    monkeypatch.setenv(tuning_workers.ENV, "many")
    assert tuning_workers.workers() == 0 and "MIXPREC_TUNING_WORKERS='many'" in caplog.text
    monkeypatch.delenv(tuning_workers.ENV)
    from torch._inductor import config

    # config.patch, inductor's own: pytest's monkeypatch undoes by deleting the key from
    # inductor's config, and later compiles in this process fail on it
    with config.patch(compile_threads=16):
        assert tuning_workers.workers() == 14
    with config.patch(compile_threads=64):
        assert tuning_workers.workers() == 16
    with config.patch(compile_threads=1):
        assert tuning_workers.workers() == 0
    with config.patch(compile_threads=16):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: two ranks share the host
        assert tuning_workers.workers() == 6
    assert config.compile_threads >= 1  # still there


KERNEL_FILE = """
class Kernel:
    def _precompile_config(self, config):
        with open({out!r}, "a") as f:
            f.write(f"{{config.kwargs['XBLOCK']}} {{config.num_warps}}\\n")
k = Kernel()
"""


def _pid() -> int:
    return os.getpid()


def gone(pid: int) -> bool:
    """The process has ended (no longer there, or a zombie its parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_a_worker_compiles_from_inductors_file_and_ignores_a_group_ctrl_c(tmp_path, monkeypatch):
    """The real pool: forked workers load the kernel's file and compile the config they were
    sent; a SIGINT (a terminal's Ctrl-C reaches the whole group) leaves them working. At exit
    the workers and the server they were forked from end at once (left alone, the server would
    notice the trainer had gone and tear down an interpreter holding torch, keeping the
    trainer's stdout open about a second longer)."""
    out = tmp_path / "compiled.txt"
    path = tmp_path / "kernel.py"
    path.write_text(KERNEL_FILE.format(out=str(out)))
    monkeypatch.setenv(tuning_workers.ENV, "1")
    monkeypatch.setattr(tuning_workers, "_pool", [None])
    monkeypatch.setattr(tuning_workers, "_workers", [0])
    tuning_workers._start()  # as start() does, in a thread
    pool = tuning_workers.get()
    assert tuning_workers.size() == 1
    try:
        pool.submit(
            tuning_workers.compile_config, str(path), "k", triton.Config({"XBLOCK": 64}, 2)
        ).result(timeout=120)
        pid = pool.submit(_pid).result(timeout=60)
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        pool.submit(
            tuning_workers.compile_config, str(path), "k", triton.Config({"XBLOCK": 8}, 4)
        ).result(timeout=60)
        assert pool.submit(_pid).result(timeout=60) == pid  # the same worker, alive
        from multiprocessing import forkserver

        server = forkserver._forkserver._forkserver_pid
        assert server and not gone(server)
    finally:
        tuning_workers.stop(pool)  # at exit: the workers are killed, not waited for
    for _ in range(100):
        if gone(pid) and gone(server):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"outlived stop(): worker {not gone(pid)}, server {not gone(server)}")
    assert out.read_text().split("\n")[:2] == ["64 2", "8 4"]
    monkeypatch.setattr(tuning_workers, "_pool", [None])  # a later pool: a new server
    tuning_workers._start()
    again = tuning_workers.get()
    try:
        assert again is not None and again.submit(_pid).result(timeout=60) != pid
    finally:
        tuning_workers.stop(again)


def test_without_a_forkserver_tuning_compiles_in_the_loop(monkeypatch, caplog):
    """A platform without the forkserver start method (Windows): a warning, no pool, and the
    walk left to compile as inductor does."""

    def no_forkserver(method=None):
        raise ValueError(f"cannot find context for {method!r}")

    monkeypatch.setattr(tuning_workers.multiprocessing, "get_context", no_forkserver)
    monkeypatch.setattr(tuning_workers, "_pool", [None])
    monkeypatch.setenv(tuning_workers.ENV, "2")
    tuning_workers._start()
    assert tuning_workers.get() is None and "no compile workers" in caplog.text


@pytest.mark.slow
def test_every_patch_of_private_internals_has_its_switch():
    """MIXPREC_PATCHES_OFF switches each patch off in a fresh process: inductor's tuner and
    recheck stay torch's own, and no exit handler of mixprec's is registered."""
    import subprocess
    import sys

    code = """
import atexit, sys
from torch._inductor.runtime import coordinate_descent_tuner as cd, triton_heuristics as th
before = (th.CachingAutotuner.recheck_autotune_cache, cd.CoordescTuner.call_func)
from mixprec.internals import inductor_fix, quick_exit, tuning_ahead
quick_exit.install()
print(inductor_fix.apply(), tuning_ahead.apply(), atexit._ncallbacks(),
      before == (th.CachingAutotuner.recheck_autotune_cache, cd.CoordescTuner.call_func))
"""

    def run(off: str) -> list[str]:
        env = {**os.environ, "MIXPREC_PATCHES_OFF": off, "MIXPREC_TUNING_WORKERS": "2"}
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout.split()

    off = run("all")
    assert off[:2] == ["False", "False"] and off[3] == "True"
    on = run("")
    assert on[1] == "True" and on[3] == "False"  # the tuner is wrapped when the switch is on
    without_exit = run("quick_exit")  # one name switches one patch: the tuner is still wrapped
    assert without_exit[1] == "True" and int(on[2]) == int(without_exit[2]) + 1


def test_a_patch_on_a_torch_it_was_not_written_for_does_nothing_and_says_so_once(
    monkeypatch, caplog
):
    import logging

    import torch

    from mixprec import internals

    monkeypatch.delenv(internals.SWITCH, raising=False)
    monkeypatch.setattr(internals, "_said", set())
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    assert internals.enabled("tuning_ahead")  # a version it was tested on
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with caplog.at_level(logging.INFO, logger="mixprec"):
        assert not internals.enabled("tuning_ahead") and not internals.enabled("tuning_ahead")
    said = [r.message for r in caplog.records if "tuning_ahead is off" in r.message]
    assert said == [
        "tuning_ahead is off (written for torch 2.11, 2.12, 2.13, 2.14; this is torch 2.99)"
    ]
    monkeypatch.setattr(internals, "GATES", {**internals.GATES, "quick_exit": ("python", ("2.7",))})
    assert not internals.enabled("quick_exit")  # a Python it was not written for

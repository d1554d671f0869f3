"""Coordinate-descent tuning with its candidates compiled ahead (tuning_ahead.py): inductor's
own tuner walks a made-up timing surface; the walk must choose and time exactly what it does
without the wrapper, and every config it compiles after the baseline must have been sent
ahead. The worker side runs in real spawned processes. (The GPU run: benchmarks/startup.py.)"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from types import SimpleNamespace as NS

import pytest

from mixprec import tuning_ahead

triton = pytest.importorskip("triton")
cd = pytest.importorskip("torch._inductor.runtime.coordinate_descent_tuner")


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

    call_func = cd.CoordescTuner.call_func
    if ahead:
        monkeypatch.setattr(cd.CoordescTuner, "call_func", tuning_ahead._call_func(call_func))
        monkeypatch.setattr(tuning_ahead, "_pool", [pool])
        monkeypatch.setattr(tuning_ahead, "_workers", [workers])
        monkeypatch.setattr(tuning_ahead, "_inflight", [0])
        monkeypatch.setattr(tuning_ahead, "_compile", lambda p, n, c: compiled.append(c))
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
    """A kernel under TINY_MS at its starting config: only that config is benchmarked and
    none compiled ahead; the walk ends where it started."""
    compiled: list = []
    scale = tuning_ahead.TINY_MS / 3  # the start costs 2.35 units: under TINY_MS
    best, benchmarked = walk(True, monkeypatch, compiled, Inline(), scale)
    start = tuning_ahead._key(triton.Config({"XBLOCK": 32}, num_warps=1))
    assert best == start and benchmarked == [start] and compiled == []
    best, benchmarked = walk(True, monkeypatch, compiled, Inline(), scale * 10)
    assert best != start and len(benchmarked) > 1  # over the line: tuned


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


def test_workers_from_the_environment(monkeypatch, caplog):
    monkeypatch.setenv(tuning_ahead.ENV, "3")
    assert tuning_ahead.workers() == 3
    monkeypatch.setenv(tuning_ahead.ENV, "0")
    assert tuning_ahead.workers() == 0
    monkeypatch.setenv(tuning_ahead.ENV, "many")
    assert tuning_ahead.workers() == 0 and "MIXPREC_TUNING_WORKERS='many'" in caplog.text
    monkeypatch.delenv(tuning_ahead.ENV)
    from torch._inductor import config

    monkeypatch.setattr(config, "compile_threads", 16)
    assert tuning_ahead.workers() == 14
    monkeypatch.setattr(config, "compile_threads", 64)
    assert tuning_ahead.workers() == 16
    monkeypatch.setattr(config, "compile_threads", 1)
    assert tuning_ahead.workers() == 0
    monkeypatch.setattr(config, "compile_threads", 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: two ranks share the host
    assert tuning_ahead.workers() == 6


KERNEL_FILE = """
class Kernel:
    def _precompile_config(self, config):
        with open({out!r}, "a") as f:
            f.write(f"{{config.kwargs['XBLOCK']}} {{config.num_warps}}\\n")
k = Kernel()
"""


def _pid() -> int:
    return os.getpid()


def test_a_worker_compiles_from_inductors_file_and_ignores_a_group_ctrl_c(tmp_path, monkeypatch):
    """The real pool: spawned workers load the kernel's file and compile the config they were
    sent; a SIGINT (a terminal's Ctrl-C reaches the whole group) leaves them working."""
    out = tmp_path / "compiled.txt"
    path = tmp_path / "kernel.py"
    path.write_text(KERNEL_FILE.format(out=str(out)))
    monkeypatch.setenv(tuning_ahead.ENV, "1")
    monkeypatch.setattr(tuning_ahead, "_pool", [None])
    monkeypatch.setattr(tuning_ahead, "_workers", [0])
    tuning_ahead._start()  # as the first tuning does, in a thread
    pool = tuning_ahead._pool[0]
    assert tuning_ahead._workers == [1]
    try:
        pool.submit(tuning_ahead._compile, str(path), "k", triton.Config({"XBLOCK": 64}, 2)).result(
            timeout=120
        )
        pid = pool.submit(_pid).result(timeout=60)
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        pool.submit(tuning_ahead._compile, str(path), "k", triton.Config({"XBLOCK": 8}, 4)).result(
            timeout=60
        )
        assert pool.submit(_pid).result(timeout=60) == pid  # the same worker, alive
    finally:
        tuning_ahead._stop(pool)  # at exit: the workers are killed, not waited for
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the worker outlived _stop")
    assert out.read_text().split("\n")[:2] == ["64 2", "8 4"]


def test_without_a_forkserver_tuning_compiles_in_the_loop(monkeypatch, caplog):
    """A platform without the forkserver start method (Windows): a warning, no pool, and the
    walk left to compile as inductor does."""

    def no_forkserver(method=None):
        raise ValueError(f"cannot find context for {method!r}")

    monkeypatch.setattr(tuning_ahead.multiprocessing, "get_context", no_forkserver)
    monkeypatch.setattr(tuning_ahead, "_pool", [None])
    monkeypatch.setenv(tuning_ahead.ENV, "2")
    tuning_ahead._start()
    assert tuning_ahead._pool == [None] and "no compile workers" in caplog.text

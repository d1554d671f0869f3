"""Coordinate-descent tuning with its next candidates compiled ahead, in worker processes.

inductor's coordinate-descent tuner (model.compile_options.coordinate_descent_tuning, on in
experiment=fast) walks each Triton kernel's block sizes and warp count one field at a time:
each candidate config is compiled by Triton (~0.2 s), then benchmarked (~0.025 s), one after
another. On a new machine that walk was most of experiment=fast's first step (236 of 293 s on
an H200, benchmarks/RESULTS.md). The walk cannot run in parallel (each step depends on the
last timing), but what it will try next is known: the neighbours, in every field, of the best
config so far. `apply()` wraps the tuner so that whenever the best changes, those neighbours
and theirs are compiled in a pool of worker processes (Triton writes each into its file
cache); when the walk reaches one, Triton's compile there is a cache hit. The walk and its
benchmarks are inductor's own; one choice differs: a kernel whose starting config runs in
under TINY_MS keeps it (tuning such a kernel bought 0.015 ms of a 64 ms step, for 16 s).

Workers: MIXPREC_TUNING_WORKERS (0 turns all of this off), by default inductor's
compile_threads (shared among torchrun's processes on the host) less 2, at most 16. They are
forked from one server process (multiprocessing's forkserver: no CUDA context, no inherited
signal handlers, torch imported once), ignore SIGINT (a Ctrl-C to the process group is the
trainer's to handle) and die with that server."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import importlib.util
import logging
import multiprocessing
import os
import signal
import threading

log = logging.getLogger("mixprec.models")
ENV = "MIXPREC_TUNING_WORKERS"
# imported once by the forkserver (the entrypoint too, as multiprocessing does for each child)
PRELOAD = ["__main__", "torch._inductor.runtime.triton_heuristics"]
TINY_MS = 0.02  # a kernel faster than this at its starting config is not tuned
_current: list = [None]  # the _Ahead of the kernel being tuned (kernels tune one at a time)
_lock = threading.RLock()  # the queues and the count in flight (callbacks come from the pool)
_inflight, _workers = [0], [0]
_pool: list = []  # [the pool once its workers are up, or None]; empty until first asked for
_loaded: dict[tuple[str, str], object] = {}  # in a worker: (file, kernel name) -> its autotuner
# tuned walks, tiny ones left untuned, configs sent ahead, found compiled when the walk came
stats = {"kernels": 0, "tiny": 0, "sent": 0, "ready": 0}


def workers() -> int:
    """How many worker processes compile ahead (0: none); by default the host's share of one
    process among torchrun's LOCAL_WORLD_SIZE on this host."""
    raw = os.environ.get(ENV, "").strip()
    if raw:
        try:
            return max(0, int(raw))
        except ValueError:
            log.warning("%s=%r is not a whole number: tuning compiles in the loop", ENV, raw)
            return 0
    from torch._inductor import config

    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(0, min(16, int(config.compile_threads) // ranks - 2))


def apply() -> bool:
    """Wrap inductor's coordinate-descent tuner (once); False where this torch lacks the
    methods it wraps or workers() is 0."""
    try:
        from torch._inductor.runtime import coordinate_descent_tuner as cd
        from torch._inductor.runtime import triton_heuristics as th
    except ImportError:
        return False
    kernel_cls, tuner_cls = th.CachingAutotuner, cd.CoordescTuner
    uses = [(kernel_cls, "coordinate_descent_tuning"), (tuner_cls, "call_func")]
    uses += [(tuner_cls, "lookup_in_cache"), (cd, "get_field"), (cd, "set_field")]
    if not all(hasattr(owner, name) for owner, name in uses):
        return False
    if getattr(kernel_cls.coordinate_descent_tuning, "_mixprec_ahead", False):
        return True
    if workers() == 0:
        return False
    kernel_cls.coordinate_descent_tuning = _tuning(kernel_cls.coordinate_descent_tuning)
    tuner_cls.call_func = _call_func(tuner_cls.call_func)
    return True


def _tuning(original):
    """CachingAutotuner.coordinate_descent_tuning with this kernel's compiling done ahead."""

    def coordinate_descent_tuning(self, launcher, *args, **kwargs):
        pool = _the_pool()
        path, name = getattr(self, "filename", None), self.inductor_meta.get("kernel_name")
        if pool is None or not path or not name or not os.path.exists(path):
            return original(self, launcher, *args, **kwargs)
        ahead = _current[0] = _Ahead(pool, path, name)
        stats["kernels"] += 1
        try:
            return original(self, launcher, *args, **kwargs)
        finally:
            ahead.close()
            _current[0] = None

    coordinate_descent_tuning._mixprec_ahead = True
    return coordinate_descent_tuning


def _call_func(original):
    """CoordescTuner.call_func (benchmark one config, or its cached timing): waits for the
    config's compile ahead, and after a new best sends its neighbours ahead."""

    def call_func(tuner, func, config):
        ahead = _current[0]
        if ahead is None or tuner.lookup_in_cache(config) is not None:
            return original(tuner, func, config)
        if ahead.tiny:  # the starting config stays: every other one "fails", uncompiled
            return float("inf")
        ahead.wait_for(config)
        timing = original(tuner, func, config)
        ahead.seen(tuner, config, timing)
        return timing

    return call_func


class _Ahead:
    """The compiles sent ahead for one kernel's walk: a queue in the order the walk will need
    them, fed to the pool so that no more are in flight than it has workers (what waits in
    the queue can still be reordered or dropped when the best changes)."""

    def __init__(self, pool: cf.ProcessPoolExecutor, path: str, name: str) -> None:
        self.pool, self.path, self.name = pool, path, name
        self.queue: list[tuple[object, object]] = []  # (key, config), the next first
        self.running: dict[object, cf.Future] = {}
        self.done: set = set()
        self.best: float | None = None
        self.tiny = self.closed = False

    def wait_for(self, config) -> None:
        """Before the walk compiles `config`: compiled ahead, or being compiled (then wait:
        the walk's compile is a cache hit either way); still queued, the walk compiles it."""
        key = _key(config)
        with _lock:
            future = self.running.get(key)
            if future is None:
                self.queue = [(k, c) for k, c in self.queue if k != key]
                stats["ready"] += key in self.done
                return
        try:
            future.result(timeout=120)
            stats["ready"] += 1
        except Exception:  # a failed compile ahead: the walk compiles (and reports) it
            pass

    def seen(self, tuner, config, timing: float) -> None:
        """After the walk timed `config`: if it is the new best, queue its neighbours (the
        walk's next steps while it stays best), then theirs (after the next improvement)."""
        if self.best is None and timing < TINY_MS:
            self.tiny = True
            stats["tiny"] += 1
            return
        if self.best is not None and not tuner.has_improvement(self.best, timing):
            return
        self.best = timing
        near = _neighbours(tuner, config)
        far = [c for n in near for c in _neighbours(tuner, n)]
        wanted = {_key(c): c for c in [*near, *far]}
        with _lock:
            skip = self.done | set(self.running)
            self.queue = [(k, c) for k, c in wanted.items() if k not in skip]
            self._pump()

    def _pump(self) -> None:
        """Send queued compiles while fewer are in flight than there are workers (_lock held)."""
        while self.queue and not self.closed and _inflight[0] < _workers[0]:
            key, config = self.queue.pop(0)
            try:
                future = self.pool.submit(_compile, self.path, self.name, config)
            except RuntimeError:  # the pool broke (a worker killed): compile in the loop
                self.queue.clear()
                return
            _inflight[0] += 1
            self.running[key] = future
            stats["sent"] += 1
            future.add_done_callback(lambda f, key=key: self._finished(key, f))

    def _finished(self, key, future: cf.Future) -> None:
        with _lock:
            _inflight[0] -= 1
            self.running.pop(key, None)
            if not future.cancelled() and future.exception() is None:
                self.done.add(key)
            if _current[0] is not None:
                _current[0]._pump()  # a free worker: the kernel being tuned now sends more

    def close(self) -> None:
        with _lock:
            self.closed = True
            self.queue.clear()


def _neighbours(tuner, config) -> list:
    """The configs the walk tries next while `config` stays best: one step up and down in
    each tunable field (inductor's own neighbour rule and validity check)."""
    from torch._inductor.runtime.coordinate_descent_tuner import get_field, set_field

    valid = getattr(tuner, "is_valid_config", lambda c: True)
    out = []
    for field in tuner.tunable_fields:
        value = get_field(config, field)
        if value is None:
            continue
        for other in tuner.get_neighbour_values(field, value):
            candidate = copy.deepcopy(config)
            set_field(candidate, field, other)
            if valid(candidate) and tuner.lookup_in_cache(candidate) is None:
                out.append(candidate)
    return out


def _key(config):
    from torch._inductor.runtime.runtime_utils import triton_config_to_hashable

    return triton_config_to_hashable(config)


def _the_pool() -> cf.ProcessPoolExecutor | None:
    """The worker pool once its workers are up; None before (the first kernels tune in the
    loop while a thread starts it: the forkserver imports torch first) and where it is off.
    Started at the first tuning, so a warm start, which tunes nothing, starts none."""
    with _lock:
        if not _pool:
            _pool.append(None)
            if workers():
                threading.Thread(target=_start, name="mixprec-tuning-pool", daemon=True).start()
    return _pool[0]


def _start() -> None:
    n, pool = workers(), None
    try:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        pool = cf.ProcessPoolExecutor(n, context, _worker_init)
        for future in [pool.submit(os.getpid) for _ in range(n)]:
            future.result(timeout=300)
    except Exception as e:  # no workers (no forkserver on this OS, a broken install)
        log.warning("kernel tuning: no compile workers (%s); tuning compiles in the loop", e)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        return
    register = getattr(threading, "_register_atexit", None)
    if register is not None:  # before concurrent.futures' own exit hook, which would join them
        register(lambda: _stop(pool))
    with _lock:
        _workers[0], _pool[0] = n, pool
    log.info("kernel tuning: %d worker processes compile the next candidates ahead", n)


def _stop(pool: cf.ProcessPoolExecutor) -> None:
    """At exit: the workers only ever compile ahead; end them at once rather than wait."""
    with _lock:
        _pool[:] = [None]
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer answers a group's Ctrl-C
    try:  # die with the forkserver, which ends with the trainer (Linux)
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _compile(path: str, name: str, config) -> None:
    """In a worker: compile one config of the kernel defined in inductor's file `path` (the
    result lands in Triton's file cache, where the trainer's compile of it finds it)."""
    kernel = _loaded.get((path, name))
    if kernel is None:
        spec = importlib.util.spec_from_file_location(f"mixprec_kernel_{len(_loaded)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kernel = _loaded[(path, name)] = getattr(module, name)
    kernel._precompile_config(config)

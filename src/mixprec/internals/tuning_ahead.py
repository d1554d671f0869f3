"""Coordinate-descent tuning with its next candidates compiled ahead, in worker processes.

inductor's coordinate-descent tuner (model.compile_options.coordinate_descent_tuning, on in
experiment=fast) walks each Triton kernel's block sizes and warp count one field at a time:
each candidate config is compiled by Triton (~0.2 s), then benchmarked (~0.025 s), one after
another. On a new machine that walk was most of experiment=fast's first step (236 of 293 s on
an H200, benchmarks/RESULTS.md). The walk cannot run in parallel (each step depends on the
last timing), but what it will try next is known: the neighbours, in every field, of the best
config so far. `apply()` wraps the tuner so that whenever the best changes, those neighbours
and theirs are compiled in worker processes (tuning_workers.py; Triton writes each into its file
cache); when the walk reaches one, Triton's compile there is a cache hit. Workers left idle
compile the first round (the neighbours of the starting config) of every kernel inductor has
compiled and not yet tuned, in the order it compiled them, so a kernel's walk starts with
its first round ready. The walk and its benchmarks are inductor's own; which kernels walk at
all is tuning_policy.py's: not those faster than MIXPREC_TUNING_MIN_MS at their starting
config, nor those first launched while a compiled model evaluates.

The pool starts when inductor first lowers a graph with the tuner on (a cache miss, so there
will be kernels to tune: a warm start lowers nothing and starts none), or at the first
tuning."""

from __future__ import annotations

import copy
import functools
import logging
import threading

from mixprec import internals
from mixprec.internals import tuning_workers
from mixprec.internals.tuning_policy import min_ms, untuned_now

log = logging.getLogger("mixprec.models")
_current: list = [None]  # the _Ahead of the kernel being tuned (kernels tune one at a time)
_lock = threading.RLock()  # the queues and the count in flight (callbacks come from the pool)
_inflight = [0]
# kernels compiled and not yet tuned, in the order inductor compiled them: their first rounds
_waiting: dict[tuple[str, str], _Ahead] = {}
# tuned walks, tiny ones left untuned, configs sent ahead (of them, first rounds sent before
# their walk began), found compiled when the walk came
stats = {"kernels": 0, "tiny": 0, "sent": 0, "early": 0, "ready": 0, "untuned": 0}


def apply() -> bool:
    """Wrap inductor's coordinate-descent tuner (once): walks skipped as tuning_policy says, and
    candidates compiled ahead. False where this torch lacks the methods it wraps (nothing
    wrapped) or workers() is 0 (the walks compile in line)."""
    if not internals.enabled("tuning_ahead"):
        return False
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
        return tuning_workers.workers() > 0
    kernel_cls.coordinate_descent_tuning = _tuning(kernel_cls.coordinate_descent_tuning)
    tuner_cls.call_func = _call_func(tuner_cls.call_func)
    if hasattr(kernel_cls, "precompile"):
        kernel_cls.precompile = _precompile(kernel_cls.precompile)
    try:
        from torch._inductor import config
        from torch._inductor.graph import GraphLowering
    except ImportError:  # the pool then starts at the first tuning
        return tuning_workers.workers() > 0
    GraphLowering.__init__ = _lowering(GraphLowering.__init__, config)
    return tuning_workers.workers() > 0  # with none, each walk compiles in line


def _marked(original, wrapper):
    """`wrapper` as mixprec's wrapper of `original` (its name, and __wrapped__: tests reach
    inductor's own method beneath whatever apply() installed in their process)."""
    wrapper = functools.wraps(original)(wrapper)
    wrapper._mixprec_ahead = True
    return wrapper


def _lowering(original, config):
    """GraphLowering.__init__, which starts the pool when the tuner is on (and the graph is
    not lowered for an evaluation, whose kernels will not walk)."""

    def __init__(self, *args, **kwargs):
        if config.coordinate_descent_tuning and not untuned_now():
            tuning_workers.start(then=_pump)
        original(self, *args, **kwargs)

    return _marked(original, __init__)


def _precompile(original):
    """CachingAutotuner.precompile: a kernel just compiled, to be tuned at its first launch,
    queues its walk's first round."""

    def precompile(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if not kwargs.get("warm_cache_only", args[0] if args else False):
            try:
                _register(self)
            except Exception as e:  # this torch's autotuner differs: the walk compiles it
                log.debug("kernel tuning: %s not queued ahead (%r)", self, e)
        return out

    return _marked(original, precompile)


def _register(kernel) -> None:
    if untuned_now():  # compiled (or loaded) for an evaluation: it will not walk
        return
    launchers = getattr(kernel, "launchers", None) or []
    meta, tuner = kernel.inductor_meta or {}, getattr(kernel, "coordesc_tuner", None)
    path, name = _where(kernel)
    if len(launchers) != 1 or tuner is None or not path or not name:
        return  # several configs: autotuning picks the walk's start at launch
    tuned = getattr(launchers[0].config, "found_by_coordesc", False)
    if tuned or not meta.get("coordinate_descent_tuning"):
        return
    if not getattr(kernel, "_should_coordesc_tune", True):
        return
    ahead = _Ahead(path, name)
    ahead.queue = [(_key(c), c) for c in _neighbours(tuner, launchers[0].config)]
    with _lock:
        _waiting[(path, name)] = ahead
    tuning_workers.start(then=_pump)
    _pump()


def _where(kernel) -> tuple[str | None, str | None]:
    """(inductor's file defining the kernel, its name there): what a worker loads it by."""
    return getattr(kernel, "filename", None), (kernel.inductor_meta or {}).get("kernel_name")


def _tuning(original):
    """CachingAutotuner.coordinate_descent_tuning with this kernel's compiling done ahead."""

    def coordinate_descent_tuning(self, launcher, *args, **kwargs):
        if untuned_now():  # evaluating: this launch keeps the starting config; a later one tunes
            stats["untuned"] += 1
            return launcher
        tuning_workers.start(then=_pump)
        path, name = _where(self)
        with _lock:
            ahead = _waiting.pop((path, name), None) or _Ahead(path, name)
            inline = tuning_workers.get() is None or not path or not name
            _current[0] = None if inline else ahead
        if inline:  # no workers yet: this walk compiles in line
            ahead.close()
            return original(self, launcher, *args, **kwargs)
        stats["kernels"] += 1
        try:
            return original(self, launcher, *args, **kwargs)
        finally:
            ahead.close()
            _current[0] = None

    return _marked(original, coordinate_descent_tuning)


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

    return _marked(original, call_func)


def _pump() -> None:
    """Send queued compiles while fewer are in flight than there are workers: the kernel being
    tuned first, then the first rounds of kernels waiting for their walk, oldest first."""
    with _lock:
        pool = tuning_workers.get()
        if pool is None:
            return
        for ahead in [_current[0], *_waiting.values()]:
            if _inflight[0] >= tuning_workers.size():
                return
            if ahead is not None and not ahead.send(pool):
                return


class _Ahead:
    """The compiles sent ahead for one kernel's walk: a queue in the order the walk will need
    them, fed to the pool so that no more are in flight than it has workers (what waits in
    the queue can still be reordered or dropped when the best changes)."""

    def __init__(self, path: str, name: str) -> None:
        self.path, self.name = path, name
        self.queue: list[tuple[object, object]] = []  # (key, config), the next first
        self.running: dict = {}  # key -> its Future
        self.done: set = set()
        self.best: float | None = None
        self.tiny = self.closed = False
        self.min_ms = min_ms()

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
        if self.best is None and timing < self.min_ms:
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
        _pump()

    def send(self, pool) -> bool:
        """Send from the queue while a worker is free (_lock held); False if the pool broke."""
        while self.queue and not self.closed and _inflight[0] < tuning_workers.size():
            key, config = self.queue.pop(0)
            try:
                future = pool.submit(tuning_workers.compile_config, self.path, self.name, config)
            except RuntimeError:  # the pool broke (a worker killed): compile in the loop
                self.queue.clear()
                return False
            _inflight[0] += 1
            self.running[key] = future
            stats["sent"] += 1
            stats["early"] += self is not _current[0]
            future.add_done_callback(lambda f, key=key: self._finished(key, f))
        return True

    def _finished(self, key, future) -> None:
        with _lock:
            _inflight[0] -= 1
            self.running.pop(key, None)
            if not future.cancelled() and future.exception() is None:
                self.done.add(key)
        _pump()  # a free worker

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

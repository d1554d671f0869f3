"""The worker processes that compile Triton configs ahead of inductor's coordinate-descent
walk (tuning_ahead.py decides what they compile; this module starts, sizes and stops them).

Workers: MIXPREC_TUNING_WORKERS (0 turns compiling ahead off), by default inductor's
compile_threads (shared among torchrun's processes on the host) less 2, at most 16. They are
forked from one server process (multiprocessing's forkserver: no CUDA context, no inherited
signal handlers, torch imported once), ignore SIGINT (a Ctrl-C to the process group is the
trainer's to handle), die with that server and are killed at exit. The pool starts in a
thread (the forkserver imports torch first: several seconds), so the trainer never waits."""

from __future__ import annotations

import concurrent.futures as cf
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
_lock = threading.Lock()
_pool: list = []  # [the pool once its workers are up, or None]; empty until first asked for
_workers = [0]  # how many are up
_loaded: dict[tuple[str, str], object] = {}  # in a worker: (file, kernel name) -> its autotuner


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


def start(then=None) -> None:
    """Start the pool in a thread, once (later calls do nothing); `then()` runs when its
    workers are up."""
    with _lock:
        if _pool:
            return
        _pool.append(None)
    if workers():
        threading.Thread(
            target=_start, args=(then,), name="mixprec-tuning-pool", daemon=True
        ).start()


def get():
    """The pool once its workers are up; None before, and where it is off."""
    return _pool[0] if _pool else None


def size() -> int:
    return _workers[0]


def _start(then=None) -> None:
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
        register(lambda: stop(pool))
    with _lock:
        _workers[0], _pool[:] = n, [pool]
    log.info("kernel tuning: %d worker processes compile the next candidates ahead", n)
    if then is not None:
        then()


def stop(pool: cf.ProcessPoolExecutor) -> None:
    """At exit: the workers only ever compile ahead; end them, and the server they were forked
    from, at once. (Left to itself the server notices the trainer is gone and tears down an
    interpreter holding torch: about a second more, with the trainer's stdout still open.)"""
    with _lock:
        _pool[:] = [None]
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    manager = getattr(pool, "_executor_manager_thread", None)
    if manager is not None:  # ended before concurrent.futures' exit hook would wake it
        manager.join(timeout=2)
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
            server._stop()  # reaps it and forgets it: a later pool starts a new one
        except (AttributeError, OSError):
            pass


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer answers a group's Ctrl-C
    try:  # die with the forkserver, which ends with the trainer (Linux)
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def compile_config(path: str, name: str, config) -> None:
    """In a worker: compile one config of the kernel defined in inductor's file `path` (the
    result lands in Triton's file cache, where the trainer's compile of it finds it)."""
    kernel = _loaded.get((path, name))
    if kernel is None:
        spec = importlib.util.spec_from_file_location(f"mixprec_kernel_{len(_loaded)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kernel = _loaded[(path, name)] = getattr(module, name)
    kernel._precompile_config(config)

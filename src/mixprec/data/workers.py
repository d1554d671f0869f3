"""What DataLoader workers must not do, and what they must do the same way every time.

Stop signals are the trainer's: a terminal's Ctrl-C, GNU `timeout` and SLURM signal the whole
process group, workers included. A worker forked while the trainer's handlers are installed
would inherit them (and their wakeup socket), count the group's signal a second time, or start
the trainer's grace timer on a signal meant for it alone; a worker left with the default action
dies on the group's SIGTERM and takes the run down before it can checkpoint. So workers ignore
the stop signals (the trainer stops them in order), and the signals are held while workers are
forked, so none lands in the window before a worker has set that up.

How they start: forked, as torch does by default, except in a process group on a Python older
than 3.11.10. There a child forked while another thread is creating its Python thread state
waits forever on a lock the parent held at the fork (CPython gh-112275; fixed in 3.11.10 and
3.12). torch.distributed's threads do exactly that after each collective: gloo's worker thread
frees the finished work's tensors, which takes the GIL (seen with gdb; NCCL's threads may too).
A worker forked at that moment never starts, and every rank waits for it: one CI run, and 1 of
5 CPU torchrun runs of 300 steps on a loaded 2-core machine. Those workers start from a
forkserver instead, a process without those threads (start_method). A forkserver's worker gets
the dataset by pickling, where a forked one inherits it: a dataset that does not pickle (a lambda
transform, an open file) is refused before any worker starts, naming hardware.num_workers.

Augmentation draws from each sample's own seed, (seed, epoch, index): the same whichever worker
serves the sample and however far that worker's RNG has run, so a run resumed part-way through
an epoch, with any number of workers, sees exactly the crops it would have seen.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import random
import signal
import sys
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from mixprec.core.errors import ConfigError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
FORK_SAFE_PYTHON = (3, 11, 10)  # CPython gh-112275 fixed (see the module's docstring)
PYTHON = tuple(sys.version_info[:3])
log = logging.getLogger(__name__)
_said: list[bool] = []


def start_method(*sent):
    """DataLoader's multiprocessing_context for workers started now: None (torch's fork), or
    a forkserver in a process group on a Python that can hang a forked worker, once what the
    workers are sent (the dataset, the collate function) is known to pickle."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    if not grouped or PYTHON >= FORK_SAFE_PYTHON or sys.platform != "linux":
        return None
    _check_sendable(sent)
    if not _said:
        _said.append(True)
        log.info(
            "DataLoader workers start from a forkserver, not by fork: Python %s can hang a "
            "worker forked beside torch.distributed's threads (CPython gh-112275, fixed in "
            "3.11.10)",
            _python(),
        )
    # the server imports what train.py imports once; each worker then starts in milliseconds,
    # as a forked one does (a worker that imports them itself: a 4 s CPU run took 110 s). A
    # server started before (with its own preloads) keeps them.
    from multiprocessing import forkserver

    kept = getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", ["__main__"])
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(dict.fromkeys(["mixprec.run.session", *kept])))
    return context


class _Probe(ForkingPickler):
    """multiprocessing's own pickler, standing in for tensors and arrays: whether the rest
    pickles is the question, and their bytes need not be copied (or moved to shared memory, as
    torch's reducers would) to answer it."""

    def persistent_id(self, obj):
        return id(obj) if isinstance(obj, (torch.Tensor, np.ndarray)) else None


def _python() -> str:
    return ".".join(map(str, PYTHON))


def _check_sendable(sent: tuple) -> None:
    try:
        with open(os.devnull, "wb") as nowhere:
            _Probe(nowhere, pickle.HIGHEST_PROTOCOL).dump(sent)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ConfigError(
            f"hardware.num_workers: on Python {_python()} in a process group "
            "(torchrun, SLURM), loader workers start from a forkserver (CPython gh-112275, fixed "
            "in 3.11.10), which sends each worker the dataset by pickling, and it does not "
            f"pickle ({e}). Make it picklable (no lambdas or open files in it: open them in "
            "__getitem__), set hardware.num_workers=0, or use Python >= 3.11.10"
        ) from e


def stop_workers(iterator) -> None:
    """Shut a DataLoader iterator's workers down now, the orderly way (done event, a stop
    message each, join): an iterator still referenced from a suspended generator (a run that
    stopped mid-epoch) would otherwise keep them until interpreter exit."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _kill_stray_workers() -> None:
    """At exit, before multiprocessing's own handler (atexit runs the later-registered first):
    that one stops daemonic children with SIGTERM, which workers ignore (see quiet_worker), and
    then waits for them. Workers not shut down by then get SIGKILL instead."""
    for child in multiprocessing.active_children():
        if child.daemon and child.pid:
            os.kill(child.pid, signal.SIGKILL)
            child.join(5)


atexit.register(_kill_stray_workers)


def quiet_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: stop signals are ignored; the trainer's wakeup fd is not ours."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held by signals_held, in the fork


@contextmanager
def signals_held():
    """Hold the stop signals while workers are forked (they inherit the mask and ignore the
    signals before they let them in); the trainer then gets any that arrived meanwhile. A
    forkserver started here inherits the mask too (it survives execve): the group's signals
    stay pending in it, and its workers start as forked ones do."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class Seeded(Dataset):
    """Indexed by (epoch, index): the wrapped dataset's sample, with torch's CPU RNG and Python's
    set from (seed, epoch, index) for its transforms. In the training process itself (no
    workers) they are put back afterwards: the run's own RNG must not move.

    Only the CPU generator, which the transforms draw from: `torch.manual_seed` seeds the CUDA,
    XPU and MTIA generators too, and where CUDA is not initialised (every loader worker, every
    CPU run) each of those records the caller's stack for a lazy seeding, 2.4 ms a sample on
    this 2-core CPU, more than the 8x8 digits' whole load; in a GPU run without workers it
    reseeded the run's CUDA generator per sample, which nothing put back."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        own = ((self.seed * 1_000_003 + epoch) * 10_000_019 + index) % 2**63
        if get_worker_info() is not None:  # a worker's RNG serves nothing else: just seed it
            torch.default_generator.manual_seed(own)
            random.seed(own)
            return self.dataset[index]
        torch_state, py_state = torch.get_rng_state(), random.getstate()
        torch.default_generator.manual_seed(own)
        random.seed(own)
        try:
            return self.dataset[index]
        finally:
            torch.set_rng_state(torch_state)
            random.setstate(py_state)

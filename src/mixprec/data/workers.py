"""What DataLoader workers must not do, and what they must do the same way every time.

Stop signals are the trainer's: a terminal's Ctrl-C, GNU `timeout` and SLURM signal the whole
process group, workers included. A worker forked while the trainer's handlers are installed
would inherit them (and their wakeup socket), count the group's signal a second time, or start
the trainer's grace timer on a signal meant for it alone; a worker left with the default action
dies on the group's SIGTERM and takes the run down before it can checkpoint. So workers ignore
the stop signals (the trainer stops them in order), and the signals are held while workers are
forked, so none lands in the window before a worker has set that up.

Augmentation draws from each sample's own seed, (seed, epoch, index): the same whichever worker
serves the sample and however far that worker's RNG has run, so a run resumed part-way through
an epoch, with any number of workers, sees exactly the crops it would have seen.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import random
import signal
from contextlib import contextmanager

import torch
from torch.utils.data import Dataset, get_worker_info

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


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
    signals before they let them in); the trainer then gets any that arrived meanwhile."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class Seeded(Dataset):
    """Indexed by (epoch, index): the wrapped dataset's sample, with torch's and Python's RNG set
    from (seed, epoch, index) for its transforms. In the training process itself (no workers)
    the RNG is put back afterwards: the run's own RNG must not move."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        own = ((self.seed * 1_000_003 + epoch) * 10_000_019 + index) % 2**63
        if get_worker_info() is not None:  # a worker's RNG serves nothing else: just seed it
            torch.manual_seed(own)
            random.seed(own)
            return self.dataset[index]
        torch_state, py_state = torch.get_rng_state(), random.getstate()
        torch.manual_seed(own)
        random.seed(own)
        try:
            return self.dataset[index]
        finally:
            torch.set_rng_state(torch_state)
            random.setstate(py_state)

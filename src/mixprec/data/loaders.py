"""A resumable epoch loader for map-style datasets (shared by every on-disk/in-memory dataset),
and the GPU prefetcher that overlaps the next batch's host-to-device copy (and its decode or
normalisation on the GPU) with the current step's compute."""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from mixprec.core.errors import ConfigError, DataError
from mixprec.data.base import Context
from mixprec.data.workers import Seeded, quiet_worker, signals_held, start_method, stop_workers


def to_device(batch, device: torch.device, fmt: torch.memory_format, convert=None):
    """A batch on its device, its input in the dtype the precision computes on
    (`convert`: Precision.convert_input, float64 -> float32 by default: a float64 input, numpy's
    default, meets float32 weights as "mat1 and mat2 must have the same dtype" at the first
    step). An input given as a dict of keyword arguments: each of its tensors so."""
    x, y = batch
    convert = convert or Context.convert
    if isinstance(x, Mapping):
        x = {k: _input_to(v, device, fmt, convert) for k, v in x.items()}
    else:
        x = _input_to(x, device, fmt, convert)
    return x, y.to(device, non_blocking=True)


def _input_to(x, device: torch.device, fmt: torch.memory_format, convert):
    """One input tensor on the device in the precision's dtype (converted before the copy where
    that narrows it), an image batch in the model's memory format; anything else as it is."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.is_floating_point():
        wanted = convert(x[:0]).dtype  # the dtype it becomes, read off an empty slice
        if wanted.itemsize < x.dtype.itemsize:
            x = x.to(dtype=wanted)
    x = convert(x.to(device, non_blocking=True))
    return x.contiguous(memory_format=fmt) if x.dim() == 4 else x


class Normalize:
    """uint8 images (what the workers ship: a quarter of float32's bytes over PCIe) to normalised
    float on the training device: (x - 255 * mean) / (255 * std), in the model's memory format."""

    def __init__(self, mean, std, device: torch.device, fmt: torch.memory_format) -> None:
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1) * 255
        self.device, self.fmt = device, fmt

    def __call__(self, batch):
        x, y = to_device(batch, self.device, self.fmt)
        return x.float().sub_(self.mean).div_(self.std), y


def tensors_of(batch) -> Iterator[torch.Tensor]:
    """The tensors of a staged batch: its (input, target), an input dict's entries too."""
    for item in batch:
        if isinstance(item, Mapping):
            yield from (v for v in item.values() if isinstance(v, torch.Tensor))
        elif isinstance(item, torch.Tensor):
            yield item


def prefetch_in_thread(
    batches: Iterable, stage: Callable, device: torch.device, depth: int = 2
) -> Iterator:
    """Yield stage(batch) for each batch, staged by a background thread up to `depth` batches
    ahead (on its own CUDA stream on a GPU). For heavy stages (data.decode=device: nvJPEG's
    host-side work and a few kernels per image), which inline would leave the GPU idle between
    steps: the training step syncs once per step, so the GPU would wait for the CPU to decode
    the next batch. The compute stream waits for each batch on an event, never the host; an
    error in the thread is raised here; closing the generator stops the thread."""
    cuda = device.type == "cuda"
    items: queue.Queue = queue.Queue(maxsize=depth)
    stop, done = threading.Event(), object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            side = torch.cuda.Stream(device) if cuda else None
            with torch.cuda.device(device) if cuda else nullcontext():
                for batch in batches:
                    with torch.cuda.stream(side) if cuda else nullcontext():
                        staged = stage(batch)
                        ready = torch.cuda.Event() if cuda else None
                        if ready is not None:
                            ready.record(side)
                    if not put((staged, ready)):
                        return
            put(done)
        except BaseException as e:  # noqa: BLE001  (re-raised in the consumer)
            put(e)

    thread = threading.Thread(target=work, name="mixprec-stage", daemon=True)
    thread.start()
    compute = torch.cuda.current_stream(device) if cuda else None
    try:
        while (item := items.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            staged, ready = item
            if ready is not None:
                compute.wait_event(ready)
                for t in tensors_of(staged):  # made on the side stream, used on the compute one
                    t.record_stream(compute)
            yield staged
    finally:
        stop.set()
        thread.join(timeout=60)


def prefetch(batches: Iterable, stage: Callable, device: torch.device) -> Iterator:
    """Yield stage(batch) for each batch. On a GPU, batch i+1 is staged (copied, decoded,
    normalised) on a side stream while the caller computes on batch i; the compute stream waits
    for the copy only when it needs the batch. Elsewhere it stages inline."""
    if device.type != "cuda":
        yield from (stage(b) for b in batches)
        return
    side, compute = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    staged = None
    for batch in batches:
        with torch.cuda.stream(side):
            nxt = stage(batch)
        if staged is not None:
            yield staged
        staged = nxt
        compute.wait_stream(side)
        for t in tensors_of(staged):  # allocated on the side stream, used on the compute one
            t.record_stream(compute)
    if staged is not None:
        yield staged


class EpochLoader:
    """Shuffles by (seed, epoch) like DistributedSampler (one replica is the single-process case),
    drops the ragged last batch (static shapes, exact loss averaging), and can start part-way
    through an epoch so a resumed run sees exactly the batches it would have seen.

    `stage` turns a collated CPU batch into (inputs, targets) on the device (default: copy);
    on a GPU it runs one batch ahead on a side stream (see prefetch), or, with
    `stage_thread=True` (for heavy stages), in a background thread (prefetch_in_thread).
    Workers come from `ctx.workers`. With `persistent` (and workers), one stream of batches runs
    across epochs: the workers decode the next epoch's first batches while this epoch ends and
    the model evaluates, so an epoch boundary costs no refill of the pipeline."""

    def __init__(
        self,
        dataset: Dataset,
        ctx: Context,
        shuffle: bool = True,
        drop_last: bool = True,
        collate_fn=None,
        stage: Callable | None = None,
        stage_thread: bool = False,
        persistent: bool = False,
    ) -> None:
        self.sampler = DistributedSampler(
            dataset,
            num_replicas=ctx.world,
            rank=ctx.rank,
            shuffle=shuffle,
            seed=ctx.seed,
            drop_last=drop_last,
        )
        self.dataset, self.batch, self.device = Seeded(dataset, ctx.seed), ctx.batch, ctx.device
        self.drop_last, self.skip, self.seed, self.epoch = drop_last, 0, ctx.seed, 0
        self.stage = stage or (lambda b: to_device(b, ctx.device, ctx.fmt, ctx.convert))
        workers = ctx.workers.num_workers
        self.persistent = persistent and workers > 0
        self.stage_thread = stage_thread
        self.loader_kw = dict(
            num_workers=workers,
            collate_fn=collate_fn,
            pin_memory=ctx.workers.pin_memory and ctx.device.type == "cuda",
            prefetch_factor=4 if workers else None,
            worker_init_fn=quiet_worker if workers else None,
            multiprocessing_context=start_method(self.dataset, collate_fn) if workers else None,
        )
        self._iterator: Iterator | None = None  # the DataLoader iterator whose workers run now
        self._stream: Iterator | None = None  # persistent: batches of this and later epochs
        self._stream_at: tuple[int, int] | None = None  # (epoch, batch) it yields next

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch if self.drop_last else -(-n // self.batch)

    @property
    def samples(self) -> int:
        """Samples this process reads per epoch."""
        return len(self.sampler)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.skip, self.epoch = skip, epoch

    def indices(self) -> list[tuple[int, int]]:
        """This epoch's samples from `skip` on, as (epoch, index): Seeded draws from both."""
        return [(self.epoch, i) for i in list(self.sampler)[self.skip * self.batch :]]

    def _generator(self) -> torch.Generator:
        # Its own generator: a DataLoader otherwise draws worker seeds from the global RNG at
        # every iter(), which a resumed run would do at a different moment (breaking exactness).
        return torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)

    def _batches(self) -> Iterator:
        """This epoch's collated CPU batches, from `skip` on."""
        if not self.persistent:
            self.close()
            with signals_held():  # the workers are forked here
                self._iterator = iter(
                    DataLoader(
                        self.dataset,
                        batch_size=self.batch,
                        drop_last=self.drop_last,
                        sampler=self.indices(),
                        generator=self._generator(),
                        **self.loader_kw,
                    )
                )
            yield from from_workers(self._iterator, self.epoch, self.skip)
            return
        if self._stream_at != (self.epoch, self.skip):  # first epoch, a resume, or a jump
            self.close()
            sampler = _Epochs(self.sampler, self.batch, self.drop_last, self.epoch, self.skip)
            with signals_held():  # the workers are forked here
                self._iterator = self._stream = iter(
                    DataLoader(
                        self.dataset,
                        batch_sampler=sampler,
                        generator=self._generator(),
                        **self.loader_kw,
                    )
                )
        for b in range(self.skip, len(self)):
            self._stream_at = None  # a batch taken but not handed on: the position is lost
            batch = next(from_workers(self._stream, self.epoch, b))
            self._stream_at = (self.epoch, b + 1) if b + 1 < len(self) else (self.epoch + 1, 0)
            yield batch

    def __iter__(self):
        ahead = prefetch_in_thread if self.stage_thread else prefetch
        yield from ahead(self._batches(), self.stage, self.device)

    def close(self) -> None:
        """Stop the workers now: dropping the DataLoader's iterator shuts them down the orderly
        way (done event, then a stop message to each). Left to interpreter exit, torch 2.11 with
        pinned memory joins each one for 5 s before killing it (pytorch#81794): minutes with
        many workers (benchmarks/RESULTS.md)."""
        stop_workers(self._iterator)
        self._iterator, self._stream, self._stream_at = None, None, None


def from_workers(batches: Iterator, epoch: int, first: int) -> Iterator:
    """The batches, where a mixprec error raised while one was read or collated (in a worker
    or not) stops the run as one line naming the epoch and batch: torch re-raises a worker's
    exception as its class with the worker's whole traceback for a message, whose last line
    is the error's own."""
    b = first
    try:
        for batch in batches:
            yield batch
            b += 1
    except (ConfigError, DataError) as e:
        text = str(e)
        if text.startswith("Caught ") and "Original Traceback" in text:
            last = text.rstrip().splitlines()[-1]
            text = last.split(": ", 1)[1] if ": " in last else last
        raise type(e)(f"{text} (epoch {epoch}, batch {b})") from None


class _Epochs:
    """A batch sampler that runs on from epoch to epoch (each shuffled by its own number, as
    DistributedSampler does): the persistent loaders' one stream of batches."""

    def __init__(
        self, sampler: DistributedSampler, batch: int, drop_last: bool, epoch: int, skip: int
    ) -> None:
        self.sampler, self.batch, self.drop_last = copy.copy(sampler), batch, drop_last
        self.start = epoch, skip

    def __iter__(self):
        epoch, skip = self.start
        while True:
            self.sampler.set_epoch(epoch)
            order = list(self.sampler)
            stop = len(order) - len(order) % self.batch if self.drop_last else len(order)
            for i in range(skip * self.batch, stop, self.batch):
                yield [(epoch, j) for j in order[i : i + self.batch]]
            epoch, skip = epoch + 1, 0

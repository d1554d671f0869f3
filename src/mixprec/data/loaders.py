"""A resumable epoch loader for map-style datasets (shared by every on-disk/in-memory dataset)."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def to_device(batch, device: torch.device, fmt: torch.memory_format):
    x, y = batch
    x = x.to(device, non_blocking=True).contiguous(memory_format=fmt)
    return x, y.to(device, non_blocking=True)


class EpochLoader:
    """Shuffles by (seed, epoch) like DistributedSampler (one replica is the single-process case),
    drops the ragged last batch (static shapes, exact loss averaging), and can start part-way
    through an epoch so a resumed run sees exactly the batches it would have seen."""

    def __init__(self, dataset: Dataset, batch: int, device: torch.device,
                 fmt: torch.memory_format, seed: int, rank: int, world: int, num_workers: int = 0,
                 pin_memory: bool = False, shuffle: bool = True, drop_last: bool = True,
                 collate_fn=None) -> None:
        self.sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle,
                                          seed=seed, drop_last=drop_last)
        self.dataset, self.batch, self.device, self.fmt = dataset, batch, device, fmt
        self.drop_last, self.skip, self.seed, self.epoch = drop_last, 0, seed, 0
        self.loader_kw = dict(num_workers=num_workers, collate_fn=collate_fn,
                              pin_memory=pin_memory and device.type == "cuda",
                              persistent_workers=False)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch if self.drop_last else -(-n // self.batch)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.skip, self.epoch = skip, epoch

    def __iter__(self):
        indices = list(self.sampler)[self.skip * self.batch:]
        # Its own generator: a DataLoader otherwise draws worker seeds from the global RNG at
        # every iter(), which a resumed run would do at a different moment (breaking exactness).
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        loader = DataLoader(self.dataset, batch_size=self.batch, sampler=indices,
                            drop_last=self.drop_last, generator=gen, **self.loader_kw)
        for batch in loader:
            yield to_device(batch, self.device, self.fmt)

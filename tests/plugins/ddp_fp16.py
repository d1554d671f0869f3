"""A parallel strategy from outside mixprec: torch's DDP with its fp16 gradient-compression
hook (gradients cast to fp16 for the all-reduce, half the bytes on the wire) and a bucket size
of its own. Its module and its YAML (conf/parallel/ddp_fp16.yaml) are all it takes:
  PYTHONPATH=tests/plugins torchrun --nproc_per_node=2 train.py \\
      'hydra.searchpath=[file://tests/plugins/conf]' parallel=ddp_fp16"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from omegaconf import MISSING
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from mixprec.core.errors import check
from mixprec.parallel import ddp
from mixprec.parallel.strategy import ParallelConfig

log = logging.getLogger(__name__)


@dataclass
class Config(ParallelConfig):
    bucket_cap_mb: float = MISSING  # DDP's gradient bucket size

    def __post_init__(self) -> None:
        check(self.bucket_cap_mb > 0, "parallel.bucket_cap_mb", self.bucket_cap_mb, "> 0")


class Strategy(ddp.Strategy):
    def wrap(self, model, prec, blocks, dd, device):
        if not dd.enabled:
            return model
        wrapped = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
        )
        wrapped.register_comm_hook(None, _compressed)
        return wrapped


def _compressed(state, bucket):
    """fp16_compress_hook, saying once (from inside the all-reduce) that it ran."""
    if not getattr(_compressed, "said", False):
        _compressed.said = True
        log.info("ddp_fp16: gradients all-reduced in float16 (%s)", bucket.buffer().dtype)
    return default_hooks.fp16_compress_hook(state, bucket)

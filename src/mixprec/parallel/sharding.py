"""Sharded data parallel: PyTorch's FSDP2 (`fully_shard`) with its mixed-precision policy as
config (`parallel=fsdp`).

Each repeated block (the blocks regional compilation finds: a Llama's layers, a ViT's blocks)
and then the root are sharded: every rank keeps 1/world of the weights, gradients and optimizer
state, and gathers a block's weights just before it runs. `MixedPrecisionPolicy` takes its
param dtype from the precision (bf16 and fp8: weights gathered and computed in bf16; otherwise
fp32, with autocast doing the casting as without sharding) and its reduce dtype from
`parallel.reduce_dtype` (fp32 by default: gradients summed across ranks in fp32).

Checkpoints stay one plain file: every rank joins in gathering the full (unsharded) model and
optimizer state (torch.distributed.checkpoint.state_dict), rank 0 writes it, and a resume hands
each rank the full state to shard again.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from mixprec.core.errors import ConfigError

log = logging.getLogger(__name__)


def check(prec, mcfg, ocfg) -> None:
    """What FSDP2 cannot take here, named before anything is built."""
    why = None
    if ocfg.state != "fp32" or ocfg.offload != "none":
        why = "optimizer.state / optimizer.offload (torchao's optimizers) are not verified sharded"
    elif mcfg.cuda_graphs:
        why = "model.cuda_graphs=true replays one captured step; FSDP2 gathers weights per step"
    elif mcfg.compile and mcfg.compile_scope != "blocks":
        why = (
            "model.compile_scope=model (one graph around FSDP2's per-block gathers is not "
            "verified here); compile each sharded block: model.compile_scope=blocks"
        )
    if why:
        raise ConfigError(f"parallel=fsdp cannot run with this config: {why}")


def param_dtype(prec) -> torch.dtype | None:
    """bf16 autocast (bf16, fp8): weights gathered in bf16; otherwise left fp32."""
    return torch.bfloat16 if prec.dtype is torch.bfloat16 else None


def shard(model: nn.Module, pcfg, prec, blocks: list[nn.Module], mesh=None) -> nn.Module:
    """fully_shard each block, then the root, with the policy of this precision and config,
    over the world (starting from rank 0's weights on every rank, as DDP does) or over `mesh`
    (batch=auto's probes: a mesh of one rank, its own weights)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        with torch.no_grad():  # each rank initialised its own copy (seed + rank): rank 0's
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src=0)
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype(prec), reduce_dtype=getattr(torch, pcfg.reduce_dtype)
    )
    how = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=pcfg.reshard_after_forward)
    for block in blocks:
        fully_shard(block, **how)
    fully_shard(model, **how)
    log.info(
        "parallel=fsdp: %d blocks and the root sharded (FSDP2); weights gathered in %s, "
        "gradients reduced in %s",
        len(blocks),
        str(policy.param_dtype or "float32").replace("torch.", ""),
        pcfg.reduce_dtype,
    )
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def no_sync(model: nn.Module):
    """Accumulation under FSDP2: no gradient reduce-scatter until the last micro-batch."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def local(t):
    """A tensor's local values (a DTensor's shard; any other tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t):
    """A DTensor's full value on every rank (a collective); any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _options(sharded: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=sharded)


def states(model: nn.Module, optimizer, by_name: bool = False) -> tuple[dict, dict]:
    """(model, optimizer) state dicts to checkpoint. Sharded, or `by_name` (parallel=fsdp on
    any world size, so that its checkpoints resume on any other): the full ones, gathered by
    every rank (a collective; rank 0 gets them on the CPU), the optimizer's keyed by parameter
    name. Otherwise torch's own state_dict()s."""
    if not (by_name or is_sharded(model)):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer, options=_options(is_sharded(model)))


def by_name(optimizer_state: dict) -> bool:
    """An optimizer state keyed by parameter name (states(by_name=True)), not by index."""
    return any(isinstance(k, str) for k in optimizer_state.get("state", {}))


def load_model(model: nn.Module, state: dict) -> None:
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options())


def load_optimizer(model: nn.Module, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_options(is_sharded(model)))

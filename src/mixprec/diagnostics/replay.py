"""An eager re-run that leaves the run as it was: the doctor, the numerics probe and the dtype
plan run a step's micro-batches again with hooks, and the run must train exactly as one without
them. Inside `untouched(model)`: compiled code runs eagerly (hooks fire), the RNG is forked,
and the gradients and buffers (BatchNorm's statistics) are put back on the way out."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch
from torch import nn

MATMULS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)  # the layers a low precision's matmul is


def tensors(obj) -> list[torch.Tensor]:
    """The tensors in a module's inputs or outputs (nested tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors(o)]
    return []


@contextmanager
def untouched(model: nn.Module, training: bool = True) -> Iterator[None]:
    """Run `model` eagerly inside; its gradients, buffers, RNG and train/eval mode are as
    before afterwards (`training=False`: eval mode inside, e.g. a forward that only looks)."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    devices = [torch.cuda.current_device()] if params and params[0].is_cuda else []
    was_training = model.training
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        for p in params:
            p.grad = None
        model.train(training)
        try:
            yield
        finally:
            model.train(was_training)
            for p, g in zip(params, grads):
                p.grad = g
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(buffers[n])

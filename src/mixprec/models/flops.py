"""FLOPs and MFU: what one training sample costs, counted by torch's own FLOP counter on the
model as converted (on the meta device where the model allows), and the peak it is measured
against."""

from __future__ import annotations

import logging

import torch

from mixprec.core import tasks
from mixprec.core.tasks import CLASSIFY

log = logging.getLogger(__name__)


def train_flops(
    model: torch.nn.Module,
    input_shape,
    num_classes: int,
    device: torch.device,
    autocast,
    owned: set[str] = frozenset(),
    task=None,
) -> tuple[int, int]:
    """(all, in the `owned` modules) forward + backward FLOPs of one sample, counted once by
    torch.utils.flop_counter on a copy of the real model (so BatchNorm statistics and gradients
    of the run are untouched). The copy lives on the meta device: counting needs shapes, not
    values, so no kernel runs (on a GPU the eager step cost 5-14 s of the start: cuDNN's
    benchmark and a cold Triton cache); a model that cannot run on meta is counted on `device`.
    A torch.compile'd model is counted on its eager module: a compiled forward first called under
    FlopCounterMode is not compiled for the real batch afterwards (benchmarks/RESULTS.md). A batch
    of 16 keeps every matmul dimension a multiple of 16, as float8 matmuls need (precision=fp8)."""
    from mixprec.models import unwrap

    task = task or CLASSIFY
    plain = unwrap(model)
    if hasattr(plain, "flops_per_token"):  # a language model states its count (llama.py)
        return stated_flops(plain, input_shape[0], owned)
    batch = 16
    try:
        counts = _flop_counts(
            plain, torch.device("meta"), autocast, batch, task, input_shape, num_classes
        )
    # meta tensors hold no values (.item(), data-dependent shapes: RuntimeError), an op may lack
    # a meta kernel (NotImplementedError), a tensor subclass may refuse a meta twin: count on
    # the device as before (tests/test_precision.py: a forward that reads a value)
    except (NotImplementedError, RuntimeError, TypeError, ValueError, AssertionError) as err:
        log.debug("FLOP count on the meta device failed (%s); counting on %s", err, device)
        try:
            counts = _flop_counts(plain, device, autocast, batch, task, input_shape, num_classes)
        except (NotImplementedError, RuntimeError, TypeError, ValueError, AssertionError) as e:
            log.warning(
                "MFU is null: torch's FLOP counter cannot count %s (%s: %s); a model may state "
                "its count as flops_per_token(seq_len) (docs/own-model.md)",
                type(plain).__name__,
                type(e).__name__,
                str(e).splitlines()[0][:120] if str(e) else "",
            )
            return 0, 0
    prefix = len(type(plain).__name__) + 1  # counter keys: Class.name
    in_owned = sum(sum(ops.values()) for key, ops in counts.items() if key[prefix:] in owned)
    return sum(counts.get("Global", {}).values()) // batch, in_owned // batch


def _flop_counts(plain, device, autocast, batch, task, input_shape, num_classes) -> dict:
    """One training step of a copy of `plain` on `device` under FlopCounterMode: its counts per
    module (key "Global": the whole step)."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    memo = {}
    if device.type == "meta":  # copy without copying the weights: each becomes an empty meta twin
        for t in [*plain.parameters(), *plain.buffers()]:
            twin = torch.empty_like(t, device="meta")
            memo[id(t)] = (
                torch.nn.Parameter(twin, t.requires_grad)
                if isinstance(t, torch.nn.Parameter)
                else twin
            )
    twin = copy.deepcopy(plain, memo).train()
    x = task.inputs(batch, input_shape, num_classes, device)
    y = task.targets(batch, input_shape, num_classes, device)
    with FlopCounterMode(display=False) as counter:
        with autocast():
            loss = task.loss(tasks.call(twin, x).float(), y)
        loss.backward()
    return counter.get_flop_counts()


def stated_flops(model: torch.nn.Module, seq_len: int, owned: set[str]) -> tuple[int, int]:
    """(all, in the `owned` Linear layers) training FLOPs of one sequence, from the model's own
    count (6 N + attention, per token; torch's counter cannot count grouped-query attention
    kernels) and 6 x in x out per token for each owned Linear."""
    in_owned = sum(
        6 * m.in_features * m.out_features
        for name, m in model.named_modules()
        if name in owned and isinstance(m, torch.nn.Linear)
    )
    return model.flops_per_token(seq_len) * seq_len, in_owned * seq_len


def blended_peak(peak: float | None, other: float | None, share: float) -> float | None:
    """The dense peak of a run with `share` of its FLOPs at `other`'s peak and the rest at
    `peak`'s: each FLOP takes 1/peak of its kind (the FLOP-weighted harmonic mean)."""
    if not share:
        return peak
    if not peak or not other:
        return None  # no honest MFU without both peaks
    return 1.0 / (share / other + (1.0 - share) / peak)


def mfu(
    flops_per_sample: int | None,
    samples_per_s: float | None,
    peak_tflops: float | None,
    world: int = 1,
) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the devices' dense peak."""
    if not flops_per_sample or not samples_per_s or not peak_tflops:
        return None
    return flops_per_sample * samples_per_s / (peak_tflops * 1e12 * world)

"""The precision doctor: which layer overflowed.

When a step overflows or diverges (GradScaler skipped it, the loss was not finite, or the run
stops for divergence), the doctor re-runs that step's micro-batches once more, eagerly, with
hooks on every module, and names where it first went wrong:
- forward: the first module to finish whose output is non-finite (or, in an fp16 run, beyond
  fp16's range) while its inputs were not: the layer that made it, not the ones it flowed into;
- backward: the first module (in backward order) whose input gradient is non-finite while the
  gradient of its output was not;
- the loss scale: the gradient of the model's output is non-finite as the backward enters it
  (scale x dL/dy beyond fp16's range), before any layer could make it so.
With the dtype, the largest |value| going in and out, and the loss scale of that step. Normal
steps pay nothing: there are no hooks until the doctor runs. The re-run leaves the run as it
was (weights, gradients, BatchNorm statistics, RNG), so a run with `debug.locate=true` trains
exactly as one without it.

On demand, `debug.locate=true` examines the first LIMIT steps that overflow (each such step is
settled at once: one sync per step); every run examines the step it stops at for divergence.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from torch import nn

from mixprec.diagnostics import numerics
from mixprec.diagnostics.replay import tensors as _tensors
from mixprec.diagnostics.replay import untouched
from mixprec.precision.base import StaticGradScaler

log = logging.getLogger(__name__)

FP16_MAX = float(torch.finfo(torch.float16).max)
SKIPPED = "GradScaler skipped the step"
FIELDS = ("step", "trigger", "where", "module", "type", "dtype", "max_abs_in", "max_abs_out")
FIELDS += ("loss", "loss_scale", "nonfinite_params", "numerics")  # every finding has every key


def _max_abs(tensors: list[torch.Tensor]) -> float:
    floats = [t.detach() for t in tensors if t.is_floating_point() and t.numel()]
    if not floats:
        return 0.0
    return max(float(t.abs().max()) if t.isfinite().all() else math.inf for t in floats)


class _Watch:
    """Hooks on every module for one forward and backward; collects the first culprit of each."""

    def __init__(self, model: nn.Module, limit: float) -> None:
        self.limit = limit  # a forward value beyond it counts as an overflow (fp16's max)
        self.forward: dict | None = None
        self.backward: dict | None = None
        self.inputs: dict[str, float] = {}  # module -> max |input| of its current call
        self.grad_out: dict[str, float] = {}  # module -> max |gradient of its output|
        self.first_grad: dict | None = None  # the first output gradient the backward hands a module
        self.handles = []
        for name, mod in model.named_modules():
            if name:  # the model itself is not a layer to name
                self.handles += [
                    mod.register_forward_pre_hook(self._pre(name), with_kwargs=True),
                    mod.register_forward_hook(self._post(name, mod)),
                ]

    def _bad(self, value: float) -> bool:
        return not math.isfinite(value) or value > self.limit

    def _pre(self, name: str) -> Callable:
        def hook(mod, args, kwargs):
            ins = _tensors(args) + _tensors(kwargs)
            self.inputs[name] = _max_abs(ins)
            for t in ins:
                if t.requires_grad:
                    t.register_hook(self._grad_in(name, mod, t.dtype))

        return hook

    def _post(self, name: str, mod: nn.Module) -> Callable:
        def hook(_mod, _args, out):
            outs = _tensors(out)
            biggest = _max_abs(outs)
            if self.forward is None and self._bad(biggest) and not self._bad(self.inputs[name]):
                dtype = next((t.dtype for t in outs if t.is_floating_point()), None)
                self.forward = _finding("forward", name, mod, dtype, self.inputs[name], biggest)
            for t in outs:
                if t.requires_grad:
                    t.register_hook(self._grad_out(name, mod))

        return hook

    def _grad_out(self, name: str, mod: nn.Module) -> Callable:
        def hook(grad):
            value = _max_abs([grad])
            self.grad_out[name] = max(self.grad_out.get(name, 0.0), value)
            if self.first_grad is None:
                self.first_grad = _finding("loss scale", name, mod, grad.dtype, value, value)

        return hook

    def scale_overflow(self) -> dict | None:
        """The scaled loss's gradient already non-finite where the backward enters the model
        (a finite forward): no layer made it, the loss scale did."""
        first = self.first_grad
        return first if first is not None and not math.isfinite(first["max_abs_in"]) else None

    def _grad_in(self, name: str, mod: nn.Module, dtype) -> Callable:
        def hook(grad):
            out = self.grad_out.get(name, 0.0)
            value = _max_abs([grad])
            if math.isfinite(value) or not math.isfinite(out):
                return
            # a module's hook and its first child's fire on the same tensor: the child made it
            if self.backward is None or name.startswith(self.backward["module"] + "."):
                self.backward = _finding("backward", name, mod, grad.dtype, out, value)

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _finding(where: str, name: str, mod: nn.Module, dtype, max_in: float, max_out: float):
    return {
        "where": where,
        "module": name,
        "type": type(mod).__name__,
        "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
        "max_abs_in": max_in,  # forward: the inputs; backward: the gradient of its output
        "max_abs_out": max_out,  # forward: the output; backward: the gradient of its input
    }


def _nonfinite_params(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not bool(p.detach().isfinite().all())]


def locate(learner, micro_batches: list, scale: float) -> dict:
    """Re-runs `micro_batches` eagerly with hooks, scaling the loss by `scale` as the step did;
    returns the first finding (forward before backward), where='loss scale' when the scaled
    loss's gradient is non-finite where it enters the model, where='none' when every value
    stayed finite, or where='weights' when the weights are already non-finite (a step before
    this one overflowed; nothing to re-run). The run's weights, gradients, buffers and RNG are
    left as they were."""
    from mixprec.models import unwrap

    model = unwrap(learner.model)  # not DDP's forward: no collective on one rank's re-run
    broken = _nonfinite_params(model)
    if broken:  # (the type: who computes the loss, which an earlier step's NaN may have been)
        return {
            "where": "weights",
            "loss_scale": scale,
            "nonfinite_params": broken[:8],
            "type": None if learner.uses_task_loss else _who(learner),
        }
    prec = learner.precision
    limit = FP16_MAX if prec.dtype is torch.float16 else math.inf
    found: dict = {"where": "none"}
    with untouched(model):
        for x, y in micro_batches:
            watch = _Watch(model, limit)
            try:
                with prec.autocast():
                    logits, loss = learner.batch_loss(x, y, model)
                made = _loss_made_it(learner, logits, loss) if watch.forward is None else None
                if watch.forward is None and made is None and loss.requires_grad:
                    (loss.float() * scale).backward()
            finally:
                watch.close()
            found = watch.forward or made or watch.backward or watch.scale_overflow() or found
            if found["where"] != "none":
                found["loss"] = float(loss.detach())
                break
    return {**found, "loss_scale": scale, "nonfinite_params": []}


def _who(learner) -> str:
    if learner.own_loss:
        return "the model's own loss (model.loss=own)"
    spec = getattr(learner.loss_fn, "spec", None)
    return f"your loss function (model.loss={spec})" if learner.loss_fn else "the task's loss"


def _loss_made_it(learner, logits, loss: torch.Tensor) -> dict | None:
    """A finding where the model's outputs are finite and the loss computed from them is not:
    the loss made it (your model.loss function, or the model's own), no layer did."""
    biggest = _max_abs(_tensors(logits))
    if not math.isfinite(biggest) or bool(torch.isfinite(loss.detach()).all()):
        return None
    return {
        "where": "loss",
        "module": "loss",
        "type": _who(learner),
        "dtype": str(loss.dtype).replace("torch.", ""),
        "max_abs_in": biggest,
        "max_abs_out": math.inf,
    }


def _or_the_loss(f: dict) -> str:
    return f", or {f['type']} returned a non-finite loss" if f.get("type") else ""


def sentence(f: dict) -> str:
    """One line for the log and the error message."""
    head = f"step {f['step']} ({f['trigger']}, loss scale {float(f['loss_scale']):g}): "
    if f["where"] == "forward":
        text = (
            f"first overflow in the forward of {f['module']} ({f['type']}, {f['dtype']}): "
            f"inputs max |x| {float(f['max_abs_in']):.4g} -> output max |y| "
            f"{float(f['max_abs_out']):.4g}"
        )
    elif f["where"] == "backward":
        text = (
            f"first overflow in the backward of {f['module']} ({f['type']}, {f['dtype']} "
            f"gradients): gradient of its output max {float(f['max_abs_in']):.4g} -> gradient of "
            f"its input max {float(f['max_abs_out']):.4g}"
        )
    elif f["where"] == "loss scale":
        text = (
            f"the loss scale itself overflowed: the gradient of the model's output "
            f"({f['module']}, {f['dtype']}) is already non-finite at loss scale "
            f"{float(f['loss_scale']):g}, before any layer's backward. No layer made it; "
            "GradScaler skips the step and halves the scale. Many such skips at the start: "
            "scaler=conservative (init_scale 4096) starts lower"
        )
    elif f["where"] == "loss":
        text = (
            f"the model's outputs are finite (max |y| {float(f['max_abs_in']):.4g}) and the loss "
            f"computed from them is not ({f['loss']}): {f['type']}"
            " made it, no layer did"
        )
    elif f["where"] == "weights":
        text = (
            f"the weights are already non-finite ({', '.join(f['nonfinite_params'])}): an "
            f"earlier step overflowed{_or_the_loss(f)}. "
            "To see where, resume from the last checkpoint with debug.locate=true (it re-runs "
            "each non-finite step before the weights move and names the loss where it made it)"
        )
    else:
        text = "re-run, every activation and gradient stayed finite (not reproduced)"
    return head + text


class Doctor:
    """When to call locate(): `on_demand` (debug.locate) at the first LIMIT overflowing steps,
    and once when the run stops for divergence. An object that does nothing when it cannot
    run (see __init__)."""

    LIMIT = 3

    def __init__(self, learner=None, on_demand: bool = False, rerun: bool = True) -> None:
        """`rerun`: false where the forward cannot be re-run with hooks (CUDA graphs replay a
        captured one). A sharded model (FSDP2, several ranks) is not re-run either: its forward
        gathers weights, which every rank would have to join for one rank's overflow."""
        from mixprec.models import unwrap
        from mixprec.parallel.sharding import is_sharded

        usable = learner is not None and rerun and not is_sharded(unwrap(learner.model))
        self.learner, self.on_demand = (learner if usable else None), on_demand
        self.findings: list[dict] = []
        self.batch: list | None = None  # the micro-batches of the latest step
        self._diverged = False
        self._examined = False  # before_update examined the step being settled

    def remember(self, micro_batches: list | None) -> None:
        self.batch = micro_batches if self.learner is not None else None

    def before_update(self, step: int, loss: torch.Tensor) -> None:
        """debug.locate, before the optimizer step: a non-finite loss is examined while the
        weights are still the ones that made it (a sync per step)."""
        self._examined = self._wanted() and not bool(torch.isfinite(loss))
        if self._examined:
            self._examine(step, "non-finite loss")

    def after_step(self, step: int, stepped: bool) -> None:
        """debug.locate: a step GradScaler skipped (its weights did not move) is examined."""
        examined, self._examined = self._examined, False  # this step's loss, just above
        if not stepped and self._wanted() and not examined:
            self._examine(step, SKIPPED)

    def _wanted(self) -> bool:
        return self.on_demand and self.batch is not None and len(self.findings) < self.LIMIT

    def on_divergence(self, step: int) -> str:
        """Once per run, as it stops for divergence: the latest step's batch, re-run; returns
        what it found as a sentence for the error message ('' when it did not run)."""
        if self._diverged or self.batch is None:
            return ""
        self._diverged = True
        found = self._examine(step, "divergence stop")
        return f" The doctor: {sentence(found)}" if found else ""

    def _examine(self, step: int, trigger: str) -> dict:
        prec = self.learner.precision
        scale = prec.loss_scale()
        if trigger == SKIPPED and prec.scaling and not isinstance(prec.scaler, StaticGradScaler):
            scale /= prec.scaler.get_backoff_factor()  # the scale the step ran at, before backoff
        try:
            f = dict.fromkeys(FIELDS) | {"step": step, "trigger": trigger}
            f.update(locate(self.learner, self.batch, scale))
            if f["where"] != "weights":  # the casts of that step, worst layers first
                f["numerics"] = numerics.worst(
                    numerics.probe(self.learner, self.batch[0], scale), 3
                )
        except Exception as e:  # the doctor must not turn a diagnosis into a second failure
            log.warning("doctor: could not re-run step %d: %s", step, e)
            return {}
        self.findings.append(f)
        log.warning("doctor: %s", sentence(f))
        return f

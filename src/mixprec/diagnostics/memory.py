"""debug.memory: where the peak's GiB go, read from the allocator itself on one step.

On the `at`-th optimizer step (the first ones compile, tune and create the optimizer state),
hooks on the model's forward and on the optimizer's step read torch.cuda.memory_allocated at the
step's boundaries, with the peak counter reset at its start: A0 before the forward, A1 after it,
A2 before the optimizer step (every gradient made), and the peaks of the forward+backward and
of the whole step. Weights, gradients and optimizer state are counted exactly, tensor by tensor
(unique storages on the device). What compile allocates counts like anything else, because it
is the allocator that is read, not the ops that run (torch's per-op trackers, such as the
dispatch-mode MemTracker, see only what passes through the dispatcher).

The peak, in parts that add up to it:
- weights, optimizer_state: exact; inputs_and_buffers: the rest of A0 (the batch, BatchNorm
  statistics, rotary tables, the data loader's pinned copies on the device);
- activations: A1 - A0, what the forward keeps for the backward (and its output), less
- autocast_copies: autocast's cached low-precision copies of the weights (eager runs; a
  compiled graph casts inside and keeps what it saves as activations);
- gradients and temporaries: the peak beyond the forward's end. In the backward (most runs),
  the gradients made by then are at most all of them, the rest temporaries and workspaces; at
  the optimizer step, all gradients, and the step's own temporaries (foreach/fused buffers);
- reserve (beside the peak): what the allocator holds and no tensor uses (cache, fragments).
On the CPU, weights, gradients and optimizer state are counted and the rest is null.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from mixprec.diagnostics.replay import MATMULS

log = logging.getLogger(__name__)
GIB = 1024**3
PARTS = ("weights", "optimizer_state", "inputs_and_buffers", "activations", "autocast_copies")
PARTS += ("gradients", "temporaries")


def tensor_bytes(tensors, device_type: str) -> int:
    """Bytes of the unique storages among `tensors` on that kind of device (a sharded
    tensor's local shard; torchao's quantised states by their own tensors)."""
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        inner = [getattr(t, a) for a in getattr(t, "__tensor_flatten__", lambda: ([], None))()[0]]
        for x in inner or [t]:
            if not isinstance(x, torch.Tensor) or x.device.type != device_type:
                continue
            storage = x.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def state_tensors(optimizer) -> list[torch.Tensor]:
    """The optimizer state's tensors (torchao's CPU offload: its host optimizers' too)."""
    out = []
    for opt in [optimizer, *getattr(optimizer, "optim_dict", {}).values()]:
        for st in getattr(opt, "state", {}).values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def autocast_copies(model: nn.Module, dtype: torch.dtype | None) -> int:
    """Bytes of the low-precision copies autocast caches for one forward: each fp32 weight and
    bias of a Linear or conv, cast once per forward while the autocast region is open."""
    if dtype is None:
        return 0
    n = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, MATMULS)
        for p in m.parameters(recurse=False)
        if p.dtype == torch.float32 and p.requires_grad
    )
    return n * dtype.itemsize


class Breakdown:
    """debug.memory's hooks; `result` after the measured step. Off: no hook is registered."""

    def __init__(self, learner=None, device=None, at: int = 3, cached_casts: bool = False) -> None:
        """`cached_casts`: autocast's weight-cast cache is in use (an eager forward under
        autocast with its cache on: the copies are counted apart from the activations)."""
        self.result: dict | None = None
        self._handles = []
        if learner is None:
            return
        self.learner, self.device, self.at = learner, device, at
        self.cached_casts = cached_casts
        self.steps, self.fresh, self.reads = 0, at == 1, {}
        opt = learner.optimizer
        self._handles = [
            learner.model.register_forward_pre_hook(self._before_forward),
            learner.model.register_forward_hook(self._after_forward),
            opt.register_step_pre_hook(self._before_step),
            opt.register_step_post_hook(self._after_step),
        ]

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _before_forward(self, *args) -> None:
        if self.fresh:
            self.fresh = False
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            self.reads = {"a0": self._allocated()}

    def _after_forward(self, *args) -> None:
        if "a0" in self.reads and "a1" not in self.reads:
            self.reads["a1"] = self._allocated()

    def _before_step(self, opt, args, kwargs) -> None:
        if "a1" not in self.reads:
            return
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        self.reads["grads"] = tensor_bytes(grads, self.device.type)
        self.reads["a2"] = self._allocated()
        if self.device.type == "cuda":
            self.reads["peak_fb"] = torch.cuda.max_memory_allocated(self.device)

    def _after_step(self, opt, args, kwargs) -> None:
        self.steps += 1
        if "a2" in self.reads:
            self.result = self._parts(opt)
            log.info("memory at the peak of step %d:\n%s", self.steps, markdown(self.result))
            for h in self._handles:
                h.remove()
            self._handles = []
        elif self.steps == self.at - 1:
            self.fresh = True  # the next forward starts the measured step

    def _parts(self, opt) -> dict:
        from mixprec.models import unwrap

        model, kind, r = unwrap(self.learner.model), self.device.type, self.reads
        weights = tensor_bytes(model.parameters(), kind)
        state = tensor_bytes(state_tensors(opt), kind)
        out = {
            "step": self.steps,
            "weights": weights,
            "optimizer_state": state,
            "gradients": r["grads"],
        }
        if kind != "cuda":  # the rest is not measured on the CPU (RSS has no such counters)
            out.update(dict.fromkeys(("inputs_and_buffers", "activations", "autocast_copies")))
            out.update(temporaries=None, peak=None, reserve=None, phase=None)
            return _gib(out)
        peak = torch.cuda.max_memory_allocated(self.device)
        copies = autocast_copies(model, self.learner.precision.dtype) if self.cached_casts else 0
        forward = r["a1"] - r["a0"]
        out.update(
            inputs_and_buffers=max(r["a0"] - weights - state, 0),
            activations=forward - copies,
            autocast_copies=copies,
            peak=peak,
            reserve=torch.cuda.max_memory_reserved(self.device) - peak,
        )
        if r["peak_fb"] >= peak:  # the peak is in the backward: beyond the forward's end
            beyond = r["peak_fb"] - r["a1"]
            out.update(gradients=min(r["grads"], max(beyond, 0)), phase="backward")
            out["temporaries"] = beyond - out["gradients"]
        else:  # at the optimizer step: every gradient, and the step's own buffers
            out.update(phase="optimizer step", temporaries=peak - r["a2"], autocast_copies=0)
            left = r["a2"] - weights - state - r["grads"] - out["inputs_and_buffers"]
            out["activations"] = left  # what the forward left for the step (its output, loss)
        return _gib(out)


def _gib(parts: dict) -> dict:
    return {k: (v / GIB if isinstance(v, int) and k != "step" else v) for k, v in parts.items()}


def markdown(b: dict) -> str:
    """The table in GiB, or in MiB where every part is under 1 GiB (a small model, a CPU run:
    rows of 0.000 GiB say nothing); memory.json keeps GiB either way."""
    values = [b.get(k) for k in (*PARTS, "peak")]
    small = max((v for v in values if isinstance(v, (int, float))), default=0) < 1
    unit, scale = ("MiB", 1024) if small else ("GiB", 1)
    lines = [f"| part | {unit} |", "|---|---|"]
    for k in PARTS:
        v = b.get(k)
        shown = "not measured" if v is None else f"{v * scale:.3f}"
        lines.append(f"| {k.replace('_', ' ')} | {shown} |")
    if b.get("peak") is not None:
        lines.append(f"| **peak** ({b['phase']}) | **{b['peak'] * scale:.2f}** |")
        lines.append(f"| reserve (held, unused) | {b['reserve'] * scale:.2f} |")
    return "\n".join(lines)

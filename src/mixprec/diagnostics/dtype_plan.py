"""The dtype plan, read from the live objects on the first optimizer step, not from the config.

What a precision promises (Promise, built from the config by run/build.py) and what the tensors
are (observe): the dtype and device of each parameter group's weights and gradients (read by an
optimizer step pre-hook of the first step, before zero_grad), of the optimizer state (its
state_dict's tensors after that step: fp32, bf16, or torchao's 8-bit/4-bit/fp8 subclasses), a
master copy if any (CPU offload's host copy of the weights), the dtype the weights have inside the
forward (FSDP2 gathers them in its param_dtype), and the dtype each Linear, conv and norm
computed in under autocast (forward hooks on an eager re-run of the first micro-batch's first 16
samples, the run left untouched). A promise the objects break (Accelerate #3979: FSDP2 master
weights that were not fp32) is a DtypeMismatch naming both, unless debug.dtype_plan=log.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass

import torch
from torch import nn

from mixprec.core import norms, tasks
from mixprec.core.errors import DtypeMismatch
from mixprec.diagnostics.replay import MATMULS, tensors, untouched

log = logging.getLogger(__name__)
_NORMS = (*norms.BATCH_NORMS, *norms.INSTANCE_NORMS, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
MODES = ("check", "log", "off")  # debug.dtype_plan


@dataclass
class Promise:
    """What the config promises (run/build.py makes it; None: not promised, not checked)."""

    weights: list  # the parameters' dtypes between steps: float32 (bfloat16: optimizer.state=bf16,
    # or what the precision's promised() adds: a plugin that keeps some weights in bf16)
    compute: str  # what Linear/conv layers compute in: float32, float16 or bfloat16
    state: str  # optimizer.state: fp32, bf16, 8bit, 4bit, fp8 (a state-less SGD: none found)
    state_device: str  # where the optimizer state lives: the run's device type, or cpu (offload)
    forward_weights: list | None = None  # the weights' dtypes inside the forward (FSDP2's gather)
    reduce: str | None = None  # FSDP2: the dtype gradients are reduced in (as configured)


def _kind(t: torch.Tensor) -> str:
    """A tensor's dtype, or the name of its subclass (torchao's quantised optimizer states)."""
    local = t.to_local() if hasattr(t, "to_local") else None  # a DTensor: its shard
    t = local if local is not None else t
    if type(t).__name__.startswith("OptimState"):  # torchao's OptimState8bit, 4bit, Fp8
        return type(t).__name__
    return str(t.dtype).replace("torch.", "")


def _state_tensors(state_dict) -> list[torch.Tensor]:
    """The tensors of an optimizer's state_dict, whatever its nesting (torchao's CPU offload
    keeps one state_dict per host optimizer), its param_groups left out."""
    if isinstance(state_dict, dict):
        return [t for k, v in state_dict.items() if k != "param_groups" for t in _state_tensors(v)]
    if isinstance(state_dict, (list, tuple)):
        return [t for v in state_dict for t in _state_tensors(v)]
    return [state_dict] if isinstance(state_dict, torch.Tensor) else []


def _census(ts) -> dict[str, int]:
    """{'dtype on device': tensor count}."""
    return dict(Counter(f"{_kind(t)} on {t.device.type}" for t in ts))


class Watch:
    """Arms the first optimizer step's hooks at construction; after that step, plan() reads
    the rest and checks the promise. Off (mode 'off'): no hook, nothing read."""

    def __init__(
        self, learner=None, promise: Promise | None = None, mode: str = "off", rerun: bool = True
    ) -> None:
        """`rerun`: false where the forward cannot be re-run eagerly (CUDA graphs replay a
        captured one): the compute dtypes are then not read, the rest is."""
        self.learner, self.promise, self.mode, self.rerun = learner, promise, mode, rerun
        self.groups: list[dict] = []
        self.state: dict[str, int] = {}
        self.state_elements: dict[str, int] = {}  # optimizer state elements per device type
        self.result: dict | None = None
        self._handles = []
        if learner is not None and mode != "off":
            opt = learner.optimizer
            self._handles = [
                opt.register_step_pre_hook(self._before),
                opt.register_step_post_hook(self._after),
            ]

    def _before(self, opt, args, kwargs) -> None:
        self.groups = [
            {
                "group": i,
                "weights": _census(g["params"]),
                "gradients": _census(p.grad for p in g["params"] if p.grad is not None),
            }
            for i, g in enumerate(opt.param_groups)
        ]

    def _after(self, opt, args, kwargs) -> None:
        found = [t for t in _state_tensors(opt.state_dict()) if t.numel() > 1]
        self.state = _census(found)  # (a step counter is a 1-element tensor: not the state)
        self.state_elements = {}
        for t in found:
            self.state_elements[t.device.type] = (
                self.state_elements.get(t.device.type, 0) + t.numel()
            )
        for h in self._handles:
            h.remove()
        self._handles = []

    def due(self) -> bool:
        """The first optimizer step ran (its hooks fired) and the plan is not read yet."""
        return self.learner is not None and self.result is None and bool(self.groups)

    def after_first_step(self, micro_batches: list | None) -> dict | None:
        """Once, after the first step that ran: the plan, logged and checked."""
        if not self.due() or micro_batches is None:
            return None
        self.result = plan = self._plan(micro_batches[0])
        wrong = plan["mismatches"] = mismatches(plan, self.promise) if self.promise else []
        log.info("dtype plan, read from the live objects after step 1:\n%s", markdown(plan))
        if wrong and self.mode == "check":
            said = "; ".join(
                f"{w['what']}: promised {w['promised']}, found {w['found']}" for w in wrong
            )
            raise DtypeMismatch(
                f"the run's tensors are not what its config promises ({said}). If this is "
                "expected for your model, debug.dtype_plan=log records it without stopping"
            )
        return plan

    def _plan(self, micro_batch) -> dict:
        from mixprec.models import unwrap

        model = unwrap(self.learner.model)
        compute, forward_weights = (
            computed(model, self.learner.precision, first_samples(micro_batch[0]))
            if self.rerun
            else ({}, {})
        )
        host = getattr(self.learner.optimizer, "param_d2h_map", None) or {}
        return {
            "groups": self.groups,
            "optimizer_state": self.state,
            "optimizer_state_elements": self.state_elements,
            "master_copy": _census(host.values()) if host else {},
            "forward_weights": forward_weights,
            "compute": compute,
            "labels": sorted(set(self.learner.precision.audited().values())),  # its own layers
            "promise": asdict(self.promise) if self.promise else None,
        }


PLAN_SAMPLES = 16  # the re-run's batch: dtypes do not depend on it, its time and memory do


def first_samples(x):
    """The first PLAN_SAMPLES samples of a batch-first input (all of a smaller one; each entry
    of a dict of keyword arguments). 16 keeps float8's rule that a matmul's rows come in
    multiples of 16 wherever the full batch kept it (16 sequences of any length; 16 images of
    any token count)."""
    return tasks.first(x, PLAN_SAMPLES)


def label_of(name: str, labels: dict[str, str]) -> str | None:
    """The precision's label of a module: its own, or that of the module it sits in (a Linear
    inside an attention block kept in fp32 computes in fp32 too)."""
    while True:
        if name in labels:
            return labels[name]
        if "." not in name:
            return labels.get("") if name else None
        name = name.rsplit(".", 1)[0]


def computed(model: nn.Module, prec, x) -> tuple[dict, dict]:
    """({layer type: {dtype: count}}, {dtype of the weights inside the forward: count}) from an
    eager no-grad forward of `x` under the run's autocast, with hooks on each Linear, conv and
    norm; the layers the precision converted (float8) or kept in fp32 carry its label."""
    labels = prec.audited()
    compute: dict[str, Counter] = {}
    weights: Counter = Counter()

    def hook_for(name: str):
        def hook(mod, args, out):
            outs = [t for t in tensors(out) if t.is_floating_point()]
            if not outs:
                return
            dtype = label_of(name, labels) or str(outs[0].dtype).replace("torch.", "")
            compute.setdefault(type(mod).__name__, Counter())[dtype] += 1
            w = getattr(mod, "weight", None)
            if isinstance(w, torch.Tensor):
                weights[_kind(w)] += 1

        return hook

    handles = [
        m.register_forward_hook(hook_for(n))
        for n, m in model.named_modules()
        if isinstance(m, MATMULS + _NORMS)
    ]
    try:
        with untouched(model, training=False), torch.no_grad(), prec.autocast():
            tasks.call(model, x)
    finally:
        for h in handles:
            h.remove()
    return {k: dict(v) for k, v in compute.items()}, dict(weights)


def _dtypes(census: dict[str, int]) -> set[str]:
    return {k.split(" on ")[0] for k in census}


_STATE_KINDS = {"fp32": "float32", "bf16": "bfloat16", "8bit": "8bit", "4bit": "4bit", "fp8": "Fp8"}


def mismatches(plan: dict, promise: Promise) -> list[dict]:
    """Where the live objects break the promise: [{what, promised, found}]."""
    out = []

    def differ(what: str, promised, found: set[str]) -> None:
        allowed = {promised} if isinstance(promised, str) else set(promised)
        if found - allowed:
            said = " or ".join(sorted(allowed))
            out.append({"what": what, "promised": said, "found": ", ".join(sorted(found))})

    for g in plan["groups"]:
        differ(f"group {g['group']} weights", promise.weights, _dtypes(g["weights"]))
        differ(f"group {g['group']} gradients", promise.weights, _dtypes(g["gradients"]))
    state, want = plan["optimizer_state"], _STATE_KINDS[promise.state]
    # torchao's 8-bit/4-bit/fp8 states keep tensors under 4,096 elements in fp32; an fp32
    # state is in the weights' dtype (AdamW's moments are zeros_like(weight))
    allowed = {want, "float32"} if promise.state in ("8bit", "4bit", "fp8") else {want}
    if promise.state == "fp32":
        allowed |= set(promise.weights)
    found = _dtypes(state)
    if any(not any(a.lower() in k.lower() for a in allowed) for k in found):
        out.append({"what": "optimizer state", "promised": want, "found": ", ".join(sorted(found))})
    where = plan["optimizer_state_elements"]
    if where and max(where, key=where.get) != promise.state_device:  # most of it, by elements
        found_at = ", ".join(f"{n:,} elements on {d}" for d, n in where.items())
        out.append(
            {"what": "optimizer state device", "promised": promise.state_device, "found": found_at}
        )
    if promise.forward_weights:
        differ("weights in the forward", promise.forward_weights, _dtypes(plan["forward_weights"]))
    labels = set(plan.get("labels") or ())  # what the precision converted or kept: its own
    for kind, counts in plan["compute"].items():
        if kind in {t.__name__ for t in MATMULS} or "Float8" in kind:
            found = {d for d in counts if d not in labels}
            differ(f"{kind} compute", promise.compute, found)
    return out


def rows(plan: dict) -> list[dict]:
    """The plan as rows {what, dtype, count} (a table for the loggers: one type per column,
    as W&B's tables need; a count that does not apply is None)."""
    return [{"what": w, "dtype": k, "count": n} for w, k, n in _rows(plan)]


def markdown(plan: dict) -> str:
    """The plan as a table: what, dtype on device, how many tensors (or layers)."""
    lines = ["| what | dtype | tensors / layers |", "|---|---|---|"]
    lines += [f"| {w} | {k} | {'-' if n is None else n} |" for w, k, n in _rows(plan)]
    for m in plan.get("mismatches") or []:
        lines.append(f"| **promised** {m['what']} | {m['promised']}, found {m['found']} | |")
    return "\n".join(lines)


def _rows(plan: dict) -> list[tuple]:
    rows = []
    for g in plan["groups"]:
        rows += [(f"group {g['group']} weights", k, n) for k, n in g["weights"].items()]
        rows += [(f"group {g['group']} gradients", k, n) for k, n in g["gradients"].items()]
    rows += [("optimizer state", k, n) for k, n in plan["optimizer_state"].items()]
    rows += [("master copy", k, n) for k, n in plan["master_copy"].items()]
    rows += [("weights in the forward", k, n) for k, n in plan["forward_weights"].items()]
    for kind, counts in plan["compute"].items():
        rows += [(f"{kind} computes in", k, n) for k, n in counts.items()]
    promise = plan.get("promise") or {}
    if promise.get("reduce"):
        rows.append(("gradients reduced in (as configured)", promise["reduce"], None))
    return rows

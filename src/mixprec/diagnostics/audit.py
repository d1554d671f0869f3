"""Mixed-precision troubleshooting, as measurements.

- dtype audit: under this run's autocast, which modules computed in fp16/bf16 and which stayed in
  fp32, weighted by their share of the forward FLOPs ("check which ops did not use FP16", made
  quantitative).
- tensor-core alignment: Conv/Linear layers whose *channel/feature* counts are not multiples of 8
  (the kernel size does not matter: 3x3 and 7x7 kernels are fine), with their FLOP share: the cost
  of padding them is bounded by that share.
- gradient histograms of the true (unscaled) gradients on logged steps (ledger.py).
- the loss-scale history plot (report/plots.py: loss_scale_plot).

`python -m mixprec.diagnose <the same overrides as train.py>` (diagnose.py) prints the first two
without training; `python train.py diagnose=true ...` writes them into the run dir and W&B, and
adds the other two.
"""

from __future__ import annotations

import json
import logging

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mixprec.core import tasks
from mixprec.diagnostics.replay import MATMULS

log = logging.getLogger("mixprec")
_LAYERS = MATMULS


def _module_flops(model: nn.Module, run_forward) -> dict[str, int]:
    """Forward FLOPs per leaf module name (named_modules() names)."""
    with FlopCounterMode(display=False) as counter:
        run_forward()
    flops = {}
    for name, ops in counter.get_flop_counts().items():
        if name == "Global":
            continue
        key = name.split(".", 1)[1] if "." in name else ""
        flops[key] = sum(ops.values())
    return flops


def _leaf_dtypes(model: nn.Module, owned: dict[str, str]) -> tuple[dict[str, str], list]:
    """Forward hooks that record each leaf module's output dtype (or the precision's own label
    for the modules it converted); returns the dict they fill and the hook handles."""
    dtypes: dict[str, str] = {}

    def hook_for(name: str):
        def hook(m, args, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if name in owned:  # e.g. a float8 matmul with a bf16 output
                dtypes[name] = owned[name]
            elif isinstance(t, torch.Tensor):
                dtypes[name] = str(t.dtype).replace("torch.", "")

        return hook

    handles = [
        mod.register_forward_hook(hook_for(name))
        for name, mod in model.named_modules()
        if next(mod.children(), None) is None
    ]  # leaves only
    return dtypes, handles


def _misaligned(model: nn.Module, leaf_flops: dict[str, int], total: int) -> list[dict]:
    """Conv/Linear layers whose in/out features (Linear) or channels per group (Conv) are not
    multiples of 8, with their share of the forward FLOPs."""
    out = []
    for n, mod in model.named_modules():
        if not isinstance(mod, _LAYERS):
            continue
        dims = (
            {"in": mod.in_features, "out": mod.out_features}
            if isinstance(mod, nn.Linear)
            else {"in": mod.in_channels // mod.groups, "out": mod.out_channels}
        )
        bad = [k for k, v in dims.items() if v % 8]
        if bad:
            out.append(
                {
                    "module": n,
                    "type": type(mod).__name__,
                    **dims,
                    "not_multiple_of_8": ",".join(bad),
                    "share": leaf_flops.get(n, 0) / total,
                }
            )
    return out


def audit(model: nn.Module, x: torch.Tensor, autocast, owned: dict[str, str] | None = None) -> dict:
    """{'modules': [...], 'low_precision_share': f, 'converted': [...], 'converted_share': f,
    'misaligned': [...], 'misaligned_share': f}. `owned`: the modules the precision converted,
    with the dtype they compute in (Precision.owned(): float8 layers under precision=fp8)."""
    owned = owned or {}
    dtypes, handles = _leaf_dtypes(model, owned)
    was_training = model.training
    model.eval()

    def forward():
        with torch.no_grad(), autocast():
            tasks.call(model, x)

    try:
        flops = _module_flops(model, forward)
    except AssertionError as e:  # torch's counter on grouped-query attention kernels (GPU)
        log.warning(
            "dtype audit: torch's FLOP counter cannot count this model (%s); FLOP shares are 0",
            str(e).splitlines()[0][:120] if str(e) else type(e).__name__,
        )
        forward()
        flops = {}
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    leaf_flops = {n: flops.get(n, 0) for n in dtypes}
    total = sum(leaf_flops.values()) or 1
    modules = [
        {
            "module": n,
            "type": type(model.get_submodule(n)).__name__,
            "dtype": d,
            "flops": leaf_flops[n],
            "share": leaf_flops[n] / total,
        }
        for n, d in dtypes.items()
    ]
    low_kinds = {"float16", "bfloat16", *(v for v in owned.values() if "float32" not in v)}
    low = sum(m["flops"] for m in modules if m["dtype"] in low_kinds)  # kept fp32 layers are not
    misaligned = _misaligned(model, leaf_flops, total)
    converted = [m for m in modules if m["module"] in owned]
    return {
        "modules": modules,
        "total_forward_flops": total,
        "low_precision_share": low / total,
        "converted": [{"module": m["module"], "dtype": m["dtype"]} for m in converted],
        "converted_share": sum(m["flops"] for m in converted) / total,
        "misaligned": misaligned,
        "misaligned_share": sum(m["share"] for m in misaligned),
    }


def markdown(result: dict, precision: str) -> str:
    fp32 = [m for m in result["modules"] if m["dtype"] == "float32" and m["flops"]]
    lines = [
        f"## dtype audit ({precision})",
        "",
        f"{100 * result['low_precision_share']:.1f}% of forward FLOPs ran in a low "
        "precision (fp16, bf16, or what the precision converted).",
        "",
    ]
    if result["converted"]:
        names = [m["module"] for m in result["converted"]]
        kinds = sorted({m["dtype"] for m in result["converted"]})
        lines += [
            f"{len(names)} layers converted by the precision ran in {'/'.join(kinds)}, "
            f"{100 * result['converted_share']:.1f}% of forward FLOPs: "
            + ", ".join(names[:12])
            + (" ..." if len(names) > 12 else ""),
            "",
        ]
    if fp32:
        lines += [
            "Modules with FLOPs that stayed in fp32:",
            "",
            "| module | type | share of FLOPs |",
            "|---|---|---|",
        ]
        lines += [
            f"| {m['module']} | {m['type']} | {100 * m['share']:.2f}% |"
            for m in sorted(fp32, key=lambda m: -m["share"])[:20]
        ]
    by_type: dict[tuple, float] = {}
    for m in result["modules"]:
        by_type[(m["type"], m["dtype"])] = by_type.get((m["type"], m["dtype"]), 0) + m["share"]
    lines += ["", "| layer type | output dtype | share of FLOPs |", "|---|---|---|"]
    lines += [
        f"| {t} | {d} | {100 * s:.2f}% |"
        for (t, d), s in sorted(by_type.items(), key=lambda kv: -kv[1])
    ]
    lines += ["", "## tensor-core alignment (channels/features not multiples of 8)", ""]
    if not result["misaligned"]:
        lines.append("Every Conv/Linear layer is aligned.")
    else:
        lines += [
            f"{len(result['misaligned'])} layers, {100 * result['misaligned_share']:.2f}% of "
            "forward FLOPs (the first conv's 3 input channels are usually unavoidable):",
            "",
            "| module | type | in | out | not a multiple of 8 | share |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {m['module']} | {m['type']} | {m['in']} | {m['out']} | "
            f"{m['not_multiple_of_8']} | {100 * m['share']:.2f}% |"
            for m in result["misaligned"]
        ]
    return "\n".join(lines) + "\n"


def on_run(parts, tracker) -> None:
    """diagnose=true: the audit of a run's model (build.Parts) into the run dir and the loggers
    (the gradient histograms are the ledger's, on logged steps: ledger.py)."""
    from mixprec.models import unwrap

    prec, run_dir = parts.learner.precision, parts.run_dir
    result = audit(unwrap(parts.learner.model), parts.example(), prec.autocast, prec.audited())
    (run_dir / "diagnose.md").write_text(markdown(result, prec.name))
    (run_dir / "diagnose.json").write_text(json.dumps(result, indent=1))
    log.info(
        "diagnose: %.1f%% of forward FLOPs in fp16/bf16; %d misaligned layers (%.2f%% of FLOPs); "
        "details in %s",
        100 * result["low_precision_share"],
        len(result["misaligned"]),
        100 * result["misaligned_share"],
        run_dir / "diagnose.md",
    )
    tracker.table("diagnose/dtype_audit", result["modules"])
    tracker.table("diagnose/misaligned", result["misaligned"])

"""Per-layer numerics of the low-precision casts (debug.numerics=true; off by default, and then
no hook exists and nothing runs).

On every logged step (each `log_every` steps) the step's first micro-batch is run once more,
eagerly, with hooks (replay.untouched: the run trains exactly as without it), and for each layer
that computes in a low precision the three tensors its matmul casts are measured under the
cast that layer really does:
- a float8 layer (torchao's Float8Linear): its input, weight and output gradient under its own
  recipe's scaling (the layer's CastConfig: e4m3 or e5m2, per tensor or per row, power-of-two
  scales), through torchao's own `tensor_to_scale` and `to_fp8_saturated`;
- an fp16 or bf16 layer (a Linear or conv under autocast): the same three under a plain cast,
  the gradient at the run's current loss scale (as GradScaler's backward makes it).
Per tensor: `amax` (largest |x|), `underflow` (the share of its non-zero elements that become 0),
`subnormal` (the share of them left below the format's smallest normal: fewer mantissa bits,
one step from flushing), `saturated` (the share at or beyond the format's largest value: clamped
in float8, inf in fp16) and `sqnr_db` (signal-to-quantisation-noise ratio of the cast against
the tensor before it, 10 log10(sum x^2 / sum (x - cast(x))^2): about 30 dB for e4m3, 55 for
bf16, 75 for fp16; null where the cast lost nothing). An fp16/bf16 layer's output gradient is
made in that dtype by autocast's backward: its cast is lossless, and what it lost shows as
`subnormal` (and as underflow in the layers that made it).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from torch import nn

from mixprec.core import files
from mixprec.diagnostics.replay import MATMULS, untouched

log = logging.getLogger(__name__)
FIELDS = ("layer", "type", "format", "tensor", "amax", "underflow", "subnormal", "saturated")
FIELDS += ("sqnr_db",)


def cast_numerics(
    x: torch.Tensor, dtype: torch.dtype, rowwise: bool = False, pow2: bool = False
) -> dict:
    """What casting `x` to `dtype` does to it. A float8 dtype is scaled as torchao scales it
    (amax to the format's max, per tensor or per row of the last dim, the scale rounded down to
    a power of two if asked); fp16/bf16 are a plain cast."""
    x = x.detach()
    xf = x.float()
    if dtype.itemsize == 1:  # float8: torchao's own scaling and saturating cast
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

        granularity = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE
        scale = tensor_to_scale(
            x,
            dtype,
            scaling_granularity=granularity,
            axiswise_dim=-1 if rowwise else None,
            round_scales_to_power_of_2=pow2,
        )
        scaled = xf * scale
        q = to_fp8_saturated(scaled, dtype).float()
        back = q / scale
    else:
        scaled = xf
        q = back = x.to(dtype).float()
    info = torch.finfo(dtype)
    nonzero = xf != 0
    n_nonzero = max(int(nonzero.sum()), 1)
    small = (q != 0) & (q.abs() < info.smallest_normal)
    signal, noise = float(xf.square().sum()), float((xf - back).square().sum())
    return {
        "amax": float(xf.abs().max()) if xf.numel() else 0.0,
        "underflow": int((nonzero & (q == 0)).sum()) / n_nonzero,
        "subnormal": int(small.sum()) / n_nonzero,
        "saturated": int((scaled.abs() >= _beyond(info)).sum()) / max(xf.numel(), 1),
        "sqnr_db": _db(signal, noise),
    }


def _beyond(info: torch.finfo) -> float:
    """The smallest |x| the cast does not round to the format's max: half an ulp above it
    (clamped there in float8, inf in fp16). e4m3: 464; fp16: 65520."""
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


def _db(signal: float, noise: float) -> float | None:
    """SQNR in dB; None where it is not a number: the cast lost nothing (a tensor already in
    that dtype), or the tensor is all zeros or not finite."""
    if not (math.isfinite(signal) and math.isfinite(noise)) or noise == 0 or signal == 0:
        return None
    return 10 * math.log10(signal / noise)


def _casts(mod: nn.Module, autocast: torch.dtype | None) -> dict | None:
    """{tensor: (dtype, rowwise, pow2)} for a layer's three casts; None: not low precision."""
    config = getattr(mod, "config", None)
    if config is not None and hasattr(config, "cast_config_input"):  # torchao's Float8Linear
        from torchao.float8.config import ScalingGranularity

        pow2 = bool(getattr(config, "round_scales_to_power_of_2", False))

        def how(cc):
            return (cc.target_dtype, cc.scaling_granularity is ScalingGranularity.AXISWISE, pow2)

        return {
            "input": how(config.cast_config_input),
            "weight": how(config.cast_config_weight),
            "grad_output": how(config.cast_config_grad_output),
        }
    if autocast is None or not isinstance(mod, MATMULS):
        return None
    return dict.fromkeys(("input", "weight", "grad_output"), (autocast, False, False))


def _label(casts: dict) -> str:
    dtype, rowwise, _ = casts["input"]
    name = str(dtype).replace("torch.", "")
    return f"{name} {'rowwise' if rowwise else 'tensorwise'}" if dtype.itemsize == 1 else name


def probe(learner, micro_batch: tuple, scale: float) -> list[dict]:
    """One eager forward and backward of `micro_batch` with the loss scaled by `scale`; a row
    per (low-precision layer, tensor). The run's gradients, buffers and RNG are untouched."""
    from mixprec.models import unwrap

    model, prec = unwrap(learner.model), learner.precision
    kept = set(prec.kept)  # (and what sits inside them: they compute in fp32)
    layers = {
        name: (mod, casts)
        for name, mod in model.named_modules()
        if not any(name == k or name.startswith(k + ".") for k in kept)
        and (casts := _casts(mod, prec.dtype)) is not None
    }
    rows: list[dict] = []
    outputs: dict[str, torch.Tensor] = {}

    def row(name, mod, casts, tensor, t):
        base = {"layer": name, "type": type(mod).__name__, "format": _label(casts)}
        dtype, rowwise, pow2 = casts[tensor]
        if dtype.itemsize == 1 and prec.dtype is not None:
            t = t.to(prec.dtype)  # torchao casts the autocast dtype's tensor, not fp32's
        rows.append({**base, "tensor": tensor, **cast_numerics(t, dtype, rowwise, pow2)})

    def hook_for(name, mod, casts):
        def hook(_mod, args, out):
            if name in outputs or not args or not isinstance(out, torch.Tensor):
                return  # a layer called twice: its first call
            row(name, mod, casts, "input", args[0])
            row(name, mod, casts, "weight", mod.weight)
            if out.requires_grad:
                outputs[name] = out

        return hook

    x, y = micro_batch
    with untouched(model):
        handles = [m.register_forward_hook(hook_for(n, m, c)) for n, (m, c) in layers.items()]
        try:
            with prec.autocast():
                loss = learner.batch_loss(x, y, model)[1]
        finally:
            for h in handles:
                h.remove()
        names = list(outputs)
        if names and loss.requires_grad:
            grads = torch.autograd.grad(
                loss.float() * scale, [outputs[n] for n in names], allow_unused=True
            )
            for name, g in zip(names, grads):
                if g is not None:
                    mod, casts = layers[name]
                    row(name, mod, casts, "grad_output", g)
    return rows


def worst(rows: list[dict], n: int = 8) -> list[dict]:
    """The rows that lose most: most underflow, then most saturation, then the lowest SQNR."""

    def key(r):
        sqnr = r["sqnr_db"] if r["sqnr_db"] is not None else math.inf
        return (-r["underflow"], -r["saturated"], -r["subnormal"], sqnr)

    return sorted(rows, key=key)[:n]


def table(rows: list[dict]) -> str:
    """A markdown table of numerics rows."""
    out = [
        "| layer | type | format | tensor | amax | underflow | subnormal | saturated | SQNR dB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sqnr = "lossless" if r["sqnr_db"] is None else f"{r['sqnr_db']:.1f}"
        out.append(
            f"| {r['layer']} | {r['type']} | {r['format']} | {r['tensor']} | {r['amax']:.3g} | "
            f"{100 * r['underflow']:.3f}% | {100 * r['subnormal']:.3f}% | "
            f"{100 * r['saturated']:.4f}% | {sqnr} |"
        )
    return "\n".join(out)


class Numerics:
    """debug.numerics: probe() on logged steps; rows into numerics.jsonl (run dir), curves
    into the loggers and the latest worst layers into the summary. Off: it does nothing."""

    def __init__(self, learner=None, run_dir: Path | None = None, rerun: bool = True) -> None:
        """`rerun`: false where a forward cannot be re-run with hooks (CUDA graphs, a model
        sharded over several ranks: as for the doctor)."""
        from mixprec.models import unwrap
        from mixprec.parallel.sharding import is_sharded

        usable = learner is not None and run_dir is not None and rerun
        if usable and is_sharded(unwrap(learner.model)):
            usable = False
        if learner is not None and run_dir is not None and not usable:
            log.warning(
                "debug.numerics: the forward cannot be re-run here (CUDA graphs or a sharded "
                "model); no numerics are measured"
            )
        if usable and learner.precision.dtype is None and not learner.precision.owned():
            log.info(
                "debug.numerics: precision=%s casts nothing (no autocast, no converted layer): "
                "nothing to probe; the numerics of a cast are measured at amp, bf16 or fp8",
                learner.precision.name,
            )
            usable = False
        self.learner = learner if usable else None
        self.path = run_dir / "numerics.jsonl" if usable else None
        self.latest: list[dict] = []

    @property
    def enabled(self) -> bool:
        return self.learner is not None

    def on_logged(self, step: int, micro_batches: list | None, tracker) -> None:
        if self.learner is None or not micro_batches:
            return
        rows = probe(self.learner, micro_batches[0], self.learner.precision.loss_scale())
        if not rows:
            return
        with files.space_checked(self.path), self.path.open("a") as f:  # a full disk: exit 8
            f.write("".join(json.dumps({"step": step, **r}) + "\n" for r in rows))
        curves = {}
        for r in rows:
            key = f"numerics/{r['layer']}/{r['tensor']}"
            curves[f"{key}/underflow"] = r["underflow"]
            curves[f"{key}/subnormal"] = r["subnormal"]
            curves[f"{key}/sqnr_db"] = r["sqnr_db"]
        curves["numerics/underflow_max"] = max(r["underflow"] for r in rows)
        curves["numerics/saturated_max"] = max(r["saturated"] for r in rows)
        finite = [r["sqnr_db"] for r in rows if r["sqnr_db"] is not None]
        curves["numerics/sqnr_db_min"] = min(finite) if finite else None
        tracker.log(curves, step)
        self.latest = [{"step": step, **r} for r in worst(rows)]
        log.info("numerics at step %d, the worst layers:\n%s", step, table(worst(rows, 5)))


TEXT = ("layer", "type", "format", "tensor")
NUMBERS = ("amax", "underflow", "subnormal", "saturated")


def read(run_dir: Path) -> list[dict]:
    """numerics.jsonl's probe rows (empty when the run did not measure them); a torn line, or a
    row without a probe's keys (an older or partial file), is skipped with a warning."""
    from mixprec.sinks.local import read_jsonl

    path = Path(run_dir) / "numerics.jsonl"
    rows = read_jsonl(path) if path.exists() else []
    whole = [r for r in rows if _probe_row(r)]
    if len(whole) < len(rows):
        log.warning("%s: %d rows are not probe rows; skipped", path, len(rows) - len(whole))
    return whole


def _probe_row(r: dict) -> bool:
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    return (
        all(isinstance(r.get(k), str) for k in TEXT)
        and all(number(r.get(k)) for k in NUMBERS)
        and (r.get("sqnr_db") is None or number(r.get("sqnr_db")))
    )

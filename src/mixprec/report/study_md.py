"""study.md's text: the table of the answer at the main target, each precision's verdict, the
speedup against training length with its two factors, and the rules (censoring, left out)."""

from __future__ import annotations

import math

from mixprec.report.curves import LEVEL
from mixprec.report.report import escape


def _pm(v: tuple | None, fmt: str = "{:.4f}") -> str:
    return "-" if v is None else f"{fmt.format(v[0])} ± {fmt.format(v[1])}"


def _interval(r) -> str:  # (a study.Row)
    if r.interval is None:
        return "-"
    return f"{r.interval[0]:.2f}-{r.interval[1]:.2f}{'' if r.paired else ' (W)'}"


def markdown(result: dict) -> str:
    ref, target, budget = result["reference"], result["target"], result.get("budget")
    where = f"its seeds' worst at step {budget}" if budget else "its seeds' worst final"
    if result.get("smooth", "none") == "power":
        fits = [s.fit for s in result["seeds"] if s.fit]
        how = (
            "read from each seed's fit L = a + b s^-c to its evaluations from step "
            f"{min(f['first'] for f in fits) if fits else '-'} (largest RMS residual "
            f"{max((f['rms'] for f in fits), default=float('nan')):.4f})"
        )
        if result.get("unfitted"):
            how += f"; not fitted, raw crossings: {escape(', '.join(result['unfitted']))}"
    else:
        how = "interpolated between evaluations"
    out = [
        f"## Time to the same quality (reference {escape(ref)}, target val loss {target:.4f}: "
        f"{where})\n",
        "Training seconds to the target (steps only: evaluation, checkpoints and the first "
        f"step's compile left out), {how}; speedup = the reference's time / this one's, "
        f"the geometric mean over seeds with a {LEVEL:.0%} paired t interval on the per-seed "
        "log ratios (seed k of every precision starts from the same weights and sees the same "
        "batches), or Welch's t on the log times where the seeds do not pair (marked W). "
        "Rates: steady state, each run alone on its device.\n",
        "| precision | seeds | tokens/s (samples/s) | raw rate vs ref | final val loss | "
        "steps to target | seconds to target | loss-matched speedup | interval | skipped "
        "| peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        out.append(
            f"| {escape(r.precision)} | {r.seeds} | {_pm(r.rate, '{:,.0f}')} | "
            f"{'-' if r.rate_vs_ref is None else f'{r.rate_vs_ref:.2f}'} | {_pm(r.final)} | "
            f"{'-' if r.steps_to is None else f'{r.steps_to:.0f}'} | "
            f"{_pm(r.seconds_to, '{:.1f}')} | "
            f"{'-' if r.speedup is None else f'**{r.speedup:.2f}**'} | "
            f"{_interval(r)} | "
            f"{r.skipped} | {'-' if r.peak_gib is None else f'{r.peak_gib:.1f}'} |"
        )
    out.append("")
    out += [f"- {escape(r.verdict)}" for r in result["rows"]]
    out += _length_table(result)
    censored = sum(len(r.censored) for r in result["rows"])
    out += [
        "",
        "A seed that never reaches a target, or diverges, counts against its precision "
        "(censored): its time is at least its whole training time and at least the slowest "
        "reaching seed's, so its ratio is at most the lowest of the seeds that reached it; "
        f"at the main target this touched {censored} seed(s). A run that crashed (a bug, out "
        "of memory, a kill) is named and left out.",
    ]
    out += _noise(result.get("eval_noise"))
    if result.get("left_out"):
        out += ["", "Left out (not counted as seeds):"]
        out += [f"- {escape(why)}" for why in result["left_out"]]
    return "\n".join(out) + "\n"


def _noise(n: dict | None) -> list[str]:
    """The evaluation's own noise against the spread between seeds."""
    head = ["", "### Evaluation noise", ""]
    if not n:
        return head + [
            "Not measured: these runs predate val/loss_noise (the loss on two halves of the "
            "validation set, logged at every evaluation), or the reference has fewer than 2 "
            "seeds."
        ]
    share = n["share"]
    if share is None:
        verdict = "the seeds end at the same loss: nothing to compare the noise with"
    elif share <= 0.25:
        verdict = "small against it: the validation set is large enough for this study"
    else:
        more = max(4, math.ceil((share / 0.25) ** 2))
        verdict = (
            f"not small against it: a validation set {more}x as large (data.val_sequences, "
            "or your val split) would bring it to a quarter (the noise falls as its square root)"
        )
    return head + [
        f"One evaluation's standard error, from the same weights on two halves of the "
        f"validation set (val/loss_noise, the median over the reference's evaluations): "
        f"{n['noise']:.4f}; the spread between the reference's seeds at the end (their final "
        f"loss's standard deviation): {n['seed_spread']:.4f}; the noise is "
        f"{'-' if share is None else f'{share:.0%}'} of the spread, {verdict}."
    ]


def _ratio(v: float | None, iv: tuple | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" + (f" ({iv[0]:.2f}-{iv[1]:.2f})" if iv else "")


def _length_table(result: dict) -> list[str]:
    """Speedup against training length, with its two factors (the rate ratio is the same
    at every length: time per step over the whole run)."""
    points = result.get("by_length") or []
    if not points:
        return []
    out = [
        "",
        "### Speedup against training length",
        "",
        "At each point the target is the reference's loss at that step (its worst seed's); "
        "speedup = rate ratio (time per step) x convergence ratio (steps to the target), each "
        f"the reference's over this one's with its {LEVEL:.0%} interval over seeds. A speedup "
        "that falls along the run is a precision that learns less per step as it goes on.",
        "",
        "| reference step | target | precision | speedup | convergence ratio | rate ratio "
        "| censored |",
        "|---|---|---|---|---|---|---|",
    ]
    for pt in points:
        for r in pt["rows"]:
            if r.precision == result["reference"]:
                continue
            out.append(
                f"| {pt['step']} ({pt['fraction']:.0%}) | {pt['target']:.4f} | "
                f"{escape(r.precision)} | {_ratio(r.speedup, r.interval)} | "
                f"{_ratio(r.convergence, r.convergence_interval)} | "
                f"{_ratio(r.rate_ratio, r.rate_interval)} | {len(r.censored)} |"
            )
    return out

"""study.md's text: the table of the answer at the main target, each precision's verdict, the
speedup against training length with its two factors, and the rules (censoring, left out)."""

from __future__ import annotations

from mixprec.report.curves import FIT_NOISE, LEVEL
from mixprec.report.report import escape

PAIRING = (
    "Seed k of every precision shares its initial weights and its batches, in order; not its "
    "kernels' rounding, nor (on a GPU, without trainer.deterministic=true) their order of "
    "summation, so two runs of one seed drift apart and the pairing removes only what the "
    "shared start and data make common."
)


def _pm(v: tuple | None, fmt: str = "{:.4f}") -> str:
    return "-" if v is None else f"{fmt.format(v[0])} ± {fmt.format(v[1])}"


def _interval(r) -> str:  # (a study.Row)
    if r.interval is None:
        return "-"
    return f"{r.interval[0]:.2f}-{r.interval[1]:.2f}{'' if r.paired else ' (W)'}"


def _how(result: dict) -> str:
    """How each seed's crossing was read: between raw evaluations, or on a checked fit."""
    how = "interpolated between the two evaluations around its first crossing"
    if result.get("smooth", "none") == "power":
        fits = [s.fit for s in result["seeds"] if s.fit]
        how = (
            f"placed on each seed's fit L = a + b s^-c where the fit is within {FIT_NOISE:g}x "
            f"the seed's evaluation noise ({len(fits)} seeds; largest RMS residual "
            f"{max((f['rms'] for f in fits), default=float('nan')):.4f}), else {how}"
        )
        if result.get("unfitted"):
            how += f"; not fitted: {escape('; '.join(result['unfitted']))}"
    return how + " (whether a seed reached the target is read from its evaluations)"


def markdown(result: dict) -> str:
    ref, target, budget = result["reference"], result["target"], result.get("budget")
    where = (
        "as given (--target or study.target)"
        if result.get("target_given")
        else f"its seeds' worst evaluated loss at step {budget}"
        if budget
        else "its seeds' worst final evaluation"
    )
    how = _how(result)
    out = [
        f"## Time to the same quality (reference {escape(ref)}, target val loss {target:.4f}: "
        f"{where})\n",
        "Training seconds to the target (steps only: evaluation, checkpoints and the first "
        f"step's compile left out), {how}; speedup = the reference's time / this one's, "
        f"the geometric mean over seeds with a {LEVEL:.0%} paired t interval on the per-seed "
        "log ratios, or Welch's t on the log times where the seeds do not pair (marked W). "
        f"{PAIRING} "
        "Every column of a row is over the same seeds (a censored seed at its bound, marked "
        ">=), so speedup = rate ratio x convergence ratio. Rates: steady state, each run alone "
        "on its device.\n",
        "| precision | seeds | tokens/s (samples/s) | raw rate vs ref | final val loss | "
        "steps to target | seconds to target | loss-matched speedup | interval | skipped "
        "| peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    out += [_table_row(r) for r in result["rows"]]
    out.append("")
    out += [f"- {escape(r.verdict)}" for r in result["rows"]]
    out += _horizon(result)
    spreads = [f"{escape(r.precision)} {r.log_spread:.3f}" for r in result["rows"] if r.log_spread]
    if spreads:
        out.append(
            "- per-seed spread of the log speedup (first passage, paired): " + ", ".join(spreads)
        )
    out += _band(result)
    out += _prediction(result)
    out += _coverage(result)
    out += _length_table(result)
    out += curve_table(result)
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


def _horizon(result: dict) -> list[str]:
    """The length the answer was measured at: the convergence ratio changes with it."""
    ends = [s.curve[-1].step for s in result.get("seeds", []) if s.curve]
    if not ends:
        return []
    return [
        f"- measured over runs of {min(ends)} steps (the reference's shortest): the convergence "
        "ratio, and so the speedup, changes with the length of training; this answer is not "
        "one for longer runs"
    ]


def _band(result: dict) -> list[str]:
    """The speedup over a band of targets around the main one, and the headline to quote."""
    rows = result.get("band") or []
    if not rows:
        return []
    steps = [p["step"] for p in rows[0]["points"]]
    out = [
        "",
        "### Over a band of targets",
        "",
        f"One target can sit where the precisions happen to be close or far. The targets here "
        f"are the reference's worst loss at each step from {steps[0]} to {steps[-1]} (0.85x to "
        "1.15x of its budget); the headline to quote is the band's median, its range beside it.",
        "",
        "| precision | headline: the band's median | range over the band | spread across it "
        "(log) | at each step |",
        "|---|---|---|---|---|",
    ]
    for b in rows:
        each = ", ".join(f"{p['step']}: {p['speedup']:.2f}" for p in b["points"])
        spread = "-" if b["log_spread"] is None else f"{b['log_spread']:.3f}"
        out.append(
            f"| {escape(b['precision'])} | **{b['median']:.2f}** | {b['range'][0]:.2f}-"
            f"{b['range'][1]:.2f} | {spread} | {each} |"
        )
    return out


def _table_row(r) -> str:
    at_least = ">=" if r.censored else ""
    return (
        f"| {escape(r.precision)} | {r.seeds} | {_pm(r.rate, '{:,.0f}')} | "
        f"{'-' if r.rate_vs_ref is None else f'{r.rate_vs_ref:.2f}'} | {_pm(r.final)} | "
        f"{'-' if r.steps_to is None else f'{at_least}{r.steps_to:.0f}'} | "
        f"{'' if r.seconds_to is None else at_least}{_pm(r.seconds_to, '{:.1f}')} | "
        f"{'-' if r.speedup is None else f'**{r.speedup:.2f}**'} | "
        f"{_interval(r)} | "
        f"{r.skipped} | {'-' if r.peak_gib is None else f'{r.peak_gib:.1f}'} |"
    )


def _prediction(result: dict) -> list[str]:
    """One new seed pair's speedup (the prediction interval), and each seed against the
    interval the others give it (leave one out)."""
    rows = [r for r in result["rows"] if r.prediction]
    if not rows:
        return []
    out = [
        "",
        "### One new pair of runs",
        "",
        f"The interval above is the mean's: it narrows as seeds are added. One new run of each "
        f"precision (a user's) lands in the {LEVEL:.0%} prediction interval, the per-seed log "
        "ratios' mean ± t sd sqrt(1 + 1/n), which does not narrow. Leave one out: each seed "
        "against the prediction interval of the others (at 95 %, about 1 in 20 falls outside).",
        "",
        "| precision | speedup (mean's interval) | one new pair (prediction) | seeds inside the "
        "others' interval | outside |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        inside = [x for x in r.leave_one_out if x["inside"]]
        outside = ", ".join(
            f"seed {x['seed']} {x['ratio']:.2f} ({x['interval'][0]:.2f}-{x['interval'][1]:.2f})"
            for x in r.leave_one_out
            if not x["inside"]
        )
        out.append(
            f"| {escape(r.precision)} | {_ratio(r.speedup, r.interval)} | "
            f"{r.prediction[0]:.2f}-{r.prediction[1]:.2f} | "
            f"{len(inside)} of {len(r.leave_one_out)} | {outside or '-'} |"
        )
    return out


def _coverage(result: dict) -> list[str]:
    """What the intervals keep when the seeds were added until they were narrow enough, and
    the intervals widened to keep LEVEL together (report/coverage.py)."""
    cov = result.get("coverage")
    if not cov:
        return []
    from mixprec.report.coverage import widened

    curves = {c["precision"]: c for c in result.get("curve_match", [])}
    rows = {r.precision: r for r in result["rows"]}
    width = next(iter(cov.values()))["width"]
    out = [
        "",
        f"### Seeds added until ±{width:g}: what the intervals keep",
        "",
        "The seeds were added until every interval was narrow enough; that stops more often "
        "when the spread came out small by chance, and then an interval is too narrow. Replayed "
        "20,000 times at this study's own per-seed spreads and their correlation (true speedup "
        f"known), the {LEVEL:.0%} intervals held it this often; widened by the factor, the two "
        f"together hold it {LEVEL:.0%} of the time. Quote the widened intervals.",
        "",
        "| precision | spreads (first passage, whole curve), correlation | coverage: first "
        "passage, whole curve, both | factor | first passage, widened | whole curve, widened |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in cov.items():
        r, w = rows[name], curves[name]
        fp = widened(r.speedup, r.interval, c["inflation"])
        wc = widened(w["speedup"], w["interval"], c["inflation"])
        out.append(
            f"| {escape(name)} | {c['spreads'][0]:.3f}, {c['spreads'][1]:.3f}, {c['rho']:.2f} | "
            f"{c['each'][0]:.1%}, {c['each'][1]:.1%}, {c['all']:.1%} | {c['inflation']:.2f} | "
            f"{_ratio(r.speedup, fp)} | {_ratio(w['speedup'], wc)} |"
        )
    return out


def _noise(n: dict | None) -> list[str]:
    """The two noises beside the spread between seeds: the validation set's (a common offset)
    and the weights' wobble between evaluations (what moves a crossing)."""
    head = ["", "### Evaluation noise", ""]
    if not n:
        return head + [
            "Not measured: these runs predate val/loss_noise (the loss on two halves of the "
            "validation set, logged at every evaluation), or the reference has fewer than 2 "
            "seeds."
        ]
    wobble = n.get("wobble")
    moves = (
        f"What moves a seed's crossing is its weights wobbling between evaluations: {wobble:.4f} "
        "nats around its own smooth curve (the median over the reference's seeds of each "
        "evaluation minus the mean of its neighbours, from half the run on), against the "
        f"spread of the reference's final losses, {n['seed_spread']:.4f}. More seeds narrow the "
        "answer; a larger validation set does not."
        if wobble is not None
        else "Too few evaluations from half the run on to measure the weights' wobble."
    )
    return head + [
        f"One evaluation's standard error from the validation set's sampling (val/loss_noise, "
        f"the same weights on its two halves; the median over the reference's evaluations): "
        f"{n['noise']:.4f}. Every seed is evaluated on the same set, so this error is mostly an "
        "offset common to the seeds, not a spread between them: it does not set how far apart "
        f"their crossings fall. {moves}"
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


def _nats(v: float | None, iv: tuple | None) -> str:
    if v is None:
        return "-"
    return f"{v:+.4f}" + (f" ({iv[0]:+.4f} to {iv[1]:+.4f})" if iv else "")


def curve_table(result: dict) -> list[str]:
    """The whole-curve estimate (curve_match) beside first passage."""
    rows = result.get("curve_match") or []
    if not rows:
        return []
    lo, hi = rows[0]["window"]
    out = [
        "",
        "### The whole curve, paired",
        "",
        f"At every evaluation from step {lo} to {hi}, seed k's loss minus the reference's seed "
        "k's, added to the reference's mean curve and read off it as a step: the steps of the "
        "reference that this precision's steps are worth (the convergence ratio, averaged on "
        "the log scale), times the rate ratio. It reads every evaluation in the window, where "
        f"first passage reads one; {LEVEL:.0%} paired t intervals. Per-seed spread: the "
        "standard deviation of the per-seed log speedup (±0.05 at 95 % takes about "
        "(2 x spread / 0.05)^2 seeds). Final loss: this precision's minus the reference's at "
        "the last common evaluation, paired, in nats (below 0: lower loss).",
        "",
        "| precision | seeds | speedup | convergence ratio | rate ratio | per-seed spread (log) "
        "| final loss difference (nats) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spread = "-" if r["log_spread"] is None else f"{r['log_spread']:.3f}"
        out.append(
            f"| {escape(r['precision'])} | {r['seeds']} | "
            f"{_ratio(r['speedup'], r['interval'])} | "
            f"{_ratio(r['convergence'], r['convergence_interval'])} | "
            f"{_ratio(r['rate_ratio'], r['rate_interval'])} | {spread} | "
            f"{_nats(r['final_diff'], r['final_diff_interval'])} |"
        )
    beyond = sum(r["beyond"] for r in rows)
    if beyond:
        out += [
            "",
            f"{beyond} evaluation(s) below anything the reference's mean curve reached were "
            "read at its last step (a bound: the estimate is then a floor).",
        ]
    return out

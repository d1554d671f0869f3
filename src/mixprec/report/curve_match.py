"""The whole-curve estimate of a study (beside first passage): at every evaluation in the last
half of the reference's budget, seed k's loss difference from the reference's seed k (the same
initial weights and batches: what makes seed k high or low is largely common to both), added to
the reference's mean curve and read off it as a step: how many of the reference's steps this
precision's steps are worth there. The log of that ratio, averaged over the window, is seed k's
convergence ratio; times its rate ratio (seconds per step over the run), its speedup. One
crossing reads one noisy evaluation; this reads every evaluation in the window, each paired, so
its per-seed spread is what a study of few seeds can resolve. Beside it, the paired difference
of the final losses, in nats."""

from __future__ import annotations

import math
import statistics

from mixprec.report.curves import LEVEL, Point, crossing, loss_at, paired_interval

WINDOW = 0.5  # the window starts at this fraction of the budget (past warm-up's transient)


def curve_match(seeds: list, reference: str, budget: int | None) -> list[dict]:
    """One entry per precision other than the reference: speedup, convergence and rate ratios
    with their paired intervals, the per-seed log spread, the final-loss difference."""
    usable = [s for s in seeds if s.curve and not s.diverged and _finished(s)]
    ref = {s.seed: s for s in usable if s.precision == reference}
    if len(ref) < 1:
        return []
    end = budget or min(s.curve[-1].step for s in ref.values())
    mean = _mean_curve(list(ref.values()))
    out = []
    for precision in sorted({s.precision for s in usable} - {reference}):
        mine = [s for s in usable if s.precision == precision and s.seed in ref]
        per_seed = [_one(s, ref[s.seed], mean, end) for s in mine]
        per_seed = [p for p in per_seed if p]
        if per_seed:
            out.append(_summary(precision, per_seed, end))
    return out


def _finished(s) -> bool:
    return s.status in ("completed", "preempted")


def _mean_curve(ref: list) -> list[Point]:
    """The reference seeds' mean loss at the first seed's evaluation steps that every seed
    reached (linear between a seed's own evaluations)."""
    out = []
    for p in ref[0].curve:
        at = [loss_at(s.curve, p.step) for s in ref]
        if any(v is None or not math.isfinite(v) for v in at):
            break
        out.append(Point(p.step, 0.0, statistics.fmean(at)))
    return out


def _one(s, r, mean: list[Point], end: int) -> dict | None:
    """Seed k of a precision against seed k of the reference."""
    logs, beyond = [], 0
    for p in s.curve:
        if not (WINDOW * end <= p.step <= end) or not math.isfinite(p.loss):
            continue
        theirs = loss_at(r.curve, p.step)
        if theirs is None:
            continue
        level = loss_at(mean, p.step)
        if level is None:
            continue
        hit = crossing(mean, level + p.loss - theirs)
        if hit is None:  # below anything the reference's mean reached: at least its last step
            beyond += 1
            hit = (float(mean[-1].step), 0.0)
        logs.append(math.log(max(hit[0], 1.0) / p.step))
    if not logs or not (_per_step(s) and _per_step(r)):
        return None
    last = min(s.curve[-1].step, r.curve[-1].step)
    return {
        "seed": s.seed,
        "convergence": math.exp(statistics.fmean(logs)),
        "rate": _per_step(r) / _per_step(s),
        "final_diff": loss_at(s.curve, last) - loss_at(r.curve, last),
        "points": len(logs),
        "beyond": beyond,
    }


def _per_step(s) -> float | None:
    last = s.curve[-1]
    return last.train_s / last.step if last.step and last.train_s else None


def _summary(precision: str, per_seed: list[dict], end: int) -> dict:
    speed = [p["rate"] * p["convergence"] for p in per_seed]
    speedup, interval = paired_interval(speed)
    convergence, c_interval = paired_interval([p["convergence"] for p in per_seed])
    rate, r_interval = paired_interval([p["rate"] for p in per_seed])
    diffs = [p["final_diff"] for p in per_seed]
    return {
        "precision": precision,
        "seeds": len(per_seed),
        "window": [math.ceil(WINDOW * end), end],
        "speedup": speedup,
        "interval": interval,
        "convergence": convergence,
        "convergence_interval": c_interval,
        "rate_ratio": rate,
        "rate_interval": r_interval,
        "log_spread": statistics.stdev(map(math.log, speed)) if len(speed) > 1 else None,
        "final_diff": statistics.fmean(diffs),
        "final_diff_interval": mean_interval(diffs),
        "beyond": sum(p["beyond"] for p in per_seed),
        "per_seed": per_seed,
    }


def mean_interval(values: list[float]) -> tuple[float, float] | None:
    """The mean's t interval (None with fewer than 2 values)."""
    if len(values) < 2:
        return None
    from scipy.stats import t

    m, sd = statistics.fmean(values), statistics.stdev(values)
    half = t.ppf(0.5 + LEVEL / 2, len(values) - 1) * sd / math.sqrt(len(values))
    return m - half, m + half

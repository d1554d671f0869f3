"""The arithmetic of a time-to-quality study (study.py): where a validation curve reaches a
target loss (between two evaluations, or on a fitted curve a + b (s/s0)^-c), and intervals over
seeds for a ratio of times (paired t on per-seed ratios, Welch's t on two groups)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

LEVEL = 0.95
MIN_FIT = 5  # evaluations a fit needs (3 parameters, 2 left for the residual)
FIT_NOISE = 2.0  # a fit is used where its RMS residual is at most this x the evaluation noise


@dataclass
class Point:
    step: int
    train_s: float
    loss: float


def crossing(curve: list[Point], target: float) -> tuple[float, float] | None:
    """(step, train_s) where the loss first reaches `target`, linear between evaluations."""
    prev = None
    for p in curve:
        if p.loss <= target:
            if prev is None or prev.loss == p.loss:
                return float(p.step), p.train_s
            f = (prev.loss - target) / (prev.loss - p.loss)
            return prev.step + f * (p.step - prev.step), prev.train_s + f * (
                p.train_s - prev.train_s
            )
        prev = p
    return None


def fit_curve(curve: list[Point], fit_from: int | None = None) -> dict | None:
    """Least squares of L(s) = a + b (s/s0)^-c on the evaluations from `fit_from` (10 % of
    the last step when None): {a, b, c, s0, first, last, rms}, or None (too few points, or
    no convergence)."""
    import numpy as np
    from scipy.optimize import curve_fit

    pts = [p for p in curve if math.isfinite(p.loss)]
    if not pts:
        return None
    start = fit_from if fit_from is not None else 0.1 * pts[-1].step
    pts = [p for p in pts if p.step >= start]
    if len(pts) < MIN_FIT:
        return None
    s = np.array([p.step for p in pts], dtype=float)
    y = np.array([p.loss for p in pts], dtype=float)
    s0 = float(np.median(s))

    def law(x, a, b, c):
        return a + b * np.power(x / s0, -c)

    lowest = float(y.min())
    guess = (0.9 * lowest, max(float(np.interp(s0, s, y)) - 0.9 * lowest, 1e-3), 0.5)
    try:
        (a, b, c), _ = curve_fit(
            law, s, y, p0=guess, bounds=([0.0, 0.0, 0.01], [lowest, np.inf, 5.0]), maxfev=20000
        )
    except (RuntimeError, ValueError):
        return None
    rms = float(np.sqrt(np.mean((law(s, a, b, c) - y) ** 2)))
    return dict(
        a=float(a), b=float(b), c=float(c), s0=s0, first=pts[0].step, last=pts[-1].step, rms=rms
    )


def fitted_loss(fit: dict, step: float) -> float:
    return fit["a"] + fit["b"] * (step / fit["s0"]) ** -fit["c"]


def fitted_crossing(curve: list[Point], fit: dict, target: float) -> tuple[float, float] | None:
    """(step, train_s) where the fit reaches `target` (train_s linear between evaluations);
    None past the last evaluation fitted (no extrapolation). A target above the fit's first
    point is met before the window: the raw crossing there."""
    if fitted_loss(fit, fit["first"]) <= target:
        return crossing([p for p in curve if p.step <= fit["first"]], target)
    if target <= fit["a"]:
        return None
    step = fit["s0"] * ((target - fit["a"]) / fit["b"]) ** (-1 / fit["c"])
    if step > fit["last"]:
        return None
    return step, seconds_at(curve, step)


def seconds_at(curve: list[Point], step: float) -> float:
    """Training seconds at `step`, linear between the evaluations around it (the last past
    the end)."""
    at = _between(curve, step, "train_s")
    return curve[-1].train_s if at is None else at


def mean_std(values: list[float]) -> tuple[float, float] | None:
    if not values:
        return None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def ratio_interval(ref: list[float], other: list[float]) -> tuple[float, tuple | None]:
    """ref / other as a ratio of geometric means, with its Welch t interval on the logs."""
    a, b = [math.log(v) for v in ref], [math.log(v) for v in other]
    d = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return math.exp(d), None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return math.exp(d), (math.exp(d), math.exp(d))
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    from scipy.stats import t

    half = t.ppf(0.5 + LEVEL / 2, dof) * se
    return math.exp(d), (math.exp(d - half), math.exp(d + half))


def paired_interval(ratios: list[float]) -> tuple[float, tuple | None]:
    """The geometric mean of per-seed ratios, with its paired t interval on their logs."""
    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    sd = statistics.stdev(logs) if len(logs) > 1 else 0.0
    if len(logs) < 2 or sd == 0:
        return math.exp(m), ((math.exp(m), math.exp(m)) if len(logs) > 1 else None)
    from scipy.stats import t

    half = t.ppf(0.5 + LEVEL / 2, len(logs) - 1) * sd / math.sqrt(len(logs))
    return math.exp(m), (math.exp(m - half), math.exp(m + half))


def prediction_interval(ratios: list[float]) -> tuple[float, float] | None:
    """Where one new seed pair's ratio falls, at LEVEL: the per-seed logs' mean
    ± t(n-1) sd sqrt(1 + 1/n). The interval of the mean shrinks with the seeds; this one does
    not: it is what a user's single run of each precision should expect."""
    logs = [math.log(r) for r in ratios]
    if len(logs) < 3:
        return None
    from scipy.stats import t

    m, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = t.ppf(0.5 + LEVEL / 2, len(logs) - 1) * sd * math.sqrt(1 + 1 / len(logs))
    return math.exp(m - half), math.exp(m + half)


def leave_one_out(ratios: dict[int, float]) -> list[dict]:
    """Each seed's ratio against the prediction interval of the others: a check that the
    interval keeps its promise on seeds it did not see (at LEVEL, about 1 in 20 falls out)."""
    out = []
    for k, r in sorted(ratios.items()):
        pi = prediction_interval([v for j, v in ratios.items() if j != k])
        if pi is not None:
            out.append({"seed": k, "ratio": r, "interval": pi, "inside": pi[0] <= r <= pi[1]})
    return out


def loss_at(curve: list[Point], step: float) -> float | None:
    """The val loss at `step`, linear between the evaluations around it (None past the end)."""
    return _between(curve, step, "loss")


def _between(curve: list[Point], step: float, field: str) -> float | None:
    """`field` of the curve at `step`, linear between the evaluations around it; None past
    the last."""
    prev = None
    for p in curve:
        if p.step >= step:
            if prev is None or p.step == step:
                return getattr(p, field)
            f = (step - prev.step) / (p.step - prev.step)
            return getattr(prev, field) + f * (getattr(p, field) - getattr(prev, field))
        prev = p
    return None

"""How often the study's 95 % intervals cover the truth when its seeds were added until they were
narrow enough (`python -m mixprec.study run ... study.width=W`), simulated at the study's own
spreads, and the factor that widens them back to 95 %.

Stopping on the widths alone keeps the intervals honest only approximately: with few seeds the
rule stops when the spread *came out* small, and then the interval is too narrow. The
simulation replays the driver's rule (start at FIRST_SEEDS, add the seeds the widest interval's
projection asks for, stop at the width or at max_seeds) on per-seed log speedups drawn from a
normal with the observed standard deviations and correlation, true speedup 1, and counts how
often each interval, and all of them together, hold 1."""

from __future__ import annotations

import math
import statistics

import numpy as np

from mixprec.report.curves import LEVEL

SIMS = 20_000  # the coverage's own standard error: about 0.15 % at 95 %


def simulate(
    spreads: list[float],
    rho: float,
    width: float,
    first: int,
    max_seeds: int,
    sims: int = SIMS,
    seed: int = 0,
) -> dict:
    """{"each": [coverage per interval], "all": coverage of them together, "inflation": the
    factor on every half-width that makes them together cover LEVEL, "mean_seeds": where the
    rule stopped on average}."""
    from scipy.stats import t

    k = len(spreads)
    cov = np.array(
        [[spreads[i] * spreads[j] * (1.0 if i == j else rho) for j in range(k)] for i in range(k)]
    )
    rng = np.random.default_rng(seed)
    x = rng.multivariate_normal(np.zeros(k), cov, size=(sims, max_seeds))
    csum, csq = np.cumsum(x, axis=1), np.cumsum(x**2, axis=1)
    ns = np.arange(max_seeds + 1)
    factor = np.full(max_seeds + 1, np.inf)  # a half-width at n seeds is sd x factor[n]
    factor[2:] = t.ppf(0.5 + LEVEL / 2, ns[2:] - 1) / np.sqrt(ns[2:])
    rows = np.arange(sims)

    def at(n):
        m = csum[rows, n - 1] / n[:, None]
        var = (csq[rows, n - 1] - n[:, None] * m**2) / (n[:, None] - 1)
        return m, np.sqrt(np.maximum(var, 0.0)) * factor[n][:, None]

    n = np.full(sims, min(first, max_seeds))
    going = np.ones(sims, dtype=bool)
    for _ in range(max_seeds):
        _, half = at(n)
        widest = half.max(axis=1)
        going &= (widest > width) & (n < max_seeds)
        if not going.any():
            break
        # the driver's next count: the fewest seeds whose projected widest half-width is W
        proj = widest[going, None] * factor[None, :] / factor[n[going]][:, None]
        ok = (proj <= width) & (ns[None, :] > n[going][:, None])
        need = np.where(ok.any(axis=1), ok.argmax(axis=1), max_seeds)
        n[going] = np.minimum(need, max_seeds)
    m, half = at(n)
    ratio = np.abs(m) / np.where(half > 0, half, np.inf)  # <= 1: the interval holds the truth
    worst = ratio.max(axis=1)
    return {
        "each": [float(c) for c in (ratio <= 1).mean(axis=0)],
        "all": float((worst <= 1).mean()),
        "inflation": float(np.quantile(worst, LEVEL)),
        "mean_seeds": float(n.mean()),
    }


def of_study(result: dict, width: float, first: int, max_seeds: int) -> dict | None:
    """The simulation at a study's own spreads: per precision, its first-passage and whole-curve
    per-seed log speedups (their standard deviations and correlation); None where a precision
    has fewer than 3 paired seeds to read them from."""
    curves = {c["precision"]: c for c in result.get("curve_match", [])}
    out = {}
    for r in result["rows"]:
        whole = curves.get(r.precision)
        if not r.leave_one_out or not whole or len(r.leave_one_out) < 3:
            continue
        first_logs = {x["seed"]: math.log(x["ratio"]) for x in r.leave_one_out}
        whole_logs = {p["seed"]: math.log(p["rate"] * p["convergence"]) for p in whole["per_seed"]}
        common = sorted(set(first_logs) & set(whole_logs))
        if len(common) < 3:
            continue
        a, b = [first_logs[k] for k in common], [whole_logs[k] for k in common]
        sa, sb = statistics.stdev(a), statistics.stdev(b)
        rho = statistics.correlation(a, b) if sa > 0 and sb > 0 else 1.0
        sim = simulate([sa, sb], rho, width, first, max_seeds)
        out[r.precision] = {"spreads": [sa, sb], "rho": rho, "width": width, **sim}
    return out or None


def widened(speedup: float, interval: tuple[float, float], factor: float) -> tuple[float, float]:
    """The interval with its half-width on the log scale times `factor`."""
    half = math.log(interval[1] / interval[0]) / 2
    centre = math.log(speedup)
    return math.exp(centre - factor * half), math.exp(centre + factor * half)

"""What precision buys in time to the same quality: a sweep of precisions x seeds (the
`experiment=*_quality` presets) read back from its run dirs, each precision matched against a
reference (bf16 by default) at one target validation loss.

    python -m mixprec.study SWEEP_DIR [--reference bf16] [--target 1.7 | --budget 200]
                                      [--smooth power|none] [--fit-from STEP]

For every seed: the training seconds (`time/train_s`: steps only, no evaluation, no checkpoint,
the first step's compile left out) and the steps at which its validation loss reaches the
target. With `smooth=power` (the default) each seed's evaluations from `fit_from` on (default:
10 % of its last step, past warm-up's transient) are fitted by least squares with
L(s) = a + b (s / s0)^-c, the form of a loss curve, and the crossing is read from the fit; with
`smooth=none`, linearly between the two evaluations around the first crossing (a curve that dips
below and comes back counts from its first crossing). Why fit: at a constant or slowly decaying
learning rate the loss between two evaluations wobbles by a few hundredths of a nat (the weights'
own noise, not the validation set's), and where the curve is flat that moves a crossing by tens of
steps; the fit reads all the evaluations at once (on the stored 8B-slice study, the same data:
the interval on fp8's speedup 1.42-1.68 from the raw crossings, 1.36-1.54 from the fits). A seed
whose fit does not converge, or with fewer than 5 evaluations to fit, falls back to the raw
crossing and says so. The fit never extrapolates: a crossing past the last evaluation is "not
reached".
The target defaults to the highest loss among the reference's seeds at `study.budget` steps
(their last evaluation without one; read from the fits when smoothing): the loss every
reference seed reaches (its mean would leave about half of them short of it). Runs longer than
the budget give the other precisions room to reach it when they learn less per step (with equal
steps, a precision a hair worse per step never reaches the target).
Loss-matched speedup = the reference's time to target / this precision's: the geometric mean
of the per-seed ratios with a 95 % paired t interval on their logs, where every seed of both
reached the target (seed k of every precision starts from the same weights and sees the same
batches, so what makes seed k slow or fast is common to both: on the stored 1B-shape study,
seed 1 was the fastest and seed 0 the slowest of bf16 and of fp8); otherwise the ratio of
geometric means with a Welch t interval on the log times. An interval that
covers 1 is "no difference we can resolve". A seed that never reaches the target is "not
reached" (with its best loss) and a diverged one is named; neither enters the ratio. Writes
study.md, study.json and study.png into the sweep dir."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

from mixprec.core import files
from mixprec.core.errors import ConfigError, check
from mixprec.report.curve_match import curve_match
from mixprec.report.curves import (  # noqa: F401 (crossing, ratio_interval: the study's API)
    FIT_NOISE,
    LEVEL,
    MIN_FIT,
    Point,
    crossing,
    fit_curve,
    fitted_crossing,
    leave_one_out,
    loss_at,
    mean_std,
    paired_interval,
    prediction_interval,
    ratio_interval,
)
from mixprec.report.seeds import Seed, crashed_run, eval_noise, read_seeds
from mixprec.report.study_md import markdown

SMOOTH = ("none", "power")


@dataclass
class StudyConfig:
    """study.* in conf/train.yaml: a sweep that is a time-to-quality study"""

    reference: Optional[str] = MISSING  # the precision the others are matched against; null: off
    target: Optional[float] = MISSING  # the val loss to reach; null: every reference seed's
    budget: Optional[int] = MISSING  # the reference's loss at this step is the target; null: last
    smooth: str = MISSING  # power: crossings read from a fitted curve per seed; none: raw
    fit_from: Optional[int] = MISSING  # the first step fitted; null: 10 % of the last step
    width: Optional[float] = MISSING  # seeds added until every half-width (log) is this; null
    max_seeds: int = MISSING  # ... or until this many seeds (python -m mixprec.study run)
    measured_to: Optional[int] = MISSING  # the run length the preset's answer was measured at

    def __post_init__(self) -> None:
        check(self.target is None or self.target > 0, "study.target", self.target, "null or > 0")
        check(self.smooth in SMOOTH, "study.smooth", self.smooth, " or ".join(SMOOTH))
        check(
            self.fit_from is None or self.fit_from >= 1,
            "study.fit_from",
            self.fit_from,
            "null (10 % of the last step) or an optimizer step >= 1",
        )
        check(
            self.width is None or 0 < self.width < 1,
            "study.width",
            self.width,
            "null or a half-width on the log scale in (0, 1), e.g. 0.05 (a speedup within ~5 %)",
        )
        check(self.max_seeds >= 2, "study.max_seeds", self.max_seeds, "an int >= 2")
        check(
            self.measured_to is None or self.measured_to >= 1,
            "study.measured_to",
            self.measured_to,
            "null or an optimizer step >= 1",
        )
        check(
            self.budget is None or self.budget >= 1,
            "study.budget",
            self.budget,
            "null (the last evaluation) or an optimizer step >= 1",
        )


@dataclass
class Row:
    """One precision's answer."""

    precision: str
    seeds: int
    rate: tuple[float, float] | None  # mean, std over seeds
    rate_vs_ref: float | None
    final: tuple[float, float] | None
    steps_to: float | None
    seconds_to: tuple[float, float] | None
    speedup: float | None
    interval: tuple[float, float] | None
    skipped: int
    peak_gib: float | None
    not_reached: list[str] = field(default_factory=list)  # "seed 2 (best 1.93)"
    diverged: list[str] = field(default_factory=list)
    verdict: str = ""
    paired: bool = False  # the interval over seeds paired with the reference's (else Welch's)
    rate_ratio: float | None = None  # time per step, the reference's / this one's (paired)
    rate_interval: tuple[float, float] | None = None
    convergence: float | None = None  # steps to the target, the reference's / this one's
    convergence_interval: tuple[float, float] | None = None
    censored: list[str] = field(default_factory=list)  # seeds counted at a bound, not left out
    crashed: list[str] = field(default_factory=list)  # runs that failed: named, left out
    log_spread: float | None = None  # the per-seed sd of the log speedup (paired)
    prediction: tuple[float, float] | None = None  # one new seed pair's speedup, at LEVEL
    leave_one_out: list[dict] = field(default_factory=list)  # each seed vs the others' PI


def default_target(seeds: list[Seed], reference: str, budget: int | None = None) -> float:
    """The loss every reference seed reaches: the highest of their evaluated losses at `budget`
    (their last evaluation without one), read from the evaluations, never from a fit. With a
    budget below the runs' length, the other precisions have the rest of their steps to reach
    what the reference reached in its budget."""
    ref = [s for s in seeds if s.precision == reference and not s.diverged and s.curve]
    at = [s.final if budget is None else loss_at(s.curve, budget) for s in ref]
    at = [v for v in at if v is not None]
    if not at:
        raise ConfigError(
            f"study.reference={reference!r}: no finished run of that precision in the sweep "
            f"{'reached step ' + str(budget) + ' ' if budget else ''}"
            f"(precisions: {', '.join(sorted({s.precision for s in seeds}))})"
        )
    return max(at)


def analyse(
    seeds: list[Seed],
    reference: str,
    target: float | None = None,
    budget: int | None = None,
    smooth: str = "none",
    fit_from: int | None = None,
) -> dict:
    """The study's answer: the target, one Row per precision (the reference first), the same
    along the run, and the whole-curve estimate (curve_match)."""
    check(smooth in SMOOTH, "study.smooth", smooth, " or ".join(SMOOTH))
    unfitted = []
    for s in seeds:
        s.fit = None
        if smooth == "power" and not s.diverged:
            s.fit, why = accepted_fit(fit_curve(s.curve, fit_from), s.noise)
            if why:
                unfitted.append(f"{s.precision} seed {s.seed} ({why})")
    given = target is not None
    target = default_target(seeds, reference, budget) if target is None else target
    _crossings(seeds, target)
    return {
        "reference": reference,
        "target": target,
        "target_given": given,
        "budget": budget,
        "smooth": smooth,
        "unfitted": unfitted,
        "level": LEVEL,
        "rows": _rows(seeds, reference),
        "seeds": seeds,
        "by_length": by_length(seeds, reference, budget),
        "band": band(seeds, reference, budget),
        "curve_match": curve_match(seeds, reference, budget),
    }


def accepted_fit(fit: dict | None, noise: float | None) -> tuple[dict | None, str | None]:
    """A seed's fit where it describes its evaluations within their own noise (its RMS residual
    at most FIT_NOISE x the seed's val/loss_noise), else None and why: a fit that misses the
    curve by more than the noise moves a crossing by more than it smooths it."""
    if fit is None:
        return None, f"fewer than {MIN_FIT} evaluations, or no convergence: raw crossing"
    if noise is None:
        return None, "no val/loss_noise to check the fit against: raw crossing"
    if fit["rms"] > FIT_NOISE * noise:
        return None, (
            f"fit residual {fit['rms']:.4f} > {FIT_NOISE:g} x its evaluation noise "
            f"{noise:.4f}: raw crossing"
        )
    return fit, None


def _crossings(seeds: list[Seed], target: float) -> None:
    """Each seed's steps and seconds to `target` (None: not reached, or diverged). Whether a
    seed reached it is read from its evaluations: an accepted fit only places the crossing."""
    for s in seeds:
        hit = None if s.diverged else crossing(s.curve, target)
        if hit and s.fit:
            hit = fitted_crossing(s.curve, s.fit, target) or hit
        s.steps_to, s.seconds_to = hit if hit else (None, None)


def _rows(seeds: list[Seed], reference: str) -> list[Row]:
    """One Row per precision (the reference first), from each seed's crossing as it stands."""
    groups: dict[str, list[Seed]] = {}
    for s in sorted(seeds, key=lambda s: (s.precision != reference, s.precision, s.seed)):
        groups.setdefault(s.precision, []).append(s)
    ref = [s for s in groups.get(reference, []) if not crashed_run(s)]
    ref_rate = mean_std([s.rate for s in ref if s.rate])
    return [_row(p, g, ref_rate, reference, ref) for p, g in groups.items()]


FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def by_length(seeds: list[Seed], reference: str, budget: int | None) -> list[dict]:
    """The loss-matched speedup along the run: for each fraction f of the reference's budget
    (its last evaluation without one), the target is the reference's loss at f x budget (the
    worst seed's, as the main target is), and every precision is matched to it. Beside it, the
    two factors: the rate ratio (time per step) and the convergence ratio (steps to the
    target). Each seed's crossings are put back as they were for the main target."""
    kept = [(s.steps_to, s.seconds_to) for s in seeds]
    ref = [s for s in seeds if s.precision == reference and s.curve and not crashed_run(s)]
    end = budget or (min(s.curve[-1].step for s in ref) if ref else None)
    out = []
    for f in FRACTIONS if end else ():
        step = max(1, round(f * end))
        try:
            target = default_target(seeds, reference, step)
        except ConfigError:  # no reference seed evaluated that early
            continue
        _crossings(seeds, target)
        rows = _rows(seeds, reference)
        out.append({"fraction": f, "step": step, "target": target, "rows": rows})
    for s, (steps, secs) in zip(seeds, kept):
        s.steps_to, s.seconds_to = steps, secs
    return out


BAND = (0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15)  # of the reference's budget (its last step)


def band(seeds: list[Seed], reference: str, budget: int | None) -> list[dict]:
    """The first-passage speedup over a band of targets: the reference's worst loss at each
    step from 0.85x to 1.15x its budget (inside its runs), so that the answer does not rest on
    one target where the precisions happen to be close or far. Per precision: each target's
    speedup, the band's median (the headline the docs tell users to quote), its range, and the
    spread of the log speedup across the band. Each seed's crossings are put back."""
    kept = [(s.steps_to, s.seconds_to) for s in seeds]
    ref = [s for s in seeds if s.precision == reference and s.curve and not crashed_run(s)]
    end = min((s.curve[-1].step for s in ref), default=None)
    centre = budget or end
    points: dict[str, list[tuple[int, float, float]]] = {}
    for f in BAND if centre else ():
        step = round(f * centre)
        if step < 1 or step > end:
            continue
        target = default_target(seeds, reference, step)
        _crossings(seeds, target)
        for r in _rows(seeds, reference):
            if r.precision != reference and r.speedup is not None:
                points.setdefault(r.precision, []).append((step, target, r.speedup))
    for s, (steps, secs) in zip(seeds, kept):
        s.steps_to, s.seconds_to = steps, secs
    out = []
    for precision, pts in points.items():
        logs = [math.log(v) for _, _, v in pts]
        out.append(
            {
                "precision": precision,
                "points": [{"step": a, "target": b, "speedup": c} for a, b, c in pts],
                "median": math.exp(statistics.median(logs)),
                "range": [min(v for _, _, v in pts), max(v for _, _, v in pts)],
                "log_spread": statistics.stdev(logs) if len(logs) > 1 else None,
            }
        )
    return out


def _row(precision: str, group: list[Seed], ref_rate, reference: str, ref: list[Seed]) -> Row:
    crashed = [s for s in group if crashed_run(s)]
    kept = [s for s in group if s not in crashed]  # diverged seeds are counted, censored
    ok = [s for s in kept if not s.diverged]
    rate = mean_std([s.rate for s in ok if s.rate])
    row = Row(
        precision,
        len(group),
        rate,
        rate[0] / ref_rate[0] if rate and ref_rate else None,
        mean_std([s.final for s in ok if s.final is not None]),
        None,
        None,
        None,
        None,
        sum(s.skipped or 0 for s in group),
        max((s.peak_gib for s in group if s.peak_gib), default=None),
        [f"seed {s.seed} (best {s.best:.4g})" for s in ok if not s.seconds_to and s.best],
        [f"seed {s.seed} ({s.run})" for s in group if s.diverged],
    )
    row.crashed = [f"seed {s.seed} ({s.run}: {s.status})" for s in crashed]
    if precision == reference:
        at = reference_times(ok)
        if at:  # the speedup is 1 by definition; its seeds' spread is in seconds_to
            row.steps_to = statistics.fmean(n for n, _ in at.values())
            row.seconds_to, row.speedup = mean_std([t for _, t in at.values()]), 1.0
            row.censored = [f"seed {s.seed}" for s in ok if not s.seconds_to]
    elif any(s.seconds_to for s in ok) and any(s.seconds_to for s in ref if not s.diverged):
        _matched(row, kept, [s for s in ref if not s.diverged])
    row.verdict = verdict(row, reference)
    return row


def _matched(row: Row, seeds: list[Seed], ref: list[Seed]) -> None:
    """The loss-matched speedup and its two factors, every column over the same seeds, so that
    speedup = rate ratio x convergence ratio in each row (each seed's time to the target is
    its steps to it x its seconds per step up to there).

    A seed that never reaches the target or diverged counts against its precision, censored:
    its time is at least its whole training time and at least the slowest reaching seed's
    (paired: its ratio at most the lowest ratio of the seeds that reached), its steps at least
    its last step at its own rate, so counting it can only lower the estimate, never raise it."""
    hit = {s.seed: (s.steps_to, s.seconds_to) for s in seeds if s.seconds_to}
    censored = [s for s in seeds if not s.seconds_to]
    ref_at = reference_times(ref)
    usual = statistics.median(t / n for n, t in hit.values())
    if set(hit) | {s.seed for s in censored} == set(ref_at) and len(ref_at) >= 2:
        row.paired = True  # seed k of each precision: the same initial weights and batch order
        low = min(ref_at[k][1] / t for k, (_, t) in hit.items() if k in ref_at)
        for s in censored:
            worst = min(low, ref_at[s.seed][1] / _spent(s)) if _spent(s) else low
            hit[s.seed] = _bound(s, ref_at[s.seed][1] / worst, usual)
        keys = sorted(hit)
        ratio = lambda i: [ref_at[k][i] / hit[k][i] for k in keys]  # noqa: E731
        per_step = [(ref_at[k][1] / ref_at[k][0]) / (hit[k][1] / hit[k][0]) for k in keys]
        row.speedup, row.interval = paired_interval(ratio(1))
        row.prediction = prediction_interval(ratio(1))
        row.leave_one_out = leave_one_out(dict(zip(keys, ratio(1))))
        row.convergence, row.convergence_interval = paired_interval(ratio(0))
        row.rate_ratio, row.rate_interval = paired_interval(per_step)
    else:  # the seeds do not pair: ratios of geometric means, Welch's t on the logs
        slowest = max(t for _, t in hit.values())
        for s in censored:
            hit[s.seed] = _bound(s, max(slowest, _spent(s)), usual)
        keys, ref_keys = sorted(hit), sorted(ref_at)
        col = lambda at, ks, i: [at[k][i] for k in ks]  # noqa: E731
        spp = lambda at, ks: [at[k][1] / at[k][0] for k in ks]  # noqa: E731
        row.speedup, row.interval = ratio_interval(col(ref_at, ref_keys, 1), col(hit, keys, 1))
        row.convergence, row.convergence_interval = ratio_interval(
            col(ref_at, ref_keys, 0), col(hit, keys, 0)
        )
        row.rate_ratio, row.rate_interval = ratio_interval(spp(ref_at, ref_keys), spp(hit, keys))
    row.censored = [f"seed {s.seed}" for s in censored]
    row.steps_to = statistics.fmean(hit[k][0] for k in hit)
    row.seconds_to = mean_std([hit[k][1] for k in sorted(hit)])
    row.log_spread = _log_spread(row, ref_at, hit) if row.paired else None


def reference_times(ref: list[Seed]) -> dict[int, tuple[float, float]]:
    """{seed: (steps, seconds)} to the target for the reference's seeds. One that never
    reaches it (an explicit target below its curve) is censored at a bound, not dropped:
    at least its whole training time and the slowest reaching seed's; dropping it would keep
    only the reference's fast seeds, bias its time low, and break the pairing."""
    at = {s.seed: (s.steps_to, s.seconds_to) for s in ref if s.seconds_to}
    if not at:
        return {}
    slowest = max(t for _, t in at.values())
    usual = statistics.median(t / n for n, t in at.values())
    for s in ref:
        if not s.seconds_to:
            at[s.seed] = _bound(s, max(slowest, _spent(s)), usual)
    return at


def _bound(s: Seed, seconds: float, usual: float) -> tuple[float, float]:
    """A censored seed's (steps, seconds) at a time bound: its steps at its own seconds per
    step over the run (`usual`, the reaching seeds' median, where it has no timed evaluation)."""
    last = s.curve[-1] if s.curve else None
    per_step = last.train_s / last.step if last and last.step and last.train_s else usual
    return seconds / per_step, seconds


def _log_spread(row: Row, ref_at: dict, hit: dict) -> float | None:
    """The per-seed standard deviation of the log speedup: what sets how many seeds the
    interval needs (±w at 95 % takes about (2 sd / w)^2)."""
    logs = [math.log(ref_at[k][1] / hit[k][1]) for k in hit]
    return statistics.stdev(logs) if len(logs) > 1 else None


def _spent(s: Seed) -> float:
    """The training seconds a seed had when it stopped (its last evaluation's; 0 without one:
    a bound that then leaves the other bound to decide)."""
    return s.curve[-1].train_s if s.curve and s.curve[-1].train_s else 0.0


def verdict(row: Row, reference: str) -> str:
    p = f"precision={row.precision}"
    if row.diverged and len(row.diverged) == row.seeds:
        return f"{p}: every seed diverged"
    if row.not_reached and not row.seconds_to:
        return f"{p}: no seed reached the target ({', '.join(row.not_reached)})"
    tail = f"; not reached: {', '.join(row.not_reached)}" if row.not_reached else ""
    tail += f"; diverged: {', '.join(row.diverged)}" if row.diverged else ""
    tail += f"; counted censored: {', '.join(row.censored)}" if row.censored else ""
    tail += f"; crashed, left out: {', '.join(row.crashed)}" if row.crashed else ""
    if row.precision == reference:
        return f"{p} is the reference{tail}"
    if row.speedup is None:
        return f"{p}: no time to target to compare{tail}"
    if row.interval is None:
        return f"{p}: {row.speedup:.2f}x the reference's speed to the target (one seed){tail}"
    lo, hi = row.interval
    if lo <= 1 <= hi:
        return (
            f"{p}: no difference we can resolve from {reference} in time to the target "
            f"({row.speedup:.2f}x, {LEVEL:.0%} interval {lo:.2f}-{hi:.2f}){tail}"
        )
    return (
        f"{p} reaches the target {row.speedup:.2f}x as fast as {reference} "
        f"({LEVEL:.0%} interval {lo:.2f}-{hi:.2f}){tail}"
    )


def write(
    sweep_dir: Path,
    reference: str = "bf16",
    target: float | None = None,
    budget: int | None = None,
    smooth: str = "none",
    fit_from: int | None = None,
    width: float | None = None,
    max_seeds: int = 16,
) -> dict:
    """study.md, study.json and study.png in the sweep dir; returns the result. `width`: the
    seeds were added until every interval was this narrow (python -m mixprec.study run), so
    the intervals' coverage under that rule is simulated and they are widened back to 95 %."""
    left_out: list[str] = []
    seeds = read_seeds(sweep_dir, left_out)
    if not seeds:
        why = f" ({'; '.join(left_out)})" if left_out else ""
        raise ConfigError(f"{sweep_dir}: no run dirs (with .hydra/) in it to study{why}")
    result = analyse(seeds, reference, target, budget, smooth, fit_from)
    if width is not None:
        from mixprec.report import coverage
        from mixprec.report.seeds import FIRST_SEEDS

        result["coverage"] = coverage.of_study(result, width, FIRST_SEEDS, max_seeds)
    result["left_out"] = left_out
    result["eval_noise"] = eval_noise(seeds, reference)
    plain = {**result, "rows": [asdict(r) for r in result["rows"]]}
    plain["by_length"] = [
        {**pt, "rows": [asdict(r) for r in pt["rows"]]} for pt in result.get("by_length", [])
    ]
    plain["seeds"] = [{**asdict(s), "curve": [asdict(p) for p in s.curve]} for s in seeds]
    from mixprec.report.plots import study_plot

    files.write_together(  # the three agree: all new, or all as they were
        {
            sweep_dir / "study.md": markdown(result),
            sweep_dir / "study.json": json.dumps(plain, indent=1),
            sweep_dir / "study.png": study_plot(result),
        }
    )
    return result

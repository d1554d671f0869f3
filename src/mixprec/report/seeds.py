"""The study's seeds: each run of a sweep read as one seed of its precision (its own config and
summary, its validation curve), what leaves a run out (a copy, another run's summary, a run
still training elsewhere), and how many seeds the study needs for its intervals to be as narrow
as asked (python -m mixprec.study run)."""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from mixprec.report.curves import LEVEL, Point


@dataclass
class Seed:
    """One run of the study: a precision at one seed."""

    precision: str
    seed: int
    run: str
    status: str
    curve: list[Point]
    rate: float | None = None  # tokens/s (or samples/s): steady state, the run alone on its GPU
    peak_gib: float | None = None
    skipped: int | None = None
    diverged: bool = False
    final: float | None = None
    best: float | None = None
    steps_to: float | None = None  # to the target; None: not reached
    seconds_to: float | None = None
    fit: dict | None = None  # smooth=power: a, b, c, s0, the steps fitted, the RMS residual
    noise: float | None = None  # the median of its evaluations' val/loss_noise (loop.evaluate)


def crashed_run(s: Seed) -> bool:
    """A run that failed for another reason than divergence (a bug, OOM, a kill): it says
    nothing about its precision's time to the target."""
    return s.status not in ("completed", "preempted") and not s.diverged


MAX_METRICS_BYTES = 1 << 30  # a run's metrics.jsonl: far below this


def read_seeds(sweep_dir: Path, left_out: list[str] | None = None) -> list[Seed]:
    """Every run of the sweep: its precision, seed, rate and validation curve. A run that
    cannot be counted (its config unreadable, a summary.json that is another run's, a second
    run of a precision and seed already read: a copied job dir) is left out, and why is
    appended to `left_out`."""
    from mixprec.report.runs import find_runs
    from mixprec.sinks import local

    seeds: list[Seed] = []
    read: dict[tuple[str, int], str] = {}  # (precision, seed) -> the run it was read from
    for run in find_runs([sweep_dir]):
        seed, why = _seed_of(run, local)
        if seed is not None and seed.status == "running":
            why = f"{seed.precision} seed {seed.seed} is still running in another process"
        elif seed is not None and (seed.precision, seed.seed) in read:
            first = read[(seed.precision, seed.seed)]
            why = f"{seed.precision} seed {seed.seed} again (read from {first}: a copy?)"
        if why:
            if left_out is not None:
                left_out.append(f"{run.name}: {why}")
            continue
        read[(seed.precision, seed.seed)] = run.name
        seeds.append(seed)
    return seeds


def _seed_of(run: Path, local) -> tuple[Seed | None, str | None]:
    """The run as a seed of the study, or why it cannot be one."""
    cfg = local.run_config(run)
    if cfg is None:
        return None, "its .hydra/config.yaml is missing or not a config"
    s = local.read(run)
    group = cfg.get("precision")
    precision = str(group.get("name") if isinstance(group, dict) else group)
    seed = cfg.get("seed", 0)
    if not isinstance(seed, int):
        return None, f"its config's seed is {seed!r}, not an int"
    said_precision, said_seed = s.get("precision"), s.get("seed")
    if (said_precision is not None and str(said_precision) != precision) or (
        said_seed is not None and said_seed != seed
    ):
        return None, (
            f"its summary.json is another run's (precision {said_precision}, seed {said_seed}; "
            f"its config: {precision}, seed {seed})"
        )
    metrics = run / "metrics.jsonl"
    if os.path.lexists(metrics) and not metrics.is_file():  # a folder, a device, a dead link
        return None, "its metrics.jsonl is not a file"
    if metrics.is_file() and metrics.stat().st_size > MAX_METRICS_BYTES:
        return None, f"its metrics.jsonl is over {MAX_METRICS_BYTES >> 20} MB: not a run's"
    rows = local.read_jsonl(metrics) if metrics.is_file() else []
    curve = [
        Point(r["step"], local.number(r.get("time/train_s")) or 0.0, float(r["val/loss"]))
        for r in rows
        if _evaluated(r)
    ]
    if any(b.train_s < a.train_s for a, b in zip(curve, curve[1:])) or any(
        p.train_s < 0 for p in curve
    ):
        return None, "its time/train_s goes below 0 or backwards: not a run's own clock"
    # a non-finite evaluation mid-run (the weights went on and evaluated finite again) is no
    # point of the curve; a last one is the run's divergence
    curve = [p for i, p in enumerate(curve) if math.isfinite(p.loss) or i == len(curve) - 1]
    finite = [p.loss for p in curve if math.isfinite(p.loss)]
    diverged = s.get("exit_code") == 3 or (bool(curve) and not math.isfinite(curve[-1].loss))
    seed_ = Seed(
        precision=precision,
        seed=seed,
        run=run.name,
        status=str(s.get("status")),
        curve=curve,
        rate=local.number(s.get("tokens_per_s")) or local.number(s.get("samples_per_s")),
        peak_gib=local.number(s.get("peak_mem_gib")),
        skipped=s.get("skipped_steps") if isinstance(s.get("skipped_steps"), int) else None,
        diverged=diverged,
        final=curve[-1].loss if curve and not diverged else None,
        best=min(finite) if finite else None,
        noise=_median([r.get("val/loss_noise") for r in rows]),
    )
    return seed_, None


def _evaluated(row: dict) -> bool:
    """An evaluation the study can place: a numeric val/loss (true is not 1.0) after step 0
    (before any step there is no time to the target to read)."""
    loss = row.get("val/loss")
    return isinstance(loss, (int, float)) and not isinstance(loss, bool) and row["step"] > 0


def _median(values: list) -> float | None:
    """The median of the finite numbers among `values` (None: there are none)."""
    v = [x for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.median(v) if v else None


def eval_noise(seeds: list, reference: str) -> dict | None:
    """The evaluation's own noise (the median over the reference's seeds of their evaluations'
    val/loss_noise: the standard error of one evaluation's loss, from the same weights on two
    halves of the validation set) against the spread between seeds at the end (the standard
    deviation of the reference's final losses): what the study can tell apart sits in the
    second; the first must be small against it. None where the runs did not measure it."""
    ref = [s for s in seeds if s.precision == reference]
    noise = _median([s.noise for s in ref])
    finals = [s.final for s in ref if s.final is not None and math.isfinite(s.final)]
    if noise is None or len(finals) < 2:
        return None
    spread = statistics.stdev(finals)
    return {
        "noise": noise,
        "seed_spread": spread,
        "share": noise / spread if spread else None,
        "wobble": _median([wobble(s.curve) for s in ref]),
    }


def wobble(curve: list) -> float | None:
    """How far a run's evaluations wobble around its own smooth curve, from half the run on
    (where the curve is nearly straight between evaluations): the standard deviation of each
    evaluation minus the mean of its two neighbours, / sqrt(1.5) (that difference of
    independent errors has 1.5 times their variance). It is the weights' own movement at the
    learning rate, what moves a crossing; the validation set's sampling error is mostly the
    same offset for every seed (one set) and cancels in second differences as it drifts slowly."""
    pts = [p for p in curve if math.isfinite(p.loss) and p.step >= curve[-1].step / 2]
    if len(pts) < 5:
        return None
    d = [b.loss - (a.loss + c.loss) / 2 for a, b, c in zip(pts, pts[1:], pts[2:])]
    return statistics.pstdev(d) / math.sqrt(1.5)


FIRST_SEEDS = 3  # python -m mixprec.study run starts here (an interval needs 2; 3 is the norm)


def half_widths(result: dict) -> dict[str, float]:
    """The 95 % half-width on the log scale of each speedup the study gives as its answer: first
    passage at the main target ({"fp8": 0.04}) and the whole curve ({"fp8 whole curve": 0.05});
    one with a speedup and no interval (one seed) is infinite. The points along the run are not
    here: they say whether the speedup falls as the run goes on, and the earliest, in the fast
    descent after warm-up, can need many times the seeds of the answer (the committed 500-step
    study's, tests/test_time_to_quality.py). Precisions no seed of which reached the target have
    none, and are not waited for."""

    def half(interval) -> float:
        return math.log(interval[1] / interval[0]) / 2 if interval else math.inf

    out = {
        r.precision: half(r.interval)
        for r in result["rows"]
        if r.precision != result["reference"] and r.speedup is not None
    }
    out |= {
        c["precision"] + " whole curve": half(c["interval"]) for c in result.get("curve_match", [])
    }
    return out


def more_seeds(result: dict, seeds: int, width: float, max_seeds: int) -> tuple[int | None, str]:
    """How many seeds the study should have next (None: stop), and why. It stops on the widths
    of the intervals alone, never on where they lie (an interval that decides when to stop by
    its own position is no longer a 95 % interval). Otherwise the count the widest interval
    implies: a t interval's half-width goes as t(n-1) / sqrt(n) for the same spread."""
    widths = half_widths(result)
    widest = max(widths.values(), default=0.0)
    if widest <= width:
        return None, f"every interval is within ±{width:g} (log; the widest {widest:.3f})"
    if seeds >= max_seeds:
        return None, f"study.max_seeds={max_seeds} reached (the widest interval ±{widest:.3f})"
    need = seeds + 1
    while need < max_seeds and projected(widest, seeds, need) > width:
        need += 1
    return need, f"the widest interval is ±{widest:.3f} at {seeds} seeds: {need} should do"


def projected(half: float, seeds: int, more: int) -> float:
    """A half-width at `seeds` seeds projected to `more` with the same spread."""
    from scipy.stats import t

    if not math.isfinite(half):
        return half
    q = lambda n: t.ppf(0.5 + LEVEL / 2, n - 1) / math.sqrt(n)  # noqa: E731
    return half * q(more) / q(seeds)

"""`python -m mixprec.study SWEEP_DIR`: the time-to-quality study of a sweep (report/quality.py).

`python -m mixprec.study run OVERRIDES...`: run a study's seeds until its answer is narrow enough.
It runs `python train.py -m OVERRIDES resume=auto` with seeds 0..n-1 into the study's sweep dir
(`hydra.sweep.dir`, else the preset's), reads the study that ends the sweep, and adds seeds (every
precision together, so they stay paired) until every speedup's 95 % half-width on the log scale is
at most `study.width`, or `study.max_seeds` seeds have run. Runs that completed are skipped and
interrupted ones resume (resume=auto), so the same command can be run again, or by several
processes or sessions at once, each taking the runs the others have not (a run dir in use is
left to its process). study.md then says what stopped it and what one more seed would buy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "train.py"


def run(overrides: list[str]) -> int:
    """The driver's loop; returns the exit code of the last sweep (0 where every job ran)."""
    from mixprec.core.errors import ConfigError
    from mixprec.report import quality
    from mixprec.report import seeds as seeding
    from mixprec.run.config import compose_config, validate

    if any(
        o.split("=")[0].lstrip("+~") in ("seed", "hydra.sweeper.params.seed") for o in overrides
    ):
        raise ConfigError(
            "python -m mixprec.study run chooses the seeds (study.max_seeds); drop seed="
        )
    c = validate(compose_config([o for o in overrides if not o.startswith("hydra.")]))
    if c.study.reference is None or c.study.width is None:
        raise ConfigError(
            f"python -m mixprec.study run needs a study (study.reference={c.study.reference}) and "
            f"a width to reach (study.width={c.study.width}): e.g. experiment=quality_cpu "
            "study.width=0.05"
        )
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.sweep.dir=")]
    sweep = Path(given[-1] if given else f"outputs/studies/{c.name}")
    seeds, why, code = min(seeding.FIRST_SEEDS, c.study.max_seeds), "", 0
    while True:
        code = _sweep(overrides, sweep, seeds)
        if not (sweep / "study.json").is_file():  # the sweep wrote no study: it said why
            return code or 1
        result = quality.write(
            sweep,
            c.study.reference,
            c.study.target,
            c.study.budget,
            c.study.smooth,
            c.study.fit_from,
        )
        # seeds an earlier session left in the sweep dir count: the result is over all of them
        seeds = max(seeds, min(r.seeds for r in result["rows"]))
        following, why = seeding.more_seeds(result, seeds, c.study.width, c.study.max_seeds)
        print(f"study: {seeds} seeds: {why}", flush=True)
        if following is None:
            break
        seeds = following
    _say(sweep, result, seeds, why)
    return code


def _sweep(overrides: list[str], sweep: Path, seeds: int) -> int:
    seed_list = ",".join(map(str, range(seeds)))
    cmd = [sys.executable, str(TRAIN), "-m", *overrides, "resume=auto"]
    cmd += [f"seed={seed_list}", f"hydra.sweep.dir={sweep}"]
    print("study:", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd)


def _say(sweep: Path, result: dict, seeds: int, why: str) -> None:
    """study.md and study.json: how many seeds, what stopped it, what one more would buy."""
    from mixprec.core import files
    from mixprec.report import seeds as seeding

    widths = seeding.half_widths(result)
    widest = max(widths.values(), default=0.0)
    more = seeding.projected(widest, seeds, seeds + 1)
    said = {"seeds": seeds, "stopped": why, "widest": widest, "one_more": more}
    text = (sweep / "study.md").read_text() + (
        f"\n### Seeds\n\n{seeds} seeds of each precision: {why}. One more seed would likely "
        f"narrow the widest interval from ±{widest:.3f} to ±{more:.3f} (log; the same spread, "
        "t quantiles). Seeds were added on the intervals' widths alone, never on where they "
        "lie, so each is still a 95 % interval.\n"
    )
    plain = {**json.loads((sweep / "study.json").read_text()), "seeding": said}
    files.write_together(
        {sweep / "study.md": text, sweep / "study.json": json.dumps(plain, indent=1)}
    )


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        from mixprec.core.errors import MixprecError

        try:
            sys.exit(run(sys.argv[2:]))
        except MixprecError as e:
            print(f"{e.label}: {e}", file=sys.stderr)
            sys.exit(e.exit_code)
    from mixprec.report.quality import main as study_main

    study_main()


if __name__ == "__main__":
    main()

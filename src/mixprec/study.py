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
    from mixprec.core import files
    from mixprec.core.errors import ConfigError, Unwritable
    from mixprec.report import quality
    from mixprec.report import seeds as seeding
    from mixprec.run.config import compose_config, validate

    if any(
        o.split("=")[0].lstrip("+~") in ("seed", "hydra.sweeper.params.seed") for o in overrides
    ):
        raise ConfigError(
            "python -m mixprec.study run chooses the seeds (study.max_seeds); drop seed="
        )
    cfg = compose_config([o for o in overrides if not o.startswith("hydra.")])
    c = validate(cfg)
    if c.study.reference is None or c.study.width is None:
        raise ConfigError(
            f"python -m mixprec.study run needs a study (study.reference={c.study.reference}) and "
            f"a width to reach (study.width={c.study.width}): e.g. experiment=quality_cpu "
            "study.width=0.05"
        )
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.sweep.dir=")]
    sweep = Path(given[-1] if given else f"outputs/studies/{c.name}")
    why_not = files.writable_dir(sweep)
    if why_not:
        raise Unwritable(f"hydra.sweep.dir={sweep}: {why_not}")
    same_config(sweep, cfg)
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
            c.study.width,
            c.study.max_seeds,
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


# what may differ between the runs of one study: the swept keys, and how a run is kept
PER_RUN = ("seed", "precision", "resume", "run_dir", "overwrite", "study", "logger", "hydra")


def same_config(sweep: Path, cfg) -> None:
    """The runs already in the sweep dir were made with this config (but for PER_RUN): a
    resume=auto sweep skips a finished run, so runs of another config would be counted for
    this one. A ConfigError naming the keys that differ, before anything runs."""
    from omegaconf import OmegaConf

    from mixprec.core.errors import ConfigError
    from mixprec.report.runs import find_runs
    from mixprec.sinks import local

    if not sweep.is_dir():
        return
    now = _flat(OmegaConf.to_container(cfg, resolve=False))
    for run in find_runs([sweep]):
        was = local.run_config(run)
        if was is None:
            continue  # (the study names it under "Left out")
        was = _flat(was)
        differ = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
        if differ:
            what = ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in differ[:6])
            more = f" (+{len(differ) - 6} more)" if differ[6:] else ""
            raise ConfigError(
                f"{sweep} holds runs of another config ({run.name}: {what}{more}); their "
                "answer is not this config's. Run the study into another hydra.sweep.dir, or "
                "with the config those runs had"
            )


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out: dict = {}
        for k, v in node.items():
            if not prefix and k in PER_RUN:
                continue
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): node}


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
        "lie; stopping when they are narrow still stops more often when the spread came out "
        "small, so the coverage section above gives what the intervals keep under this rule "
        "and the widened ones that keep 95 %.\n"
    )
    plain = {**json.loads((sweep / "study.json").read_text()), "seeding": said}
    files.write_together(
        {sweep / "study.md": text, sweep / "study.json": json.dumps(plain, indent=1)}
    )


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        from mixprec.core.errors import ConfigError, MixprecError

        try:
            sys.exit(run(sys.argv[2:]))
        except MixprecError as e:
            print(f"{e.label}: {e}", file=sys.stderr)
            sys.exit(e.exit_code)
        except (HydraException, OmegaConfBaseException) as e:  # a typo, a value of a wrong type
            print(f"{ConfigError.label}: {' '.join(str(e).splitlines()[:2])}", file=sys.stderr)
            sys.exit(ConfigError.exit_code)
    from mixprec.report.study_cli import main as study_main

    study_main()


if __name__ == "__main__":
    main()

"""`python -m mixprec.study SWEEP_DIR`: the study's command line (report/quality.py holds the
analysis and its writer): the flags, each checked as it is read, and the study.* settings a
sweep's runs were configured with, checked the same way."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from mixprec.core import files
from mixprec.core.errors import ConfigError
from mixprec.report.quality import SMOOTH, markdown, write


def sweep_study(sweep_dir: Path) -> dict:
    """The study.* settings the sweep's first readable run was configured with ({} if none),
    so that reading a study again gives the answer the sweep wrote unless told otherwise."""
    from mixprec.report.runs import find_runs
    from mixprec.sinks import local

    for run in find_runs([sweep_dir]):
        cfg = local.run_config(run)
        study = cfg.get("study") if isinstance(cfg, dict) else None
        if isinstance(study, dict):
            keys = ("reference", "target", "budget", "smooth", "fit_from", "width", "max_seeds")
            said = {k: study[k] for k in keys if study.get(k) is not None}
            for key, value in said.items():  # a run's config is read, never trusted
                try:
                    READ[key](str(value) if not isinstance(value, bool) else "")
                except argparse.ArgumentTypeError as e:
                    raise ConfigError(
                        f"{run / '.hydra' / 'config.yaml'}: study.{key}: {e}; give "
                        f"--{key.replace('_', '-')} on the command line"
                    ) from None
            return {k: (READ[k](str(v)) if k in NUMBERS else v) for k, v in said.items()}
    return {}


def _checked(cast, ok, what: str):
    """A flag's (or a run config's) value: `cast` of the text where `ok` holds, else argparse's
    one-line error saying what it must be."""

    def read(text: str):
        try:
            v = cast(text)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"{text!r}: {what}")
        return v

    return read


_precision_name = _checked(str, bool, "a precision's name")
_smooth = _checked(str, lambda v: v in SMOOTH, f"one of {', '.join(SMOOTH)}")
_width = _checked(float, lambda v: 0 < v < 1, "a half-width on the log scale in (0, 1)")
_at_least_1 = _checked(int, lambda n: n >= 1, "an optimizer step >= 1")
_loss = _checked(float, lambda v: math.isfinite(v) and v > 0, "a finite validation loss > 0")


# how each study.* key a run's config holds is read (the command line's own checks)
READ = {
    "reference": _precision_name,
    "target": _loss,
    "budget": _at_least_1,
    "smooth": _smooth,
    "fit_from": _at_least_1,
    "width": _width,
    "max_seeds": _at_least_1,
}
NUMBERS = ("target", "budget", "fit_from", "width", "max_seeds")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mixprec.study", description=__doc__.split("\n")[0])
    ap.add_argument("sweep", type=Path, help="the sweep dir of precisions x seeds")
    ap.add_argument(
        "--reference", default=None, help="the precision matched against (the sweep's, or bf16)"
    )
    ap.add_argument("--target", type=_loss, default=None, help="val loss (default: see above)")
    ap.add_argument(
        "--budget", type=_at_least_1, default=None, help="the reference's step (the sweep's)"
    )
    ap.add_argument(
        "--smooth", choices=SMOOTH, default=None, help="none (raw crossings) or power (a fit)"
    )
    ap.add_argument(
        "--fit-from", type=_at_least_1, default=None, help="first step fitted (10 %% of the last)"
    )
    ap.add_argument(
        "--width",
        type=_width,
        default=None,
        help="the seeds were added until every interval's half-width (log) was this (the "
        "sweep's study.width): their coverage under that rule is simulated",
    )
    ap.add_argument(
        "--max-seeds", type=_at_least_1, default=None, help="... or until this many (16)"
    )
    a = ap.parse_args(argv)
    if not a.sweep.is_dir():
        ap.error(f"{a.sweep} does not exist or is not a directory")  # exit 2, as diagnose's
    with files.cli_errors(a.sweep):  # a config error, a full disk, a read-only sweep dir
        said = sweep_study(a.sweep)  # what the sweep ran with, where the command line is silent
        pick = lambda key, v, default=None: said.get(key, default) if v is None else v  # noqa: E731
        result = write(
            a.sweep,
            pick("reference", a.reference, "bf16"),
            pick("target", a.target),
            pick("budget", a.budget),
            pick("smooth", a.smooth, "none"),
            pick("fit_from", a.fit_from),
            pick("width", a.width),
            pick("max_seeds", a.max_seeds, 16),
        )
    print(markdown(result))
    print(f"wrote {a.sweep / 'study.md'}, study.json, study.png")

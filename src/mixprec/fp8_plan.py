"""`python -m mixprec.fp8_plan [OVERRIDES...]`: the per-layer float8 plan of a config, measured on
this GPU without training (precision/fp8_layers.py): each layer's shape, its forward+backward time
in bf16 and in each candidate recipe, the choice and the expected saving. The same overrides as
train.py; precision=fp8_auto unless a precision with `fp8_layers` is given. The timings land in
the plan cache, so the training run that follows starts without measuring."""

from __future__ import annotations

import sys

USAGE = """usage: python -m mixprec.fp8_plan [OVERRIDES...]   e.g. model=vit_base batch=64
       (the plan of precision=fp8_auto for that config, measured on this GPU; no training)"""


def main(argv: list[str] | None = None) -> None:
    from mixprec.precision import fp8_early

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return
    if not any(a.startswith("precision=") for a in argv):
        argv.insert(0, "precision=fp8_auto")
    fp8_early.start([*argv, "precision.fp8_layers=auto"])  # they import while this one does

    from hydra.errors import HydraException

    from mixprec.core.errors import MixprecError
    from mixprec.precision import fp8_layers
    from mixprec.run.build import planned_precision
    from mixprec.run.config import compose_config, validate

    try:
        c = validate(compose_config([*argv, "precision.fp8_layers=auto"]))
        prec = planned_precision(c)
    except MixprecError as e:  # as train.py: one line and its exit code
        print(f"{e.label}: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except HydraException as e:  # an unknown option, or a precision without fp8_layers
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(fp8_layers.table(prec.choices, list(c.precision.fp8_candidates)))
    summary = prec.plan_summary() or {}
    print(f"\nplanned in {summary.get('planning_s', 0):.1f}s (0 when every timing was cached)")


if __name__ == "__main__":
    main()

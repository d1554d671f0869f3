"""`python -m mixprec.diagnose`: a config's dtype audit without training (diagnostics/audit.py),
or what the precision doctor found in a finished run (its summary.json). Help and a run dir that
is not one are answered before torch is imported (in a second, not in the 10 s of a training
process's imports on a 2-core CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

USAGE = """usage: python -m mixprec.diagnose [OVERRIDES...]  a config's dtype audit (no training)
       python -m mixprec.diagnose RUN_DIR         a run: its doctor, numerics and dtype plan"""


def shown_run(run_dir: Path) -> str:
    """`python -m mixprec.diagnose RUN_DIR`: what the doctor found in a run, from summary.json;
    a ValueError naming what is wrong where it cannot be read."""
    try:
        s = json.loads((run_dir / "summary.json").read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("it is not text (binary)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"it is not whole JSON ({e.msg} at line {e.lineno})") from None
    doctor = s.get("doctor") if isinstance(s, dict) else None
    if (
        not isinstance(s, dict)
        or not isinstance(doctor, (list, type(None)))
        or any(not isinstance(f, dict) for f in doctor or [])
    ):
        raise ValueError("it is not a mixprec summary (an object with a list of doctor findings)")
    lines = [
        f"# {run_dir}",
        "",
        f"status {s.get('status')}, precision {s.get('precision')}, "
        f"{s.get('steps')} steps, {s.get('skipped_steps')} skipped, loss scale "
        f"{s.get('loss_scale')}",
        "",
        "## precision doctor",
        "",
    ]
    again = _again(s)
    doctor = _shown("doctor findings", lambda: _doctor(s.get("doctor") or [], again))
    plan = _shown("dtype plan", lambda: _plan(s))
    return "\n".join(lines + doctor + _numerics(run_dir, s, again) + plan)


def _again(s: dict) -> str:
    """How to measure what the run did not: a finished run is run again (a resume of it
    trains nothing more); one that stopped may be resumed with the switch."""
    return "Run it again" if s.get("status") == "completed" else "Run it again (or resume it)"


FP32 = ("fp32", "tf32")  # the built-in precisions that cast nothing


def _shown(what: str, lines) -> list[str]:
    """A section of summary.json as lines; one that an older or a partial summary holds in
    another shape is said so, not a traceback."""
    try:
        return lines()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        return [
            "",
            f"The {what} in summary.json cannot be shown: it is partial or from another "
            f"mixprec version ({type(e).__name__}: {str(e)[:120]}).",
        ]


def _numerics(run_dir: Path, s: dict, again: str) -> list[str]:
    """The worst casts of the run's last numerics probe (numerics.jsonl)."""
    from mixprec.diagnostics import numerics

    rows = numerics.read(run_dir)
    lines = ["", "## numerics (debug.numerics)", ""]
    if not rows and s.get("precision") in FP32:
        return lines + [
            f"Nothing to measure: precision={s.get('precision')} casts nothing (no autocast, no "
            "converted layer); the numerics of a cast are measured at amp, bf16 or fp8."
        ]
    if not rows:
        return lines + [f"Not measured: {again.lower()} with debug.numerics=true."]
    last = max(r["step"] for r in rows)
    at = [r for r in rows if r["step"] == last]
    return lines + [
        f"The worst of {len(at)} casts at step {last} (of {len({r['step'] for r in rows})} "
        "probes), most underflow first:",
        "",
        numerics.table(numerics.worst(at, 10)),
    ]


def _plan(s: dict) -> list[str]:
    from mixprec.diagnostics import dtype_plan

    plan = s.get("dtype_plan")
    lines = ["", "## dtype plan (read from the live objects after step 1)", ""]
    if not isinstance(plan, dict):
        return lines + ["Not read: the run had debug.dtype_plan=off or stopped before step 1."]
    return lines + [dtype_plan.markdown(plan)]


def _doctor(found: list[dict], again: str = "Run it again") -> list[str]:
    from mixprec.diagnostics.doctor import sentence

    if not found:
        return [
            "No step was examined: the run had debug.locate=false and did not stop "
            f"for divergence. {again} with debug.locate=true."
        ]
    lines = []
    lines += [
        "| step | trigger | where | module | type | dtype | max in | max out | loss scale |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in found:
        cells = [f.get(k) for k in ("step", "trigger", "where", "module", "type", "dtype")]
        nums = [f.get(k) for k in ("max_abs_in", "max_abs_out", "loss_scale")]
        lines.append(
            "| "
            + " | ".join(
                [
                    *(str("" if c is None else c) for c in cells),
                    *("" if n is None else f"{float(n):.4g}" for n in nums),
                ]
            )
            + " |"
        )
    return lines + [""] + [sentence(f) for f in found]


def main(argv: list[str] | None = None) -> None:
    """`python -m mixprec.diagnose [overrides...]`: the audit for a config, without training;
    `python -m mixprec.diagnose RUN_DIR`: what the precision doctor found in a run."""
    argv = argv if argv is not None else sys.argv[1:]
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return
    if len(argv) == 1 and "=" not in argv[0]:  # a run dir, not an override
        if not (Path(argv[0]) / "summary.json").is_file():
            why = (
                "holds no summary.json (not a run dir)"
                if Path(argv[0]).is_dir()
                else "does not exist"
            )
            print(f"config error: {argv[0]} {why}", file=sys.stderr)
            raise SystemExit(2)
        try:
            print(shown_run(Path(argv[0])))
        except ValueError as e:  # torn, empty, binary or not a summary
            print(f"config error: {argv[0]}/summary.json cannot be read: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    from hydra.errors import HydraException

    from mixprec.core.errors import MixprecError
    from mixprec.diagnostics.audit import audit, markdown
    from mixprec.run.build import audit_inputs
    from mixprec.run.config import compose_config, validate

    try:
        cfg = compose_config(argv)
        model, x, prec = audit_inputs(validate(cfg))
    except MixprecError as e:  # as train.py: one line and its exit code, no traceback
        print(f"{e.label}: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except HydraException as e:  # an unknown group option, a bad override
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(markdown(audit(model, x, prec.autocast, prec.audited()), prec.name))


if __name__ == "__main__":
    main()

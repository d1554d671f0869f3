"""Upload offline W&B runs: `python -m mixprec.sync <run dir or sweep dir> [--print]`.

Finds every offline run under the given directories (a run's `wandb/`, every job of a sweep, and
the sweep's report run in `<sweep dir>/wandb/`) and hands them to `wandb sync` in one call."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def offline_runs(dirs: list[Path]) -> list[Path]:
    """The offline-run-* folders under `dirs`, in path order."""
    return sorted({p for d in dirs for p in d.rglob("offline-run-*") if p.is_dir()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mixprec.sync", description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="run dirs or multirun sweep dirs")
    ap.add_argument("--print", action="store_true", help="list the runs, upload nothing")
    a = ap.parse_args(argv)
    missing = [str(d) for d in a.dirs if not d.is_dir()]
    if missing:
        print(f"not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    runs = offline_runs(a.dirs)
    if not runs:
        print(f"no offline W&B runs under {', '.join(map(str, a.dirs))}", file=sys.stderr)
        return 1
    if a.print:
        print("\n".join(map(str, runs)))
        return 0
    return subprocess.call([sys.executable, "-m", "wandb", "sync", *map(str, runs)])


if __name__ == "__main__":
    sys.exit(main())

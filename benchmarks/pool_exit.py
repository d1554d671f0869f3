"""How long a process that started the tuning workers (src/mixprec/tuning_workers.py) keeps its
stdout open after its final line, against one that started none: each a fresh process that
imports torch, optionally starts the pool, prints its final line and exits through train.py's
quick exit; the time runs until the pipe closes (every process holding it has ended), as
`train.py | tee log` or a CI runner sees it. Side by side, `--repeat` times each.

    python3 benchmarks/pool_exit.py --workers 14 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(workers: int) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from mixprec import quick_exit

    quick_exit.install()
    import torch  # noqa: F401  (what the trainer holds)

    from mixprec import tuning_workers

    if workers:
        os.environ[tuning_workers.ENV] = str(workers)
        tuning_workers.start()
        while tuning_workers.get() is None:
            time.sleep(0.05)
    print("final line", flush=True)
    quick_exit.exiting_with(0)


def one(workers: int) -> float:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", str(workers)], stdout=subprocess.PIPE, text=True
    )
    for line in proc.stdout:
        if line.startswith("final line"):
            t0 = time.monotonic()
    proc.wait()
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        return child(a.child)
    rows = {n: [one(n) for _ in range(a.repeat)] for n in (0, a.workers)}
    out = {f"{n} workers": round(statistics.median(t), 3) for n, t in rows.items()}
    print(json.dumps({"stdout_open_after_final_line_s (median)": out, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()

"""How long a process that started worker pools keeps running after its final line, against
one that started none: inductor's compile workers (the sidecar and pool inductor starts to compile Triton kernels; on a CPU
nothing starts it, so the child does). Each a fresh process that imports torch, starts the
pool, prints its final line and exits through train.py's quick exit; timed until its stdout
closes (every process holding it has ended) and it has exited, as `train.py | tee log` or a
CI runner sees it. Side by side, `--repeat` times each.

    python3 benchmarks/pool_exit.py --workers 14 --repeat 5
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


def child(pool: str, workers: int) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from mixprec.internals import quick_exit

    quick_exit.install()
    import torch  # noqa: F401  (what the trainer holds)

    if pool == "inductor":
        from torch._inductor import async_compile, config

        config.compile_threads = workers
        started = async_compile.AsyncCompile.process_pool()
        started.submit(os.getpid).result()  # its workers are up
    print("final line", flush=True)
    quick_exit.exiting_with(0)


def one(pool: str, workers: int) -> float:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", pool, "--workers", str(workers)],
        stdout=subprocess.PIPE,
        text=True,
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
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        return child(a.child, a.workers)
    rows = {p: [one(p, a.workers) for _ in range(a.repeat)] for p in ("none", "inductor")}
    out = {p: round(statistics.median(t), 3) for p, t in rows.items()}
    print(json.dumps({"exit_after_final_line_s (median)": out, "workers": a.workers}))


if __name__ == "__main__":
    main()

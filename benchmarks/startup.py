"""Time to the first step and to exit: the same train.py command run cold (inductor's and
Triton's caches empty: a new machine) and then warm (the second run on this machine), each a
fresh process. Reads first_step_s, compile_s, compile_first_step_s (the rest of compile_s is
the first evaluation's graph), tune_s (Triton kernel tuning at first launch) and samples_per_s
from summary.json, and times the gap between the run's final line and the process's exit.

    python3 benchmarks/startup.py                                  # experiment=fast, cold then warm
    python3 benchmarks/startup.py --runs warm --args experiment=fast precision=bf16
    python3 benchmarks/startup.py --runs cold --cache /tmp/c1 --args experiment=fast model.compile_cache=/tmp/fast.bin
    python3 benchmarks/startup.py --runs cold --cache /tmp/c2 --args experiment=fast model.compile_cache=/tmp/fast.bin
        # the second: a new machine (inductor's cache empty) given the first run's kernels

Python's own bytecode counts too: where the image has none (PYTHONDONTWRITEBYTECODE, as on the
GPU machines here), compile it first as an install would, e.g.
    export PYTHONPYCACHEPREFIX=/tmp/pyc; python3 -m compileall -q -j 0 $(python3 -c \
        "import site; print(*site.getsitepackages())") src

Measured rows: benchmarks/RESULTS.md ("Time to the first step").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("first_step_s", "compile_s", "compile_first_step_s", "tune_s", "samples_per_s", "wall_s")


def one(args: list[str], env: dict, timeout: float, log: Path | None = None) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="mixprec-startup-"))
    cmd = [sys.executable, "-u", str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    final_at, tail = None, []
    for line in proc.stdout:  # the run's own lines, as they come
        tail = [*tail[-40:], line]
        if "][mixprec][INFO] - " in line and " in " in line and " at step " in line:
            final_at = time.monotonic()  # "completed in ... at step ..." (the final line)
    proc.wait(timeout=timeout)
    exited = time.monotonic()
    row = {"rc": proc.returncode, "process_s": round(exited - t0, 1)}
    row["exit_after_final_line_s"] = round(exited - final_at, 2) if final_at else None
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        row.update({k: s.get(k) for k in KEYS})
    if proc.returncode:
        row["tail"] = "".join(tail[-15:])
    if log is not None and (run_dir / "train.log").exists():
        shutil.copyfile(run_dir / "train.log", log)
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def per_run(folder: Path | None, name: str) -> Path | None:
    """FOLDER/NAME for one run (the folder made, an older file removed); None without FOLDER."""
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).unlink(missing_ok=True)
    return folder / name


def _bytecode_cached(module) -> bool:
    import importlib.util

    return os.path.exists(importlib.util.cache_from_source(module.__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--args", nargs="*", default=["experiment=fast"], help="train.py overrides")
    ap.add_argument("--runs", nargs="*", default=["cold", "warm"], choices=("cold", "warm"))
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "mixprec-startup")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--logs", type=Path, help="keep each run's train.log as DIR/<run>.log")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "startup.json")
    a = ap.parse_args()
    import torch

    env = {
        **os.environ,
        "WANDB_MODE": "disabled",
        "TORCHINDUCTOR_CACHE_DIR": str(a.cache / "inductor"),
        "TRITON_CACHE_DIR": str(a.cache / "triton"),
    }
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "args": a.args,
        "cpus": os.cpu_count(),
        # whether torch's modules load from cached bytecode, as after a pip or conda install
        # (an image built with PYTHONDONTWRITEBYTECODE compiles every module at each start:
        # 10.6 s of a warm run on the H200 machine, benchmarks/RESULTS.md)
        "torch_bytecode_cached": _bytecode_cached(torch),
    }
    rows = []
    for kind in a.runs:
        if kind == "cold":
            shutil.rmtree(a.cache, ignore_errors=True)
        log = per_run(a.logs, f"{kind}.log")
        rows.append({"run": kind, **one(a.args, env, a.timeout, log)})
        print(json.dumps(rows[-1]), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

"""precision=fp8_auto's timing processes (fp8_timing.py), started by train.py's first lines:
this is the early module conf/precision/fp8.yaml declares (`early:`, core/early.py).

On a machine whose caches are empty, the plan's time is its timing processes' imports (torch,
torchao, inductor). Started by the plugin's warm_up, after the training process has imported
torch and composed its config, they begin too late to hide them; started here, they import
while the training process does (the measured difference is benchmarks/RESULTS.md's fp8 plan
rows). start() starts them before the training process imports torch, on the
command line's word: an argument `precision=fp8_auto` or `precision.fp8_layers=auto`, no timings
yet in the plan cache the command line names (or the default one), NVIDIA's driver loaded, and
not a sweep or a help. Then they import while the training process imports, composes its config
and builds. The plugin's warm_up claims them (claim()); the builder releases what is left
unclaimed (core/early.release(): a resumed plan, another GPU, a cached plan), and the
process's end ends them too.
MIXPREC_FP8_EARLY=0 switches it off (warm_up starts them, as before).

Nothing here imports torch: it runs before anything heavy is imported.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SWITCH = "MIXPREC_FP8_EARLY"
AUTO = ("precision=fp8_auto", "precision.fp8_layers=auto")
NOT_A_RUN = ("-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "--info")
DEFAULT_CACHE = "~/.cache/mixprec/fp8_plan.json"  # fp8_plan_cache's default (fp8.Config)
GPU_NODES = (Path("/dev/nvidiactl"), Path("/proc/driver/nvidia/version"))  # a driver: a GPU
_early: list[tuple[subprocess.Popen, float, int]] = []  # (process, started at, GPU index)


def processes() -> int:
    """How many timing processes a plan starts: one per 4 CPU cores, at most 4 (the float8
    timings' cost is compiling them, on the CPU; their GPU time is a few ms each)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def spawn(device: str, n: int, early: bool = False) -> tuple[subprocess.Popen, float]:
    """One timing process for `device` (cuda:I), one of `n`: inductor's compile workers shared
    between them. A process group of its own, so its compile workers end with it. `early`: it
    ends quietly where it finds no such GPU (warm_up then starts its own, which says why)."""
    t0 = time.time()
    env = dict(os.environ)
    if n > 1:
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    setup = json.dumps({"device": device, "t0": t0, "early": early})
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixprec.precision.fp8_timing", setup],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    return proc, t0


def end(proc: subprocess.Popen) -> None:
    """End a timing process (and its compile workers) unless it has ended; close its pipes."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            stream.close()


def wanted(argv: list[str], environ: dict | None = None, nodes=None) -> bool:
    """Whether this command line asks for a plan that will time layers on a GPU here (`nodes`:
    the device files whose presence says NVIDIA's driver is loaded: GPU_NODES)."""
    environ = os.environ if environ is None else environ
    nodes = GPU_NODES if nodes is None else nodes
    if environ.get(SWITCH, "1") == "0" or any(a in NOT_A_RUN for a in argv):
        return False
    if not any(a.lstrip("+") in AUTO for a in argv):
        return False
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    if not any(node.exists() for node in nodes):
        return False
    cache = DEFAULT_CACHE
    for a in argv:
        key, _, value = a.lstrip("+").partition("=")
        if key == "precision.fp8_plan_cache":
            cache = value
    return not _has_timings(cache)


def _has_timings(cache: str) -> bool:
    if cache in ("null", "None", ""):
        return False
    try:
        return bool(json.loads(Path(cache).expanduser().read_text()))
    except (OSError, ValueError):
        return False


def start(argv: list[str]) -> None:
    """train.py's first lines: the timing processes, where the command line wants a plan."""
    if _early or not wanted(argv):
        return
    index = int(os.environ.get("LOCAL_RANK", "0"))  # the GPU hardware.setup will choose
    n = processes()
    for _ in range(n):
        proc, t0 = spawn(f"cuda:{index}", n, early=True)
        _early.append((proc, t0, index))
    atexit.unregister(release)  # once; after quick_exit's handler, so that it runs before it
    atexit.register(release)


def claim(index: int) -> list[tuple[subprocess.Popen, float]]:
    """The early processes for GPU `index` that are still alive, handed over (the rest ended)."""
    mine = []
    for proc, t0, i in _early:
        if i == index and proc.poll() is None:
            mine.append((proc, t0))
        else:
            end(proc)
    _early.clear()
    return mine


def release() -> None:
    """End the early processes that no plan claimed."""
    while _early:
        end(_early.pop(0)[0])

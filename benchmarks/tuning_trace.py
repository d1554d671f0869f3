"""Where inductor's coordinate-descent tuning spends its time: runs train.py with the tuner
traced and appends one JSON line per tuned kernel to TRACE: its name, the configs it
benchmarked, seconds the walk spent compiling them (on its own thread), benchmarking them and
in all (the rest: waiting for a compile ahead, loading a launcher), the baseline and best timings (ms), and mixprec's compile-ahead counters so far.

    python3 benchmarks/tuning_trace.py TRACE.jsonl train.py experiment=fast ...
    python3 benchmarks/startup.py --trace outputs/bench/trace    # cold and warm, each traced
"""

from __future__ import annotations

import json
import runpy
import sys
import time


def install(trace: str) -> None:
    from torch._inductor.runtime import triton_heuristics as th

    cls, now = th.CachingAutotuner, time.perf_counter
    spent = {"compile": 0.0, "bench": 0.0, "configs": 0}

    def timed(name, original):
        def wrapper(self, *args, **kwargs):  # the thread tuning (backward's: autograd's own)
            t0 = now()
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[name] += now() - t0
                spent["configs"] += name == "bench"

        return wrapper

    original_tuning = cls.coordinate_descent_tuning

    def tuning(self, launcher, *args, **kwargs):
        spent.update(compile=0.0, bench=0.0, configs=0)
        t0 = now()
        winner = original_tuning(self, launcher, *args, **kwargs)
        tuner = self.coordesc_tuner
        timings = [t for t in tuner.cached_benchmark_results.values() if t != float("inf")]
        from mixprec.internals import tuning_ahead

        row = {
            "kernel": self.inductor_meta.get("kernel_name"),
            "configs": spent["configs"],
            "compile_s": round(spent["compile"], 3),
            "bench_s": round(spent["bench"], 3),
            "total_s": round(now() - t0, 3),
            "baseline_ms": tuner.lookup_in_cache(launcher.config),
            "best_ms": min(timings) if timings else None,
            "ahead": dict(tuning_ahead.stats),
        }
        with open(trace, "a") as f:
            f.write(json.dumps(row) + "\n")
        return winner

    cls._precompile_config = timed("compile", cls._precompile_config)
    cls.bench = timed("bench", cls.bench)
    cls.coordinate_descent_tuning = tuning


def install_at_compile(trace: str) -> None:
    """Install when train.py first compiles (torch is then imported after train.py's own
    exit handler, as in a run without the trace)."""
    from mixprec.internals import tuning_ahead

    apply = tuning_ahead.apply

    def traced_apply() -> bool:
        if tuning_ahead.apply is traced_apply:
            install(trace)
            tuning_ahead.apply = apply
        return apply()

    tuning_ahead.apply = traced_apply


if __name__ == "__main__":
    install_at_compile(sys.argv[1])
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")

"""round 4 session 9: fp8_auto planning, cold (empty plan cache, inductor and Triton caches), train.py's
early timing processes (MIXPREC_FP8_EARLY=1) against warm_up's (=0), alternated.
usage: s9plan.py MODEL MODE[,MODE...]   MODE: early | late"""
import json, os, re, subprocess, sys, tempfile, time
sys.path.insert(0, "benchmarks")
from fp8_plan import overrides
model, modes = sys.argv[1], sys.argv[2].split(",")
for mode in modes:
    with tempfile.TemporaryDirectory() as d:
        args = [*overrides(model), "precision=fp8_auto", "logger=none", f"hydra.run.dir={d}/run",
                f"precision.fp8_plan_cache={d}/plan.json", "trainer.max_steps=3", "trainer.perf_warmup_steps=1"]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{d}/inductor", "TRITON_CACHE_DIR": f"{d}/triton",
               "MIXPREC_FP8_EARLY": "1" if mode == "early" else "0"}
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        s = json.loads(open(f"{d}/run/summary.json").read()) if os.path.exists(f"{d}/run/summary.json") else {}
        lines = [l for l in p.stderr.splitlines() if l.startswith("fp8 plan:") and ("imported" in l or "timed" in l)]
        log = open(f"{d}/run/train.log").read() if os.path.exists(f"{d}/run/train.log") else ""
        measured = [l.split(" - ", 1)[-1][:160] for l in log.splitlines() if "measured in" in l]
        first = [l.split(" - ", 1)[-1][:120] for l in log.splitlines() if "first step took" in l]
        print(json.dumps({"model": model, "mode": mode, "rc": p.returncode, "wall_s": round(wall, 1),
                          "plan": s.get("precision_plan"), "measured": measured, "first": first, "child": lines,
                          "err": p.stderr[-1500:] if p.returncode else ""}), flush=True)

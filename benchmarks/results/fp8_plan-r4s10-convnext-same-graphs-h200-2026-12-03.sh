#!/usr/bin/env bash
# round 4 session 10, call 2: does fp8_auto (0 layers float8) compile ConvNeXt-T to bf16's graphs? bf16, then fp8_auto on
# the warm plan cache, then bf16 again, sharing one fresh inductor cache; new FX-graph entries per run. Then 3 more rounds of 400 timed steps.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null && export PYTHONPATH=/tmp/site:$PWD/src || exit
export WANDB_MODE=offline PYTHONPYCACHEPREFIX=/tmp/pyc
t0=$(date +%s)
export TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc
entries() { find /tmp/ic -path "*fxgraph*" -type f | sort; }
: > /tmp/seen
for p in bf16 fp8_auto bf16; do
  extra=""; [ $p = fp8_auto ] && extra="precision.fp8_plan_cache=$PWD/scratch/cnx_plan_cache.json"
  timeout 150 python3 train.py experiment=fp8_table hydra.mode=RUN model.name=convnext_tiny precision=$p logger=none \
    hydra.run.dir=/tmp/r_${p}_$RANDOM $extra trainer.max_steps=60 > /tmp/log 2>&1 || { tail -20 /tmp/log; }
  grep -h "Linear layers compute in float8\|fp8_layers=auto" /tmp/log | head -2 | cut -c1-200
  entries > /tmp/now; echo "$p: fxgraph entries $(wc -l < /tmp/now), new $(comm -13 /tmp/seen /tmp/now | wc -l); $(grep -ho '[0-9.]* samples/s' /tmp/log | tail -1)"
  comm -13 /tmp/seen /tmp/now | head -3; cp /tmp/now /tmp/seen
done
echo "identity done: $(( $(date +%s) - t0 )) s"
unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
mkdir -p $OUT/cnx2 && cp scratch/cnx_plan_cache.json $OUT/cnx2/fp8_plan_cache.json
timeout 400 python3 benchmarks/fp8_plan.py --models convnext_tiny --uniform none --repeat 3 --steps 440 --warmup 40 --out $OUT/cnx2 2>&1 | python3 -c "
import sys, json
for l in sys.stdin:
    if l.startswith('{'):
        r = json.loads(l); print(r['round'], r['precision'], round(r.get('rate', 0)), r.get('vs_bf16'), 'wall', r.get('wall_s'), 'plan', r.get('planning_s'), 'win', r.get('windows'), r.get('error', '')[-600:])
" | tail -8
echo "total: $(( $(date +%s) - t0 )) s"

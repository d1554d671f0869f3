#!/usr/bin/env bash
# Issue 44 on two GPUs (nvidia-h200-x2), in one call of at most 10 minutes: every run's run dir
# and summary.json land under $OUT/two_gpu/ (or outputs/two_gpu/), its tail in the console.
#   1. DDP vs FSDP2 on the 1B shape, bf16 and fp8: tokens/s and peak memory per GPU
#   2. FSDP2's gradient reduction in fp32 vs bf16: tokens/s and val loss after the same steps
#   3. a model that fits only sharded (Llama-3-8B's full 32 layers, activation checkpointing),
#      a few steps with sharded checkpoints, then resumed
#   4. scaling.py's DDP row (ResNet-50 amp, 1 GPU then 2)
# --dry-run: the same commands on the CPU over gloo (two processes, a tiny Llama, 2-3 steps,
# bf16 only: float8 needs a GPU), to see every command run end to end before a GPU is lent.
#   bash benchmarks/two_gpu.sh             # on the 2-GPU machine
#   bash benchmarks/two_gpu.sh --dry-run   # here
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-outputs}/two_gpu
mkdir -p "$out"
dry=${1:-}
export WANDB_MODE=offline PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
PY=${PYTHON:-python3}
TR=("$PY" -m torch.distributed.run --standalone --nproc_per_node=2)
if [ "$dry" = "--dry-run" ]; then
  export OMP_NUM_THREADS=1
  LM=(model=llama_tiny data=text data.seq_len=64 data.max_mb=1 data.val_sequences=8 hardware=cpu
      batch=2 logger=none trainer.max_steps=2 trainer.log_every=1 trainer.perf_warmup_steps=0
      needs_gpu=false model.compile=false ckpt.at_end=false)
  BIG=("${LM[@]}" model.kwargs.n_layers=3)
  PRECISIONS=(bf16)
  STEPS=3
else
  LM=(experiment=lm_table hydra.mode=RUN model=llama_1b logger=none trainer.max_steps=30
      trainer.perf_warmup_steps=10)
  BIG=(experiment=lm_table hydra.mode=RUN model=llama_8b_slice model.kwargs.n_layers=32
       model.grad_checkpointing=true precision=bf16 logger=none trainer.perf_warmup_steps=2)
  PRECISIONS=(bf16 fp8)
  STEPS=6
fi
run() {  # name, then train.py's arguments (under torchrun, two processes)
  local name=$1; shift
  echo "### $name"
  "${TR[@]}" train.py "$@" "hydra.run.dir=$out/$name" > "$out/$name.log" 2>&1
  echo "exit $? ($name)"; tail -n 2 "$out/$name.log"
}
for p in "${PRECISIONS[@]}"; do  # 1. DDP vs FSDP2
  for s in ddp fsdp; do run "1-$s-$p" "${LM[@]}" precision=$p parallel=$s; done
done
for r in float32 bfloat16; do  # 2. FSDP2's reduce dtype, with an evaluation at the end
  run "2-fsdp-reduce-$r" "${LM[@]}" precision=bf16 parallel=fsdp parallel.reduce_dtype=$r
done
# 3. only sharded: sharded checkpoints every 3 steps, then a resume that continues to STEPS+2
run 3-big-sharded "${BIG[@]}" parallel=fsdp trainer.max_steps=$STEPS ckpt.sharded=true \
  ckpt.every_steps=3 ckpt.at_end=true
run 3-big-resumed "${BIG[@]}" parallel=fsdp trainer.max_steps=$((STEPS + 2)) ckpt.sharded=true \
  ckpt.at_end=true "resume=$out/3-big-sharded"
if [ "$dry" != "--dry-run" ]; then  # 4. DDP scaling (GPU only: it times ResNet-50)
  "$PY" benchmarks/scaling.py --gpus 2 > "$out/4-scaling.log" 2>&1; tail -n 6 "$out/4-scaling.log"
fi
"$PY" - "$out" <<'PYEOF'
import json, sys
from pathlib import Path
for s in sorted(Path(sys.argv[1]).glob("*/summary.json")):
    d = json.loads(s.read_text())
    print(s.parent.name, d["status"], "steps", d["steps"], "tokens/s", d.get("tokens_per_s"),
          "peak GiB", d.get("peak_mem_gib"), "val loss", d.get("val_loss"), "world", d.get("world_size"))
PYEOF

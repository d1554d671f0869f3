#!/usr/bin/env bash
# Run jobs on a GPU machine that lacks hydra/omegaconf/wandb/torchao: installs the wheels that
# ../shared/device/wheels.sh put in .whl/, then runs each argument as a shell command on its own
# GPU (argument i on GPU i, in parallel), logging to $OUT/gpu<i>.log (or ./outputs/device/).
#   bash benchmarks/on_device.sh "python3 -m pytest -q -m gpu" "python3 benchmarks/bare_vs_train.py ..."
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-outputs/device}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
fi
export WANDB_MODE=offline PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
i=0
pids=()
for cmd in "$@"; do
  ( export CUDA_VISIBLE_DEVICES=$i; echo "### GPU $i: $cmd"; bash -c "$cmd" ) > "$out/gpu$i.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for f in "$out"/gpu*.log; do echo "===== $f (tail)"; tail -n 25 "$f"; done
exit $status

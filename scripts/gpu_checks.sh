#!/usr/bin/env bash
# What needs a CUDA GPU, in one go on a machine with one (no network needed): the GPU tests (8-bit and bf16/fp16
# on one GPU, predict.py on the GPU) and the speed benchmark's GPU figures (one epoch of the bf16 defaults and of
# 8-bit on a bert-base-sized model, 50 steps of the original). Results go to the folder given (default
# output/gpu-checks): tests.log, speed.json, speed.log.
#
#   bash scripts/gpu_checks.sh [RESULTS_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
results=$(realpath -m "${1:-output/gpu-checks}")
mkdir -p "$results"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$results/gpu.txt"
"$PY" -c 'import torch, transformers, peft, accelerate, bitsandbytes, datasets
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, peft {peft.__version__},"
      f" accelerate {accelerate.__version__}, bitsandbytes {bitsandbytes.__version__}, datasets {datasets.__version__}")' |
    tee -a "$results/gpu.txt"

status=0
"$PY" -m pytest -m gpu -p no:cacheprovider -o addopts="-ra --durations=5" tests/test_gpu.py 2>&1 | tee "$results/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" benchmarks/train_speed.py --epoch --skip-allreduce --startup-repeats 3 --json "$results/speed.json" 2>&1 |
    tee "$results/speed.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status

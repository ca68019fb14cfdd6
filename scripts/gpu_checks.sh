#!/usr/bin/env bash
# What needs a CUDA GPU, in one call on a machine with one (no network needed, under 8 minutes on an H100): the
# figures of docs/performance.md (benchmarks/gpu_checks.py: eager and fast arms in bf16 and 8-bit, their start-up
# cold and warm, the step profile before and after, bitsandbytes' options), then the GPU tests with the time left.
# Results go to the folder given (default output/gpu-checks): gpu.json (written after every part), each part's
# log, tests.log, gpu.txt. GPU_CHECKS_SMOKE=1: a tiny model and a few rows, to know on the CPU that the script
# runs to its end and writes every field (the GPU-only parts may fail there; on a GPU every failure counts).
#
#   bash scripts/gpu_checks.sh [RESULTS_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
results=$(realpath -m "${1:-output/gpu-checks}")
mkdir -p "$results"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
smoke=${GPU_CHECKS_SMOKE:-0}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$results/gpu.txt"
"$PY" -c 'import torch, transformers, peft, accelerate, bitsandbytes, datasets
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, peft {peft.__version__},"
      f" accelerate {accelerate.__version__}, bitsandbytes {bitsandbytes.__version__}, datasets {datasets.__version__}")' 2>/dev/null |
    tee -a "$results/gpu.txt"

status=0
"$PY" benchmarks/gpu_checks.py "$results" $([ "$smoke" = 1 ] && echo --smoke) 2>&1 | tee "$results/gpu_checks.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ "$smoke" != 1 ]; then
    left=$((470 - (SECONDS - started)))  # the whole call under 8 minutes
    if [ "$left" -gt 30 ]; then
        timeout "$left" "$PY" -m pytest -m gpu -p no:cacheprovider -o addopts="-ra --durations=5" tests/test_gpu.py 2>&1 |
            tee "$results/tests.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    else
        echo "GPU tests skipped: ${left} s left of the call's 8 minutes" | tee "$results/tests.log"
    fi
fi
echo "gpu_checks: $((SECONDS - started)) s, exit $status"
exit $status

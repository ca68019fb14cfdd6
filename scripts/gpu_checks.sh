#!/usr/bin/env bash
# What needs a CUDA GPU, in one call on a machine with one (no network needed, under 8 minutes on an H100): the
# figures of docs/performance.md (benchmarks/gpu_checks.py: eager and fast arms in bf16 and 8-bit, their start-up
# cold and warm, the step profile before and after, bitsandbytes' options), then the GPU tests with the time left.
# Results go to the folder given (default output/gpu-checks), four files: gpu.json (written after every part),
# gpu_checks.log, tests.log, gpu.txt; each part's own log stays in the work folder (/tmp/gpu-checks-work), the end of
# a failed one in gpu.json. GPU_CHECKS_SMOKE=1: a tiny model and a few rows, to know on the CPU that the script
# runs to its end and writes every field (the GPU-only parts may fail there; on a GPU every failure counts).
# WHEELS=DIR: a machine with a CUDA PyTorch but not the job's packages, and no network, gets them from the wheels
# scripts/gpu_wheels.sh downloaded, installed into a private folder for this call.
#
#   bash scripts/gpu_checks.sh [RESULTS_DIR]
#   WHEELS=.whl bash scripts/gpu_checks.sh [RESULTS_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
results=$(realpath -m "${1:-output/gpu-checks}")
mkdir -p "$results"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
smoke=${GPU_CHECKS_SMOKE:-0}

if [ -n "${WHEELS:-}" ]; then
    site=$(mktemp -d)
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" "$WHEELS"/*.whl || exit 1
    # Compiled once here, on every core: where PYTHONDONTWRITEBYTECODE is set, each of the call's dozen processes
    # would otherwise compile transformers from source again (seconds each).
    "$PY" -m compileall -q -j 0 "$site" >/dev/null
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "packages from $WHEELS: $(find "$WHEELS" -name '*.whl' | wc -l) wheels installed in $((SECONDS - started)) s"
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$results/gpu.txt"
if ! versions=$("$PY" -c 'import torch, transformers, peft, accelerate, bitsandbytes, datasets
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, peft {peft.__version__},"
      f" accelerate {accelerate.__version__}, bitsandbytes {bitsandbytes.__version__}, datasets {datasets.__version__}")' \
    2>"$results/imports.log"); then
    echo "error: the job's packages do not import with $PY (the wheels of scripts/gpu_wheels.sh, WHEELS=DIR, bring them):" >&2
    tail -5 "$results/imports.log" >&2
    exit 1
fi
rm "$results/imports.log"  # few files in RESULTS_DIR: a lent machine may send back only a handful
echo "$versions" | tee -a "$results/gpu.txt"

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

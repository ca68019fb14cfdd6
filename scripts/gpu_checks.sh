#!/usr/bin/env bash
# What needs a CUDA GPU, in one call of at most 7 minutes on a machine with one (no network needed): the figures of
# docs/performance.md (benchmarks/gpu_checks.py: the job itself, eager and fast, bf16 and 8-bit, cold and warm, and
# the fast path's step profile), then the GPU tests with the time left. Results go to the folder given (default
# output/gpu-checks), five files: gpu.txt (the device and the package versions, first), gpu.json (written after
# every part), gpu_checks.log, tests.log and logs.tar.gz (every part's whole log and records, no caches or weights).
# GPU_CHECKS_SMOKE=1: a tiny model and a few rows on the CPU, so CI knows the script runs to its end.
# WHEELS=DIR: a machine with a CUDA PyTorch but not the job's packages, and no network, gets them from the wheels
# scripts/gpu_wheels.sh downloaded, installed into a private folder for this call.
#
#   bash scripts/gpu_checks.sh [RESULTS_DIR [gpu_checks.py's options]]
#   WHEELS=.whl bash scripts/gpu_checks.sh [RESULTS_DIR]
#   WHEELS=.whl bash scripts/gpu_checks.sh "$OUT" --parts fast-8bit,fast-8bit-threshold-0 --merge benchmarks/results/gpu.json
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
results=$(realpath -m "${1:-output/gpu-checks}")
shift $(($# > 0 ? 1 : 0))
options=("$@")
mkdir -p "$results"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
smoke=${GPU_CHECKS_SMOKE:-0}
CALL_S=${GPU_CHECKS_CALL_S:-390}  # the whole call, the wheels' install included: 6.5 of the 7 minutes
work=${TMPDIR:-/tmp}/gpu-checks-work

if [ -n "${WHEELS:-}" ]; then
    site=$(mktemp -d)
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" "$WHEELS"/*.whl || exit 1
    # Compiled once here, on every core: where PYTHONDONTWRITEBYTECODE is set, each of the call's processes would
    # otherwise compile transformers from source again (seconds each).
    "$PY" -m compileall -q -j 0 "$site" >/dev/null
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "packages from $WHEELS: $(find "$WHEELS" -name '*.whl' | wc -l) wheels installed in $((SECONDS - started)) s"
fi

# The device and the versions first: what the call ran on is known even if nothing else comes back.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$results/gpu.txt"
# Libraries' import-time notices (bitsandbytes' on a CPU, say) go to a log shown only if the check fails.
if ! "$PY" - 2>"$work-imports.log" <<'EOF' | tee -a "$results/gpu.txt"; then
import importlib
import sys
from importlib.metadata import requires, version

broken = []
for name in ("torch", "transformers", "peft", "accelerate", "datasets", "pyarrow", "bitsandbytes", "evaluate"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {module.__version__}" + (f" (CUDA {module.version.cuda})" if name == "torch" else ""))
    except Exception as exc:  # any failure to import is the same verdict: the call cannot run the job
        broken.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
pyarrow_needed = next((r for r in requires("datasets") or [] if r.startswith("pyarrow") and ";" not in r), "?")
if broken:
    print("error: the job's packages do not import; the call stops here:", *broken, sep="\n  ", file=sys.stderr)
    if any(b.startswith(("datasets", "pyarrow")) for b in broken):
        print(f"  datasets {version('datasets')} needs {pyarrow_needed}; this image's pyarrow is older. The pyarrow "
              "wheel (55 MB) does not fit beside the others in a 64 MB call: pin an older datasets in "
              "scripts/gpu_wheels.sh (datasets 4.x needs pyarrow >= 21) and rerun", file=sys.stderr)
    else:
        print("  scripts/gpu_wheels.sh brings the job's packages (WHEELS=DIR)", file=sys.stderr)
    sys.exit(1)
EOF
    cat "$work-imports.log" >&2
    exit 1
fi

status=0
left=$((CALL_S - (SECONDS - started) - 45))  # 45 s kept for the archive and the GPU tests' start
deadline=()
[ "$smoke" = 1 ] || deadline=(--deadline "$left")
"$PY" benchmarks/gpu_checks.py "$results" --work-dir "$work" "${deadline[@]}" "${options[@]}" $([ "$smoke" = 1 ] && echo --smoke) 2>&1 |
    tee "$results/gpu_checks.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ "$smoke" != 1 ]; then
    left=$((CALL_S - (SECONDS - started) - 10))
    if [ "$left" -gt 30 ]; then
        timeout "$left" "$PY" -m pytest -m gpu -p no:cacheprovider -o addopts="-ra --durations=5" tests/test_gpu.py 2>&1 |
            tee "$results/tests.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    else
        echo "GPU tests not run: ${left} s left of the call's ${CALL_S} s" | tee "$results/tests.log"
    fi
fi
# Every part's whole log and records, in one file (a lent machine sends back a handful): no caches, data or weights.
tar -czf "$results/logs.tar.gz" -C "$work" --exclude='cache' --exclude='checkpoint-*' --exclude='*.safetensors' \
    --exclude='data-sst2-*' --exclude='bert-base-random-12l' --exclude='tiny-bert' --exclude='tokenizer*' . 2>/dev/null
echo "gpu_checks: $((SECONDS - started)) s, exit $status"
exit $status

#!/usr/bin/env bash
# The wheels a GPU machine with no network needs to run the job and scripts/gpu_checks.sh when its Python already
# holds a CUDA PyTorch (a PyTorch image, say) but not the job's other packages, or older releases of them. Run it
# here, where pip reaches an index; copy the folder to the machine; there, `WHEELS=DIR bash scripts/gpu_checks.sh`
# installs them into a private folder first (nothing of the machine's own Python changes).
#
#   bash scripts/gpu_wheels.sh [DIR] [PYTHON_VERSION] [CUDA_MAJOR]   # default .whl, 3.12 and 13 (torch 2.13's images)
#
# The versions are the ones this checkout's venv holds (the job's pins, tested here), each package without its
# dependencies: the list below names every one the job imports that such an image may lack, or hold in a release
# older than the pins need. Not listed, and needed from the image: torch, accelerate, numpy, pandas, pyarrow
# (>= 24, for datasets), tokenizers, safetensors, matplotlib, tensorboard, psutil, pyyaml, tqdm, regex, xxhash.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
python_version=${2:-3.12}
cuda_major=${3:-13}
PY=${PYTHON:-.venv/bin/python}
PACKAGES=(
    transformers peft bitsandbytes datasets evaluate huggingface-hub  # the job's libraries, at the pins
    pydantic pydantic-core pydantic-settings annotated-types typing-inspection python-dotenv  # settings
    tenacity                                                            # Hub retries
    dill multiprocess                                                   # datasets
    httpx2 httpcore2 truststore h11 anyio idna click typing-extensions fsspec  # huggingface-hub 2.x and its floors
)
pins=$("$PY" - "${PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"error: {', '.join(missing)} not installed in {sys.prefix}; run `make venv` first")
EOF
)
mkdir -p "$dest"
platforms=()
for tag in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux2014; do
    platforms+=(--platform "${tag}_x86_64")
done
# shellcheck disable=SC2086 # one requirement per word
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$python_version" --implementation cp "${platforms[@]}" --dest "$dest" $pins 2>&1 |
    grep -v "^WARNING: Location" || true
# bitsandbytes ships its kernels for every CUDA 11, 12 and 13 release, ROCm and XPU (43 MB of the 63): keep the CPU
# ones and the machine's CUDA major only (5 MB), which bitsandbytes picks from torch.version.cuda at import.
"$PY" - "$dest" "$cuda_major" <<'EOF'
import re
import sys
import zipfile
from pathlib import Path

dest, major = Path(sys.argv[1]), sys.argv[2]
for wheel in dest.glob("bitsandbytes-*.whl"):
    other = re.compile(rf"bitsandbytes/libbitsandbytes_(?!cpu|cuda{major}\d)\w+\.so")
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if other.fullmatch(item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):  # the files it lists are the files it holds
                data = b"".join(line for line in data.splitlines(True) if not other.match(line.decode()))
            target.writestr(item, data)
    slim.replace(wheel)
EOF
count=$(find "$dest" -name '*.whl' | wc -l)
[ "$count" -ge "${#PACKAGES[@]}" ] || { echo "error: $count wheels in $dest for ${#PACKAGES[@]} packages" >&2; exit 1; }
echo "$count wheels in $dest, $(du -sh "$dest" | cut -f1) (Python $python_version, x86-64)"

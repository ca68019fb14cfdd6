# The training job's image: one image for `docker run --gpus 1` (single GPU, 8-bit), the managed
# platform's replicas and the Kubernetes PyTorchJob pods. Each replica runs `python main.py [flags]`.
#
#   docker build -t sst2-lora .
#   docker run --gpus 1 --read-only --tmpfs /tmp --shm-size 2g -v "$PWD/pvc-home:/pvc-home" \
#     -e RESULT_MODEL_ID -e HF_TOKEN sst2-lora [--num-epochs 1 ...]
#
# CI builds this file on a CPU stand-in base (BASE_IMAGE=debootstrap + python + CPU torch) and runs
# it read-only as uid 10000: scripts/container_smoke.sh.

# The official CUDA PyTorch runtime image, pinned: torch comes from here, never from requirements.txt
# (the same torch release as Kubeflow's torch-distributed runtime and the CPU wheel CI tests with).
ARG BASE_IMAGE=docker.io/pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

# Every cache and temp path lies under /tmp (a tmpfs or emptyDir), so the root filesystem can be
# read-only; results go to the shared volume. HOME=/tmp: libraries that fall back to ~/.cache write there.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    HOME=/tmp \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/huggingface \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    MPLCONFIGDIR=/tmp/matplotlib \
    TORCH_EXTENSIONS_DIR=/tmp/torch_extensions \
    OUTPUT_DIR=/pvc-home/output

WORKDIR /app

# Dependencies in their own layer, before the code: editing the code does not reinstall them. The
# constraint keeps the base image's torch (a dependency's looser pin must not pull another build).
# dumb-init is PID 1: it forwards SIGTERM (preemption) to the job, which python as PID 1 would ignore.
#
# DeepSpeed (STRATEGY=deepspeed) installs with DS_BUILD_OPS=0: no op is compiled into the image, and none
# needs nvcc at run time, which this CUDA *runtime* base does not have. On GPUs the optimizer is torch's
# AdamW, built by the Trainer and handed to DeepSpeed (the job's DeepSpeed config has no "optimizer"
# block, so DeepSpeed's FusedAdam, a CUDA op, is never used), and ZeRO 1-3 communicate over NCCL: nothing
# is compiled. Two CPU ops are, once, on first use, with g++ and ninja (ninja comes with deepspeed) against
# the base python's own C headers (Python.h; the base's python ships them):
# DeepSpeedCPUAdam for ZERO_OFFLOAD (the optimizer steps on the CPU) and, on a CPU-only machine, the
# shared-memory collectives. They land in TORCH_EXTENSIONS_DIR under /tmp, writable with a read-only root.
COPY requirements.txt ./
# g++ unpinned: the base's own distribution release decides it (Ubuntu in the CUDA base, Debian in CI's stand-in).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-pin.txt \
    && DS_BUILD_OPS=0 python -m pip install --no-cache-dir --constraint /tmp/torch-pin.txt --requirement requirements.txt dumb-init==1.2.5.post1 \
    && rm /tmp/torch-pin.txt

# uid/gid 10000: the platform runs jobs as this user; the manifests' securityContext says the same.
# /pvc-home exists in the image so OUTPUT_DIR's default applies; a volume is mounted over it.
RUN groupadd --gid 10000 trainer \
    && useradd --no-log-init --uid 10000 --gid 10000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin trainer \
    && mkdir -p /pvc-home \
    && chown 10000:10000 /pvc-home

# The code stays root-owned and read-only; byte-compiled now because /app is not writable at run time.
COPY main.py predict.py ./
COPY utils/ utils/
COPY scripts/ scripts/
COPY examples/ examples/
COPY recipes/ recipes/
RUN python -m compileall -q main.py predict.py utils scripts

USER 10000:10000
# Rendezvous ports, documentation only: 23456 the PyTorchJob's pytorchjob-port (the operator's default),
# 29500 torch's default, used by the job when a launcher gives MASTER_ADDR without MASTER_PORT.
EXPOSE 23456 29500
ENTRYPOINT ["dumb-init", "--", "python", "/app/main.py"]
CMD []

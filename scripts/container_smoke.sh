#!/usr/bin/env bash
# Build the Dockerfile for real and run the job in it, the way the platform runs it: as the image's
# non-root user, read-only root filesystem, tmpfs /tmp, a host folder as the shared volume, no network.
#
#   sudo bash scripts/container_smoke.sh [HOST_DIR]      # HOST_DIR: the folder mounted at /pvc-home
#
# No Docker engine and no registry are needed (none is reachable in CI): Debian's buildah/podman build
# and run the image, and the CUDA PyTorch base is replaced through BASE_IMAGE by a CPU stand-in made
# here: a debootstrapped Debian with python and the CPU torch wheel pip finds on this machine.
# Exit codes: 0 built, trained (1 process: preempted, resumed; DeepSpeed ZeRO-2 on 2 ranks) and left
# model/ + metrics.json in HOST_DIR/output and HOST_DIR/output-zero2; 77 the container
# tools could not be installed (callers skip); anything else is a failure.
#
# The stand-in base and the image's layers are kept between runs, in CONTAINER_WORK, outside the checkout:
# a later run, from this checkout or a new clone, rebuilds only what changed since (the requirements layer is
# reused while requirements.txt and the lines above it in the Dockerfile are the same), as a Docker build cache
# would. A first run on a machine builds everything.
#
# Knobs: CONTAINER_WORK (storage and scratch, default ~/.cache/sst2-lora-container), REBUILD_BASE=1 (remake the
# stand-in even when one is stored), TORCH_SPEC (default torch==2.13.0, the base image's release),
# DEBIAN_MIRROR, STORAGE_DRIVER (overlay when the kernel allows it, else vfs).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=${CONTAINER_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/sst2-lora-container}
HOST_DIR=${1:-$WORK/pvc-home}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm             # its python3 is 3.11, the ABI of the CPU torch wheel
# -headers: python's C headers, as the real base's conda python has them (DeepSpeed compiles its CPU ops
# against them); a stand-in stored without them is not reused.
BASE=localhost/pytorch-cpu-standin:2.13.0-headers
IMAGE=localhost/sst2-lora:smoke
JOB_UID=10000              # the Dockerfile's USER; checked against the image below
CONTAINER=sst2-lora-smoke-$$
SKIP=77

log() { printf '[container_smoke %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
now() { date +%s; }

# ----------------------------------------------------------------------------- tools
install_tools() {
    local missing=() tool
    for tool in buildah podman debootstrap runc; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")  # each tool's Debian package has its name
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        log "SKIP: ${missing[*]} missing and cannot be installed here (needs root and apt-get)"; exit $SKIP
    fi
    log "installing ${missing[*]} from Debian"
    # Another apt run on the machine holds the lock for a while: wait for it rather than fail.
    if ! { apt-get -o DPkg::Lock::Timeout=600 update -qq \
           && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
                buildah podman debootstrap runc conmon uidmap >/dev/null; }; then
        log "SKIP: apt-get could not install ${missing[*]}"; exit $SKIP
    fi
}

# A private storage and engine configuration: nothing outside WORK is touched, no daemon, no systemd.
configure_storage() {
    mkdir -p "$WORK"
    local driver=${STORAGE_DRIVER:-} probe
    if [ -z "$driver" ]; then
        probe=$(mktemp -d "$WORK/overlay-probe.XXXX")
        mkdir "$probe"/{lower,upper,work,merged}
        if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" 2>/dev/null; then
            umount "$probe/merged"; driver=overlay
        else
            driver=vfs  # slower and larger (every layer a full copy), but works anywhere
        fi
        rm -rf "$probe"
    fi
    cat >"$WORK/storage.conf" <<EOF
[storage]
driver = "$driver"
graphroot = "$WORK/storage"
runroot = "$WORK/run"
EOF
    cat >"$WORK/containers.conf" <<EOF
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
EOF
    export CONTAINERS_STORAGE_CONF=$WORK/storage.conf CONTAINERS_CONF=$WORK/containers.conf
    log "storage: $driver under $WORK"
}

# ----------------------------------------------------------------------------- the CPU stand-in base
host_ca_bundle() {
    local cert=${PIP_CERT:-}
    [ -n "$cert" ] || cert=$(python3 -m pip config get global.cert 2>/dev/null | tr -d "'\"" || true)
    [ -f "$cert" ] || cert=/etc/ssl/certs/ca-certificates.crt
    echo "$cert"
}

build_base() {
    if [ "${REBUILD_BASE:-0}" != 1 ] && podman image exists "$BASE"; then
        log "stand-in base $BASE already stored (REBUILD_BASE=1 remakes it)"; return 0
    fi
    local ctx=$WORK/base-context rootfs=$WORK/base-context/rootfs
    rm -rf "$ctx"; mkdir -p "$ctx/wheels"
    # Inside a build pip cannot reach this machine's local CPU wheel (and PyPI would give the multi-GB
    # CUDA build), so the wheel and its dependencies are fetched here, for the stand-in's python 3.11.
    log "downloading $TORCH_SPEC (CPU) and its dependencies into the build context"
    python3 -m pip download --quiet --disable-pip-version-check --dest "$ctx/wheels" --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any "$TORCH_SPEC" \
        >"$WORK/pip-download.log" 2>&1 || { tail -20 "$WORK/pip-download.log" >&2; die "pip download $TORCH_SPEC failed"; }
    ls "$ctx"/wheels/torch-*+cpu-*.whl >/dev/null 2>&1 || die "pip found no CPU build for $TORCH_SPEC: $(ls "$ctx/wheels")"

    log "debootstrap $SUITE (minbase + python3 and its headers) from $DEBIAN_MIRROR"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
        "$SUITE" "$rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed (log: $WORK/debootstrap.log)"; }

    log "installing the CPU torch wheel into the stand-in's /opt/venv"
    cp -r "$ctx/wheels" "$rootfs/tmp/wheels"
    chroot "$rootfs" /bin/sh -c 'python3 -m venv /opt/venv \
        && /opt/venv/bin/pip install --quiet --no-index --no-cache-dir --disable-pip-version-check /tmp/wheels/*.whl'
    # This machine reaches PyPI through TLS that its own CA bundle trusts (pip's `cert`); the stand-in
    # trusts the same, so pip inside the build can install the requirements. The real base needs none of it.
    cp "$(host_ca_bundle)" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$rootfs/tmp/wheels" "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs/usr/share/doc" "$rootfs/usr/share/man"

    # Like the real base: `python` and `pip` on PATH, running as root until the Dockerfile says otherwise.
    tar -C "$rootfs" -c . | podman import --quiet \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' - "$BASE" >/dev/null
    rm -rf "$ctx"
}

# ----------------------------------------------------------------------------- run helpers
# The platform's conditions: no network (air-gapped), read-only root, a tmpfs /tmp, shm for data
# loaders, the shared volume at /pvc-home, the image's own user. The ulimits are what runc may set here.
run_image() {
    podman run --runtime runc --network none \
        --read-only --read-only-tmpfs=false --tmpfs /tmp:rw,size=2g --shm-size 512m \
        --ulimit nofile=1024:1024 --ulimit nproc=4096:4096 \
        -v "$HOST_DIR:/pvc-home" \
        -e HF_HUB_OFFLINE=1 -e HF_DATASETS_OFFLINE=1 -e OMP_NUM_THREADS=2 \
        "$@"
}

main() {
    local t0 t_base t_build t_run metrics
    t0=$(now)
    install_tools
    log "buildah, podman, debootstrap, runc ready in $(($(now) - t0)) s"
    mkdir -p "$WORK"
    exec 9>"$WORK/lock"
    flock 9  # one build at a time per checkout: they share the storage
    configure_storage

    build_base
    t_base=$(now)
    log "stand-in base ready in $((t_base - t0)) s"

    log "building the Dockerfile with BASE_IMAGE=$BASE"
    # --layers: each step's result is stored and reused while its instruction and inputs are unchanged.
    buildah bud --quiet --layers --isolation chroot --pull=never --build-arg "BASE_IMAGE=$BASE" \
        --file Dockerfile --tag "$IMAGE" "$REPO" >/dev/null
    podman image prune --force >/dev/null  # the previous build's image, now untagged: the storage does not grow
    t_build=$(now)
    log "job image built in $((t_build - t_base)) s"

    local user
    user=$(podman image inspect --format '{{.Config.User}}' "$IMAGE")
    [ "$user" = "$JOB_UID:$JOB_UID" ] || die "the image runs as '$user', expected $JOB_UID:$JOB_UID"

    # A fresh shared volume owned by the job's user, as the platform provides it.
    rm -rf "$HOST_DIR"; mkdir -p "$HOST_DIR"; chown "$JOB_UID:$JOB_UID" "$HOST_DIR"

    log "--dry-run in the container (flags pass through the entry point)"
    run_image --rm "$IMAGE" --dry-run --seed 7 >"$WORK/dry-run.json"
    python3 - "$WORK/dry-run.json" <<'EOF' || die "dry-run in the container resolved the wrong settings"
import json, sys
out = json.load(open(sys.argv[1]))
assert out["config"]["output_dir"] == "/pvc-home/output", out["config"]["output_dir"]
assert out["config"]["seed"] == 7, out["config"]["seed"]
assert out["distributed"]["source"] == "single", out["distributed"]
EOF

    log "making the offline demo model on the volume (the image's own python and transformers)"
    run_image --rm --entrypoint python "$IMAGE" scripts/make_demo_assets.py model /pvc-home/tiny-bert \
        --data examples/sst2-synthetic >/dev/null

    # The offline demo settings (make demo); checkpoints every 20 steps so the preemption below has one.
    local job_env=(-e MODEL_NAME=/pvc-home/tiny-bert -e DATASET_PATH=/app/examples/sst2-synthetic
                   -e PER_DEVICE_BATCH_SIZE=32 -e LEARNING_RATE=3e-3 -e DATALOADER_NUM_WORKERS=0 -e SAVE_STEPS=20)
    local t_job code name=$CONTAINER
    t_job=$(now)
    log "preemption: SIGTERM after the first checkpoint (docker stop, pod eviction) must reach the job through PID 1"
    trap 'podman rm -f "$CONTAINER" >/dev/null 2>&1 || true' EXIT
    run_image -d --name "$name" "${job_env[@]}" "$IMAGE" --num-epochs 3 >/dev/null
    for _ in $(seq 600); do
        compgen -G "$HOST_DIR/output/checkpoints/checkpoint-*" >/dev/null && break
        [ "$(podman inspect -f '{{.State.Running}}' "$name")" = true ] || break
        sleep 0.5
    done
    podman stop -t 120 "$name" >/dev/null
    code=$(podman inspect -f '{{.State.ExitCode}}' "$name")
    [ "$code" = 143 ] || { podman logs "$name" 2>&1 | tail -20 >&2; die "the stopped job exited $code, not 143 (preempted: restart me)"; }
    podman rm "$name" >/dev/null
    log "stopped with exit 143; the same command again resumes and finishes (read-only, uid $JOB_UID, no network)"
    run_image --rm "${job_env[@]}" "$IMAGE" --num-epochs 3
    t_run=$(now)
    log "job ran in $((t_run - t_job)) s (preempted run + resumed run)"

    metrics=$HOST_DIR/output/metrics.json
    [ -f "$HOST_DIR/output/model/adapter_config.json" ] || die "no model/ in $HOST_DIR/output"
    [ -f "$metrics" ] || die "no metrics.json in $HOST_DIR/output"
    [ "$(stat -c %u "$metrics")" = "$JOB_UID" ] || die "metrics.json is owned by uid $(stat -c %u "$metrics"), not $JOB_UID"
    log "metrics: $(tr -d '\n ' <"$metrics")"

    # DeepSpeed ZeRO-2 on 2 ranks (torchrun in the container, as in a pod with 2 GPUs): the image's own g++
    # and ninja compile DeepSpeed's CPU collectives once into TORCH_EXTENSIONS_DIR, which must be under the
    # tmpfs /tmp with the root read-only. Its own run folder: a folder holds one run and one strategy.
    local t_ds zero=$HOST_DIR/output-zero2
    t_ds=$(now)
    log "STRATEGY=deepspeed ZERO_STAGE=2 on 2 ranks (torchrun), read-only root, extension cache under /tmp"
    run_image --rm "${job_env[@]}" -e OMP_NUM_THREADS=1 -e STRATEGY=deepspeed -e ZERO_STAGE=2 \
        -e OUTPUT_DIR=/pvc-home/output-zero2 -e MAX_STEPS=8 -e SAVE_STEPS=4 \
        --entrypoint dumb-init "$IMAGE" -- torchrun --nnodes 1 --nproc-per-node 2 --master-port 29500 /app/main.py \
        || die "the ZeRO-2 run failed in the container"
    [ -f "$zero/model/adapter_model.safetensors" ] || die "no model/ in $zero"
    python3 -c 'import json, sys; m = json.load(open(sys.argv[1])); assert m["world_size"] == 2, m' "$zero/metrics.json" \
        || die "the ZeRO-2 run did not train on 2 ranks"
    grep -q '"strategy": "deepspeed"' "$zero/run.json" || die "$zero/run.json does not record STRATEGY=deepspeed"
    log "ZeRO-2 metrics: $(tr -d '\n ' <"$zero/metrics.json")"
    log "timings: base $((t_base - t0)) s, image build $((t_build - t_base)) s, job run $((t_run - t_job)) s, ZeRO-2 $(($(now) - t_ds)) s, total $(($(now) - t0)) s"
}

main "$@"

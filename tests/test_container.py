"""The image for real: scripts/container_smoke.sh builds the Dockerfile on a CPU stand-in base and runs the job in it
as the platform does (non-root user, read-only root, tmpfs /tmp, no network, a host folder as the shared volume),
then DeepSpeed ZeRO-2 on 2 ranks in the same image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.deploy import docker_user, shared_output_dir
from tests.support.env import REPO, unavailable
from tests.support.processes import run_command
from utils.config.settings import SHARED_VOLUME

SMOKE = REPO / "scripts" / "container_smoke.sh"
TOOLS_UNAVAILABLE = 77  # the script's exit code when buildah/podman cannot be installed


@pytest.mark.integration
@pytest.mark.slow
def test_image_builds_and_trains_read_only_as_its_user(tmp_path):
    volume = tmp_path / "pvc-home"
    proc = run_command(["bash", str(SMOKE), str(volume)], cwd=REPO, timeout=1800)
    if proc.returncode == TOOLS_UNAVAILABLE:
        unavailable(f"container tools unavailable: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"

    # The job wrote to the image's default OUTPUT_DIR, which is on the mounted volume.
    output = volume / Path(shared_output_dir()).relative_to(SHARED_VOLUME)
    assert (output / "model" / "adapter_config.json").is_file()
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["world_size"] == 1 and metrics["eval_accuracy"] > 0.75, metrics  # the demo data is learnable
    uid, _ = docker_user()
    assert (output / "metrics.json").stat().st_uid == uid, "the job must run as the image's user"
    # DeepSpeed ZeRO-2 on 2 ranks in the same image, its CPU op compiled under the read-only root's /tmp.
    zero2 = volume / "output-zero2"
    assert (zero2 / "model" / "adapter_model.safetensors").is_file()
    assert json.loads((zero2 / "metrics.json").read_text())["world_size"] == 2
    print(next(line for line in proc.stderr.splitlines() if "timings:" in line))

"""scripts/gpu_checks.sh (docs/performance.md) as its smoke run: a lent GPU's one call of minutes must not be wasted
on a broken script. `GPU_CHECKS_SMOKE=1` runs every default part on the CPU with the tiny model and a few rows (the
capture without a graph, bitsandbytes' 8-bit on its CPU kernels); every part must succeed and write every field
gpu.json promises (written here, not read from the script). No timing is compared to a bound."""

from __future__ import annotations

import json
import math
import sys
import tarfile

import pytest

from tests.support.env import REPO, base_env
from tests.support.processes import run_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The whole jobs (main.py) and the step arms (benchmarks/captured_step.py) of the default parts, each step arm with
# its batch (the smoke run's is 16).
JOB_ARMS = {"job-bf16", "job-8bit"}
STEP_ARMS = dict.fromkeys(
    "eager-bf16 captured-bf16 eager-8bit captured-8bit eager-8bit-threshold-6 captured-bf16-b16 eager-bf16-b16"
    " captured-compiled-bf16".split(),
    16,
) | {"captured-bf16-b256": 256}
FIELDS = set(
    "compile_s steady_epoch_s steady_step_ms samples_per_s job_cold_s job_warm_s first_step_done_cold_s"
    " first_step_done_warm_s epoch_measured steps steps_per_epoch eval_accuracy final_loss loss_curve graphs"
    " recompiles graph_breaks cudagraphs cudagraph_skips precision quantization bitsandbytes_loaded"
    " peak_memory_mib".split()
)
STEPS_PER_EPOCH = 512 // 16  # the smoke run's rows and batch


def test_the_gpu_checks_run_every_part_to_its_end_on_the_cpu(tmp_path):
    results = tmp_path / "results"
    env = base_env(tmp_path, GPU_CHECKS_SMOKE="1", PYTHON=sys.executable, TMPDIR=str(tmp_path))  # its work dir too
    # The timeout: the smoke run's own clock, 4x the GPU call's, and the start.
    proc = run_command(["bash", "scripts/gpu_checks.sh", str(results)], env=env, cwd=REPO, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((results / "gpu.json").read_text())
    assert report["failed"] == []
    assert (report["device"], report["smoke"], report["rows"]) == ("cpu", True, 512)
    # The versions come first, one line a package.
    versions = (results / "gpu.txt").read_text().splitlines()
    packages = "torch transformers peft accelerate datasets pyarrow bitsandbytes evaluate"
    assert [line.split()[0] for line in versions] == packages.split()
    # Few files: what a lent machine sends back is limited; every part's log in the archive.
    assert {path.name for path in results.iterdir()} == {"gpu.json", "gpu.txt", "gpu_checks.log", "logs.tar.gz"}
    with tarfile.open(results / "logs.tar.gz") as archive:
        names = archive.getnames()
    for arm in JOB_ARMS:
        assert f"./arms/{arm}/cold.log" in names and f"./arms/{arm}/cold/logs/rank-0.log" in names, arm
    for part in ("steps", "steps-8bit", "steps-batch", "steps-compiled", "equivalence"):
        assert f"./{part}.log" in names and f"./{part}.json" in names, part
    assert not [name for name in names if "/cache/" in name or name.endswith(".safetensors")]

    # The headline: each step arm's figures, the captured ones from their static buffers (no graph on a CPU).
    assert set(report["steps"]) == set(STEP_ARMS)
    for name, arm in report["steps"].items():
        assert "error" not in arm, (name, arm["error"])
        assert arm["step_ms"] > 0 and arm["samples_per_s"] > 0 and arm["call"] == 1, name
        assert arm["batch"] == STEP_ARMS[name] and arm["steps_per_epoch"] == 512 // STEP_ARMS[name], name
        assert arm["steady_epoch_s"] == pytest.approx(arm["step_ms"] * arm["steps_per_epoch"] / 1000, abs=1e-2)
        assert arm["captured"] is name.startswith("captured") and arm["cuda_graphs"] is False, name
        assert arm["quantization"] == ("8bit" if "8bit" in name else "none"), name
        assert arm["compiled"] is ("compiled" in name), name
        # MAX_SEQ_LENGTH=32: buckets 16 and 32, one set of static buffers each.
        assert arm["shapes"] == (2 if arm["captured"] else None), name
        assert (arm["capture_s"] is not None) is arm["captured"], name
        assert arm["host_ms"] > 0 and arm["host_top_ops"], name
        # What only a GPU measures is None on the CPU, never a made-up figure.
        assert (arm["gpu_busy_ms"], arm["kernels_per_step"], arm["syncs_per_step"]) == (None, None, None), name

    # The numerics: 60 steps eager and captured, without and with dropout, the same losses and weights.
    equivalence = report["equivalence"]["equivalence"]
    assert set(equivalence) == {"dropout-0", "dropout-default"}
    for label, arms in equivalence.items():
        assert arms["steps"] == 60 and arms["max_relative_difference"] == 0 and arms["same_weights"], (label, arms)

    # The whole jobs: their own records, the bf16 one cold and warm.
    assert set(report["arms"]) == JOB_ARMS
    for name, arm in report["arms"].items():
        assert set(arm) >= FIELDS, (name, FIELDS - set(arm))
        assert "error" not in arm, (name, arm.get("error"))
        assert arm["steady_step_ms"] > 0 and arm["samples_per_s"] > 0, name
        assert (arm["epoch_measured"], arm["steps"], arm["steps_per_epoch"]) == (True, *[STEPS_PER_EPOCH] * 2)
        assert arm["steady_epoch_s"] == pytest.approx(arm["steady_step_ms"] * STEPS_PER_EPOCH / 1000, abs=2e-3), name
        assert arm["job_cold_s"] > arm["first_step_done_cold_s"] > 0, name
        assert math.isfinite(arm["final_loss"]) and 0 <= arm["eval_accuracy"] <= 1, name
        assert arm["loss_curve"][0][0] == 1 and arm["loss_curve"][-1][1] == arm["final_loss"], name
        # On the CPU the defaults are full-precision weights, eager (8-bit and the capture are a GPU's defaults).
        assert (arm["quantization"], arm["bitsandbytes_loaded"], arm["graphs"]) == ("none", False, 0), name
        assert arm["call"] == 1, name
    job = report["arms"]["job-bf16"]
    assert job["job_warm_s"] > job["first_step_done_warm_s"] > 0
    assert report["arms"]["job-8bit"]["job_warm_s"] is None  # cold only
    assert report["profile"] == {}  # the earlier fast path's profile is outside the default parts

"""scripts/gpu_checks.sh, the one call a GPU machine gets (docs/performance.md), run here as its smoke run.

The GPU figures can only be taken on a lent GPU, in one call of minutes: a script broken since its last run would
waste that call. `GPU_CHECKS_SMOKE=1` runs every part on the CPU with the tiny model and a few rows (all but the
CUDA-graphs arm, which has nothing to run on the CPU; bitsandbytes' 8-bit runs here, so its arms must pass too);
this holds that every part succeeds and writes every field gpu.json promises, from what each part really ran. The
arms and fields are written here, not read from the script under test. Timings on a shared CI machine mean
nothing: none is compared to a bound.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import REPO, base_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Every arm but the two with CUDA graphs, which have nothing to run on a CPU.
ARMS = {
    "eager-bf16",
    "fast-bf16",
    "eager-8bit",
    "fast-8bit",
    "fast-8bit-threshold-0",
    "fast-bf16-encoder",
    "fast-bf16-no-cudnn-attention",
    "eager-bf16-host-levers-off",
}
FIELDS = {
    "compile_s",
    "steady_epoch_s",
    "steady_step_ms",
    "samples_per_s",
    "job_cold_s",
    "job_warm_s",
    "first_step_done_cold_s",
    "first_step_done_warm_s",
    "epoch_measured",
    "steps",
    "steps_per_epoch",
    "eval_accuracy",
    "final_loss",
    "loss_curve",
    "graphs",
    "recompiles",
    "graph_breaks",
    "cudagraphs",
    "cudagraph_skips",
    "precision",
    "quantization",
    "bitsandbytes_loaded",
    "peak_memory_mib",
}
STEPS_PER_EPOCH = 512 // 16  # the smoke run's rows and batch
SHORT_STEPS = 20  # the smoke run's short arms


def test_the_gpu_checks_run_every_part_to_its_end_on_the_cpu(tmp_path):
    results = tmp_path / "results"
    env = base_env(tmp_path, GPU_CHECKS_SMOKE="1", PYTHON=sys.executable, TMPDIR=str(tmp_path))  # its work dir too
    proc = subprocess.run(
        ["bash", "scripts/gpu_checks.sh", str(results)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2400,  # the smoke run's own clock, 4x the GPU call's, and the start
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((results / "gpu.json").read_text())
    assert report["failed"] == []
    assert (report["device"], report["smoke"], report["rows"]) == ("cpu", True, 512)
    # The versions come first, one line a package.
    versions = (results / "gpu.txt").read_text().splitlines()
    assert [line.split()[0] for line in versions] == [
        "torch",
        "transformers",
        "peft",
        "accelerate",
        "datasets",
        "pyarrow",
        "bitsandbytes",
        "evaluate",
    ]
    # Few files: what a lent machine sends back is limited; every part's log in the archive.
    assert {path.name for path in results.iterdir()} == {"gpu.json", "gpu.txt", "gpu_checks.log", "logs.tar.gz"}
    with tarfile.open(results / "logs.tar.gz") as archive:
        names = archive.getnames()
    for arm in ARMS:
        assert f"./arms/{arm}/cold.log" in names and f"./arms/{arm}/cold/logs/rank-0.log" in names, arm
    assert not [name for name in names if "/cache/" in name or name.endswith(".safetensors")]

    assert set(report["arms"]) == ARMS
    for name, arm in report["arms"].items():
        assert set(arm) >= FIELDS, (name, FIELDS - set(arm))
        assert "error" not in arm, (name, arm.get("error"))
        assert arm["steady_step_ms"] > 0 and arm["samples_per_s"] > 0, name
        assert arm["steps_per_epoch"] == STEPS_PER_EPOCH, name
        # Both rounded by the job's record (to 1 ms and 1 us).
        assert arm["steady_epoch_s"] == pytest.approx(arm["steady_step_ms"] * STEPS_PER_EPOCH / 1000, abs=2e-3), name
        assert arm["first_step_done_cold_s"] > 0, name
        assert math.isfinite(arm["final_loss"]) and 0 <= arm["eval_accuracy"] <= 1, name
        assert arm["loss_curve"][0][0] == 1 and arm["loss_curve"][-1][1] == arm["final_loss"], name
        quantized = "8bit" in name
        assert (arm["quantization"], arm["bitsandbytes_loaded"]) == (("8bit", True) if quantized else ("none", False))
        assert arm["cudagraphs"] is False and arm["cudagraph_skips"] == 0, name
        assert arm["call"] == 1, name
        if name.startswith("fast"):  # MAX_SEQ_LENGTH=32: buckets 16 and 32, one graph each, never broken
            # 8-bit: one more, as bitsandbytes quantizes its weights at their first forward (seen on the CPU).
            assert (arm["graphs"], arm["recompiles"]) == ((3, 2) if quantized else (2, 1)), name
            assert arm["compile_s"] > 0, name
        else:
            assert (arm["graphs"], arm["compile_s"]) == (0, None), name
    fast, eager = report["arms"]["fast-bf16"], report["arms"]["eager-bf16"]
    assert fast["graph_breaks"] == 0
    # The fast bf16 arm ran whole jobs, cold and warm; the others projected their epoch from their steps.
    assert (fast["epoch_measured"], fast["steps"]) == (True, STEPS_PER_EPOCH)
    assert fast["job_cold_s"] > fast["first_step_done_cold_s"] and fast["job_warm_s"] > fast["first_step_done_warm_s"]
    for name, arm in report["arms"].items():
        if name != "fast-bf16":
            assert (arm["epoch_measured"], arm["steps"], arm["job_cold_s"], arm["job_warm_s"]) == (
                False,
                SHORT_STEPS,
                None,
                None,
            ), name
    # Same seed, same rows, same padding: the fast path's first loss is the eager path's (later ones follow another
    # learning-rate schedule: the short arm decays over its 20 steps).
    assert fast["loss_curve"][0] == pytest.approx(eager["loss_curve"][0], rel=1e-5)

    assert set(report["profile"]) == {"eager", "fast"}
    for label, profile in report["profile"].items():  # the step profile of both paths
        assert "error" not in profile, profile
        assert profile["torch_compile"] is (label == "fast") and profile["step_ms"] > 0

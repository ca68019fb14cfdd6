"""scripts/gpu_checks.sh, the one call a GPU machine gets (docs/performance.md), run here as its smoke run.

The GPU figures can only be taken on a lent GPU, in one call with minutes to spare: a script broken since its last
run would waste that call. `GPU_CHECKS_SMOKE=1` runs every part on the CPU with the tiny model and a few rows; this
holds that it reaches its end and writes every field gpu.json promises, from what each part really ran (the
compiled arm compiled, the eager one did not). Timings on a shared CI machine mean nothing: none is compared.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from benchmarks.gpu_checks import ARM_FIELDS, ARMS
from tests.conftest import REPO, base_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_gpu_checks_run_to_their_end_on_the_cpu(tmp_path):
    results = tmp_path / "results"
    env = base_env(tmp_path, GPU_CHECKS_SMOKE="1", PYTHON=sys.executable, TMPDIR=str(tmp_path))  # its work dir too
    proc = subprocess.run(
        ["bash", "scripts/gpu_checks.sh", str(results)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,  # the smoke run's own clock: 3x the GPU call's 420 s, and the start
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((results / "gpu.json").read_text())
    assert (report["device"], report["smoke"], report["rows"]) == ("cpu", True, 512)
    assert "torch " in (results / "gpu.txt").read_text()  # the versions line
    # Few files: what a lent machine sends back may be limited (tests.log: the GPU tests, not run by a smoke run).
    assert {path.name for path in results.iterdir()} == {"gpu.json", "gpu.txt", "gpu_checks.log"}

    # On the CPU only the GPU-only parts may fail (bitsandbytes' 8-bit runs here too, so none did on a quiet run).
    assert all(any(word in f["part"] for word in ("8bit", "cudagraphs")) for f in report["failed"]), report["failed"]
    assert set(report["arms"]) == set(ARMS)  # no cudagraphs arm without CUDA
    for name in ("eager-bf16", "fast-bf16"):
        arm = report["arms"][name]
        assert set(ARM_FIELDS) <= set(arm), name
        assert arm["samples_per_s"] > 0 and arm["epoch_s"] > 0, name
        assert arm["first_step_cold_s"] > 0 and arm["first_step_warm_s"] > 0, name
        assert math.isfinite(arm["final_loss"]) and 0 <= arm["eval_accuracy"] <= 1, name
        assert arm["loss_curve"][0][0] == 1 and arm["loss_curve"][-1][1] == arm["final_loss"], name
    eager, fast = report["arms"]["eager-bf16"], report["arms"]["fast-bf16"]
    # The eager arm ran steps and projected its epoch; the fast one trained the whole epoch, compiling included.
    assert (eager["epoch_measured"], fast["epoch_measured"]) == (False, True)
    # MAX_SEQ_LENGTH=32 in the smoke run: one bucket, one graph, never recompiled or broken.
    assert (eager["graphs"], fast["graphs"], fast["recompiles"], fast["graph_breaks"]) == (0, 1, 0, 0)
    assert fast["compile_s"] > 0 and eager["compile_s"] == 0 and fast["cudagraph_skips"] == 0
    assert fast["epoch_s"] > fast["compile_s"]

    for label in ("eager", "fast"):  # the step profile before and after
        profile = report["profile"][label]
        assert "error" not in profile, profile
        assert profile["torch_compile"] is (label == "fast") and profile["step_ms"] > 0
    assert set(report["int8_options"]) == {"threshold-6", "threshold-0"}

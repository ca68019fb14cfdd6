"""The job on one CUDA GPU, the single-GPU fallback as `docker run --gpus 1` starts it: 8-bit base weights under
bf16 autocast by default, full-precision weights with `QUANTIZATION=none` in bf16 and fp16, and the published
model served from the GPU by predict.py. The same entry point and the tiny BERT as the CPU tests; these run where
torch sees a GPU and are skipped elsewhere (the CPU suite covers the 8-bit path with bitsandbytes' CPU kernels)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.env import REPO_ID, push_settings, tiny_run_env
from tests.support.processes import run_main, run_predict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is false)"),
]

SENTENCES = ["the film is wonderful and moving", "the script is awful and boring"]
GPU_0 = {"CUDA_VISIBLE_DEVICES": "0"}  # the tiny run sees GPU 0 (the CPU tests' environment hides every GPU)


def labels(model: Path, *args: str, env: dict[str, str]) -> list[str]:
    """predict.py's labels for SENTENCES, served from the GPU the environment shows."""
    result = run_predict(env, model, *args, stdin="\n".join(SENTENCES) + "\n")
    assert result.code == 0, result.stderr[-3000:]
    return [json.loads(line)["label"] for line in result.stdout.splitlines()]


def test_one_gpu_trains_8bit_weights_in_bf16_by_default_and_publishes_a_model_that_serves(
    tmp_path, tiny_bert, sst2_dir, hub
):
    env = tiny_run_env(tmp_path, tiny_bert, sst2_dir, **GPU_0, MERGE_ADAPTER="true", **push_settings(hub))
    result = run_main(env)
    assert result.code == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    # QUANTIZATION=auto and PRECISION=auto on one GPU that has bf16 (every GPU this job targets does).
    assert (metrics["quantization"], metrics["precision"]) == ("8bit", "bf16"), metrics
    assert metrics["eval_accuracy"] > 0.8, metrics  # the CPU run's bar: chance is 0.5 on this balanced task
    log = (out / "logs" / "rank-0.log").read_text()
    assert "device cuda:0, weights 8bit, precision bf16" in log
    assert [c["repo"] for c in hub.commits] == [REPO_ID]
    # The merged export of an 8-bit run holds the base in full precision, with no trace of the quantizer.
    assert "quantization_config" not in json.loads((out / "merged" / "config.json").read_text())
    # Served from the GPU: the adapter on the local base (its config names the base by Hub id), and the merged
    # model alone, give the same labels.
    adapter, merged = labels(out / "model", "--base-model", str(tiny_bert), env=env), labels(out / "merged", env=env)
    assert adapter == merged == ["positive", "negative"], (adapter, merged)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_gpu_trains_full_precision_weights_under_mixed_precision(tmp_path, tiny_bert, sst2_dir, precision):
    """QUANTIZATION=none is the speed setting for one GPU; fp16 goes through the Trainer's loss scaling. In bf16
    (as with PRECISION=auto) CUDA_GRAPHS=auto captures every bucket's forward and backward before the first step, one
    CUDA graph each, none inside the epoch."""
    result = run_main(tiny_run_env(tmp_path, tiny_bert, sst2_dir, **GPU_0, QUANTIZATION="none", PRECISION=precision))
    assert result.code == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["quantization"], metrics["precision"]) == ("none", precision), metrics
    assert metrics["eval_accuracy"] > 0.8, metrics
    if precision == "bf16":
        record = json.loads((out / "logs" / "rank-0.json").read_text())
        capture = record["capture"]
        assert capture is not None and capture["graphs"] is True, record
        lengths = sorted(shape["input_ids"][1] for shape in capture["shapes"])
        assert len(lengths) == len(set(lengths)) and lengths[0] == 16, capture  # one graph a bucket, from 16 up
        assert "a batch of a new shape" not in (out / "logs" / "rank-0.log").read_text()

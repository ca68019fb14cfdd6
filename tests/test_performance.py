"""The speed benchmarks (benchmarks/train_speed.py, benchmarks/strategies.py) end to end, small, on the CPU. No
timing is asserted (a shared CI machine's mean nothing): every figure is there and each arm did what it claims. The
figures derived without measuring (bert-base's gradient bytes) are checked against what the job trains."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.env import REPO, base_env
from tests.support.processes import run_command


@pytest.mark.parametrize(
    "fields",
    [{}, {"train_pooler": False, "lora_r": 4, "lora_target_modules": "query,key,value"}, {"lora_variant": "dora"}],
    ids=["defaults", "no-pooler-r4-qkv", "dora"],
)
def test_the_projected_gradient_bytes_are_what_the_job_trains(tiny_bert, fields):
    """The 4-replica projection uses bert-base's gradient bytes counted without loading it
    (benchmarks/allreduce.py): the count must be what the job's own model builder trains, here on the tiny BERT."""
    import torch
    from transformers import AutoConfig

    from benchmarks.allreduce import lora_grad_bytes
    from utils.config.settings import Settings
    from utils.training.model import ModelChoices, build_model

    settings = Settings(model_name=str(tiny_bert), **fields)
    model = build_model(settings.select(ModelChoices), "none", torch.device("cpu"))
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    config = AutoConfig.from_pretrained(tiny_bert)
    assert lora_grad_bytes(settings, config.num_hidden_layers, config.hidden_size) == trained


@pytest.mark.integration
@pytest.mark.slow
def test_benchmark_runs_small_on_the_cpu(tmp_path, tiny_bert, sst2_dir):
    out = tmp_path / "results.json"
    command = [sys.executable, "benchmarks/train_speed.py", "--model", tiny_bert, "--data", sst2_dir]
    command += "--warmup 2 --steps 6 --original-steps 2 --startup-repeats 1".split()
    command += ["--work-dir", tmp_path / "work", "--json", out]
    proc = run_command(command, env=base_env(tmp_path), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())

    original, defaults = results["arms"]["original"], results["arms"]["defaults"]
    assert (original["timed_steps"], defaults["timed_steps"]) == (2, 6)
    # What the original ran: checkpointing, fp32, random order, every row padded to 128 tokens.
    assert original["gradient_checkpointing"] and original["precision"] == "fp32" and original["sampler"] == "random"
    assert original["padding_fraction"] == pytest.approx(1 - original["mean_real_tokens_per_row"] / 128, abs=1e-3)
    # The defaults: no checkpointing, length-grouped batches padded to their longest row, SDPA.
    assert not defaults["gradient_checkpointing"] and defaults["sampler"] == "group_by_length"
    assert defaults["attention"] == "sdpa" and defaults["optim"] == "adamw_torch_fused"
    assert defaults["padding_fraction"] < original["padding_fraction"]
    for arm in (original, defaults):
        assert arm["samples_per_s"] > 0 and arm["real_tokens_per_s"] > 0 and arm["peak_memory_mib"] > 0
        assert 0 < arm["time_to_first_step_s"] < 600 and arm["mfu"] is None  # MFU only on CUDA
        assert 0 < arm["cpu_share"] and arm["samples_per_cpu_s"] > 0
    assert results["comparison"]["defaults_vs_original"]["samples_per_s_ratio"] > 0
    assert results["startup"]["help_s"] > 0 and results["startup"]["dry_run_s"] > 0

    # The real job: two CPU replicas each do half the optimizer steps of one, on half the rows, in sync.
    job = results["job"]
    # 2000 rows in whole global batches (64 rows on one replica, 2 x 64 on two): the rows left over wait for the
    # next epoch; each replica trains half of every global batch.
    assert job["1"]["optimizer_steps_per_replica"] == 2000 // 64
    assert job["2"]["optimizer_steps_per_replica"] == 2000 // 128
    assert job["1"]["ranks"][0]["samples"] == 2000 // 64 * 64
    assert [r["samples"] for r in job["2"]["ranks"]] == [2000 // 128 * 64] * 2
    assert set(job["two_replicas_vs_one"]) == {"optimizer_steps_ratio", "samples_per_replica_ratio"}
    assert job["2"]["ranks"][0]["checksum"] == job["2"]["ranks"][1]["checksum"]
    assert job["2"]["same_weights_on_all_ranks"] is True
    assert all(r["first_step"] == 1 for r in job["1"]["ranks"] + job["2"]["ranks"])
    assert all(r["time_to_first_step_s"] > 0 for r in job["1"]["ranks"] + job["2"]["ranks"])

    scale = results["scale"]
    assert set(scale["gradient_bytes_per_step"]) == {"model", "bert-base"}
    assert set(scale["gloo_allreduce"]) == {"2", "4"}
    assert set(scale["projected_efficiency_4_replicas"]) == {"this_device", "h100_target"}
    assert "| original |" in proc.stdout and "| defaults |" in proc.stdout


@pytest.mark.integration
@pytest.mark.slow
def test_strategy_benchmark_runs_small_on_the_cpu(tmp_path, tiny_bert):
    """benchmarks/strategies.py: DDP and ZeRO-2 on 2 CPU replicas each, a few steps, every rank measured."""
    out = tmp_path / "results.json"
    command = [sys.executable, "-m", "benchmarks.strategies", "--model", tiny_bert]
    command += [
        *"--steps 3 --rows 256 --arms ddp zero2 --no-warmup --work-dir".split(),
        tmp_path / "work",
        "--json",
        out,
    ]
    # The DeepSpeed ops `make ops` compiled into the venv before the suite: no warm-up run to compile them.
    env = base_env(tmp_path, TORCH_EXTENSIONS_DIR=Path(sys.prefix) / "torch-extensions")
    proc = run_command(command, env=env, cwd=REPO, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())

    assert list(results["arms"]) == ["ddp", "zero2"] and results["world_size"] == 2
    ddp, zero2 = results["arms"]["ddp"], results["arms"]["zero2"]
    for arm in (ddp, zero2):
        assert arm["samples_per_s"] > 0 and len(arm["peak_rss_mib_per_rank"]) == 2
        assert all(peak > 0 for peak in arm["peak_rss_mib_per_rank"]) and arm["same_weights_on_all_ranks"]
    assert zero2["samples_per_s_vs_ddp"] > 0 and zero2["peak_rss_vs_ddp"] > 0
    # Each arm trained what it says: 3 optimizer steps of 16 rows on each of 2 ranks, under its strategy.
    for name, strategy in (("ddp", "ddp"), ("zero2", "deepspeed")):
        run = results["runs"][name]
        assert run["optimizer_steps_per_replica"] == 3 and [r["samples"] for r in run["ranks"]] == [48, 48]
        recorded = json.loads((tmp_path / "work" / "job" / name / "run" / "run.json").read_text())
        assert f'"strategy": "{strategy}"' in json.dumps(recorded), name
    assert "| ddp |" in proc.stdout and "| zero2 |" in proc.stdout

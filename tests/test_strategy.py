"""STRATEGY=ddp|fsdp: FSDP never turns into DDP unannounced, and the FSDP path really shards the LoRA model.

The Trainer and Accelerate drop FSDP on the CPU without a word (seen with transformers 5.23, accelerate 1.15), so on this
machine the job must refuse STRATEGY=fsdp (exit 2 on every rank, nothing trained). The FSDP machinery itself
is checked on the CPU with the preparation Accelerate runs on GPUs (tests/support/fsdp_worker.py), and end to end on
CUDA GPUs where there are two.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.support.env import REPO, free_port, job_settings, rank_env
from tests.support.outcomes import rank_report
from tests.support.processes import ACCELERATE, TORCHRUN, start, start_main, wait_all
from utils.common.errors import JobError
from utils.config.distributed import DistEnv, launcher_options
from utils.config.settings import Settings

TWO = DistEnv(0, 0, 2, 0, "10.0.0.1", 29500, "torchrun")  # rank, local rank, world size, node, address, port
ONE = DistEnv(0, 0, 1, 0, None, None, "single")


def refusal(settings: Settings, dist=TWO, cuda=True, quantize=False, precision="bf16", **launcher) -> str | None:
    from utils.config.deepspeed_config import check_launcher
    from utils.training.strategy import check_strategy

    options = {"fsdp": False, "deepspeed": False, "mixed_precision": None, **launcher}
    try:
        check_launcher(settings.strategy, options)  # as the settings are read (deepspeed_config.deepspeed_overrides)
        check_strategy(settings.strategy, settings.quantization, dist, cuda, quantize, precision, options)
    except JobError as exc:
        assert exc.code == 2
        return exc.message
    return None


@pytest.mark.check
def test_fsdp_runs_only_where_it_can_shard():
    fsdp, ddp = Settings(strategy="fsdp"), Settings()
    assert refusal(fsdp) is None  # 2 CUDA processes, full-precision weights: FSDP
    assert "CUDA" in refusal(fsdp, cuda=False) and "DDP" in refusal(fsdp, cuda=False)
    assert "one process" in refusal(fsdp, dist=ONE)
    assert "QUANTIZATION=8bit" in refusal(fsdp, quantize=True)
    assert refusal(ddp, cuda=False) is None and refusal(ddp, dist=ONE) is None


@pytest.mark.check
def test_accelerate_config_cannot_change_the_strategy_or_precision_behind_the_settings():
    assert "STRATEGY=fsdp" in refusal(Settings(), fsdp=True)  # an FSDP accelerate config with STRATEGY=ddp
    assert "ACCELERATE_USE_FSDP" in refusal(Settings(strategy="fsdp"), fsdp=True)  # the job configures FSDP itself
    # An accelerate DeepSpeed config has become STRATEGY=deepspeed before this check (deepspeed_config.deepspeed_overrides).
    assert refusal(Settings(strategy="deepspeed"), deepspeed=True) is None
    assert "one run shards one way" in refusal(Settings(strategy="deepspeed"), fsdp=True)
    assert "PRECISION" in refusal(Settings(), precision="fp32", mixed_precision="bf16")
    assert refusal(Settings(), precision="bf16", mixed_precision="bf16") is None
    assert refusal(Settings(), precision="fp32", mixed_precision="no") is None
    # The variables `accelerate launch` exports for a config file are the ones read.
    read = launcher_options({"ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "BF16"})
    assert read.items() >= {"fsdp": True, "deepspeed": False, "mixed_precision": "bf16", "zero_stage": None}.items()
    nothing = launcher_options({})
    assert not any(nothing.values()), nothing
    # What `accelerate launch --config_file launchers/accelerate/deepspeed-zero3.yaml` exports.
    exported = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    exported |= {
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
    }
    read = launcher_options(exported)
    assert read.items() >= {"fsdp": False, "deepspeed": True, "mixed_precision": None, "zero_stage": 3}.items()
    assert (read["offload_optimizer_device"], read["offload_param_device"]) == ("none", "cpu")


@pytest.mark.check
def test_fsdp_units_are_the_repeated_transformer_blocks(tiny_bert):
    from utils.training.model import ModelChoices, build_model
    from utils.training.strategy import trainer_options, wrap_classes

    settings = Settings(model_name=str(tiny_bert), strategy="fsdp")
    model = build_model(settings.select(ModelChoices), "none", torch.device("cpu"))
    assert wrap_classes(model) == ["BertLayer"]  # not BertEmbeddings: Accelerate shards the input embedding itself
    options = trainer_options(settings.strategy, model)
    assert options["fsdp"] is True and options["fsdp_config"]["version"] == 2
    assert trainer_options("ddp", model) == {}  # ddp: the Trainer's defaults
    with pytest.raises(JobError, match="STRATEGY=ddp"):
        wrap_classes(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.slow
def test_fsdp_on_the_cpu_stops_every_rank_before_training(job_env, tmp_path):
    """Two platform replicas with STRATEGY=fsdp: without the check they would train plain DDP and report success."""
    port = free_port()
    settings = {
        k: v
        for k, v in job_settings(job_env).items()
        if k in ("MODEL_NAME", "DATASET_PATH", "OUTPUT_DIR", "MAX_STEPS")
    }
    logs = [tmp_path / f"stdout-{rank}.txt" for rank in (0, 1)]
    procs = [
        start_main(rank_env(tmp_path, rank, 2, port, STRATEGY="fsdp", **settings), log=logs[rank]) for rank in (0, 1)
    ]
    assert [proc.wait(timeout=300) for proc in procs] == [2, 2], [log.read_text()[-2000:] for log in logs]
    for log in logs:
        errors = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "STRATEGY=fsdp" in errors[0] and "DDP" in errors[0], log.read_text()[-2000:]
        assert "Traceback" not in log.read_text()
    out = tmp_path / "out"
    assert not (out / "model").exists() and not list((out / "checkpoints").glob("checkpoint-*"))
    # nothing trained
    assert "processed" not in "".join(path.read_text() for path in (out / "logs").glob("rank-*.log"))


@pytest.mark.slow
def test_accelerate_fsdp_launch_is_refused_not_run_as_ddp(job_env, tmp_path):
    """`accelerate launch --use_fsdp` (or an FSDP config file) on the CPU: Accelerate would quietly run DDP."""
    log = tmp_path / "accelerate.txt"
    cmd = [*ACCELERATE, "--use_fsdp", "--num_processes", "2", "--main_process_port", str(free_port()), "main.py"]
    proc = start(cmd, job_settings(job_env, ACCELERATE_USE_CPU="1"), log)
    assert proc.wait(timeout=300) != 0
    text = log.read_text()
    # Each rank stops with this line (torchrun may end the second one before it prints, once the first exits 2).
    assert (
        "error: the accelerate config asks for FSDP" in text
        and "Traceback (most recent call last)" not in text.split("error:")[0]
    ), text[-3000:]
    out = tmp_path / "out"
    assert not (out / "model").exists()
    # nothing trained
    assert "processed" not in "".join(path.read_text() for path in (out / "logs").glob("rank-*.log"))


@pytest.mark.slow
def test_fsdp_shards_the_lora_model_trains_it_in_sync_and_saves_it_whole(tiny_bert, tmp_path):
    """The job's FSDP options through Accelerate's FSDP2 preparation, on the CPU (tests/support/fsdp_worker.py)."""
    from peft import AutoPeftModelForSequenceClassification

    log = tmp_path / "worker.txt"
    cmd = [
        *TORCHRUN,
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(REPO / "tests" / "support" / "fsdp_worker.py"),
        str(tiny_bert),
        str(tmp_path),
    ]
    proc = start(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, log=log)
    wait_all([proc], [log], timeout=240)
    reports = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        assert report["refused_unsharded"][0] == 2 and "did not shard" in report["refused_unsharded"][1]
        assert report["units"] == 4  # 2 BertLayer + the input embedding + the root
        assert report["sharded_trainable"] == ["DTensor"]  # LoRA's weights are sharded too
        assert report["local_numel"] < report["full_numel"]  # each rank holds only its shard
    assert reports[0]["checksum"] == reports[1]["checksum"], "ranks disagree after FSDP steps"
    assert reports[0]["state_keys"] > 0 and reports[1]["state_keys"] == 0  # the whole weights on rank 0 only
    assert reports[0]["lora_b_trained"]

    saved = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "adapter").state_dict()
    for name, values in reports[0]["gathered_lora"].items():
        assert torch.equal(saved[name], torch.tensor(values, dtype=saved[name].dtype)), name


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="FSDP end to end needs 2 CUDA GPUs"
)
def test_fsdp_job_end_to_end_on_two_gpus(job_env, tmp_path):
    log = tmp_path / "torchrun.txt"
    cmd = [*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), "main.py"]
    env = {**job_settings(job_env, STRATEGY="fsdp"), "CUDA_VISIBLE_DEVICES": "0,1"}
    wait_all([start(cmd, env, log)], [log])
    out = tmp_path / "out"
    for rank in (0, 1):
        assert "the model is sharded by FSDP" in (out / "logs" / f"rank-{rank}.log").read_text()
    reports = rank_report(out, 2)
    assert reports[0]["checksum"] == reports[1]["checksum"]
    from peft import AutoPeftModelForSequenceClassification, get_peft_model_state_dict
    from safetensors.torch import load_file

    # The weights gathered from the shards are whole: peft loads every saved tensor back, unchanged.
    loaded = get_peft_model_state_dict(AutoPeftModelForSequenceClassification.from_pretrained(out / "model"))
    saved = load_file(out / "model" / "adapter_model.safetensors")
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k].cpu()) for k in saved)
    assert json.loads((out / "metrics.json").read_text())["world_size"] == 2

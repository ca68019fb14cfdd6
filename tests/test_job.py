"""The job end to end, in real processes, on the tiny BERT: one process (the suite's shared finished run, and
restarts of a copy of it), two platform replicas, 8-bit, and the Hub push's checks before training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.env import REPO_ID, free_port, job_settings, push_settings, rank_env
from tests.support.outcomes import rank_record, trained_plan
from tests.support.processes import run_main, start_main


def logits_of(model_dir: Path, sentences: list[str], base: Path | None = None, merged: bool = False):
    """The logits of the adapter in `model_dir` on its base (or on `base`, a local copy of the base its config names
    by Hub id); of the whole model in `model_dir` when `merged`."""
    import torch
    from peft import AutoPeftModelForSequenceClassification, PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if merged:
        model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    elif base is None:
        model = AutoPeftModelForSequenceClassification.from_pretrained(model_dir).eval()
    else:
        model = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base), model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        return model(**tokenizer(sentences, return_tensors="pt", padding=True)).logits


def classify(model_dir: Path, sentences: list[str], base: Path | None = None) -> list[int]:
    return logits_of(model_dir, sentences, base).argmax(-1).tolist()


def test_one_process_trains_saves_and_the_model_loads_back(finished_run, tiny_bert):
    out = finished_run.out
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_accuracy"] > 0.8, metrics  # chance is 0.5 on this balanced synthetic task
    assert metrics["eval_samples"] == 101 and metrics["world_size"] == 1
    assert metrics["train_samples_per_second"] > 0 and metrics["train_runtime"] > 0
    saved = {p.name for p in (out / "model").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md"} <= saved
    # The run was pushed, so its adapter names its base by Hub id: offline, the local base stands in.
    sentences = ["the film is wonderful and moving", "the script is awful and boring"]
    assert classify(out / "model", sentences, base=tiny_bert) == [1, 0]
    card = (out / "model" / "README.md").read_text()
    assert "accuracy" in card and str(round(metrics["eval_accuracy"], 4)) in card
    record = json.loads((out / "run.json").read_text())
    assert record["settings"]["lora_r"] == 8 and record["versions"]["transformers"]
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert list((out / "cache").glob("tokenized-*/dataset_dict.json"))
    assert rank_record(out, 0)["samples_trained"] == 2000 * 2  # every training row, every epoch
    assert "eval_accuracy=" in finished_run.first.stdout
    # A DDP run leaves DeepSpeed unloaded (installed here, Accelerate would import it): none of its notices, which
    # name DeepSpeed's accelerator module, reach the log.
    assert "real_accelerator" not in finished_run.first.stderr + finished_run.first.stdout


def test_dry_run_prints_the_plan_the_run_trained_with(finished_run):
    """What `--dry-run` prints is what the run used: run.json records the same plan, completed with what only the
    device (precision, quantization) and the data (the steps) tell, and the Trainer trained with it."""
    out = finished_run.out
    dry = run_main(finished_run.env, "--dry-run", timeout=60)
    assert dry.code == 0, dry.stderr[-2000:]
    planned = dry.json()["plan"]
    plan = trained_plan(out)
    later = dict.fromkeys(("precision", "quantization", "compile", "capture"), "auto")
    later |= dict.fromkeys(("steps", "warmup_steps", "steps_per_epoch", "eval_every"))  # None
    assert planned == {**plan, **later}
    # The tiny run: 2,000 rows in 125 batches of 16 an epoch, 2 epochs; LoRA+ trains B at 8x the rate set.
    assert (plan["steps_per_epoch"], plan["steps"], plan["warmup_steps"]) == (125, 250, 15)
    assert plan["eval_every"] == 125 // 4  # EVALUATIONS_PER_EPOCH
    assert (plan["precision"], plan["quantization"], plan["rates"]["lora_B"]) == ("fp32", "none", 8 * 3e-3)
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["global_batch"], metrics["learning_rate"]) == (
        plan["batch"]["global_batch"],
        plan["learning_rate"],
    )


def restart_env(finished_run, tmp_path, hub, **extra: str) -> dict[str, str]:
    """The finished run's settings on a copy of its folder, pushing to `hub` (a fresh stand-in, same token)."""
    shutil.copytree(finished_run.out, tmp_path / "out", symlinks=True)
    folders = {"HF_HOME": str(tmp_path / "hf-home"), "OUTPUT_DIR": str(tmp_path / "out")}
    return {**finished_run.env, **push_settings(hub), **folders, **extra}


def test_restart_after_success_does_no_second_training_and_no_second_push(finished_run, hub, tmp_path):
    env = restart_env(finished_run, tmp_path, hub)
    metrics_before = (tmp_path / "out" / "metrics.json").read_text()
    again = run_main(env)
    assert again.code == 0, again.stderr[-2000:]
    assert "already holds a finished run" in again.stderr
    assert (tmp_path / "out" / "metrics.json").read_text() == metrics_before
    assert hub.commits == []  # both models were pushed by the finished run: nothing is sent again


def test_output_dir_with_other_settings_is_refused(finished_run, hub, tmp_path):
    other = run_main(restart_env(finished_run, tmp_path, hub, LORA_R="4"))
    assert other.code == 2
    assert other.stderr.startswith("error: ") and "LORA_R: 8 -> 4" in other.stderr and "Traceback" not in other.stderr


@pytest.mark.slow
def test_two_platform_replicas_train_one_model_in_sync_and_push_it_once(job_env, hub, tmp_path):
    """Two `python main.py` processes with RANK/WORLD_SIZE/NODE_RANK/MASTER_* set by hand, as the platform does."""
    port = free_port()
    settings = {
        k: v
        for k, v in job_env.items()
        if k in ("MODEL_NAME", "DATASET_PATH", "OUTPUT_DIR", "NUM_EPOCHS", "PER_DEVICE_BATCH_SIZE", "LEARNING_RATE")
    }
    procs = [
        start_main(
            rank_env(tmp_path, rank, 2, port, **settings, **push_settings(hub)), log=tmp_path / f"stdout-{rank}.txt"
        )
        for rank in (0, 1)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"stdout-{r}.txt").read_text()[-2000:] for r in (0, 1)]

    out = tmp_path / "out"
    (r0, samples0, sum0), (r1, samples1, sum1) = (
        (record["rank"], record["samples_trained"], record["trainable_checksum"])
        for record in (rank_record(out, rank) for rank in (0, 1))
    )
    assert (r0, r1) == (0, 1)
    assert sum0 == sum1, "trainable weights differ between ranks: gradients were not synchronised"
    # Each rank trains half of each whole global batch of 2 x 16 rows, 62 of them an epoch for 2 epochs; the 16
    # rows left over in an epoch wait for the next one.
    micro = int(settings["PER_DEVICE_BATCH_SIZE"])
    assert samples0 == samples1 == 2 * (2000 // (2 * micro)) * micro
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["eval_samples"] == 101  # odd: no row counted twice
    assert metrics["eval_accuracy"] > 0.8
    assert (out / "model" / "adapter_model.safetensors").exists()
    assert "eval_accuracy=" in (tmp_path / "stdout-0.txt").read_text()
    assert "eval_accuracy=" not in (tmp_path / "stdout-1.txt").read_text()  # only rank 0 publishes
    assert len(hub.commits) == 1 and hub.commits[0]["repo"] == REPO_ID  # pushed once, by rank 0
    # each rank checks the token before the rendezvous: none waits in a collective on a silent Hub
    assert hub.count("/api/whoami-v2") == 2


@pytest.mark.parametrize("bits", ["8bit", "4bit"])
def test_quantized_path_runs_on_the_cpu_and_saves_a_loadable_adapter(job_env, tmp_path, bits):
    """QUANTIZATION=8bit (LLM.int8) and 4bit (NF4, double quantization): bitsandbytes runs both on the CPU."""
    result = run_main(
        job_settings(job_env, QUANTIZATION=bits, MERGE_ADAPTER="true")
    )  # a few steps: the path, not a good model
    assert result.code == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["quantization"] == bits
    log = (tmp_path / "out" / "logs" / "rank-0.log").read_text()
    assert f"weights {bits}" in log
    # The adapter trained on quantized weights loads back on the full-precision base and answers as the merged
    # export does (a few steps: not a good model, so its answers are compared, not its labels).
    sentences = ["the cast is superb", "a dull and tedious mess"]
    adapter = logits_of(tmp_path / "out" / "model", sentences)
    merged = logits_of(tmp_path / "out" / "merged", sentences, merged=True)
    assert adapter.shape == merged.shape == (2, 2)
    assert adapter.flatten().tolist() == pytest.approx(merged.flatten().tolist(), abs=1e-4)
    # The merged export of a quantized run: the base reloaded in full precision, no trace of the quantizer.
    from safetensors import safe_open

    merged = tmp_path / "out" / "merged"
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    with safe_open(str(merged / "model.safetensors"), framework="pt") as weights:
        assert {str(weights.get_tensor(name).dtype) for name in weights.keys()} == {"torch.float32"}


def test_bf16_full_precision_weights_train_on_the_cpu_through_main(job_env, tmp_path):
    """QUANTIZATION=none PRECISION=bf16, which the job accepts without a GPU: test_gpu.py's bf16 case, here. The
    frozen base is stored in bf16 and the steps run under bf16 autocast; the adapter still learns the task and is
    published in full precision."""
    from safetensors import safe_open

    result = run_main({**job_env, "QUANTIZATION": "none", "PRECISION": "bf16"})
    assert result.code == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["quantization"], metrics["precision"]) == ("none", "bf16"), metrics
    assert metrics["eval_accuracy"] > 0.8, metrics  # the fp32 run's bar: chance is 0.5 on this balanced task
    assert "device cpu, weights none, precision bf16" in (out / "logs" / "rank-0.log").read_text()
    assert trained_plan(out)["precision"] == "bf16"  # what the Trainer read back at the end of training
    with safe_open(str(out / "model" / "adapter_model.safetensors"), framework="pt") as weights:
        assert {str(weights.get_tensor(name).dtype) for name in weights.keys()} == {"torch.float32"}


def test_push_without_token_is_bad_input(job_env):
    result = run_main({**job_env, "RESULT_MODEL_ID": "tester/sst2-lora", "BASE_MODEL_ID": "tester/tiny-bert"})
    assert result.code == 2 and "HF_TOKEN" in result.stderr and "Traceback" not in result.stderr


WRONG_TOKEN = "hf_wrong_token_abcdef"


@pytest.mark.check
@pytest.mark.parametrize(
    "token, role, scopes, says",
    [
        (WRONG_TOKEN, "write", None, "401"),
        (None, "read", None, "cannot write to RESULT_MODEL_ID=tester/sst2-lora"),
        (None, "fineGrained", ["repo.content.read"], "cannot write to RESULT_MODEL_ID=tester/sst2-lora"),
    ],
    ids=["wrong", "read", "fine-grained-read"],
)
def test_a_token_that_cannot_push_is_bad_input(hub, hub_in_process, token, role, scopes, says):
    """The Hub check the job runs before loading anything (`Hub.check_write_access`), in this process; a
    refused start through main.py (nothing trained, nothing pushed) is tests/test_refusals.py's `hub` case."""
    from utils.common.errors import EXIT_BAD_INPUT, JobError

    hub.role, hub.scopes = role, scopes if scopes is not None else hub.scopes
    with pytest.raises(JobError) as refused:
        hub_in_process(60, token).check_write_access(REPO_ID)
    assert refused.value.code == EXIT_BAD_INPUT and says in refused.value.message, refused.value.message
    assert "\n" not in refused.value.message and WRONG_TOKEN not in refused.value.message
    assert hub.commits == [] and hub.count("/api/repos/create") == 0

"""STRATEGY=deepspeed on the CPU, end to end: two `main.py` replicas under ZeRO stages 1, 2 and 3 and ZeRO-2 with the
optimizer offloaded train what DDP trains (the same loss at every step, the same adapter within a tolerance);
a ZeRO-3 run stopped with SIGTERM (both ranks checkpoint and exit 143) and, restarted, killed after a
checkpoint, resumes to the uninterrupted run's weights; the published adapter is whole and loads with peft
where deepspeed is not installed; and every DeepSpeed setting that cannot apply is refused with exit 2 before
anything loads.

The comparison runs take tests/test_ddp_numerics.py's set-up: every sentence the same token length, dropout
off, so both strategies see the same rows at every step and draw nothing at random while training. DeepSpeed
JIT-compiles its CPU ops (deepspeed_shm_comm, and cpu_adam for offload) on first use into
TORCH_EXTENSIONS_DIR, kept inside the venv: the first run of a fresh venv pays minutes for it, every later
run none.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from tests.support.data import write_fixed_length_data
from tests.support.env import REPO, base_env, free_port, push_settings, rank_env, tiny_run_settings
from tests.support.harness import configured
from tests.support.numerics import adapter_weights, first_divergence
from tests.support.outcomes import assert_refusal, complete_steps, rank_record
from tests.support.processes import Replicas, run_command, run_main, run_predict, start_main, wait_all, wait_for

# Compiled once per venv, never per test run: CI pays the compile at most once.
EXTENSIONS = Path(sys.prefix) / "torch-extensions"
BATCH = 4  # rows per replica per step: 8 steps an epoch of the fixed-length data
TRAIN_ROWS, VALIDATION_ROWS = 64, 32
STEPS = TRAIN_ROWS // (2 * BATCH)
SAVE_EVERY = 4
# The ZeRO-3 run checkpoints twice as often: its 8 steps then leave room for a stop and, after the restart, a
# kill, each after a checkpoint and before the end, so the fault test's runs can take it as their reference.
ZERO3_SAVE_EVERY = 2
# Measured on 2 CPU cores (fp32, gloo), 8 steps, against DDP: see LOSS_RTOL's note below the table in
# docs/reliability.md. The tolerances sit a few times above what was measured; a rate x2 moves step 2's loss
# by ~1e-2 (relative) and the weights by up to 0.3.
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
ARMS = {  # test id -> (ZERO_STAGE, ZERO_OFFLOAD)
    "zero1": ("1", "none"),
    "zero2": ("2", "none"),
    "zero3": ("3", "none"),
    "zero2-offload": ("2", "optimizer"),
}


def comparison_settings(tiny_bert: Path, data: Path, out: Path, **extra) -> dict[str, str]:
    """One epoch, every step logged, dropout off: the strategies' losses compared step by step; `extra` wins."""
    compared = dict(
        NUM_EPOCHS=1,
        PER_DEVICE_BATCH_SIZE=BATCH,
        PER_DEVICE_EVAL_BATCH_SIZE=VALIDATION_ROWS // 2,
        LORA_DROPOUT=0,
        MODEL_DROPOUT=0,
        LOGGING_STEPS=1,
        EVAL_STEPS=SAVE_EVERY,
        SAVE_STEPS=SAVE_EVERY,
        REPORT_TO="none",
        RENDEZVOUS_TIMEOUT=600,  # the first DeepSpeed start compiles its ops for minutes
        TORCH_EXTENSIONS_DIR=EXTENSIONS,
    )
    return tiny_run_settings(tiny_bert, data, out, **{**compared, **extra})


def train_two(tmp: Path, tag: str, settings: dict[str, str], timeout: float = 900) -> Path:
    group = Replicas(tmp)
    try:
        procs = group.start(tag, settings)
        wait_all(procs, [tmp / f"{tag}-rank{rank}.txt" for rank in (0, 1)], timeout=timeout)
    finally:
        group.cleanup()
    return Path(settings["OUTPUT_DIR"])


def curves(out: Path) -> dict[str, dict[int, float]]:
    """The training loss (every step) and the eval loss (every SAVE_EVERY) from the last checkpoint's log_history."""
    last = max(complete_steps(out))
    history = json.loads((out / "checkpoints" / f"checkpoint-{last}" / "trainer_state.json").read_text())[
        "log_history"
    ]
    return {key: {e["step"]: e[key] for e in history if key in e} for key in ("loss", "eval_loss")}


def weight_differences(ours: dict, theirs: dict) -> dict[str, float]:
    """Name -> the largest absolute difference, for every tensor that differs beyond WEIGHT_ATOL."""
    return {
        name: (ours[name] - theirs[name]).abs().max().item()
        for name in sorted(ours)
        if (ours[name] - theirs[name]).abs().max().item() > WEIGHT_ATOL
    }


@pytest.fixture(scope="module")
def fixed_data(tmp_path_factory) -> Path:
    return write_fixed_length_data(tmp_path_factory.mktemp("fixed") / "data", counts=(TRAIN_ROWS, VALIDATION_ROWS))


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, tiny_bert, fixed_data) -> Path:
    """The reference: the same two replicas under DDP, run once for every arm."""
    tmp = tmp_path_factory.mktemp("ddp")
    return train_two(tmp, "ddp", comparison_settings(tiny_bert, fixed_data, tmp / "out"))


def zero3_settings(tiny_bert: Path, data: Path, out: Path) -> dict[str, str]:
    """The ZeRO-3 comparison run, checkpointing every ZERO3_SAVE_EVERY steps: a checkpoint writes the state and
    changes none of it, so the numbers are those of a run that checkpoints less often."""
    return comparison_settings(tiny_bert, data, out, STRATEGY="deepspeed", ZERO_STAGE=3, SAVE_STEPS=ZERO3_SAVE_EVERY)


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, tiny_bert, fixed_data) -> Path:
    """Uninterrupted ZeRO-3: an arm of the comparison with DDP, the adapter peft loads, and the weights the
    stopped and killed run must come back to."""
    tmp = tmp_path_factory.mktemp("zero3")
    return train_two(tmp, "zero3", zero3_settings(tiny_bert, fixed_data, tmp / "out"))


def without_deepspeed(tmp_path: Path, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """A Python where deepspeed is not installed: the venv's packages less deepspeed, seen through a folder of
    links (python -S keeps the venv's own site-packages off the path). The interpreter's argv prefix and env."""
    import site

    packages = Path(next(p for p in site.getsitepackages() if p.endswith("site-packages")))
    shadow = tmp_path / "site-packages"
    if not shadow.exists():
        shadow.mkdir()
        for entry in packages.iterdir():
            if not entry.name.lower().startswith("deepspeed"):
                (shadow / entry.name).symlink_to(entry)
    return [sys.executable, "-S"], {**env, "PYTHONPATH": f"{REPO}{os.pathsep}{shadow}"}


# ------------------------------------------------------------------------------- the same numbers as DDP
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("arm", list(ARMS))
def test_two_replicas_under_deepspeed_train_what_ddp_trains(arm, request, tmp_path, tiny_bert, fixed_data, ddp_run):
    stage, offload = ARMS[arm]
    if arm == "zero3":
        out = request.getfixturevalue("zero3_run")
    else:
        settings = comparison_settings(
            tiny_bert, fixed_data, tmp_path / "out", STRATEGY="deepspeed", ZERO_STAGE=stage, ZERO_OFFLOAD=offload
        )
        out = train_two(tmp_path, arm, settings)
    log = (out / "logs" / "rank-0.log").read_text()
    # DeepSpeed really ran, at the stage asked for: not plain DDP under another name.
    assert f"strategy deepspeed: ZeRO stage {stage}, optimizer state offloaded {offload != 'none'}" in log, log[-3000:]
    assert (out / "checkpoints" / f"checkpoint-{STEPS}" / f"global_step{STEPS}").is_dir()  # a DeepSpeed checkpoint

    ours, reference = curves(out), curves(ddp_run)
    assert sorted(ours["loss"]) == list(range(1, STEPS + 1)), "a training loss at every step"
    problems = [
        f"{key} {where}"
        for key in ("loss", "eval_loss")
        if (where := first_divergence(reference[key], ours[key], LOSS_RTOL))
    ]
    steps = ", ".join(
        f"{step}: {abs(ours['loss'][step] - reference['loss'][step]):.1e}" for step in sorted(ours["loss"])
    )
    print(f"{arm}: |loss - DDP loss| per step: {steps}")

    # The adapter is whole: every tensor DDP saved, at full shape, none empty (ZeRO-3 gathered it from the shards).
    weights, ddp_weights = adapter_weights(out), adapter_weights(ddp_run)
    assert weights.keys() == ddp_weights.keys()
    assert all(weights[name].shape == ddp_weights[name].shape and weights[name].numel() for name in weights)
    if differ := weight_differences(weights, ddp_weights):
        worst = max(differ, key=differ.get)
        problems.append(
            f"weights: {len(differ)} of {len(weights)} tensors differ beyond {WEIGHT_ATOL:g}; {worst} by {differ[worst]:.3g}"
        )
    print(
        f"{arm}: largest weight difference {max((weights[n] - ddp_weights[n]).abs().max().item() for n in weights):.1e}"
    )
    assert not problems, f"{arm} did not train what DDP trains:\n" + "\n".join(problems)
    records = [rank_record(out, rank) for rank in (0, 1)]
    assert records[0]["trainable_checksum"] == records[1]["trainable_checksum"]  # both ranks hold the same weights


@pytest.mark.integration
@pytest.mark.slow
def test_the_zero3_adapter_loads_with_peft_without_deepspeed_and_predicts_like_ddp(
    tmp_path, zero3_run, ddp_run, tiny_bert
):
    """Where deepspeed is not installed (an import of it fails), peft loads the published adapter, and its
    predictions on the validation rows match the DDP-trained adapter's; predict.py classifies with it."""
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("the film was wonderful and moving\nthe plot was dull and boring\n")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib.util, json, sys, torch\n"
        "assert importlib.util.find_spec('deepspeed') is None, 'deepspeed is installed here'\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        "base, sentences = sys.argv[1], open(sys.argv[2]).read().split(chr(10))[:-1]\n"
        "tokenizer = AutoTokenizer.from_pretrained(base)\n"
        "out = {}\n"
        "for adapter in sys.argv[3:]:\n"
        "    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=2)\n"
        "    model = PeftModel.from_pretrained(model, adapter).eval()\n"
        "    with torch.no_grad():\n"
        "        out[adapter] = model(**tokenizer(sentences, return_tensors='pt', padding=True)).logits.tolist()\n"
        "print(json.dumps(out))\n"
    )
    python, env = without_deepspeed(
        tmp_path, {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    )
    result = run_command(
        [*python, str(probe), str(tiny_bert), str(sentences), str(zero3_run / "model"), str(ddp_run / "model")],
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logits = json.loads(result.stdout.splitlines()[-1])
    ours, theirs = logits[str(zero3_run / "model")], logits[str(ddp_run / "model")]
    for row_ours, row_theirs in zip(ours, theirs, strict=True):
        assert max(abs(a - b) for a, b in zip(row_ours, row_theirs, strict=True)) < 1e-4, (ours, theirs)

    predicted = run_predict(env, zero3_run / "model", "--base-model", tiny_bert, sentences, timeout=300)
    assert predicted.code == 0, predicted.stderr[-3000:]
    # predict.py answers each sentence with the class of the adapter's largest logit above, by the run's name.
    names = json.loads((zero3_run / "model" / "id2label.json").read_text())
    expected = [
        (text, names[str(row.index(max(row)))])
        for text, row in zip(sentences.read_text().splitlines(), ours, strict=True)
    ]
    answers = [json.loads(line) for line in predicted.stdout.splitlines()]
    assert [(answer["text"], answer["label"]) for answer in answers] == expected, predicted.stdout


# ------------------------------------------------------------------------------- SIGTERM, kill, resume
@pytest.mark.integration
@pytest.mark.slow
def test_zero3_stopped_then_killed_after_checkpoints_resumes_to_the_uninterrupted_weights(
    tmp_path, tiny_bert, fixed_data, zero3_run, hub
):
    """One ZeRO-3 run ended both ways an orchestrator ends a replica, each after a checkpoint: SIGTERM to one
    rank (both save the checkpoint of the stop and exit 143), then, in the restart, SIGKILL (no checkpoint of
    its own; its peer notices and exits 143). The second restart finishes it bit for bit as `zero3_run`, which
    trained the same settings without a break."""
    out = tmp_path / "out"
    settings = {**zero3_settings(tiny_bert, fixed_data, out), **push_settings(hub)}
    group = Replicas(tmp_path)
    try:
        procs = group.start("preempted", settings)
        wait_for(out / "checkpoints" / f"checkpoint-{ZERO3_SAVE_EVERY}" / "COMPLETE", procs, timeout=900)
        procs[1].send_signal(signal.SIGTERM)
        assert wait_all(procs, timeout=300) == [143, 143], (tmp_path / "preempted-rank0.txt").read_text()[-3000:]
        stopped_at = complete_steps(out)[-1]
        assert ZERO3_SAVE_EVERY < stopped_at < STEPS  # the checkpoint of the stop, both ranks' shards in it
        shards = {
            p.name for p in (out / "checkpoints" / f"checkpoint-{stopped_at}" / f"global_step{stopped_at}").iterdir()
        }
        assert {name for name in shards if "optim_states" in name} == {
            f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)
        }, shards
        for rank in (0, 1):
            text = (tmp_path / f"preempted-rank{rank}.txt").read_text()
            assert "preempted: SIGTERM during training, checkpoint saved" in text and "Traceback" not in text

        # The restart goes on from the checkpoint of the stop; its rank 1 is killed once the next one is complete.
        later = (stopped_at // ZERO3_SAVE_EVERY + 1) * ZERO3_SAVE_EVERY
        assert later < STEPS, f"stopped at step {stopped_at}: no checkpoint before the end to kill the restart after"
        procs = group.start("killed", settings)
        wait_for(out / "checkpoints" / f"checkpoint-{later}" / "COMPLETE", procs, timeout=900)
        procs[1].kill()  # SIGKILL: no checkpoint of its own, its peer must notice
        codes = wait_all(procs, timeout=300)
        assert codes == [143, -signal.SIGKILL], (tmp_path / "killed-rank0.txt").read_text()[-3000:]
        assert_refusal((tmp_path / "killed-rank0.txt").read_text(), ["rank 0", "RENDEZVOUS_TIMEOUT=", "2 replicas"])
        assert not (out / "model").exists()
        resumed_from = complete_steps(out)[-1]
        assert later <= resumed_from < STEPS

        procs = group.start("restart", settings)
        wait_all(procs, [tmp_path / f"restart-rank{rank}.txt" for rank in (0, 1)], timeout=900)
    finally:
        group.cleanup()
    log = (out / "logs" / "rank-0.log").read_text()  # every start of the run appends to it
    assert f"resuming from step {stopped_at}" in log and f"resuming from step {resumed_from}" in log
    records = [rank_record(out, rank) for rank in (0, 1)]
    assert [r["first_step"] for r in records] == [resumed_from + 1] * 2

    # Bit for bit: the fp32 weights, the optimizer state (each rank's shard), the scheduler, the RNG and the
    # data position all come back from the ZeRO-3 checkpoints exactly (docs/reliability.md), twice over.
    theirs = rank_record(zero3_run, 0)["trainable_checksum"]
    assert [r["trainable_checksum"] for r in records] == [theirs, theirs]
    weights, reference_weights = adapter_weights(out), adapter_weights(zero3_run)
    assert all(weights[name].equal(reference_weights[name]) for name in weights)
    ours, uninterrupted = curves(out), curves(zero3_run)
    resumed_losses = {step: loss for step, loss in ours["loss"].items() if step > resumed_from}
    assert resumed_losses == {step: uninterrupted["loss"][step] for step in resumed_losses}
    # One push, by rank 0, of the whole adapter gathered from the ZeRO-3 shards.
    [commit] = hub.commits
    assert commit["files"]["adapter_model.safetensors"] == (out / "model" / "adapter_model.safetensors").read_bytes()


# ------------------------------------------------------------------------------- refusals
def dry_run(tmp_path: Path, job_env: dict[str, str], **extra: str):
    env = {**job_env, **{k: str(v) for k, v in extra.items()}}
    return run_main({k: v for k, v in env.items() if v is not None}, "--dry-run", timeout=60)


def configured_dry_run(monkeypatch, job_env: dict[str, str], **extra: str):
    """What `main.py --dry-run` resolves (main.configure), in this process: (settings, dist, args, the strategy as
    --dry-run prints it)."""
    from utils.config.deepspeed_config import describe_strategy

    settings, dist, args, plan = configured(
        monkeypatch, {**job_env, **{k: str(v) for k, v in extra.items()}}, ["--dry-run"]
    )
    return settings, dist, args, describe_strategy(plan, settings.weight_decay)


def refused_in_process(monkeypatch, capsys, job_env: dict[str, str], **extra: str) -> str:
    """main.configure, which `main.py --dry-run` runs before anything else, in this process: the bad-input
    error (exit 2) main.py prints as its one `error:` line, nothing printed on the way. Its message."""
    from utils.common.errors import JobError

    with pytest.raises(JobError) as refused:
        configured_dry_run(monkeypatch, job_env, **extra)
    message = refused.value.message
    assert refused.value.code == 2, message
    assert "\n" not in message and capsys.readouterr().out == "", message  # one line, and nothing on stdout
    return message


def ds_file(tmp_path: Path, config: object, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


ZERO2 = {"zero_optimization": {"stage": 2}}
REFUSED = {  # id -> (settings, what the error line names: {key} is the path of files[key])
    "8bit": (
        {"STRATEGY": "deepspeed", "QUANTIZATION": "8bit"},
        ["QUANTIZATION=8bit", "STRATEGY=deepspeed", "QUANTIZATION=none", "STRATEGY=ddp"],
    ),
    "torch-compile": (
        {"STRATEGY": "deepspeed", "TORCH_COMPILE": "true"},
        "TORCH_COMPILE=true runs under STRATEGY=ddp only",
    ),
    "parameters-offload-below-stage-3": (
        {"STRATEGY": "deepspeed", "ZERO_STAGE": "2", "ZERO_OFFLOAD": "optimizer+parameters"},
        ["ZERO_OFFLOAD=optimizer+parameters", "ZERO_STAGE=2", "ZERO_STAGE=3", "ZERO_OFFLOAD=optimizer"],
    ),
    "config-without-deepspeed": (
        {"STRATEGY": "ddp", "DEEPSPEED_CONFIG": "{file}"},
        ["DEEPSPEED_CONFIG={file}", "STRATEGY=ddp", "STRATEGY=deepspeed"],
    ),
    "accelerate-fsdp": (
        {"STRATEGY": "deepspeed", "ACCELERATE_USE_FSDP": "true"},
        ["ACCELERATE_USE_FSDP=true", "STRATEGY=deepspeed", "STRATEGY=fsdp"],
    ),
    "accelerate-cpu": (
        {"STRATEGY": "deepspeed", "ACCELERATE_USE_CPU": "true"},
        ["ACCELERATE_USE_CPU=true", "--cpu", "use_cpu: false"],
    ),
    "accelerate-deepspeed-vs-ddp": (
        {"STRATEGY": "ddp", "ACCELERATE_USE_DEEPSPEED": "true"},
        ["accelerate", "strategy deepspeed", "STRATEGY=ddp", "STRATEGY=deepspeed"],
    ),
    "accelerate-stage-vs-zero-stage": (
        {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ZERO_STAGE": "2"},
        ["accelerate", "zero_stage 3", "ZERO_STAGE=2", "ZERO_STAGE=3"],
    ),
    "missing-file": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{missing}"},
        ["DEEPSPEED_CONFIG={missing}", "No such file or directory", "ZERO_STAGE"],
    ),
    "not-json": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{not_json}"},
        ["DEEPSPEED_CONFIG={not_json}", "line 1, column 2"],
    ),
    "pinned-micro-batch": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{micro}"},
        ["DEEPSPEED_CONFIG={micro}", "train_micro_batch_size_per_gpu: 32", "16", "PER_DEVICE_BATCH_SIZE"],
    ),
    "pinned-rate": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{rate}"},
        ["DEEPSPEED_CONFIG={rate}", "optimizer.params.lr: 0.0001", "0.003", "LEARNING_RATE"],
    ),
    "pinned-bf16": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{bf16}", "PRECISION": "fp32"},
        ["DEEPSPEED_CONFIG={bf16}", "bf16.enabled: true", "false", "PRECISION"],
    ),
    "pinned-clipping": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{clip}"},
        ["DEEPSPEED_CONFIG={clip}", "gradient_clipping: 0.5", "1.0"],
    ),
    "stage-0": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{stage0}"},
        ["DEEPSPEED_CONFIG={stage0}", "zero_optimization.stage: 0", "STRATEGY=ddp"],
    ),
    "file-offloads-parameters-at-stage-2": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{param2}"},
        ["DEEPSPEED_CONFIG={param2}", "zero_optimization.offload_param.device: cpu", "stage 2", "offload_param"],
    ),
    "file-offloads-parameters-alone": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{param_alone}"},
        [
            "DEEPSPEED_CONFIG={param_alone}",
            "zero_optimization.offload_param",
            "offload_optimizer",
            "ZERO_OFFLOAD=optimizer+parameters",
        ],
    ),
    # What transformers compares with its TrainingArguments only once the model has loaded: the step counts
    # (trainer_config_finalize), and the optimizer's betas and epsilon.
    "pinned-warmup-without-max-steps": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{warmup}"},
        ["DEEPSPEED_CONFIG={warmup}", "scheduler.params.warmup_num_steps: 100", "MAX_STEPS"],
    ),
    "pinned-warmup-against-max-steps": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{warmup}", "MAX_STEPS": "10"},
        ["DEEPSPEED_CONFIG={warmup}", "scheduler.params.warmup_num_steps: 100", "WARMUP_RATIO", "MAX_STEPS"],
    ),
    "pinned-total-steps-against-max-steps": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{total}", "MAX_STEPS": "10"},
        ["DEEPSPEED_CONFIG={total}", "scheduler.params.total_num_steps: 500", "10", "MAX_STEPS"],
    ),
    # transformers compares with !=, so a rate a rounding away is refused here rather than there.
    "pinned-rate-a-rounding-away": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{near_rate}"},
        ["DEEPSPEED_CONFIG={near_rate}", "optimizer.params.lr: 0.0030000001", "0.003", "LEARNING_RATE"],
    ),
    "pinned-betas": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{betas}"},
        ["DEEPSPEED_CONFIG={betas}", "optimizer.params.betas: [0.9, 0.95]", "[0.9, 0.999]"],
    ),
    "pinned-eps": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{eps}"},
        ["DEEPSPEED_CONFIG={eps}", "optimizer.params.eps: 1e-06", "1e-08"],
    ),
    "scheduler-with-its-own-rates": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{one_cycle}"},
        [
            "DEEPSPEED_CONFIG={one_cycle}",
            'scheduler.type: "OneCycle"',
            "WARMUP_RATIO",
            "WarmupLR, WarmupDecayLR, WarmupCosineLR",
        ],
    ),
    "scheduler-parameter-it-does-not-take": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{cosine_max_lr}"},
        ["DEEPSPEED_CONFIG={cosine_max_lr}", "WarmupCosineLR", "scheduler.params.warmup_max_lr", "cos_min_ratio"],
    ),
    "auto-nobody-fills": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{auto_stage3}"},
        ["DEEPSPEED_CONFIG={auto_stage3}", 'zero_optimization.stage3_max_live_parameters: "auto"'],
    ),
    "precision-not-an-object": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{bf16_bool}"},
        ["DEEPSPEED_CONFIG={bf16_bool}", "bf16", '"enabled": "auto"', "PRECISION"],
    ),
    # ZERO_STAGE and ZERO_OFFLOAD beside a file that sets otherwise: refused, not overridden.
    "zero-stage-against-file": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{file}", "ZERO_STAGE": "3"},
        ["ZERO_STAGE=3", "DEEPSPEED_CONFIG={file}", "stage 2", "zero_optimization.stage"],
    ),
    "zero-offload-against-file": (
        {"STRATEGY": "deepspeed", "DEEPSPEED_CONFIG": "{file}", "ZERO_OFFLOAD": "optimizer"},
        ["ZERO_OFFLOAD=optimizer", "DEEPSPEED_CONFIG={file}", "none", "zero_optimization.offload_optimizer"],
    ),
    "accelerate-stage-against-file": (
        {
            "ACCELERATE_USE_DEEPSPEED": "true",
            "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
            "STRATEGY": "deepspeed",
            "DEEPSPEED_CONFIG": "{file}",
        },
        ["accelerate", "ZERO_STAGE=3", "DEEPSPEED_CONFIG={file}", "stage 2"],
    ),
}


# One refusal from each place that refuses (the settings, the accelerate config, reading the file, checking it)
# runs as `main.py --dry-run`, for what the process prints and its exit code; the rest go through
# main.configure in this process, the same function the process runs first.
END_TO_END = {"8bit", "accelerate-fsdp", "not-json", "pinned-rate", "pinned-warmup-without-max-steps"}


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=() if case in END_TO_END else pytest.mark.check) for case in REFUSED]
)
def test_deepspeed_settings_that_cannot_apply_are_refused_before_anything_loads(
    case, tmp_path, job_env, monkeypatch, capsys
):
    files = {
        "file": ds_file(tmp_path, ZERO2),
        "missing": tmp_path / "nowhere.json",
        "not_json": ds_file(tmp_path, "{stage: 2", "broken.json"),
        "micro": ds_file(tmp_path, {**ZERO2, "train_micro_batch_size_per_gpu": 32}, "micro.json"),
        "rate": ds_file(
            tmp_path,
            {**ZERO2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
            "rate.json",
        ),
        "bf16": ds_file(tmp_path, {**ZERO2, "bf16": {"enabled": True}}, "bf16.json"),
        "clip": ds_file(tmp_path, {**ZERO2, "gradient_clipping": 0.5}, "clip.json"),
        "stage0": ds_file(tmp_path, {"zero_optimization": {"stage": 0}}, "stage0.json"),
        "param2": ds_file(
            tmp_path, {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "param2.json"
        ),
        "param_alone": ds_file(
            tmp_path, {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "param_alone.json"
        ),
        "warmup": ds_file(
            tmp_path, {**ZERO2, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}, "warmup.json"
        ),
        "total": ds_file(
            tmp_path,
            {**ZERO2, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500}}},
            "total.json",
        ),
        "betas": ds_file(
            tmp_path, {**ZERO2, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}}, "b.json"
        ),
        "near_rate": ds_file(
            tmp_path, {**ZERO2, "optimizer": {"type": "AdamW", "params": {"lr": 0.0030000001}}}, "near_rate.json"
        ),
        "eps": ds_file(tmp_path, {**ZERO2, "optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}}, "eps.json"),
        "one_cycle": ds_file(tmp_path, {**ZERO2, "scheduler": {"type": "OneCycle", "params": {}}}, "one_cycle.json"),
        "cosine_max_lr": ds_file(
            tmp_path,
            {**ZERO2, "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_max_lr": "auto"}}},
            "cosine.json",
        ),
        "auto_stage3": ds_file(
            tmp_path, {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"}}, "auto3.json"
        ),
        "bf16_bool": ds_file(tmp_path, {**ZERO2, "bf16": True}, "bf16_bool.json"),
    }
    settings, names = REFUSED[case]
    settings = {name: value.format(**files) for name, value in settings.items()}
    names = [name.format(**files) for name in names]
    # LoRA+ off for the optimizer-block case: the rate is what is refused there, not the block itself.
    if case not in END_TO_END:
        message = refused_in_process(monkeypatch, capsys, job_env, LORAPLUS_LR_RATIO="1", **settings)
        assert not [name for name in names if name not in message], message
        return
    result = dry_run(tmp_path, job_env, LORAPLUS_LR_RATIO="1", **settings)
    assert result.stdout == "", result.stdout[-2000:]
    assert_refusal(result, names)


@pytest.mark.check
def test_an_optimizer_block_that_would_drop_the_recipes_rates_is_refused(tmp_path, job_env, monkeypatch, capsys):
    config = ds_file(tmp_path, {**ZERO2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    refused = refused_in_process(monkeypatch, capsys, job_env, STRATEGY="deepspeed", DEEPSPEED_CONFIG=config)
    assert "LORAPLUS_LR_RATIO=8" in refused, refused
    # With the recipe's per-group rates off, the same file applies.
    *_, strategy = configured_dry_run(
        monkeypatch, job_env, STRATEGY="deepspeed", DEEPSPEED_CONFIG=config, LORAPLUS_LR_RATIO="1"
    )
    assert strategy["deepspeed"]["optimizer"]["type"] == "AdamW"


def test_dry_run_shows_the_deepspeed_config_the_run_uses(tmp_path, job_env, monkeypatch):
    shown = dry_run(
        tmp_path, job_env, STRATEGY="deepspeed", ZERO_STAGE="3", ZERO_OFFLOAD="optimizer+parameters"
    ).json()
    assert shown["strategy"] == "deepspeed"
    config = shown["deepspeed"]
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    # What the settings own, resolved: 16 rows a step on one process, the tiny run's rate; precision waits
    # for the hardware.
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
        config["train_batch_size"],
    ) == (16, 1, 16)
    assert config["gradient_clipping"] == 1.0 and config["bf16"] == {"enabled": "auto"}
    assert "optimizer" not in config  # the job's AdamW, with its per-group rates

    # What --dry-run prints under "strategy" and "deepspeed" is main.configure's strategy, which the cases
    # below read in this process.
    *_, strategy = configured_dry_run(
        monkeypatch, job_env, STRATEGY="deepspeed", ZERO_STAGE="3", ZERO_OFFLOAD="optimizer+parameters"
    )
    assert strategy == {"strategy": shown["strategy"], "deepspeed": config}

    # A user's file: its own values kept, what it leaves out of the job's completed, "auto" filled in, the stage
    # and offload the file's, and ZERO_STAGE and ZERO_OFFLOAD saying so (run.json records them).
    path = ds_file(tmp_path, {"zero_optimization": {"stage": 1}, "train_batch_size": "auto", "gradient_clipping": 1.0})
    settings, _, _, shown = configured_dry_run(monkeypatch, job_env, STRATEGY="deepspeed", DEEPSPEED_CONFIG=path)
    assert shown["deepspeed"] == {
        "zero_optimization": {"stage": 1},
        "train_batch_size": 16,
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }
    assert (settings.zero_stage, settings.zero_offload) == (1, "none")
    from utils.config.plan import build_plan

    assert build_plan(settings, 1).identity["zero_stage"] == 1  # the run identity records what trains
    # A scheduler and an optimizer block: what the Trainer fills in from the run completed, the step counts
    # left "auto" until the data set's size is known, and ZERO_STAGE/ZERO_OFFLOAD agreeing with the file accepted.
    path = ds_file(
        tmp_path,
        {
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "AdamW", "params": {}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "linear"}},
        },
        "scheduled.json",
    )
    settings, _, _, shown = configured_dry_run(
        monkeypatch,
        job_env,
        STRATEGY="deepspeed",
        DEEPSPEED_CONFIG=path,
        ZERO_STAGE="3",
        ZERO_OFFLOAD="optimizer",
        LORAPLUS_LR_RATIO="1",
    )
    assert shown["deepspeed"]["optimizer"]["params"] == {"lr": 0.003, "weight_decay": settings.weight_decay}
    assert shown["deepspeed"]["scheduler"]["params"] == {
        "warmup_type": "linear",
        "warmup_max_lr": 0.003,
        "warmup_num_steps": "auto",
        "total_num_steps": "auto",
    }
    assert (settings.zero_stage, settings.zero_offload) == (3, "optimizer")

    # DDP shows no DeepSpeed config, and the same run name as before DeepSpeed settings existed.
    *_, plain = configured_dry_run(monkeypatch, job_env)
    assert plain["strategy"] == "ddp" and "deepspeed" not in plain


@pytest.mark.check
def test_an_accelerate_deepspeed_config_becomes_strategy_deepspeed(job_env, monkeypatch):
    settings, _, _, shown = configured_dry_run(
        monkeypatch,
        job_env,
        ACCELERATE_USE_DEEPSPEED="true",
        ACCELERATE_DEEPSPEED_ZERO_STAGE="3",
        ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE="cpu",
        ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE="none",
    )
    assert shown["strategy"] == "deepspeed"
    config = settings.as_dict()  # --dry-run's "config"
    assert (config["zero_stage"], config["zero_offload"]) == (3, "optimizer")
    assert shown["deepspeed"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_deepspeed_not_installed_is_refused_with_the_install_line(tmp_path, job_env):
    python, env = without_deepspeed(tmp_path, {**job_env, "STRATEGY": "deepspeed"})
    result = run_command([*python, str(REPO / "main.py"), "--dry-run"], env=env, cwd=REPO, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert_refusal(result.stderr, ["STRATEGY=deepspeed", "pip install deepspeed==0.19.8"])


@pytest.mark.integration
@pytest.mark.slow
def test_one_process_with_zero_offload_trains_and_exports_a_merged_model(tmp_path, tiny_bert, fixed_data):
    """ZeRO-Offload on one process is a real use (a larger base model on one GPU): no launcher, no peers."""
    settings = comparison_settings(
        tiny_bert,
        fixed_data,
        tmp_path / "out",
        STRATEGY="deepspeed",
        ZERO_OFFLOAD="optimizer",
        MAX_STEPS=2,
        MERGE_ADAPTER="true",
    )
    result = run_main(base_env(tmp_path, **settings), timeout=900)
    assert result.code == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert (
        "strategy deepspeed: ZeRO stage 2, optimizer state offloaded True" in (out / "logs" / "rank-0.log").read_text()
    )
    assert rank_record(out, 0)["world_size"] == 1
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("the film was wonderful\n")
    predicted = run_command(
        [sys.executable, str(REPO / "predict.py"), str(out / "merged"), str(sentences)],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        cwd=REPO,
        timeout=300,
    )
    assert predicted.returncode == 0 and predicted.stdout.strip(), predicted.stderr[-3000:]


@pytest.mark.integration
@pytest.mark.slow
def test_replicas_with_another_zero_stage_are_refused_at_the_rendezvous(tmp_path, tiny_bert, fixed_data):
    port = free_port()
    procs = [
        start_main(
            rank_env(
                tmp_path,
                rank,
                2,
                port,
                **comparison_settings(
                    tiny_bert,
                    fixed_data,
                    tmp_path / "out",
                    STRATEGY="deepspeed",
                    ZERO_STAGE=stage,
                    RENDEZVOUS_TIMEOUT=120,
                ),
            ),
            log=tmp_path / f"rank{rank}.txt",
        )
        for rank, stage in ((0, 2), (1, 3))
    ]
    assert wait_all(procs, timeout=300) == [2, 2]
    for rank in (0, 1):
        assert_refusal((tmp_path / f"rank{rank}.txt").read_text(), ["rank 1: ", "ZERO_STAGE: 2 -> 3"])


@pytest.mark.integration
@pytest.mark.slow
def test_a_deepspeed_run_does_not_resume_on_another_replica_count(tmp_path, tiny_bert, fixed_data):
    """GLOBAL_BATCH_SIZE lets a DDP run come back on another count; a DeepSpeed checkpoint holds each rank's
    partition of the optimizer state, so the same restart is refused with the count that works. The run is
    cut after its training by taking its final outputs away: what a restart then finds is its checkpoint (one:
    the refusal needs no more steps)."""
    out = tmp_path / "out"
    settings = comparison_settings(
        tiny_bert,
        fixed_data,
        out,
        STRATEGY="deepspeed",
        ZERO_STAGE=2,
        GLOBAL_BATCH_SIZE=2 * BATCH,
        PER_DEVICE_BATCH_SIZE=BATCH,
        MAX_STEPS=SAVE_EVERY,
    )
    train_two(tmp_path, "zero2", settings)
    shutil.rmtree(out / "model")
    (out / "metrics.json").unlink()
    alone = run_main(base_env(tmp_path, **settings))
    # The replica counts, and the way out that keeps the count free: DDP with GLOBAL_BATCH_SIZE.
    assert_refusal(alone, [f"OUTPUT_DIR={out}", "replica count: 2 -> 1", "STRATEGY=ddp", "GLOBAL_BATCH_SIZE"])


@pytest.mark.check
def test_what_transformers_compares_with_its_arguments_is_compared_at_dry_run(tmp_path):
    """Every field transformers' DeepSpeed integration checks against TrainingArguments (a mismatch there is a
    ValueError after the model has loaded) is one the job compares first, with the Trainer's own defaults for
    those the job keeps; the schedulers' parameters are the ones DeepSpeed's classes take."""
    import inspect
    import re

    from deepspeed.runtime import lr_schedules
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from utils.config import deepspeed_config
    from utils.config.plan import build_plan
    from utils.config.settings import Settings

    source = inspect.getsource(HfTrainerDeepSpeedConfig.trainer_config_process) + inspect.getsource(
        HfTrainerDeepSpeedConfig.trainer_config_finalize
    )
    compared = set(re.findall(r'self\.fill_match\(\s*"([^"]+)"', source))
    assert "scheduler.params.warmup_num_steps" in compared, source  # the pattern still finds them
    settings = Settings(max_steps=10, precision="fp32")
    owned = deepspeed_config.owned_values(build_plan(settings, 1), settings.weight_decay)
    assert compared <= set(owned), f"compared by transformers, not by the job: {sorted(compared - set(owned))}"

    defaults = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert [defaults.adam_beta1, defaults.adam_beta2] == deepspeed_config.ADAM_BETAS
    assert (defaults.adam_epsilon, defaults.max_grad_norm) == (
        deepspeed_config.ADAM_EPSILON,
        deepspeed_config.GRADIENT_CLIPPING,
    )
    for kind, (taken, filled) in deepspeed_config.SCHEDULERS.items():
        parameters = set(inspect.signature(getattr(lr_schedules, kind)).parameters) - {"self", "optimizer"}
        assert parameters == taken, (kind, parameters ^ taken)
        assert set(filled) <= taken


@pytest.mark.integration
@pytest.mark.slow
def test_a_config_with_only_a_stage_trains_records_its_stage_and_a_changed_one_is_refused_on_resume(
    tmp_path, tiny_bert, fixed_data
):
    """A file that sets only the ZeRO stage (the rest the job's) trains; run.json and the checkpoints record the
    stage it set; the file edited to another stage afterwards is refused at the restart (exit 2, before anything
    loads), and a checkpoint whose recorded stage differs from the start's is refused by the resume itself."""
    config = ds_file(tmp_path, {"zero_optimization": {"stage": 1}})
    out = tmp_path / "out"
    settings = comparison_settings(
        tiny_bert, fixed_data, out, STRATEGY="deepspeed", DEEPSPEED_CONFIG=config, MAX_STEPS=2, SAVE_STEPS=1
    )
    result = run_main(base_env(tmp_path, **settings), timeout=900)
    assert result.code == 0, result.stderr[-3000:]
    assert (
        "strategy deepspeed: ZeRO stage 1, optimizer state offloaded False"
        in (out / "logs" / "rank-0.log").read_text()
    )
    record = json.loads((out / "run.json").read_text())
    assert (record["identity"]["zero_stage"], record["identity"]["zero_offload"]) == (1, "none")
    from utils.run_folder.checkpoints import checkpoint_resume_key
    from utils.run_folder.layout import RunDir

    checkpoint = out / "checkpoints" / f"checkpoint-{max(complete_steps(out))}"
    key = checkpoint_resume_key(checkpoint)["identity"]
    assert (key["zero_stage"], key["zero_offload"]) == (1, "none")

    ds_file(tmp_path, {"zero_optimization": {"stage": 3}})
    restart = run_main(base_env(tmp_path, **settings), timeout=120)
    assert_refusal(restart, [f"OUTPUT_DIR={out}", "ZERO_STAGE: 1 -> 3"])

    from utils.common.errors import JobError
    from utils.run import resume_checkpoint

    with pytest.raises(JobError) as refused:
        resume_checkpoint(RunDir(out), {**key, "zero_stage": 3})
    assert refused.value.code == 2
    assert "ZERO_STAGE: 1 -> 3" in refused.value.message and "DEEPSPEED_CONFIG" in refused.value.message
    assert resume_checkpoint(RunDir(out), key) == str(checkpoint)  # the same stage resumes

"""The default global batch: with no batch setting given, 64 rows a step (one GPU's batch) on every replica count,
so more replicas train the same model faster (utils/config/plan.py's rule). PER_DEVICE_BATCH_SIZE or
GRADIENT_ACCUMULATION_STEPS given keeps the per-device rule (the global batch follows the count); a count that
cannot share 64 rows equally trains the nearest multiple of the count, and says so.

The plan is checked in this process on 1 to 8 replicas (torchrun's range; config.yaml's 4, multi-gpu-per-pod's 8);
the last test trains the defaults on 1 and on 2 CPU replicas (DDP on gloo) and holds them to one model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.data import write_fixed_length_data
from tests.support.env import base_env, free_port, rank_env
from tests.support.harness import configured
from tests.support.numerics import LOSS_RTOL, WEIGHT_ATOL, WEIGHT_RTOL, adapter_weights, first_divergence
from tests.support.outcomes import error_lines, rank_record, trained_plan
from tests.support.processes import Replicas, run_main, start_main, wait_all
from utils.common.errors import JobError
from utils.config.plan import batch_warning

DEFAULT = 64
# The multiple of each count that cannot share 64 rows equally nearest to 64: what the default becomes there.
ROUNDED = {3: 63, 5: 65, 6: 66, 7: 63}


def plan_on(monkeypatch, tmp_path: Path, world: int, **extra: str):
    """(settings, plan) of one replica of `world`, as main.configure resolves them before torch."""
    ranks = dict(RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500") if world > 1 else {}
    settings, _, _, plan = configured(monkeypatch, base_env(tmp_path, **ranks, **extra))
    return settings, plan


@pytest.mark.check
@pytest.mark.parametrize("world", range(1, 9))
def test_the_defaults_train_one_global_batch_on_every_count(tmp_path, monkeypatch, world):
    """No batch setting: 64 rows a step on each count that divides 64, in equal full shares of at most
    PER_DEVICE_BATCH_SIZE (64) rows, at the one-GPU rate; on the others the nearest multiple, warned about."""
    _, alone = plan_on(monkeypatch, tmp_path, 1)
    settings, plan = plan_on(monkeypatch, tmp_path, world)
    batch = plan.batch
    assert batch.global_batch == ROUNDED.get(world, DEFAULT), batch
    assert batch.micro_batch * batch.accumulation * world == batch.global_batch, batch
    assert batch.micro_batch <= settings.per_device_batch_size == DEFAULT and batch.fixed
    assert (batch.micro_batch, batch.accumulation) == (batch.global_batch // world, 1)  # 4 replicas: 16 rows each
    # Where the batch came from, as --dry-run, run.json and the card show it.
    assert batch.source.startswith("the default"), batch.source
    warning = batch_warning(batch, settings.global_batch_size, settings.per_device_batch_size)
    if world in ROUNDED:
        assert f"{ROUNDED[world]}, the nearest multiple of {world} replicas" in batch.source, batch.source
        assert warning and f"the global batch is {ROUNDED[world]} rows, not the default 64" in warning, warning
    else:
        assert warning is None, warning
        assert (plan.learning_rate, plan.loraplus_ratio) == (alone.learning_rate, alone.loraplus_ratio) == (1e-3, 8)
    # One run on any count: the identity names neither the count nor the micro-batch cap (a restart may change both).
    assert plan.identity["world_size"] is None and plan.identity["per_device_batch_size"] is None
    assert plan.identity["global_batch"] == batch.global_batch


@pytest.mark.check
@pytest.mark.parametrize(
    ("world", "extra", "global_batch"),
    [
        (4, {"PER_DEVICE_BATCH_SIZE": "64"}, 256),  # the per-device rule, as before the default was fixed
        (3, {"PER_DEVICE_BATCH_SIZE": "16"}, 48),
        (2, {"GRADIENT_ACCUMULATION_STEPS": "2"}, 256),  # accumulation given: 64 x 2 replicas x 2
    ],
)
def test_a_per_device_batch_given_keeps_the_per_device_rule(tmp_path, monkeypatch, world, extra, global_batch):
    _, plan = plan_on(monkeypatch, tmp_path, world, **extra)
    assert (plan.batch.global_batch, plan.batch.fixed) == (global_batch, False)
    assert "the global batch follows the replica count" in plan.batch.source, plan.batch.source
    assert plan.identity["world_size"] == world and "per_device_batch_size" in plan.identity


@pytest.mark.check
def test_a_per_device_cap_beside_a_global_batch_only_caps_the_micro_batch(tmp_path, monkeypatch):
    """To keep 64 rows a step under a smaller memory cap: GLOBAL_BATCH_SIZE=64 with PER_DEVICE_BATCH_SIZE."""
    _, plan = plan_on(monkeypatch, tmp_path, 2, GLOBAL_BATCH_SIZE="64", PER_DEVICE_BATCH_SIZE="8")
    assert (plan.batch.global_batch, plan.batch.micro_batch, plan.batch.accumulation) == (64, 8, 4)
    assert plan.batch.source == "GLOBAL_BATCH_SIZE=64, on any replica count"


@pytest.mark.check
def test_a_global_batch_a_count_cannot_share_is_refused_with_the_nearest_that_it_can(tmp_path, monkeypatch):
    """GLOBAL_BATCH_SIZE is the user's number: never rounded, refused with the batches 3 replicas can share."""
    with pytest.raises(JobError) as refused:
        plan_on(monkeypatch, tmp_path, 3, GLOBAL_BATCH_SIZE="64")
    assert refused.value.message.startswith("GLOBAL_BATCH_SIZE=64 cannot be shared by 3 replicas"), refused.value
    assert "e.g. 63 or 66" in refused.value.message, refused.value


@pytest.mark.check
@pytest.mark.parametrize(("nodes", "refused"), [("1:2", None), ("2:4", "3"), ("4:8", "5, 6, 7")])
def test_an_elastic_range_keeps_the_default_only_where_every_count_shares_it(tmp_path, monkeypatch, nodes, refused):
    """An elastic range needs one global batch for all its counts: the default where each divides 64, else a
    refusal at start naming the counts and batches every count can share (k8s/elastic sets GLOBAL_BATCH_SIZE)."""
    low = nodes.split(":")[0]
    torchrun = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=low, LOCAL_WORLD_SIZE="1", TORCHELASTIC_RUN_ID="job")
    env = base_env(tmp_path, **torchrun, GROUP_RANK="0", PET_NNODES=nodes, MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    if refused is None:
        assert configured(monkeypatch, env)[3].batch.global_batch == DEFAULT
        return
    with pytest.raises(JobError) as error:
        configured(monkeypatch, env)
    message = error.value.message
    assert message.startswith(f"the default global batch (64) cannot be shared by {refused} replica(s)"), message
    assert f"PET_NNODES={nodes}" in message and "set GLOBAL_BATCH_SIZE to a multiple of every count" in message


def test_dry_run_says_the_global_batch_and_why(tmp_path):
    """The real entry point: the batch and its source in --dry-run's plan, and the warning for a rounded one."""
    out = str(tmp_path / "out")
    shown = run_main(rank_env(tmp_path, 0, 4, free_port(), OUTPUT_DIR=out), "--dry-run")
    assert shown.code == 0 and "warning:" not in shown.stderr, shown.stderr
    batch = shown.json()["plan"]["batch"]
    assert (batch["global_batch"], batch["micro_batch"], batch["world_size"]) == (64, 16, 4)
    assert batch["source"].startswith("the default, 64 (one GPU's batch)"), batch
    rounded = run_main(rank_env(tmp_path, 0, 3, free_port(), OUTPUT_DIR=out), "--dry-run")
    assert rounded.code == 0 and not error_lines(rounded.stderr), rounded.stderr
    assert rounded.json()["batch"]["global_batch"] == 63
    assert "warning: the global batch is 63 rows, not the default 64" in rounded.stderr, rounded.stderr


# ------------------------------------------------------------------------------- 1 and 2 replicas, trained
STEPS_PER_EPOCH, EPOCHS = 2, 2
TRAIN_ROWS, VALIDATION_ROWS = DEFAULT * STEPS_PER_EPOCH + 5, 32  # 5 rows left out of each epoch's whole batches


def curves(out: Path) -> dict[str, dict[int, float]]:
    checkpoint = out / "checkpoints" / f"checkpoint-{EPOCHS * STEPS_PER_EPOCH}"
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {
        key: {entry["step"]: entry[key] for entry in history if key in entry}
        for key in ("loss", "eval_loss", "learning_rate")
    }


@pytest.mark.slow
def test_the_defaults_train_the_same_model_on_1_and_2_replicas(tmp_path, tiny_bert):
    """No batch setting and no rate: one process and two replicas (DDP on gloo) both train 64 rows a step at the
    one rate, the same losses and weights (up to summation order), and the card says the global batch and why.
    Dropout is off: each rank would draw its own masks."""
    import torch

    data = write_fixed_length_data(tmp_path / "data", seed=5, counts=(TRAIN_ROWS, VALIDATION_ROWS))
    settings = dict(MODEL_NAME=str(tiny_bert), DATASET_PATH=str(data), NUM_EPOCHS=str(EPOCHS), REPORT_TO="none")
    settings |= dict(LORA_DROPOUT="0", MODEL_DROPOUT="0", LOGGING_STEPS="1", EVAL_STEPS="1", RENDEZVOUS_TIMEOUT="120")
    one_out, two_out = tmp_path / "one", tmp_path / "two"
    group, port = Replicas(tmp_path), free_port()
    try:
        for rank in (0, 1):
            log = tmp_path / f"two-rank{rank}.txt"
            group.started.append(
                start_main(rank_env(tmp_path, rank, 2, port, **settings, OUTPUT_DIR=two_out), log=log)
            )
            group.streams.append(log)
        one = run_main(base_env(tmp_path, **settings, OUTPUT_DIR=one_out))
        codes = wait_all(group.started)
    finally:
        group.cleanup()
    assert one.code == 0, one.stderr[-3000:]
    assert codes == [0, 0], [(tmp_path / f"two-rank{r}.txt").read_text()[-3000:] for r in (0, 1)]

    one_plan, two_plan = trained_plan(one_out), trained_plan(two_out, ranks=(0, 1))
    assert (one_plan["batch"]["micro_batch"], two_plan["batch"]["micro_batch"]) == (64, 32)
    for plan in (one_plan, two_plan):
        assert plan["batch"]["global_batch"] == DEFAULT and plan["steps"] == EPOCHS * STEPS_PER_EPOCH
        assert plan["learning_rate"] == one_plan["learning_rate"] and plan["rates"] == one_plan["rates"]
    records = [rank_record(two_out, rank) for rank in (0, 1)]
    assert [r["samples_trained"] for r in records] == [EPOCHS * STEPS_PER_EPOCH * DEFAULT // 2] * 2
    assert rank_record(one_out, 0)["samples_trained"] == EPOCHS * STEPS_PER_EPOCH * DEFAULT
    assert records[0]["trainable_checksum"] == records[1]["trainable_checksum"], "the replicas' weights differ"

    problems = []
    one_curves, two_curves = curves(one_out), curves(two_out)
    for key, rtol in (("learning_rate", 0), ("loss", LOSS_RTOL), ("eval_loss", LOSS_RTOL)):
        if where := first_divergence(one_curves[key], two_curves[key], rtol):
            problems.append(f"{key} {where}")
    weights_one, weights_two = adapter_weights(one_out), adapter_weights(two_out)
    assert weights_one.keys() == weights_two.keys()
    problems += [
        f"{name} differs by up to {(weights_one[name] - weights_two[name]).abs().max().item():.3g}"
        for name in sorted(weights_one)
        if not torch.allclose(weights_one[name], weights_two[name], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
    ]
    assert not problems, "the defaults trained another model on 2 replicas than on 1:\n" + "\n".join(problems)

    for out in (one_out, two_out):
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["global_batch"] == DEFAULT and metrics["global_batch_source"].startswith("the default")
        card = (out / "model" / "README.md").read_text()
        assert "| global batch | 64 rows a step (the default, 64 (one GPU's batch)" in card, card

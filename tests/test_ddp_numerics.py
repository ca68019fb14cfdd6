"""DDP against one process, number for number: one `main.py` at batch 2B and two replicas at B each, the same seed,
data and rate, give the same loss curve and adapter. As torchtune's recipe tests compare losses: a rate scaled by the
world size, or gradients summed instead of averaged, fools every "the ranks agree" check and fails this one.

Every sentence tokenises to one length, so the length-grouped sampler keeps its seeded order and rank r takes
batches r, r+2, ...: step k sees the same 2B rows in both runs. Checked, not trusted: one token length, step 1's loss
(before any update) equal, an evaluation after every step. Dropout is off: nothing random is drawn in training."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.support.data import write_fixed_length_data
from tests.support.numerics import LOSS_RTOL, WEIGHT_ATOL, WEIGHT_RTOL, adapter_weights, first_divergence
from tests.support.outcomes import rank_record, trained_plan
from tests.support.processes import train_one_and_two

BATCH = 4  # B: rows per replica per step; the one process takes 2B
EPOCHS, STEPS_PER_EPOCH = 2, 8  # 16 optimizer steps; the second epoch draws a new order from SEED + 1
TRAIN_ROWS, VALIDATION_ROWS = 2 * BATCH * STEPS_PER_EPOCH, 32  # no partial batch, no padded evaluation batch
RATE = "3e-3"  # explicit in both runs; a tiny random model needs a high rate, and a x2 error shows within steps


def token_lengths(model: Path, data: Path) -> set[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = set()
    for split in ("train", "validation"):
        with open(data / f"{split}.csv") as handle:
            sentences = [row["sentence"] for row in csv.DictReader(handle)]
        encoded = tokenizer(sentences)["input_ids"]
        lengths |= {len(ids) for ids in encoded}
        unknown = [s for s, ids in zip(sentences, encoded, strict=True) if tokenizer.unk_token_id in ids]
        assert not unknown, f"words outside the tiny vocabulary: {unknown[:3]}"
    return lengths


def loss_curve(out: Path) -> dict[str, dict[int, float]]:
    """The Trainer's log_history as the final checkpoint saved it: the training loss (LOGGING_STEPS=1), the rate
    and the eval loss (EVAL_STEPS=1) after every step."""
    checkpoint = out / "checkpoints" / f"checkpoint-{EPOCHS * STEPS_PER_EPOCH}"
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {
        key: {entry["step"]: entry[key] for entry in history if key in entry}
        for key in ("eval_loss", "loss", "learning_rate")
    }


@pytest.mark.slow
def test_two_replicas_match_one_process_at_twice_the_batch(tmp_path, tiny_bert):
    import torch

    data = write_fixed_length_data(tmp_path / "data", counts=(TRAIN_ROWS, VALIDATION_ROWS))
    assert len(token_lengths(tiny_bert, data)) == 1, "every sentence must tokenise to one length, or batches regroup"
    settings = dict(MODEL_NAME=tiny_bert, DATASET_PATH=data, NUM_EPOCHS=EPOCHS, LEARNING_RATE=RATE, REPORT_TO="none")
    settings |= dict(LORA_DROPOUT=0, MODEL_DROPOUT=0, EVAL_STEPS=1, LOGGING_STEPS=1, RENDEZVOUS_TIMEOUT=120)
    settings["PER_DEVICE_EVAL_BATCH_SIZE"] = VALIDATION_ROWS // 2
    one_out, two_out = train_one_and_two(tmp_path, settings, BATCH)

    # The same rows, in the same steps: every step of both runs trained 2B rows, split evenly between the ranks.
    records = [rank_record(two_out, rank) for rank in (0, 1)]
    one_record = rank_record(one_out, 0)
    assert [r["world_size"] for r in records] == [2, 2] and one_record["world_size"] == 1
    assert [r["samples_trained"] for r in records] == [EPOCHS * TRAIN_ROWS // 2] * 2
    assert one_record["samples_trained"] == EPOCHS * TRAIN_ROWS
    # Both ranks trained with the plan the two-replica run recorded: B rows a step each, the steps of 2B rows.
    two_plan = trained_plan(two_out, ranks=(0, 1))
    assert (two_plan["batch"]["world_size"], two_plan["batch"]["micro_batch"]) == (2, BATCH)
    assert two_plan["steps"] == trained_plan(one_out)["steps"] == EPOCHS * STEPS_PER_EPOCH
    one, two = loss_curve(one_out), loss_curve(two_out)
    every_step = list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    # The last step is checkpointed before it is evaluated (by the final evaluation, metrics.json's).
    assert (sorted(one["loss"]), sorted(one["eval_loss"])) == (every_step, every_step[:-1]), "a loss every step"

    problems = []
    for run, name in ((one_out, "1 process"), (two_out, "2 replicas")):
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["global_batch"] == 2 * BATCH, metrics
        if metrics["learning_rate"] != float(RATE):
            problems.append(f"metrics.json: {name} trained at learning rate {metrics['learning_rate']:g}, not {RATE}")
    for key, rtol in (("learning_rate", 0), ("loss", LOSS_RTOL), ("eval_loss", LOSS_RTOL)):
        if where := first_divergence(one[key], two[key], rtol):
            problems.append(f"{key} {where}")
    weights_one, weights_two = adapter_weights(one_out), adapter_weights(two_out)
    assert weights_one.keys() == weights_two.keys()
    differ = {
        name: ((weights_one[name] - weights_two[name]).abs().max().item(), weights_one[name].abs().max().item())
        for name in sorted(weights_one)
        if not torch.allclose(weights_one[name], weights_two[name], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
    }
    if differ:
        worst = max(differ, key=lambda name: differ[name][0])
        problems.append(
            f"weights: {len(differ)} of {len(weights_one)} adapter tensors differ beyond rtol {WEIGHT_RTOL:g}, "
            f"atol {WEIGHT_ATOL:g}; the most, {worst}, by up to {differ[worst][0]:.3g} "
            f"(its 1-process values reach {differ[worst][1]:.3g})"
        )
    failed = "two replicas at batch B did not train what one process at batch 2B trains:\n"
    assert not problems, failed + "\n".join(problems)

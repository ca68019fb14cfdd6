"""PROBLEM_TYPE=multi_label_classification through the real entry point, labels as lists of names (JSON, or `|` in a
csv cell) or 0/1 columns (LABEL_COLUMNS). The tiny model learns `praise` (a positive adjective), `blame` (a negative
one) and `motion` (one of three verbs), each independently present; one real `main.py` run per module fixture."""

from __future__ import annotations

import csv
import json
import random
import re
import sys
from pathlib import Path

import pytest

from scripts.make_demo_assets import FILLER, NEGATIVE, NOUNS, POSITIVE, VERBS
from tests.support.commands import readme_predict_command, runnable
from tests.support.env import base_env, tiny_run_settings
from tests.support.outcomes import assert_refusal, succeeded
from tests.support.processes import run_command, run_main, run_predict, wait_all

NAMES = ("blame", "motion", "praise")  # sorted: the order the data's names take without LABEL_NAMES
RATE = "3e-3"  # a tiny randomly initialised model needs a high rate (as tests/support/env.tiny_run_settings)


def rows(rng: random.Random, count: int):
    """(sentence, its labels): `the NOUN VERB [positive] [negative] filler`, every row 6 words long."""
    for _ in range(count):
        labels = {name for name in NAMES if rng.random() < 0.5}
        verb = rng.choice(VERBS[:3] if "motion" in labels else VERBS[3:])
        words = ["the", rng.choice(NOUNS), verb]
        words += [rng.choice(POSITIVE[:4]) if "praise" in labels else rng.choice(FILLER)]
        words += [rng.choice(NEGATIVE[:4]) if "blame" in labels else rng.choice(FILLER)]
        words += [rng.choice(FILLER)]
        yield " ".join(words), sorted(labels)


def write_lists(folder: Path, train: int = 480, validation: int = 60) -> dict[str, Path]:
    """The settings naming train.jsonl (JSON lists) and validation.csv (`|`-separated names), written."""
    rng = random.Random(7)
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text(
        "".join(json.dumps({"sentence": s, "tags": labels}) + "\n" for s, labels in rows(rng, train))
    )
    with open(folder / "validation.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sentence", "tags"])
        writer.writerows((s, "|".join(labels)) for s, labels in rows(rng, validation))
    return {"TRAIN_FILE": folder / "train.jsonl", "VALIDATION_FILE": folder / "validation.csv", "LABEL_COLUMN": "tags"}


def write_columns(folder: Path, train: int = 480, validation: int = 60, odd=None) -> Path:
    """`write_lists`' rows as 0/1 columns in csv files; `odd`: (row, column, value) written over one training cell."""
    rng = random.Random(7)
    folder.mkdir(parents=True)
    for split, count in (("train", train), ("validation", validation)):
        table = [[s, *(int(name in labels) for name in NAMES)] for s, labels in rows(rng, count)]
        if odd and split == "train":
            table[odd[0]][1 + NAMES.index(odd[1])] = odd[2]
        with open(folder / f"{split}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["sentence", *NAMES])
            writer.writerows(table)
    return folder


def multi_settings(tmp: Path, tiny_bert: Path, data: Path | dict, **extra) -> dict[str, str]:
    """The settings of a run on `data`: a DATASET_PATH, or the settings naming its files (`write_lists`)."""
    files = data if isinstance(data, dict) else {"DATASET_PATH": data}
    settings = dict(MODEL_NAME=tiny_bert, **files, OUTPUT_DIR=tmp / "out", PROBLEM_TYPE="multi_label_classification")
    # NUM_EPOCHS: each label learned by then (6 epochs: micro F1 0.84, the three not all learned)
    settings |= dict(LEARNING_RATE=RATE, NUM_EPOCHS=10, PER_DEVICE_BATCH_SIZE=16, REPORT_TO="none")
    return {k: str(v) for k, v in {**settings, **extra}.items()}


def multi_env(tmp: Path, tiny_bert: Path, data: Path | dict, **extra) -> dict[str, str]:
    return base_env(tmp, **multi_settings(tmp, tiny_bert, data, **extra))


def trained(tmp: Path, env: dict[str, str]) -> dict:
    succeeded(run_main(env))
    return json.loads((tmp / "out" / "metrics.json").read_text())


@pytest.fixture(scope="module")
def lists_run(tmp_path_factory, tiny_bert):
    tmp = tmp_path_factory.mktemp("lists")
    env = multi_env(tmp, tiny_bert, write_lists(tmp / "data"), MERGE_ADAPTER="true")
    return tmp, trained(tmp, env)


@pytest.fixture(scope="module")
def columns_run(tmp_path_factory, tiny_bert):
    tmp = tmp_path_factory.mktemp("columns")
    env = multi_env(tmp, tiny_bert, write_columns(tmp / "data"), LABEL_COLUMNS=",".join(NAMES), THRESHOLD="0.4")
    return tmp, trained(tmp, env)


# ------------------------------------------------------------------------------- the metric
def test_the_metric_counts_every_decision_each_label_and_whole_rows():
    import evaluate

    from utils.config.tasks import METRIC_MODULES, MULTI_LABEL

    # Row 0: label 0 right, label 2 predicted wrongly; row 1 exact; row 2: label 1 predicted wrongly; row 3: label 2
    # missed. TP 3 (label 0 twice, label 1 once), FP 2, FN 1: micro F1 = 6 / 9. Per label F1: 1, 2/3 (TP 1, FP 1),
    # 0 (FP 1, FN 1): macro 5/9. One row of four exactly right.
    predictions, references = (
        [[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0]],
        [[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1]],
    )
    scores = evaluate.load(METRIC_MODULES[MULTI_LABEL]).compute(predictions=predictions, references=references)
    assert scores == pytest.approx({"f1_micro": 6 / 9, "f1_macro": 5 / 9, "subset_accuracy": 0.25})


def test_the_threshold_decides_what_counts_as_predicted():
    import numpy as np
    from transformers import EvalPrediction

    from utils.training.trainer import multi_label_metrics

    # Sigmoid scores 0.62 and 0.38 (logits +-0.5) on a row labelled [1, 1]: at 0.5 one of two labels, at 0.3 both.
    logits, labels = np.array([[0.5, -0.5]]), np.array([[1.0, 1.0]])
    half, low = (multi_label_metrics(cut)(EvalPrediction(logits, labels)) for cut in (0.5, 0.3))
    assert (half["f1_micro"], half["subset_accuracy"]) == pytest.approx((2 / 3, 0.0))
    assert (low["f1_micro"], low["subset_accuracy"]) == pytest.approx((1.0, 1.0))
    # The loss is the model's: the mean binary cross-entropy per label, -log(sigmoid(logit)) for a label the row has.
    assert half["loss"] == pytest.approx((np.log1p(np.exp(-0.5)) + np.log1p(np.exp(0.5))) / 2)


def test_a_length_bucket_leaves_the_multi_hot_labels_whole():
    """The GPU paths' warm-up batches pad tensors of the sequence's length: 16 labels in 16 tokens stay labels."""
    import torch

    from utils.training.trainer import bucket_batch

    batch = {"input_ids": torch.ones(2, 16, dtype=torch.long), "attention_mask": torch.ones(2, 16)}
    batch["labels"] = torch.eye(2, 16)
    padded = bucket_batch(batch, 32, pad=0)
    assert padded["input_ids"].shape == padded["attention_mask"].shape == (2, 32)
    assert torch.equal(padded["labels"], batch["labels"])


# ------------------------------------------------------------------------------- both forms, trained
def test_label_lists_train_a_multi_label_model(lists_run):
    tmp, metrics = lists_run
    out = tmp / "out"
    assert metrics["problem_type"] == "multi_label_classification" and metrics["labels"] == list(NAMES)
    assert metrics["threshold"] == 0.5 and metrics["eval_samples"] == 60
    assert metrics["eval_f1_micro"] > 0.9 and metrics["eval_f1_macro"] > 0.9, metrics  # chance: about 0.5
    assert metrics["eval_subset_accuracy"] > 0.8 and "eval_accuracy" not in metrics  # chance: 1/8
    config = json.loads((out / "merged" / "config.json").read_text())
    assert config["problem_type"] == "multi_label_classification"
    assert config["id2label"] == {str(i): name for i, name in enumerate(NAMES)}
    assert json.loads((out / "model" / "inputs.json").read_text())["threshold"] == 0.5
    card = (out / "model" / "README.md").read_text()
    assert "multi-label classification into any of 3 labels (blame / motion / praise)" in card
    assert "at least 0.5" in card and "| f1_micro |" in card and "| subset_accuracy |" in card
    state = json.loads(next((out / "checkpoints").glob("checkpoint-*/trainer_state.json")).read_text())
    assert state["best_metric"] is not None and any("eval_f1_micro" in e for e in state["log_history"])


def test_zero_one_columns_train_a_multi_label_model(columns_run):
    tmp, metrics = columns_run
    assert metrics["labels"] == list(NAMES) and metrics["threshold"] == 0.4
    assert metrics["eval_f1_micro"] > 0.9, metrics
    run = json.loads((tmp / "out" / "run.json").read_text())
    assert run["identity"]["label_columns"] == list(NAMES)
    assert run["identity"]["problem"] == "multi_label_classification"


@pytest.mark.parametrize("folder", ["model", "merged"])
def test_predict_prints_every_label_above_the_threshold(lists_run, folder):
    tmp = lists_run[0]
    sentences = list(rows(random.Random(21), 12))
    stdin = "".join(f"{s}\n" for s, _ in sentences)
    result = succeeded(run_predict(base_env(tmp), tmp / "out" / folder, stdin=stdin, cwd=tmp))
    predicted = [json.loads(line) for line in result.stdout.splitlines()]
    assert [p["text"] for p in predicted] == [s for s, _ in sentences]
    for p in predicted:
        assert list(p["scores"]) == list(NAMES) and set(p) == {"text", "labels", "scores"}
        assert p["labels"] == [name for name in NAMES if p["scores"][name] >= 0.5]
    right = sum(p["labels"] == labels for p, (_, labels) in zip(predicted, sentences, strict=True))
    assert right >= 10, predicted  # the run's subset accuracy, roughly
    # A lower threshold never predicts fewer labels.
    low = succeeded(run_predict(base_env(tmp), tmp / "out" / folder, "--threshold", "0.05", stdin=stdin, cwd=tmp))
    for p, q in zip(predicted, map(json.loads, low.stdout.splitlines()), strict=True):
        assert set(p["labels"]) <= set(q["labels"]) and q["labels"] == [n for n in NAMES if q["scores"][n] >= 0.05]


def test_the_readmes_multi_label_predict_command_runs_as_written(lists_run):
    tmp = lists_run[0]
    command = readme_predict_command("--threshold")
    cut = float(command.split("--threshold")[1].split()[0])
    sentences = [s for s, _ in rows(random.Random(22), 6)]
    (tmp / "comments.txt").write_text("".join(f"{s}\n" for s in sentences))
    result = run_command(["bash", "-c", runnable(command, tmp / "out")], env=base_env(tmp), cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    predicted = [json.loads(line) for line in result.stdout.splitlines()]
    assert [p["text"] for p in predicted] == sentences
    assert all(p["labels"] == [n for n in NAMES if p["scores"][n] >= cut] for p in predicted), predicted


@pytest.mark.parametrize("folder", ["model", "merged"])
def test_the_cards_python_gives_the_scores_predict_prints(lists_run, folder):
    """The card's snippet, run as written: every label's sigmoid score, as predict.py prints them."""
    tmp = lists_run[0]
    sentences = [s for s, _ in rows(random.Random(23), 4)]
    [code] = re.findall(r"```python\n(.*?)```", (tmp / "out" / folder / "README.md").read_text(), re.S)
    script = code + "\nimport json, sys\nprint(json.dumps(classifier(json.loads(sys.argv[1]))))"
    result = run_command([sys.executable, "-c", script, json.dumps(sentences)], env=base_env(tmp), cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.splitlines()[-1])
    printed = succeeded(
        run_predict(base_env(tmp), tmp / "out" / folder, stdin="".join(f"{s}\n" for s in sentences), cwd=tmp)
    )
    for answer, line in zip(answers, printed.stdout.splitlines(), strict=True):
        scores = {entry["label"]: entry["score"] for entry in answer}
        assert scores == pytest.approx(json.loads(line)["scores"], abs=2e-4)


def test_predict_takes_the_threshold_the_model_was_trained_with(columns_run):
    tmp = columns_run[0]
    result = succeeded(run_predict(base_env(tmp), tmp / "out" / "model", stdin="the plot is good bad it\n", cwd=tmp))
    [p] = [json.loads(line) for line in result.stdout.splitlines()]
    assert p["labels"] == [name for name in NAMES if p["scores"][name] >= 0.4]


def test_predict_refuses_a_threshold_for_a_single_label_model(tmp_path, tiny_bert, sst2_dir):
    settings = tiny_run_settings(tiny_bert, sst2_dir, tmp_path / "out", MAX_STEPS=2, REPORT_TO="none")
    succeeded(run_main(base_env(tmp_path, **settings)))
    refused = run_predict(base_env(tmp_path), tmp_path / "out" / "model", "--threshold", "0.3", stdin="a good film\n")
    assert refused.stdout == ""
    assert_refusal(refused, ["--threshold 0.3", "drop --threshold"])


# ------------------------------------------------------------------------------- dry run
def test_dry_run_shows_the_problem_type_and_threshold(tmp_path, tiny_bert):
    data = write_columns(tmp_path / "data", train=8, validation=4)
    env = multi_env(tmp_path, tiny_bert, data, LABEL_COLUMNS=",".join(NAMES), THRESHOLD="0.3")
    shown = succeeded(run_main(env, "--dry-run"))
    task = shown.json()["task"]
    assert task["problem_type"] == "multi_label_classification" and task["threshold"] == 0.3
    assert task["label_names"] == list(NAMES) and task["label_columns"] == list(NAMES)
    assert task["metrics"] == ["f1_micro", "f1_macro", "subset_accuracy"]
    assert task["metric_for_best_model"] == "f1_micro"
    assert shown.json()["identity"]["problem"] == "multi_label_classification"
    # THRESHOLD is the run's only where the scores measured at it choose the saved model.
    assert shown.json()["identity"]["threshold"] is None
    chosen = run_main({**env, "LOAD_BEST_MODEL": "true"}, "--dry-run")
    assert chosen.code == 0 and chosen.json()["identity"]["threshold"] == 0.3, chosen.stderr


# ------------------------------------------------------------------------------- refusals
BAD_COMBINATIONS = {
    "class weights": ({"CLASS_WEIGHTS": "balanced"}, ["CLASS_WEIGHTS=balanced", "unset CLASS_WEIGHTS"]),
    "no problem type": ({"PROBLEM_TYPE": "auto"}, ["LABEL_COLUMNS=", "PROBLEM_TYPE=multi_label_classification"]),
    "one column": ({"LABEL_COLUMNS": "blame"}, ["LABEL_COLUMNS=blame", "at least two"]),
    "a missing column": ({"LABEL_COLUMNS": "blame,nope"}, ["'nope'", "LABEL_COLUMNS"]),
    "names beside columns": ({"LABEL_NAMES": "a,b,c"}, ["LABEL_NAMES=a,b,c", "unset LABEL_NAMES"]),
    "threshold 1": ({"THRESHOLD": "1"}, ["THRESHOLD=1", "range"]),
}


@pytest.mark.parametrize("extra, names", BAD_COMBINATIONS.values(), ids=BAD_COMBINATIONS)
def test_a_bad_combination_is_refused_at_dry_run(tmp_path, tiny_bert, extra, names):
    data = write_columns(tmp_path / "data", train=8, validation=4)
    env = multi_env(tmp_path, tiny_bert, data, **{"LABEL_COLUMNS": ",".join(NAMES), **extra})
    assert_refusal(run_main(env, "--dry-run"), names)


def test_a_threshold_without_a_multi_label_problem_is_refused(tmp_path, sst2_dir):
    refused = run_main(base_env(tmp_path, DATASET_PATH=sst2_dir, THRESHOLD="0.3"), "--dry-run")
    assert_refusal(refused, ["THRESHOLD=0.3", "PROBLEM_TYPE=multi_label_classification"])


def refused_start(tmp: Path, env: dict[str, str], names: list[str]) -> None:
    """A start refused once the data is read: exit 2, one line, before any training step."""
    env = {**env, "MAX_STEPS": "1"}
    line = assert_refusal(run_main(env), names)
    assert not list((tmp / "out").glob("checkpoints/checkpoint-*")), line


def test_a_zero_one_column_holding_2_is_refused(tmp_path, tiny_bert):
    data = write_columns(tmp_path / "data", train=16, validation=4, odd=(4, "motion", 2))
    env = multi_env(tmp_path, tiny_bert, data, LABEL_COLUMNS=",".join(NAMES))
    refused_start(tmp_path, env, ["'motion'", "holds 2 in row 5", "0 or 1"])


def test_a_row_naming_an_unknown_label_is_refused(tmp_path, tiny_bert):
    data = write_lists(tmp_path / "data", train=16, validation=4)
    env = multi_env(tmp_path, tiny_bert, data, LABEL_NAMES="praise,blame")
    refused_start(tmp_path, env, ["'tags'", "['motion']", "LABEL_NAMES"])


def test_a_label_column_of_lists_without_the_problem_type_is_refused(tmp_path, tiny_bert):
    data = write_lists(tmp_path / "data", train=16, validation=4)
    env = multi_env(tmp_path, tiny_bert, data)
    del env["PROBLEM_TYPE"]
    refused_start(tmp_path, env, ["'tags'", "PROBLEM_TYPE=multi_label_classification"])


@pytest.mark.check
def test_joined_names_trained_one_label_a_row_are_warned_about(tmp_path, caplog):
    """A multi-label csv trained without the problem type: each combination a class, and a warning with the fix."""
    import logging

    from utils.config.settings import Settings
    from utils.training.data import DataSource, check_and_rename, load_raw

    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("train", "validation"):
        (folder / f"{split}.csv").write_text("sentence,tags\na,praise\nb,blame|praise\nc,blame\n")
    settings = Settings(dataset_path=str(folder), label_column="tags")
    with caplog.at_level(logging.WARNING, logger="utils.training.data"):
        check_and_rename(load_raw(settings.select(DataSource)), settings.select(DataSource))
    assert "(row 2: 'blame|praise')" in caplog.text and "PROBLEM_TYPE=multi_label_classification" in caplog.text


def test_class_ids_in_the_label_column_are_refused(tmp_path, tiny_bert, sst2_dir):
    env = multi_env(tmp_path, tiny_bert, sst2_dir)
    refused_start(tmp_path, env, ["'label'", "int64", "LABEL_COLUMNS"])


def test_the_step_on_static_buffers_trains_as_the_eager_step(tmp_path, tiny_bert):
    """CUDA_GRAPHS=true on the CPU runs the captured step's code on its static buffers: the eager step's losses."""
    data = write_lists(tmp_path / "data", train=96, validation=8)
    losses = {}
    for captured in ("true", "false"):
        out = tmp_path / f"out-{captured}"
        extra = dict(OUTPUT_DIR=out, MAX_STEPS=4, LOGGING_STEPS=1, LORA_DROPOUT=0, CUDA_GRAPHS=captured)
        succeeded(run_main(multi_env(tmp_path, tiny_bert, data, **extra)))
        state = json.loads((out / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
        losses[captured] = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses["true"]) == 4 and losses["true"] == pytest.approx(losses["false"], rel=1e-6), losses


# ------------------------------------------------------------------------------- two replicas
@pytest.mark.slow
def test_two_replicas_train_and_evaluate_the_whole_split(tmp_path, tiny_bert, replicas):
    """Gloo DDP on two ranks: the multi-hot labels are gathered from both (61 rows: one rank's last batch uneven)."""
    data = write_columns(tmp_path / "data", train=64, validation=61)
    extra = dict(LABEL_COLUMNS=",".join(NAMES), MAX_STEPS=4, PER_DEVICE_BATCH_SIZE=8, RENDEZVOUS_TIMEOUT=120)
    settings = multi_settings(tmp_path, tiny_bert, data, **extra)
    wait_all(replicas.start("ddp", settings), logs=lambda: replicas.streams)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["eval_samples"]) == (2, 61)
    assert {"eval_f1_micro", "eval_f1_macro", "eval_subset_accuracy"} <= set(metrics)

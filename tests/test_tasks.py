"""Tasks other than SST-2 (N classes, pairs, regression, GLUE tasks by TASK), each learned by the tiny model from
data shaped like its GLUE task: MNLI pairs whose hypothesis word decides the class, STS-B pairs scored by their
positive adjectives, CoLA sentences in order or scrambled. One real `main.py` run each, shared by module fixtures."""

from __future__ import annotations

import csv
import json
import math
import random
import re
import sys
from pathlib import Path

import pytest

from scripts.make_demo_assets import FILLER, NEGATIVE, NOUNS, POSITIVE, SUBJECTS, VERBS
from tests.support.commands import readme_predict_command, runnable
from tests.support.env import base_env, tiny_run_env
from tests.support.outcomes import assert_refusal, rank_record, succeeded
from tests.support.processes import run_command, run_main, run_predict, train_one_and_two, wait_all

RATE = "3e-3"  # a tiny randomly initialised model needs a high rate (as tests/support/env.tiny_run_settings)
MNLI_NAMES = ("entailment", "neutral", "contradiction")
# The hypothesis word that decides an MNLI-shaped row's class: three per class, learned within a short run.
MARKERS = {"entailment": POSITIVE[:3], "neutral": NOUNS[:3], "contradiction": NEGATIVE[:3]}


def write_csv(path: Path, header: list[str], rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def premise(rng: random.Random, words: int = 4) -> str:
    return " ".join(["the", rng.choice(NOUNS), rng.choice(VERBS), *(rng.choice(FILLER) for _ in range(words - 3))])


def mnli_rows(rng: random.Random, count: int, names: bool = False):
    """premise, hypothesis, label: every row 4 + 4 words (one token length: batches keep their seeded order)."""
    for _ in range(count):
        label = rng.randrange(3)
        hypothesis = f"it {rng.choice(VERBS)} {rng.choice(MARKERS[MNLI_NAMES[label]])} {rng.choice(FILLER)}"
        yield premise(rng), hypothesis, MNLI_NAMES[label] if names else label


MNLI_SPLITS = ("validation_matched", "validation_mismatched")


def write_mnli(folder: Path, train: int = 480, validation: int = 90, names: bool = False, splits=MNLI_SPLITS) -> Path:
    """MNLI's local copy: train plus validation_matched and validation_mismatched (or `splits`)."""
    rng = random.Random(3)
    header = ["premise", "hypothesis", "label"]
    write_csv(folder / "train.csv", header, mnli_rows(rng, train, names))
    for split in splits:
        write_csv(folder / f"{split}.csv", header, mnli_rows(rng, validation, names))
    return folder


def stsb_rows(rng: random.Random, count: int):
    """sentence1, sentence2, a 0-5 score: 5 x the share of sentence2's four adjectives (of six) that are positive."""
    for _ in range(count):
        positive = rng.randint(0, 4)
        adjectives = [rng.choice(POSITIVE[:3]) for _ in range(positive)]
        adjectives += [rng.choice(NEGATIVE[:3]) for _ in range(4 - positive)]
        rng.shuffle(adjectives)
        yield premise(rng), " and ".join(adjectives), 5 * positive / 4


def cola_rows(rng: random.Random, count: int):
    """sentence, label: a subject, verb and adjective in order (acceptable, 1) or the same words scrambled (0)."""
    for _ in range(count):
        words = [*rng.choice(SUBJECTS).split(), rng.choice(VERBS), rng.choice(POSITIVE + NEGATIVE)]
        label = rng.randint(0, 1)
        if not label:
            while True:
                scrambled = rng.sample(words, len(words))
                if scrambled != words:
                    break
            words = scrambled
        yield " ".join(words), label


def trained(tmp: Path, tiny_bert: Path, data: Path, task: str) -> tuple[Path, dict, object]:
    """(tmp, metrics, result) of a two-epoch run of `task` on `data`."""
    result = run_main(
        tiny_run_env(tmp, tiny_bert, data, REPORT_TO="none", TASK=task, NUM_EPOCHS=2, PER_DEVICE_BATCH_SIZE=8)
    )
    assert result.code == 0, result.stderr[-3000:]
    return tmp, json.loads((tmp / "out" / "metrics.json").read_text()), result


def write_splits(data: Path, header: list[str], rows, counts: tuple[int, int] = (320, 60)) -> Path:
    """train.csv and validation.csv of `counts` rows each from `rows(count)`."""
    for split, count in zip(("train", "validation"), counts, strict=True):
        write_csv(data / f"{split}.csv", header, rows(count))
    return data


@pytest.fixture(scope="module")
def mnli_run(tmp_path_factory, tiny_bert):
    tmp = tmp_path_factory.mktemp("mnli")
    return trained(tmp, tiny_bert, write_mnli(tmp / "data", train=320, validation=60), "mnli")


@pytest.fixture(scope="module")
def stsb_run(tmp_path_factory, tiny_bert):
    tmp, rng = tmp_path_factory.mktemp("stsb"), random.Random(4)
    data = write_splits(tmp / "data", ["sentence1", "sentence2", "label"], lambda n: stsb_rows(rng, n))
    return trained(tmp, tiny_bert, data, "stsb")


@pytest.fixture(scope="module")
def cola_run(tmp_path_factory, tiny_bert):
    tmp, rng = tmp_path_factory.mktemp("cola"), random.Random(5)
    return trained(
        tmp, tiny_bert, write_splits(tmp / "data", ["sentence", "label"], lambda n: cola_rows(rng, n)), "cola"
    )


def model_config(out: Path) -> dict:
    return json.loads((out / "model" / "id2label.json").read_text())


def test_mnli_shaped_pairs_learn_three_classes_on_both_validation_splits(mnli_run):
    tmp, metrics, result = mnli_run
    for split in ("matched", "mismatched"):
        assert metrics[f"eval_{split}_accuracy"] > 0.8, metrics  # chance is 1/3
        assert f"eval_{split}_f1" in metrics and f"eval_{split}_matthews_correlation" in metrics
    assert metrics["labels"] == list(MNLI_NAMES) and metrics["problem_type"] == "classification"
    assert model_config(tmp / "out") == {str(i): name for i, name in enumerate(MNLI_NAMES)}
    card = (tmp / "out" / "model" / "README.md").read_text()
    assert "classification into 3 classes (entailment / neutral / contradiction)" in card
    assert "| matched_accuracy |" in card and "| mismatched_accuracy |" in card
    assert "eval_matched_accuracy=" in result.stdout and "eval_mismatched_accuracy=" in result.stdout
    # The base's 2-label head under 3 classes is trained afresh: no LOAD REPORT table (with terminal colours) for it.
    assert "LOAD REPORT" not in result.stderr + (tmp / "out" / "logs" / "rank-0.log").read_text()
    state = json.loads(next((tmp / "out" / "checkpoints").glob("checkpoint-*/trainer_state.json")).read_text())
    evaluated = [entry["eval_matched_accuracy"] for entry in state["log_history"] if "eval_matched_accuracy" in entry]
    # The task's metric (MNLI: matched accuracy) tracked over the evaluations this checkpoint had seen.
    assert len(evaluated) >= 2 and state["best_metric"] == max(evaluated), (state["best_metric"], evaluated)
    run = json.loads((tmp / "out" / "run.json").read_text())
    # TASK itself is no field of the identity: what it sets is (the columns, the labels, the problem).
    assert run["settings"]["task"] == "mnli" and run["identity"]["text_column"] == "premise,hypothesis"


@pytest.mark.parametrize("huge_rows", ["every other row", "one row"])
def test_a_loss_that_overflows_stops_the_run_naming_the_steps(huge_rows, tiny_bert, tmp_path):
    """Targets of 3.5e20 are finite, their squared error is not: exit 2 naming the steps, at the loss record that
    shows it or, after the last record, once training ends; no metrics.json or model."""
    rng = random.Random(6)
    every = huge_rows == "every other row"
    huge = (lambda i: i % 2 == 1) if every else (lambda i: i == 40)
    rows = [(a, b, 3.5e20 if huge(i) else score) for i, (a, b, score) in enumerate(stsb_rows(rng, 64))]
    write_csv(tmp_path / "data" / "train.csv", ["sentence1", "sentence2", "label"], rows)
    write_csv(tmp_path / "data" / "validation.csv", ["sentence1", "sentence2", "label"], stsb_rows(rng, 8))
    logging = "1" if every else "10"
    env = tiny_run_env(
        tmp_path, tiny_bert, tmp_path / "data", REPORT_TO="none", TASK="stsb", MAX_STEPS=4, LOGGING_STEPS=logging
    )
    result = run_main(env)
    line = assert_refusal(result, ["the training loss is", "LEARNING_RATE", "new OUTPUT_DIR"])
    out = tmp_path / "out"
    assert not (out / "metrics.json").exists() and not (out / "model").exists()
    records = re.findall(r"step (\d+): \{'loss': ([^,]+)", (out / "logs" / "rank-0.log").read_text())
    if every:
        assert "in step 1," in line and records == [("1", "inf")], (line, records)
    else:  # row 40 trains after the first record in this order: the end of training names the steps after it
        assert "in steps 2-4," in line and records == [("1", records[0][1])] and records[0][1] != "inf", line


def test_stsb_shaped_scores_train_a_regression(stsb_run):
    tmp, metrics, _ = stsb_run
    assert metrics["eval_pearson"] > 0.5, metrics
    assert -1 <= metrics["eval_spearman"] <= 1 and metrics["eval_mse"] >= 0
    assert metrics["labels"] == [] and metrics["problem_type"] == "regression"
    assert model_config(tmp / "out") == {"0": "score"}
    assert "regression" in (tmp / "out" / "model" / "README.md").read_text()


def test_cola_shaped_task_reports_matthews_correlation(cola_run):
    tmp, metrics, _ = cola_run
    assert math.isfinite(metrics["eval_matthews_correlation"]) and metrics["eval_matthews_correlation"] > 0.2, metrics
    assert metrics["labels"] == ["unacceptable", "acceptable"]
    assert "| matthews_correlation |" in (tmp / "out" / "model" / "README.md").read_text()


def test_a_resume_with_another_task_is_refused(mnli_run, tiny_bert):
    tmp, _, _ = mnli_run
    other = {"TEXT_COLUMN": "premise", "LABEL_NAMES": "entailment,neutral,contradiction"}
    env = tiny_run_env(tmp, tiny_bert, tmp / "data", REPORT_TO="none", **other)
    result = run_main(env, "--dry-run")
    assert_refusal(result, [f"OUTPUT_DIR={env['OUTPUT_DIR']}", " -> "])  # the folder, and what changed in it


# ------------------------------------------------------------------------------- two replicas
BATCH, STEPS = 4, 8


def curve(out: Path) -> dict[str, dict[int, float]]:
    state = json.loads((out / "checkpoints" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    history = state["log_history"]
    return {key: {e["step"]: e[key] for e in history if key in e} for key in ("loss", "eval_loss")}


@pytest.mark.integration
@pytest.mark.slow
def test_three_class_pairs_on_two_replicas_equal_one_process(tmp_path, tiny_bert):
    """As tests/test_ddp_numerics.py: one process at batch 2B against two replicas at B, on pairs with three classes
    named by the data."""
    import torch
    from safetensors.torch import load_file

    data = write_mnli(tmp_path / "data", train=2 * BATCH * STEPS, validation=16, names=True, splits=("validation",))
    settings = dict(MODEL_NAME=tiny_bert, DATASET_PATH=data, TEXT_COLUMN="premise,hypothesis", NUM_EPOCHS=1)
    settings |= dict(LEARNING_RATE=RATE, LORA_DROPOUT=0, MODEL_DROPOUT=0, EVAL_STEPS=4, LOGGING_STEPS=1)
    settings |= dict(PER_DEVICE_EVAL_BATCH_SIZE=8, REPORT_TO="none", RENDEZVOUS_TIMEOUT=120)
    one_out, two_out = train_one_and_two(tmp_path, settings, BATCH)
    assert [rank_record(two_out, r)["samples_trained"] for r in (0, 1)] == [BATCH * STEPS] * 2
    metrics = [json.loads((out / "metrics.json").read_text()) for out in (one_out, two_out)]
    assert [m["labels"] for m in metrics] == [sorted(MNLI_NAMES)] * 2  # the data's names, sorted
    assert metrics[0]["eval_samples"] == metrics[1]["eval_samples"] == 16  # gathered over both ranks
    assert metrics[0]["eval_accuracy"] == pytest.approx(metrics[1]["eval_accuracy"], abs=1e-9)
    one, two = curve(one_out), curve(two_out)
    for key in ("loss", "eval_loss"):
        assert one[key].keys() == two[key].keys() and one[key]
        for step in one[key]:
            assert one[key][step] == pytest.approx(two[key][step], rel=1e-6), (key, step, one[key], two[key])
    weights = [load_file(out / "model" / "adapter_model.safetensors") for out in (one_out, two_out)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.allclose(weights[0][name], weights[1][name], rtol=1e-5, atol=1e-6), name


@pytest.mark.slow
def test_the_evaluation_loss_is_the_whole_splits_on_two_replicas(tmp_path, tiny_bert, replicas):
    """Regression on two replicas, the last evaluation batch uneven (15 rows, 4 a batch a rank): eval_loss is still
    the MSE over the 15 rows."""
    rng = random.Random(6)
    data = write_splits(tmp_path / "data", ["sentence1", "sentence2", "label"], lambda n: stsb_rows(rng, n), (32, 15))
    settings = dict(MODEL_NAME=str(tiny_bert), DATASET_PATH=str(data), OUTPUT_DIR=str(tmp_path / "out"), TASK="stsb")
    settings |= dict(MAX_STEPS="2", PER_DEVICE_BATCH_SIZE="4", PER_DEVICE_EVAL_BATCH_SIZE="4", LEARNING_RATE=RATE)
    settings |= dict(REPORT_TO="none", RENDEZVOUS_TIMEOUT="120")
    wait_all(replicas.start("ddp", settings), logs=lambda: replicas.streams)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["eval_samples"]) == (2, 15)
    assert metrics["eval_loss"] == pytest.approx(metrics["eval_mse"], rel=1e-9), metrics


# ------------------------------------------------------------------------------- refusals and warnings
def checked_data(tmp: Path, tiny_bert: Path, env: dict[str, str]):
    """The settings a start resolves from `env`, then the data checks (`check_and_rename(load_raw(...))`)."""
    from utils.config.sources import load_settings
    from utils.training.data import DataSource, check_and_rename, load_raw

    settings, _ = load_settings([], {"MODEL_NAME": str(tiny_bert), "OUTPUT_DIR": str(tmp / "out"), **env})
    return check_and_rename(load_raw(settings.select(DataSource)), settings.select(DataSource))


HUB_CONFIGS = [
    ({"DATASET_CONFIG": "mnli_matched"}, ["DATASET_CONFIG=mnli_matched", "nyu-mll/glue"]),
    ({"TASK": "mnli", "DATASET_CONFIG": "qnli"}, ["TASK=mnli", "DATASET_CONFIG=mnli", "qnli"]),
]


@pytest.mark.parametrize("env, names", HUB_CONFIGS)
def test_a_hub_config_the_task_cannot_train_is_refused_at_dry_run(env, names, tmp_path):
    """From the Hub (no DATASET_PATH): refused before any download (other task refusals: tests/test_refusals.py)."""
    result = run_main(base_env(tmp_path, **env), "--dry-run")
    assert_refusal(result, names)


def test_dry_run_shows_the_resolved_task(tmp_path):
    shown = succeeded(run_main(base_env(tmp_path, TASK="stsb"), "--dry-run"))
    task = shown.json()["task"]
    assert task["text_columns"] == ["sentence1", "sentence2"] and task["problem_type"] == "regression"
    assert task["metrics"] == ["pearson", "spearman", "mse"] and task["metric_for_best_model"] == "pearson"
    assert shown.json()["config"]["dataset_config"] == "stsb"
    names = run_main(base_env(tmp_path, LABEL_NAMES='["low", "mid", "high"]'), "--dry-run").json()
    assert names["config"]["label_names"] == names["task"]["label_names"] == ["low", "mid", "high"]


@pytest.mark.check
def test_labels_from_the_data(tmp_path, tiny_bert, caplog):
    """N classes from a text label column (sorted), digit strings as ids, LABEL_NAMES' order, and the warning for a
    second text column no setting names."""
    import logging

    from utils.training.data import label_names_of

    data = tmp_path / "words"
    rows = [("a", "high"), ("b", "low"), ("c", "mid"), ("d", "low")]
    write_splits(data, ["sentence", "label"], lambda _: rows)
    found = checked_data(tmp_path, tiny_bert, {"DATASET_PATH": str(data)})
    assert label_names_of(found) == ("high", "low", "mid") and found["train"]["labels"] == [0, 1, 2, 1]
    named = checked_data(tmp_path, tiny_bert, {"DATASET_PATH": str(data), "LABEL_NAMES": "low,mid,high"})
    assert label_names_of(named) == ("low", "mid", "high") and named["train"]["labels"] == [2, 0, 1, 0]

    digits = tmp_path / "digits"
    lines = "".join(json.dumps({"sentence": s, "label": str(i % 2)}) + "\n" for i, s in enumerate("abcd"))
    digits.mkdir()
    (digits / "train.jsonl").write_text(lines)
    (digits / "validation.jsonl").write_text(lines)
    ids = checked_data(tmp_path, tiny_bert, {"DATASET_PATH": str(digits)})
    assert ids["train"]["labels"] == [0, 1, 0, 1] and label_names_of(ids) == ("negative", "positive")

    pairs = write_mnli(tmp_path / "pairs", train=12, validation=6, splits=("validation",))
    with caplog.at_level(logging.WARNING, logger="utils.training.data"):
        checked_data(tmp_path, tiny_bert, {"DATASET_PATH": str(pairs), "TEXT_COLUMN": "premise"})
    assert "another text column 'hypothesis' that no setting names" in caplog.text
    assert "set TEXT_COLUMN=premise,hypothesis" in caplog.text


# ------------------------------------------------------------------------------- predict.py
def predictions(tmp: Path, *args, stdin: str = "") -> list[dict]:
    result = succeeded(run_predict(base_env(tmp), tmp / "out" / "model", *args, stdin=stdin, cwd=tmp))
    assert "LOAD REPORT" not in result.stderr  # a base's head of another size: the adapter restores its own
    return [json.loads(line) for line in result.stdout.splitlines()]


def run_as_written(command: str, tmp: Path) -> list[dict]:
    """A documented `python predict.py` command run in `tmp` (OUTPUT_DIR: the run's); its answers."""
    result = run_command(["bash", "-c", runnable(command, tmp / "out")], env=base_env(tmp), cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOAD REPORT" not in result.stderr  # a base's head of another size: the adapter restores its own
    return [json.loads(line) for line in result.stdout.splitlines()]


def readme_predictions(tmp: Path, columns: str) -> list[dict]:
    """The README's `predict.py` command for these columns, run as written in `tmp` (OUTPUT_DIR: the run's)."""
    return run_as_written(readme_predict_command(f"--text-column {columns}"), tmp)


def card_answers(tmp: Path, inputs: list) -> list[dict]:
    """The model card's Python, run as written, then its `classifier` on `inputs`."""
    card = (tmp / "out" / "model" / "README.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", card, re.S)
    script = code + "\nimport json, sys\nprint(json.dumps(classifier(json.loads(sys.argv[1]))))"
    result = run_command([sys.executable, "-c", script, json.dumps(inputs)], env=base_env(tmp), cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_predict_labels_mnli_shaped_pairs(mnli_run):
    tmp = mnli_run[0]
    rows = list(mnli_rows(random.Random(11), 30))
    pairs = tmp / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"premise": p, "hypothesis": h}) + "\n" for p, h, _ in rows))
    predicted = readme_predictions(tmp, "premise,hypothesis")
    assert [(p["text"], p["text_pair"]) for p in predicted] == [(p, h) for p, h, _ in rows]
    assert {p["label"] for p in predicted} <= set(MNLI_NAMES)
    right = sum(p["label"] == MNLI_NAMES[label] for p, (_, _, label) in zip(predicted, rows, strict=True))
    assert right / len(rows) > 0.8, predicted


PAIR_REFUSALS = {
    "one text on stdin": ([], "the film is good\n", ["takes sentence pairs", "premise,hypothesis", "one text a row"]),
    "one column of a file": (
        ["pairs.csv", "--text-column", "premise"],
        "",
        ["takes sentence pairs", "--text-column premise"],
    ),
    "an empty second text": (
        ["pairs.csv", "--text-column", "premise,hypothesis"],
        "",
        ["pairs.csv has 1 row(s)", "empty or missing 'hypothesis'", "line 3"],
    ),
}


@pytest.mark.parametrize("args, stdin, names", PAIR_REFUSALS.values(), ids=PAIR_REFUSALS)
def test_predict_refuses_for_a_pair_model_what_training_refuses(mnli_run, args, stdin, names):
    tmp = mnli_run[0]
    (tmp / "pairs.csv").write_text("premise,hypothesis\nthe film,it is good\nthe film, \n")
    result = run_predict(base_env(tmp), tmp / "out" / "model", *args, stdin=stdin, cwd=tmp)
    assert result.stdout == ""
    assert_refusal(result, names)


def test_predict_scores_stsb_shaped_pairs(stsb_run):
    import numpy as np

    tmp = stsb_run[0]
    rows = list(stsb_rows(random.Random(12), 40))
    pairs = tmp / "pairs.tsv"
    pairs.write_text("sentence1\tsentence2\n" + "".join(f"{a}\t{b}\n" for a, b, _ in rows))
    predicted = readme_predictions(tmp, "sentence1,sentence2")
    assert all(set(p) == {"text", "text_pair", "score"} for p in predicted), predicted[:2]  # a score, no label
    scores = np.array([p["score"] for p in predicted])
    assert np.corrcoef(scores, [score for _, _, score in rows])[0, 1] > 0.5, scores
    # The card's own use of the model: its pairs, and raw scores (a sigmoid without problem_type="regression").
    card = (tmp / "out" / "model" / "README.md").read_text()
    [command] = re.findall(r"`(python predict\.py [^`]*)`", card)
    assert command.endswith("pairs.jsonl --text-column sentence1,sentence2"), command
    (tmp / "pairs.jsonl").write_text("".join(json.dumps({"sentence1": a, "sentence2": b}) + "\n" for a, b, _ in rows))
    assert run_as_written(command, tmp) == predicted
    pairs = [{"text": a, "text_pair": b} for a, b, _ in rows[:4]]
    assert [round(a["score"], 4) for a in card_answers(tmp, pairs)] == pytest.approx(scores[:4], abs=2e-4)


def test_predict_labels_cola_shaped_sentences(cola_run, tiny_bert):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tmp = cola_run[0]
    rows = list(cola_rows(random.Random(13), 10))
    predicted = predictions(tmp, stdin="".join(f"{sentence}\n" for sentence, _ in rows))
    assert [p["text"] for p in predicted] == [sentence for sentence, _ in rows]
    # The run is not right on every sentence (MCC > 0.2), so the answer predict.py must give is the adapter's own:
    # each sentence's class by name in id order, and its probability.
    base = AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=2)
    model = PeftModel.from_pretrained(base, tmp / "out" / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp / "out" / "model")
    with torch.no_grad():
        probabilities = model(**tokenizer([s for s, _ in rows], return_tensors="pt", padding=True)).logits.softmax(-1)
    expected = [["unacceptable", "acceptable"][i] for i in probabilities.argmax(-1).tolist()]
    assert [p["label"] for p in predicted] == expected
    assert [p["score"] for p in predicted] == pytest.approx(probabilities.max(-1).values.tolist(), abs=1e-4)


@pytest.mark.check
def test_the_tokenized_cache_is_keyed_on_the_text_columns(tmp_path, tiny_bert):
    """Premise alone and premise with hypothesis are other token rows: neither may load the other's cache."""
    from transformers import AutoTokenizer

    from utils.training.data import tokenize

    pairs = write_mnli(tmp_path / "pairs", train=12, validation=6, splits=("validation",))
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    lengths = {}
    for columns in ("premise", "premise,hypothesis"):
        raw = checked_data(tmp_path, tiny_bert, {"DATASET_PATH": str(pairs), "TEXT_COLUMN": columns})
        data = tokenize(raw, tokenizer, 48, tmp_path / "cache", tuple(columns.split(",")))
        lengths[columns] = [len(ids) for ids in data["train"]["input_ids"]]
    assert len(list((tmp_path / "cache").glob("tokenized-*"))) == 2
    assert [pair - 5 for pair in lengths["premise,hypothesis"]] == lengths["premise"]

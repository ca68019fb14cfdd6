"""Your own data in the shapes people have it (one file, TRAIN_FILE/VALIDATION_FILE, VALIDATION_SPLIT, MAX_*_SAMPLES),
through the real entry point: the start-up in this process (`check`), or `python main.py` for a whole run."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from tests.support.docs import assert_documented
from tests.support.env import base_env, tiny_run_env, tiny_run_settings
from tests.support.harness import start_in_process
from tests.support.outcomes import error_lines, succeeded
from tests.support.processes import run_main, run_predict
from utils.common.errors import EXIT_BAD_INPUT

COPIES, TEXTS = 3, 150  # each text three times: a carve by rows would split some texts across the two sides


def sst2_rows(sst2_dir: Path, split: str = "train") -> list[dict]:
    with open(sst2_dir / f"{split}.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def repeated_rows(folder: Path, sst2_dir: Path) -> Path:
    """train.csv of TEXTS distinct sentences, each COPIES times, the copies far apart."""
    distinct = list({row["sentence"]: row for row in sst2_rows(sst2_dir)}.values())[:TEXTS]
    folder.mkdir()
    path = folder / "train.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["sentence", "label"], extrasaction="ignore")
        writer.writeheader()
        for _ in range(COPIES):
            writer.writerows(distinct)
    return path


def started(monkeypatch, env: dict):
    start = start_in_process(monkeypatch, env)
    assert start.code is None, start.stderr[-3000:]
    return start.ready


def rows_of(dataset) -> set[tuple[int, ...]]:
    return {tuple(ids) for ids in dataset["input_ids"]}


@pytest.mark.check
def test_validation_split_keeps_every_text_on_one_side(monkeypatch, tmp_path, tiny_bert, sst2_dir):
    train = repeated_rows(tmp_path / "data", sst2_dir)
    settings = tiny_run_settings(tiny_bert, sst2_dir, tmp_path / "out", VALIDATION_SPLIT="0.05")
    env = base_env(tmp_path, **{**settings, "DATASET_PATH": str(train)})
    ready = started(monkeypatch, env)
    assert ready.train_rows + ready.validation_rows == COPIES * TEXTS
    # 5% is 22.5 rows: the whole texts reach it at 24 (8 texts of 3 rows), every copy of a text on one side
    assert (ready.validation_rows, ready.train_rows) == (24, COPIES * TEXTS - 24)
    trained, held_out = rows_of(ready.trainer.train_dataset), rows_of(ready.trainer.eval_dataset)
    assert not trained & held_out
    assert len(held_out) == 24 // COPIES

    # The same SEED carves the same rows; another carves others.
    again = started(monkeypatch, env)
    assert rows_of(again.trainer.eval_dataset) == held_out
    other = started(monkeypatch, {**env, "SEED": "7", "OUTPUT_DIR": str(tmp_path / "out-7")})
    assert rows_of(other.trainer.eval_dataset) != held_out


@pytest.mark.check
def test_max_samples_limit_the_rows_drawn_with_the_seed(monkeypatch, tmp_path, tiny_bert, sst2_dir):
    settings = tiny_run_settings(tiny_bert, sst2_dir, tmp_path / "out", MAX_TRAIN_SAMPLES="96", MAX_EVAL_SAMPLES="40")
    ready = started(monkeypatch, base_env(tmp_path, **settings))
    assert (ready.train_rows, ready.validation_rows) == (96, 40)
    # Drawn after a shuffle, not the file's head: the first 96 rows of train.csv are not the ones trained.
    whole = base_env(tmp_path, **{**settings, "OUTPUT_DIR": str(tmp_path / "out-all")})
    head = started(monkeypatch, {name: value for name, value in whole.items() if not name.startswith("MAX_")})
    assert (head.train_rows, head.validation_rows) == (2000, 101)
    first = rows_of(head.trainer.train_dataset.select(range(96)))
    assert rows_of(ready.trainer.train_dataset) != first


def test_one_file_dataset_path_with_a_validation_file_trains_on_the_limits(tmp_path, tiny_bert, sst2_dir):
    out = tmp_path / "out"
    limits = dict(VALIDATION_FILE=sst2_dir / "validation.csv", MAX_TRAIN_SAMPLES=64, MAX_EVAL_SAMPLES=50, NUM_EPOCHS=1)
    settings = tiny_run_settings(tiny_bert, sst2_dir / "train.csv", out, **limits)
    succeeded(run_main(base_env(tmp_path, **settings)))
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["eval_samples"], metrics["data"]["train_rows"]) == (50, 64)
    assert json.loads((out / "logs" / "rank-0.json").read_text())["samples_trained"] == 64  # 4 steps of 16


def test_train_file_and_validation_file_of_two_formats_train(tmp_path, tiny_bert, sst2_dir):
    validation = tmp_path / "held-out.jsonl"
    rows = sst2_rows(sst2_dir, "validation")
    validation.write_text(
        "".join(json.dumps({"sentence": r["sentence"], "label": int(r["label"])}) + "\n" for r in rows)
    )
    out = tmp_path / "out"
    settings = tiny_run_settings(tiny_bert, sst2_dir, out, MAX_STEPS=2)
    del settings["DATASET_PATH"]
    env = base_env(tmp_path, **settings, TRAIN_FILE=str(sst2_dir / "train.csv"), VALIDATION_FILE=str(validation))
    succeeded(run_main(env))
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["eval_samples"], metrics["data"]["train_rows"]) == (len(rows), 2000)


def test_a_carved_run_is_one_run_only_with_its_own_fraction(tmp_path, tiny_bert, sst2_dir):
    """VALIDATION_SPLIT trains and is part of the run's identity: another fraction on the folder is refused."""
    train = repeated_rows(tmp_path / "data", sst2_dir)
    out = tmp_path / "out"
    settings = tiny_run_settings(tiny_bert, sst2_dir, out, NUM_EPOCHS=1, VALIDATION_SPLIT="0.05")
    del settings["DATASET_PATH"]
    env = base_env(tmp_path, **settings, TRAIN_FILE=str(train))
    succeeded(run_main(env))
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["eval_samples"], metrics["data"]["train_rows"]) == (24, COPIES * TEXTS - 24)

    for args in (("--dry-run",), ()):
        refused = run_main({**env, "VALIDATION_SPLIT": "0.1"}, *args, timeout=120)
        assert refused.code == EXIT_BAD_INPUT, refused.stderr[-3000:]
        [line] = error_lines(refused.stderr)
        assert "VALIDATION_SPLIT: 0.05 -> 0.1" in line, line


def both_sources(tmp: Path, sst2_dir: Path) -> tuple[dict, str]:
    return {"TRAIN_FILE": str(sst2_dir / "train.csv")}, (
        f"error: DATASET_PATH={sst2_dir} and TRAIN_FILE={sst2_dir / 'train.csv'} both name the training rows; "
        "unset one: DATASET_PATH for a folder (or one file), TRAIN_FILE (with VALIDATION_FILE) for files"
    )


def split_beside_a_file(tmp: Path, sst2_dir: Path) -> tuple[dict, str]:
    file = {"DATASET_PATH": str(sst2_dir / "train.csv"), "VALIDATION_FILE": str(sst2_dir / "validation.csv")}
    return {**file, "VALIDATION_SPLIT": "0.1"}, (
        f"error: VALIDATION_SPLIT=0.1 carves validation rows out of the training rows, and "
        f"VALIDATION_FILE={sst2_dir / 'validation.csv'} gives them; unset one of them"
    )


def split_beside_a_folders_validation(tmp: Path, sst2_dir: Path) -> tuple[dict, str]:
    return {"VALIDATION_SPLIT": "0.1"}, (
        f"error: VALIDATION_SPLIT=0.1 carves validation rows out of the training rows, and DATASET_PATH={sst2_dir} "
        "holds validation rows already; unset VALIDATION_SPLIT, or remove the validation rows"
    )


def missing_validation_file(tmp: Path, sst2_dir: Path) -> tuple[dict, str]:
    path = tmp / "no-such.csv"
    return {"DATASET_PATH": str(sst2_dir / "train.csv"), "VALIDATION_FILE": str(path)}, (
        f"error: VALIDATION_FILE={path} does not exist; point it at the validation rows' file"
    )


def validation_file_without_the_column(tmp: Path, sst2_dir: Path) -> tuple[dict, str]:
    path = tmp / "other.csv"
    path.write_text("review,label\ngood,1\n")
    return {"DATASET_PATH": str(sst2_dir / "train.csv"), "VALIDATION_FILE": str(path)}, (
        "error: the validation split has no column 'sentence' (columns: ['review', 'label']); set TEXT_COLUMN to the "
        "right one (TEXT_COLUMN=first,second names a sentence pair)"
    )


def missing_test_file(tmp: Path, sst2_dir: Path) -> tuple[dict, str]:
    path = tmp / "no-such.csv"
    return {"TEST_FILE": str(path)}, f"error: TEST_FILE={path} does not exist; point it at the test rows' file"


def a_test_file_without_the_column(tmp: Path, sst2_dir: Path) -> tuple[dict, str]:
    path = tmp / "test.csv"
    path.write_text("idx,review\n0,good\n")
    return {"TEST_FILE": str(path)}, (
        f"error: the test split ({path}) has no column 'sentence' (columns: ['idx', 'review']); give it the text "
        "column(s) the run trains on (sentence), or move it away to train without answering it"
    )


def a_test_file_beside_a_folders_test(tmp: Path, sst2_dir: Path) -> tuple[dict, str]:
    data = tmp / "data"
    shutil.copytree(sst2_dir, data)
    shutil.copy(sst2_dir / "validation.csv", data / "test.csv")
    return {"DATASET_PATH": str(data), "TEST_FILE": str(sst2_dir / "validation.csv")}, (
        f"error: TEST_FILE={sst2_dir / 'validation.csv'} and DATASET_PATH={data}'s test.csv both name the test rows; "
        "unset TEST_FILE to answer test.csv, or move test.csv out of the folder"
    )


REFUSALS = {
    "dataset-path-and-train-file": both_sources,
    "validation-split-and-file": split_beside_a_file,
    "validation-split-and-folder-validation": split_beside_a_folders_validation,
    "validation-file-missing": missing_validation_file,
    "validation-file-column-wrong": validation_file_without_the_column,
    "test-file-missing": missing_test_file,
    "test-file-column-wrong": a_test_file_without_the_column,
    "test-file-and-folder-test": a_test_file_beside_a_folders_test,
}

# The line of the "a test split that cannot be answered" row (docs/reliability.md) that each case prints.
TEST_SPLIT_LINES = {"test-file-column-wrong": 0, "test-file-missing": 1, "test-file-and-folder-test": 2}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_dry_run_and_the_run_refuse_a_data_shape_with_one_line(case, tmp_path, tiny_bert, sst2_dir):
    extra, line = REFUSALS[case](tmp_path, sst2_dir)
    env = {**tiny_run_env(tmp_path, tiny_bert, sst2_dir), **extra}
    for args in (("--dry-run",), ()):
        result = run_main(env, *args, timeout=180)
        assert result.code == EXIT_BAD_INPUT, result.stderr[-3000:]
        assert error_lines(result.stderr) == [line] and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "out" / "run.json").exists()  # a refused start leaves the folder reusable
    if case in TEST_SPLIT_LINES:  # the row docs/reliability.md shows for a test split, this case its line N
        assert_documented("a test split that cannot be answered", line.removeprefix("error: "), TEST_SPLIT_LINES[case])


# ------------------------------------------------------------------------------- the test split
def prediction_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_test_split_is_answered_once_trained_as_predict_answers_it(tmp_path, tiny_bert, sst2_dir):
    """test.csv beside train and validation: --dry-run names it; rank 0 answers it once model/ is saved (a line a
    row, other columns carried, its labels' metrics), as predict.py does; a restart leaves the answers."""
    data = tmp_path / "data"
    shutil.copytree(sst2_dir, data)
    rows = sst2_rows(sst2_dir, "validation")[:30]
    with open(data / "test.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["idx", "label", "sentence"])
        writer.writeheader()
        writer.writerows(rows)
    out = tmp_path / "out"
    env = base_env(tmp_path, **tiny_run_settings(tiny_bert, data, out, MAX_STEPS=4))
    dry = run_main(env, "--dry-run", timeout=120)
    assert dry.code == 0 and dry.json()["test_split"] == str(data / "test.csv"), dry.stderr[-3000:]
    succeeded(run_main(env))
    lines = prediction_lines(out / "predictions" / "predictions.jsonl")
    carried = [(line["text"], line["idx"], line["input_label"]) for line in lines]
    assert carried == [(row["sentence"], row["idx"], row["label"]) for row in rows]
    assert all(line["label"] in ("negative", "positive") and 0.5 <= line["score"] <= 1 for line in lines), lines
    metrics = json.loads((out / "predictions" / "metrics.json").read_text())
    right = sum(line["label"] == ("negative", "positive")[int(line["input_label"])] for line in lines)
    assert (metrics["samples"], metrics["accuracy"]) == (len(rows), round(right / len(rows), 4)), metrics
    assert metrics["file"] == str(data / "test.csv")

    served = succeeded(run_predict(base_env(tmp_path), out / "model", data / "test.csv", cwd=tmp_path))
    assert [json.loads(line) for line in served.stdout.splitlines()] == lines

    written = (out / "predictions" / "predictions.jsonl").stat().st_mtime_ns
    again = run_main(env)
    assert again.code == 0 and "already holds the answers to the test split" in again.stderr, again.stderr[-3000:]
    assert (out / "predictions" / "predictions.jsonl").stat().st_mtime_ns == written


def test_a_test_file_given_to_a_finished_run_is_answered_without_metrics_when_unlabelled(
    tmp_path, tiny_bert, sst2_dir
):
    """No test split, no predictions/; TEST_FILE of -1 labels given to the finished run: answered, no metrics."""
    out = tmp_path / "out"
    env = base_env(tmp_path, **tiny_run_settings(tiny_bert, sst2_dir, out, MAX_STEPS=2))
    first = run_main(env)
    assert first.code == 0 and not (out / "predictions").exists(), first.stderr[-3000:]
    test = tmp_path / "test.jsonl"
    texts = [row["sentence"] for row in sst2_rows(sst2_dir, "validation")[:5]]
    test.write_text("".join(json.dumps({"idx": i, "sentence": t, "label": -1}) + "\n" for i, t in enumerate(texts)))
    again = succeeded(run_main({**env, "TEST_FILE": str(test)}))
    lines = prediction_lines(out / "predictions" / "predictions.jsonl")
    assert [(line["idx"], line["text"], line["input_label"]) for line in lines] == [
        (i, t, -1) for i, t in enumerate(texts)
    ]
    assert not (out / "predictions" / "metrics.json").exists()
    assert "(no labels: no metrics)" in again.stderr


def test_a_bad_test_row_is_refused_before_training(tmp_path, tiny_bert, sst2_dir):
    """A test row without text is refused at the start, in training's words, not after the run's hours."""
    test = tmp_path / "test.csv"
    test.write_text("sentence,label\na wonderful film,1\n ,0\n")
    out = tmp_path / "out"
    env = base_env(tmp_path, **tiny_run_settings(tiny_bert, sst2_dir, out), TEST_FILE=str(test))
    result = run_main(env)
    assert result.code == EXIT_BAD_INPUT, result.stderr[-3000:]
    assert error_lines(result.stderr) == [
        f"error: {test} has 1 row(s) with an empty or missing 'sentence' (the first is line 3); a row without text "
        "would be read as nothing at all: fill in or remove those rows"
    ]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert not (out / "run.json").exists()

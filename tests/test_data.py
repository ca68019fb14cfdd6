"""The data path: a DatasetDict shaped exactly like GLUE sst2 (what a Hub load returns), every local
file format, the tokenized cache, and the checks on columns, splits and labels. The in-process tests take
seconds each and are part of `make check`; the rest run the real `main.py`: labels mapped by the names the
data gives them, and every row of a file trained or refused (ambiguous data is exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from tests.conftest import (
    assert_refused_as_bad_input,
    error_lines,
    job_settings,
    push_settings,
    rank_record,
    run_main,
)
from utils.data import load_sst2
from utils.errors import JobError
from utils.model import load_tokenizer
from utils.settings import Settings

GLUE_FEATURES = Features(
    {"sentence": Value("string"), "label": ClassLabel(names=["negative", "positive"]), "idx": Value("int32")}
)


def glue_like(rows: int, labelled: bool = True) -> Dataset:
    sentences = [("a wonderful film " if i % 2 else "a dull film ") + "x" * (i % 7) for i in range(rows)]
    labels = [i % 2 if labelled else -1 for i in range(rows)]
    features = GLUE_FEATURES if labelled else Features({**GLUE_FEATURES, "label": Value("int64")})
    return Dataset.from_dict({"sentence": sentences, "label": labels, "idx": list(range(rows))}, features=features)


@pytest.fixture
def tokenizer(tiny_bert):
    return load_tokenizer(Settings(model_name=str(tiny_bert)))


def settings_for(path, **extra) -> Settings:
    return Settings(dataset_path=str(path), max_seq_length=16, **extra)


@pytest.mark.check
def test_glue_shaped_save_to_disk_takes_the_hub_code_path(tmp_path, tokenizer):
    # train/validation/test with GLUE's columns; the test split is unlabelled (-1) and must be ignored.
    DatasetDict(
        {"train": glue_like(40), "validation": glue_like(9), "test": glue_like(5, labelled=False)}
    ).save_to_disk(tmp_path / "glue")
    data = load_sst2(settings_for(tmp_path / "glue"), tokenizer, tmp_path / "cache")
    assert set(data) == {"train", "validation"}
    assert len(data["train"]) == 40 and len(data["validation"]) == 9
    assert {"input_ids", "attention_mask", "labels"} <= set(data["train"].column_names)
    assert "sentence" not in data["train"].column_names and "idx" not in data["train"].column_names
    assert data["validation"]["labels"] == [i % 2 for i in range(9)]  # order kept
    lengths = {len(ids) for ids in data["train"]["input_ids"]}
    assert len(lengths) > 1 and max(lengths) <= 16  # truncated, not padded: the collator pads per batch


@pytest.mark.check
@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".json", ".jsonl", ".parquet"])
def test_every_local_format_loads_the_same_rows(tmp_path, tokenizer, suffix):
    folder = tmp_path / "files"
    folder.mkdir()
    for split, rows in (("train", 30), ("validation", 7)):
        frame = glue_like(rows).to_pandas()
        path = folder / f"{split}{suffix}"
        if suffix == ".parquet":
            frame.to_parquet(path)
        elif suffix in (".json", ".jsonl"):
            frame.to_json(path, orient="records", lines=True)
        else:
            frame.to_csv(path, index=False, sep="\t" if suffix == ".tsv" else ",")
    data = load_sst2(settings_for(folder), tokenizer, tmp_path / "cache")
    assert (len(data["train"]), len(data["validation"])) == (30, 7)
    assert data["train"]["labels"][:4] == [0, 1, 0, 1]


@pytest.mark.check
def test_tokenized_cache_is_reused_and_keyed_on_max_length(tmp_path, tokenizer, sst2_dir):
    cache = tmp_path / "cache"
    load_sst2(settings_for(sst2_dir), tokenizer, cache)
    load_sst2(settings_for(sst2_dir), tokenizer, cache)
    assert len(list(cache.glob("tokenized-*"))) == 1  # the second call loaded it
    load_sst2(Settings(dataset_path=str(sst2_dir), max_seq_length=32), tokenizer, cache)
    assert len(list(cache.glob("tokenized-*"))) == 2
    assert not list(cache.glob("*.partial"))


@pytest.mark.check
def test_custom_column_names(tmp_path, tokenizer):
    folder = tmp_path / "custom"
    folder.mkdir()
    for split in ("train", "validation"):
        pd.DataFrame({"review": ["good", "bad", "great"], "stars": [1, 0, 1]}).to_csv(
            folder / f"{split}.csv", index=False
        )
    data = load_sst2(settings_for(folder, text_column="review", label_column="stars"), tokenizer, tmp_path / "cache")
    assert data["train"]["labels"] == [1, 0, 1]


def write_split_files(folder, train: pd.DataFrame, validation: pd.DataFrame | None):
    folder.mkdir(exist_ok=True)
    train.to_csv(folder / "train.csv", index=False)
    if validation is not None:
        validation.to_csv(folder / "validation.csv", index=False)
    return folder


GOOD = pd.DataFrame({"sentence": ["good", "bad"], "label": [1, 0]})
CASES = {
    "missing validation split": (GOOD, None, "no 'validation' split"),
    "missing text column": (
        pd.DataFrame({"text": ["a"], "label": [1]}),
        pd.DataFrame({"text": ["b"], "label": [0]}),
        "no column 'sentence'",
    ),
    "splits with other columns": (pd.DataFrame({"text": ["a"], "label": [1]}), GOOD, "need the same columns"),
    "labels outside 0/1": (pd.DataFrame({"sentence": ["a", "b"], "label": [1, 2]}), GOOD, "labels [2]"),
    "unlabelled test rows": (GOOD, pd.DataFrame({"sentence": ["a"], "label": [-1]}), "labels [-1]"),
    "empty split": (GOOD, pd.DataFrame({"sentence": [], "label": []}), "is empty"),
}


@pytest.mark.check
@pytest.mark.parametrize("case", CASES)
def test_bad_data_is_refused_with_the_fix(tmp_path, tokenizer, case):
    train, validation, message = CASES[case]
    folder = write_split_files(tmp_path / "bad", train, validation)
    with pytest.raises(JobError) as caught:
        load_sst2(settings_for(folder), tokenizer, tmp_path / "cache")
    assert caught.value.code == 2 and message in caught.value.message


@pytest.mark.check
def test_missing_dataset_folder(tmp_path, tokenizer):
    with pytest.raises(JobError, match="is not a folder"):
        load_sst2(settings_for(tmp_path / "nowhere"), tokenizer, tmp_path / "cache")


# ------------------------------------------------------------------------------- through main.py
def write_files(folder: Path, files: dict[str, str]) -> Path:
    """`files` (name -> text) written into a new `folder`."""
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


SIZES = (("train", 8), ("validation", 4))  # 4 steps of 2 rows: one epoch


def film_rows(rows: int) -> list[tuple[str, int]]:
    return [(("a wonderful film" if i % 2 else "a dull film") + " x" * (i % 5), i % 2) for i in range(rows)]


def delimited(rows, sep: str = ",", header: str = "sentence,label") -> str:
    return "\n".join([header.replace(",", sep), *(f"{text}{sep}{label}" for text, label in rows)]) + "\n"


def saved(folder: Path, names: list[str], label_of=lambda label: label) -> Path:
    """A save_to_disk DatasetDict whose label column is a ClassLabel named `names`; `label_of` turns the
    0 (negative) / 1 (positive) of each row into the id the data stores."""
    features = Features({"sentence": Value("string"), "label": ClassLabel(names=names)})
    columns = {
        split: {"sentence": [text for text, _ in film_rows(n)], "label": [label_of(y) for _, y in film_rows(n)]}
        for split, n in SIZES
    }
    DatasetDict({split: Dataset.from_dict(data, features=features) for split, data in columns.items()}).save_to_disk(
        folder
    )
    return folder


GOOD_CSV = delimited(film_rows(8))
JSONL_MIX = "".join(
    json.dumps({"sentence": f"film {i}", "label": label}) + "\n" for i, label in enumerate([1, "1", True])
)
# Line 3 opens a quote, line 6 closes one: read as quoted csv, lines 3-6 are one row, without a word.
STRAY_QUOTE = [
    ("a good film", 1),
    ('"a dull start', 0),
    ("more of it", 1),
    ("not much", 0),
    ('he said "fine" twice', 1),
    ("the end", 1),
]

AMBIGUOUS_DATA = {
    "classlabel-names-not-label-names": (
        lambda folder: saved(folder, ["bad", "good"]),
        (
            "a ClassLabel named ['bad', 'good'], and LABEL_NAMES is ['negative', 'positive']",
            "set LABEL_NAMES=bad,good",
        ),
    ),
    "duplicated-label-column": (
        lambda folder: write_files(
            folder, {"train.csv": "sentence,label,label\na film,1,0\n", "validation.csv": GOOD_CSV}
        ),
        ("train.csv names the column 'label' 2 times in its header", "rename or remove the extra column"),
    ),
    "duplicated-text-column": (
        lambda folder: write_files(
            folder,
            {"train.tsv": "sentence\tsentence\tlabel\na\tb\t1\n", "validation.tsv": delimited(film_rows(4), "\t")},
        ),
        ("train.tsv names the column 'sentence' 2 times in its header",),
    ),
    "stray-quote-in-csv": (
        lambda folder: write_files(folder, {"train.csv": delimited(STRAY_QUOTE), "validation.csv": GOOD_CSV}),
        ("train.csv line 3: a quoted field runs over lines 3-6", 'double a quote inside a quoted field ("")'),
    ),
    "jsonl-labels-of-three-types": (
        lambda folder: write_files(folder, {"train.jsonl": JSONL_MIX, "validation.jsonl": JSONL_MIX}),
        ("train.jsonl mixes label types in 'label': number (1), string (\"1\"), boolean (true)",),
    ),
    "two-files-for-one-split": (
        lambda folder: write_files(
            folder,
            {"train.csv": GOOD_CSV, "train.jsonl": '{"sentence": "a film", "label": 1}\n', "validation.csv": GOOD_CSV},
        ),
        ("has 2 files for the 'train' split (train.csv, train.jsonl)", "keep one and move the others out"),
    ),
}


@pytest.mark.parametrize("case", AMBIGUOUS_DATA)
def test_ambiguous_data_is_refused(case, job_env, hub, tmp_path):
    build, says = AMBIGUOUS_DATA[case]
    folder = build(tmp_path / "data")
    result = assert_refused_as_bad_input(
        {**job_env, **push_settings(hub), "DATASET_PATH": str(folder)}, [], says[0], hub
    )
    [error] = error_lines(result.stderr)
    assert all(fragment in error for fragment in says), error


def short_run(job_env: dict, data: Path, out: Path) -> dict:
    """A 4-step run on `data`; what it reports: metrics.json, rank 0's record and the console."""
    result = run_main(job_settings(job_env, DATASET_PATH=str(data), OUTPUT_DIR=str(out), PER_DEVICE_BATCH_SIZE="2"))
    assert result.code == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    return {"metrics": metrics, "checksum": rank_record(out, 0)["trainable_checksum"], "console": result.stderr}


def words(label: int) -> str:
    return [" Negative", "POSITIVE"][label]  # case and spaces differ from LABEL_NAMES: still the same names


NAMED_LABELS = {
    # the data, the same rows labelled 0/1 as LABEL_NAMES says, and what the log says about the mapping
    "classlabel-in-reverse-order": (
        lambda folder: saved(folder, ["positive", "negative"], label_of=lambda label: 1 - label),
        lambda folder: saved(folder, ["negative", "positive"]),
        "remapped by name to LABEL_NAMES ['negative', 'positive'] (positive: 0 -> 1, negative: 1 -> 0)",
    ),
    "labels-as-words": (
        lambda folder: write_files(
            folder, {f"{split}.csv": delimited((t, words(y)) for t, y in film_rows(n)) for split, n in SIZES}
        ),
        lambda folder: write_files(folder, {f"{split}.csv": delimited(film_rows(n)) for split, n in SIZES}),
        "labels are words; mapped by name to LABEL_NAMES ['negative', 'positive']",
    ),
}


@pytest.mark.parametrize("case", NAMED_LABELS)
def test_labels_are_mapped_by_the_names_the_data_gives(case, job_env, tmp_path):
    """The same sentences with the same meaning, once named in another order (or as words), once as 0/1
    in LABEL_NAMES' order: the job trains on identical data, so both runs end identical."""
    named, plain, logged = NAMED_LABELS[case]
    data = named(tmp_path / "named")
    given = sorted(data.rglob("*"))
    mapped = short_run(job_env, data, tmp_path / "out-named")
    assert sorted(data.rglob("*")) == given  # nothing written into the user's data folder
    reference = short_run(job_env, plain(tmp_path / "plain"), tmp_path / "out-plain")
    assert logged in mapped["console"]
    assert mapped["metrics"]["data"] == reference["metrics"]["data"]  # the rows, tokens and labels trained
    assert mapped["checksum"] == reference["checksum"]
    assert mapped["metrics"]["eval_accuracy"] == reference["metrics"]["eval_accuracy"]


def test_every_tsv_row_trains_quotes_and_na_included(job_env, tmp_path):
    """SST-2's TSV is unquoted text: a sentence opening with a quote is a sentence, not the start of a field
    that swallows the rows after it; `NA`, `null`, `None` and `nan` are sentences, not missing values."""
    rows = [*STRAY_QUOTE, ("NA", 0), ("null", 1), ("None", 0), ("nan", 1), ("n/a", 0)]
    tsv = delimited(rows, "\t")
    folder = write_files(tmp_path / "data", {"train.tsv": tsv, "validation.tsv": delimited(film_rows(4), "\t")})
    run = short_run(job_env, folder, tmp_path / "out")
    records = len(tsv.splitlines()) - 1  # one row a line after the header
    assert run["metrics"]["data"]["train_rows"] == records == len(rows)

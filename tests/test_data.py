"""The data path: a DatasetDict shaped exactly like GLUE sst2 (what a Hub load returns), every local
file format, the tokenized cache, and the checks on columns, splits and labels."""

from __future__ import annotations

import pandas as pd
import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from utils.data import load_sst2
from utils.errors import JobError
from utils.model import load_tokenizer
from utils.settings import Settings

pytestmark = pytest.mark.check  # in-process and seconds each: part of `make check`

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


def test_tokenized_cache_is_reused_and_keyed_on_max_length(tmp_path, tokenizer, sst2_dir):
    cache = tmp_path / "cache"
    load_sst2(settings_for(sst2_dir), tokenizer, cache)
    load_sst2(settings_for(sst2_dir), tokenizer, cache)
    assert len(list(cache.glob("tokenized-*"))) == 1  # the second call loaded it
    load_sst2(Settings(dataset_path=str(sst2_dir), max_seq_length=32), tokenizer, cache)
    assert len(list(cache.glob("tokenized-*"))) == 2
    assert not list(cache.glob("*.partial"))


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


@pytest.mark.parametrize("case", CASES)
def test_bad_data_is_refused_with_the_fix(tmp_path, tokenizer, case):
    train, validation, message = CASES[case]
    folder = write_split_files(tmp_path / "bad", train, validation)
    with pytest.raises(JobError) as caught:
        load_sst2(settings_for(folder), tokenizer, tmp_path / "cache")
    assert caught.value.code == 2 and message in caught.value.message


def test_missing_dataset_folder(tmp_path, tokenizer):
    with pytest.raises(JobError, match="is not a folder"):
        load_sst2(settings_for(tmp_path / "nowhere"), tokenizer, tmp_path / "cache")

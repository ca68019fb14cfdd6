"""The data path through `load_sst2` in this process: GLUE-shaped and every local format, the tokenized cache, labels
mapped by name, every row of a file trained; what the Trainer is given is checked whole (refusals: test_refusals)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pandas as pd
import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from tests.support.data import SPLIT_SIZES, STRAY_QUOTE, delimited, film_rows, saved_dataset, write_files
from utils.config.settings import Settings
from utils.training.data import DataSource, load_sst2
from utils.training.model import load_tokenizer

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
    return load_tokenizer(str(tiny_bert), max_seq_length=128, lora_r=8)


def source_for(path, **extra) -> DataSource:
    return Settings(dataset_path=str(path), max_seq_length=16, **extra).select(DataSource)


def plain_films(folder: Path) -> Path:
    """SPLIT_SIZES' `film_rows` as train.csv and validation.csv, labelled 0/1: what other forms must load as."""
    return write_files(folder, {f"{split}.csv": delimited(film_rows(n)) for split, n in SPLIT_SIZES})


@pytest.mark.check
def test_glue_shaped_save_to_disk_takes_the_hub_code_path(tmp_path, tokenizer):
    # train/validation/test with GLUE's columns; the test split is unlabelled (-1) and must be ignored.
    splits = {"train": glue_like(40), "validation": glue_like(9), "test": glue_like(5, labelled=False)}
    DatasetDict(splits).save_to_disk(tmp_path / "glue")
    data = load_sst2(source_for(tmp_path / "glue"), tokenizer, tmp_path / "cache")
    assert set(data) == {"train", "validation"}
    assert len(data["train"]) == 40 and len(data["validation"]) == 9
    assert {"input_ids", "attention_mask", "labels"} <= set(data["train"].column_names)
    assert "sentence" not in data["train"].column_names and "idx" not in data["train"].column_names
    assert data["validation"]["labels"] == [i % 2 for i in range(9)]  # order kept
    lengths = {len(ids) for ids in data["train"]["input_ids"]}
    assert len(lengths) > 1 and max(lengths) <= 16  # truncated, not padded: the collator pads per batch


@pytest.mark.check
# A suffix says the format whatever its case (train.CSV from a spreadsheet export), as it does for predict.py.
@pytest.mark.parametrize(
    "suffix", [".csv", ".tsv", ".json", ".jsonl", ".parquet", ".CSV", ".Tsv", ".JSONL", ".Parquet"]
)
def test_every_local_format_loads_the_same_rows(tmp_path, tokenizer, suffix):
    folder = tmp_path / "files"
    folder.mkdir()
    for split, rows in (("train", 30), ("validation", 7)):
        frame = glue_like(rows).to_pandas()
        path = folder / f"{split}{suffix}"
        fmt = suffix.lower()
        if fmt == ".parquet":
            frame.to_parquet(path)
        elif fmt in (".json", ".jsonl"):
            frame.to_json(path, orient="records", lines=True)
        else:
            frame.to_csv(path, index=False, sep="\t" if fmt == ".tsv" else ",")
    data = load_sst2(source_for(folder), tokenizer, tmp_path / "cache")
    assert (len(data["train"]), len(data["validation"])) == (30, 7)
    assert data["train"]["labels"][:4] == [0, 1, 0, 1]


@pytest.mark.check
def test_tokenized_cache_is_reused_and_keyed_on_max_length(tmp_path, tokenizer, sst2_dir):
    cache = tmp_path / "cache"
    load_sst2(source_for(sst2_dir), tokenizer, cache)
    load_sst2(source_for(sst2_dir), tokenizer, cache)
    assert len(list(cache.glob("tokenized-*"))) == 1  # the second call loaded it
    load_sst2(Settings(dataset_path=str(sst2_dir), max_seq_length=32).select(DataSource), tokenizer, cache)
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
    data = load_sst2(source_for(folder, text_column="review", label_column="stars"), tokenizer, tmp_path / "cache")
    assert data["train"]["labels"] == [1, 0, 1]


def arrow_table(dataset):
    """What the Trainer is given of a split, whole: every column, its type and every row."""
    return dataset.with_format("arrow")[:].combine_chunks()


def identical(data, reference) -> bool:
    return set(data) == set(reference) and all(arrow_table(data[s]).equals(arrow_table(reference[s])) for s in data)


def assert_film_rows(data, tokenizer) -> None:
    """The splits hold SPLIT_SIZES' `film_rows` in order (two loads alike could both be empty or wrong)."""
    for split, count in SPLIT_SIZES:
        rows = film_rows(count)
        assert list(data[split]["labels"]) == [label for _, label in rows], split
        tokens = [list(ids) for ids in data[split]["input_ids"]]
        assert tokens == [tokenizer(text)["input_ids"] for text, _ in rows], split


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(path): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def words(label: int) -> str:
    return [" Negative", "POSITIVE"][label]  # case and spaces differ from LABEL_NAMES: still the same names


NAMED_LABELS = {
    # the data, the same rows labelled 0/1 as LABEL_NAMES says, and what the log says about the mapping
    "classlabel-in-reverse-order": (
        lambda folder: saved_dataset(folder, ["positive", "negative"], label_of=lambda label: 1 - label),
        lambda folder: saved_dataset(folder, ["negative", "positive"]),
        "remapped by name to LABEL_NAMES ['negative', 'positive'] (positive: 0 -> 1, negative: 1 -> 0)",
    ),
    "labels-as-words": (
        lambda folder: write_files(
            folder, {f"{s}.csv": delimited((t, words(y)) for t, y in film_rows(n)) for s, n in SPLIT_SIZES}
        ),
        plain_films,
        "labels are words; mapped by name to LABEL_NAMES ['negative', 'positive']",
    ),
}


@pytest.mark.check
@pytest.mark.parametrize("case", NAMED_LABELS)
def test_labels_are_mapped_by_the_names_the_data_gives(case, tmp_path, tokenizer, caplog):
    """The same rows named in another order (or as words), and as 0/1 in LABEL_NAMES' order: identical tables."""
    named, plain, logged = NAMED_LABELS[case]
    data = named(tmp_path / "named")
    given = files_of(data)
    with caplog.at_level(logging.INFO, logger="utils.training.data"):
        mapped = load_sst2(source_for(data), tokenizer, tmp_path / "cache-named")
    assert files_of(data) == given  # nothing written into the user's data folder
    assert logged in caplog.text
    reference = load_sst2(source_for(plain(tmp_path / "plain")), tokenizer, tmp_path / "cache-plain")
    assert mapped["train"]["labels"] == [label for _, label in film_rows(8)]
    assert identical(mapped, reference)


@pytest.mark.check
def test_a_mix_of_label_types_is_mapped_where_the_settings_say_what_the_labels_are(tmp_path, tokenizer):
    """Names in one split and ids in the other train once LABEL_NAMES says which id each name is; class labels
    train as scores under PROBLEM_TYPE=regression."""
    rows = film_rows(8)
    mixed = write_files(
        tmp_path / "mixed", {"train.csv": delimited((t, words(y)) for t, y in rows), "validation.csv": delimited(rows)}
    )
    data = load_sst2(source_for(mixed, label_names=("negative", "positive")), tokenizer, tmp_path / "cache")
    assert data["train"]["labels"] == data["validation"]["labels"] == [label for _, label in rows]
    classes = saved_dataset(tmp_path / "classes", ["negative", "positive"])
    scores = load_sst2(source_for(classes, problem_type="regression"), tokenizer, tmp_path / "cache")
    assert scores["train"].features["labels"] == Value("float32")
    assert scores["train"]["labels"] == [float(label) for _, label in rows]


@pytest.mark.check
def test_every_tsv_row_trains_quotes_and_na_included(tmp_path, tokenizer):
    """SST-2's TSV is unquoted: a sentence opening with a quote is a sentence; `NA`, `null`, `None`, `nan` too."""
    rows = [*STRAY_QUOTE, ("NA", 0), ("null", 1), ("None", 0), ("nan", 1), ("n/a", 0)]
    tsv = delimited(rows, "\t")
    folder = write_files(tmp_path / "data", {"train.tsv": tsv, "validation.tsv": delimited(film_rows(4), "\t")})
    data = load_sst2(source_for(folder), tokenizer, tmp_path / "cache")
    assert len(data["train"]) == len(tsv.splitlines()) - 1 == len(rows)  # one row a line after the header
    assert data["train"]["labels"] == [label for _, label in rows]
    ids = [tokenizer(text, truncation=True, max_length=16)["input_ids"] for text, _ in rows]
    assert data["train"]["input_ids"] == ids  # each sentence as written, the quotes in it


@pytest.mark.check
def test_float_and_boolean_labels_are_0_and_1(tmp_path, tokenizer):
    """0.0/1.0 (a csv label column with a blank filled in, a pandas export) and true/false are the two classes."""
    rows = film_rows(8)
    train = delimited((text, f"{label:.1f}") for text, label in rows)
    validation = delimited((text, "true" if label else "false") for text, label in rows)
    folder = write_files(tmp_path / "data", {"train.csv": train, "validation.csv": validation})
    data = load_sst2(source_for(folder), tokenizer, tmp_path / "cache")
    labels = [label for _, label in rows]
    assert data["train"]["labels"] == data["validation"]["labels"] == labels
    assert data["train"].features["labels"].dtype == data["validation"].features["labels"].dtype == "int64"


def labelled_files(folder: Path, suffix: str, labels: list[str]) -> Path:
    """train and validation files of `film_rows` sentences with `labels` as given: bare in a csv, as written in jsonl."""
    texts = [text for text, _ in film_rows(len(labels))]
    if suffix == ".csv":
        text = delimited(zip(texts, labels, strict=True))
    else:
        text = "".join(f'{{"sentence": "{t}", "label": {y}}}\n' for t, y in zip(texts, labels, strict=True))
    return write_files(folder, {f"train{suffix}": text, f"validation{suffix}": text})


LABEL_FORMS = {
    "zero-one-floats": (["0.0", "1.0"], {}),
    "digit-and-float": (["0", "1.0"], {}),
    "scores": (["0.5", "3.25", "-1e1"], {}),
    "named-ids": (["1.0", "0.0"], {"label_names": "a,b"}),
}


@pytest.mark.check
@pytest.mark.parametrize("labels, settings", LABEL_FORMS.values(), ids=LABEL_FORMS)
def test_labels_read_the_same_from_csv_and_jsonl(labels, settings, tmp_path, tokenizer):
    """A csv's 1.0/0.0 and a jsonl file's "1.0"/"0.0" (or 1.0/0.0) are the same labels, or the same scores."""
    labels, read = labels * 4, {}
    forms = [
        ("csv", ".csv", labels),
        ("jsonl-strings", ".jsonl", [f'"{y}"' for y in labels]),
        ("jsonl-numbers", ".jsonl", labels),
    ]
    for name, suffix, written in forms:
        folder = labelled_files(tmp_path / name, suffix, written)
        data = load_sst2(source_for(folder, **settings), tokenizer, tmp_path / name / "cache")
        read[name] = (data["train"].features["labels"], data["train"]["labels"], data["validation"]["labels"])
    assert read["jsonl-strings"] == read["csv"] == read["jsonl-numbers"], read


def _truncate_arrow(cache: Path) -> str:
    arrow = next(cache.glob("train/*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size * 2 // 3])
    return "OSError: Expected to be able to read"  # Arrow finds the last record batch cut short


def _tear(name: str):
    def damage(cache: Path) -> str:
        path = next(cache.glob(f"**/{name}"))
        path.write_text(path.read_text()[: len(path.read_text()) // 2])
        return "JSONDecodeError"

    return damage


DAMAGE = [
    ("truncated-arrow", _truncate_arrow),
    ("torn-dataset-dict", _tear("dataset_dict.json")),
    ("torn-state", _tear("state.json")),
]


@pytest.mark.check
@pytest.mark.parametrize("damage", [d for _, d in DAMAGE], ids=[name for name, _ in DAMAGE])
def test_damaged_tokenized_cache_is_rebuilt_with_a_warning(damage, tmp_path, tokenizer, sst2_dir, caplog):
    source, cache_dir = source_for(sst2_dir), tmp_path / "cache"
    first = load_sst2(source, tokenizer, tmp_path / "first")
    # A copy is damaged: the splits loaded above map their own files, which must not shrink under them.
    shutil.copytree(tmp_path / "first", cache_dir)
    [cache] = list(cache_dir.glob("tokenized-*"))
    kind = damage(cache)
    with caplog.at_level(logging.WARNING, logger="utils.training.data"):
        again = load_sst2(source, tokenizer, cache_dir)
    [warning] = [record.getMessage() for record in caplog.records if "is damaged" in record.getMessage()]
    assert f"tokenized cache {cache} is damaged ({kind}" in warning and "tokenizing again" in warning
    assert identical(again, first)
    assert (cache / "dataset_dict.json").is_file()  # rebuilt under the same key: the next run loads it
    caplog.clear()
    assert identical(load_sst2(source, tokenizer, cache_dir), first) and "is damaged" not in caplog.text


def long_review(words: int) -> str:
    return " ".join(["wonderful"] * words)


@pytest.mark.check
@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_a_field_over_the_csv_modules_128_kib_limit_is_read_and_truncated(tmp_path, tokenizer, suffix):
    """A long review (200 KiB in one cell): the row count used the csv module, which stops at 128 KiB a field."""
    sep = "\t" if suffix == ".tsv" else ","
    rows = [(long_review(20_000), 1), *film_rows(3)]
    folder = write_files(
        tmp_path / "data",
        {f"train{suffix}": delimited(rows, sep), f"validation{suffix}": delimited(film_rows(4), sep)},
    )
    assert (folder / f"train{suffix}").stat().st_size > 200_000
    data = load_sst2(source_for(folder), tokenizer, tmp_path / "cache")
    assert data["train"]["labels"] == [label for _, label in rows]
    assert len(data["train"]["input_ids"][0]) == 16  # truncated to MAX_SEQ_LENGTH


def parquet_splits(folder: Path) -> Path:
    """train.parquet, and validation.parquet with a nested column of its own."""
    folder.mkdir()
    frames = {split: pd.DataFrame(film_rows(n), columns=["sentence", "label"]) for split, n in SPLIT_SIZES}
    frames["validation"]["meta"] = [{"source": "web", "score": i} for i in range(4)]
    for split, frame in frames.items():
        frame.to_parquet(folder / f"{split}.parquet")
    return folder


train_csv = "sentence,label,idx\n" + "".join(f"{t},{y},{i}\n" for i, (t, y) in enumerate(film_rows(8)))
EXTRA_COLUMNS = {
    # each split's own unused columns, other in each file: loaded together, validation was cast to train's columns
    ".csv": lambda folder: write_files(
        folder,
        {
            "train.csv": train_csv,
            "validation.csv": "sentence,label,source\n" + "".join(f"{t},{y},web\n" for t, y in film_rows(4)),
        },
    ),
    ".jsonl": lambda folder: write_files(
        folder,
        {
            "train.jsonl": "".join(f'{{"sentence": "{t}", "label": {y}}}\n' for t, y in film_rows(8)),
            "validation.jsonl": "".join(
                f'{{"sentence": "{t}", "label": {y}, "extra": [1]}}\n' for t, y in film_rows(4)
            ),
        },
    ),
    ".parquet": parquet_splits,
}


@pytest.mark.check
@pytest.mark.parametrize("suffix", EXTRA_COLUMNS)
def test_columns_the_job_does_not_use_are_ignored_in_either_split(tmp_path, tokenizer, suffix):
    folder = EXTRA_COLUMNS[suffix](tmp_path / "data")
    data = load_sst2(source_for(folder), tokenizer, tmp_path / "cache")
    reference = load_sst2(source_for(plain_films(tmp_path / "plain")), tokenizer, tmp_path / "cache-plain")
    assert identical(data, reference)
    assert_film_rows(data, tokenizer)


@pytest.mark.check
def test_a_byte_order_mark_and_crlf_line_ends_read_as_plain_utf8(tmp_path, tokenizer):
    """What Excel and Windows editors save: `\\ufeff` before the header, `\\r\\n` after every line."""
    plain = plain_films(tmp_path / "plain")
    folder = tmp_path / "windows"
    folder.mkdir()
    for split, _ in SPLIT_SIZES:
        (folder / f"{split}.csv").write_bytes(
            ("\ufeff" + (plain / f"{split}.csv").read_text().replace("\n", "\r\n")).encode()
        )
    data = load_sst2(source_for(folder), tokenizer, tmp_path / "cache")
    assert identical(data, load_sst2(source_for(plain), tokenizer, tmp_path / "cache-plain"))
    assert_film_rows(data, tokenizer)


@pytest.mark.check
def test_a_local_load_asks_the_network_nothing(tmp_path, tokenizer, monkeypatch):
    """datasets counts a download of its csv module on the Hub at each load unless told not to: on a cluster that
    sets no offline variable and reaches no network, a DNS lookup and a 3 s timeout a file (seen: 5 s a load here)."""
    import datasets.load

    asked = []

    def session():
        asked.append("network")
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets.load, "get_session", session)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # no HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set
    data = load_sst2(source_for(plain_films(tmp_path / "data")), tokenizer, tmp_path / "cache")
    assert len(data["train"]) and asked == []

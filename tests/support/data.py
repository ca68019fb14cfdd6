"""Small data sets built in a test: csv/tsv rows of the tiny model's vocabulary, a saved DatasetDict, sentences of
known token length."""

from __future__ import annotations

import csv
import random
from pathlib import Path

from scripts.make_demo_assets import FILLER, NEGATIVE, NOUNS, POSITIVE, VERBS

WORDS = 8  # every fixed-length sentence: a subject, a verb, an adjective, filler: [CLS] + 8 word tokens + [SEP]


def write_fixed_length_data(folder: Path, counts: tuple[int, int], seed: int = 1, extra_words=None) -> Path:
    """`counts` (train, validation) sentences of exactly WORDS words from the tiny model's vocabulary, labelled
    by their adjective; with `extra_words` (rng -> a count), that many filler words instead, for sentences of
    many lengths."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    for split, rows in zip(("train", "validation"), counts, strict=True):
        with open(folder / f"{split}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["sentence", "label"])
            for _ in range(rows):
                label = rng.randint(0, 1)
                words = ["the", rng.choice(NOUNS), rng.choice(VERBS), rng.choice(POSITIVE if label else NEGATIVE)]
                fill = extra_words(rng) if extra_words else WORDS - len(words)
                words += [rng.choice(FILLER + NOUNS) for _ in range(fill)]
                writer.writerow([" ".join(words), label])
    return folder


def write_files(folder: Path, files: dict[str, str]) -> Path:
    """`files` (name -> text) written into a new `folder`."""
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def film_rows(rows: int) -> list[tuple[str, int]]:
    """`rows` sentences of the tiny BERT's vocabulary, labelled 0 (a dull film) and 1 (a wonderful film) in turn."""
    return [(("a wonderful film" if i % 2 else "a dull film") + " x" * (i % 5), i % 2) for i in range(rows)]


def delimited(rows, sep: str = ",", header: str = "sentence,label") -> str:
    """A csv (or, with sep="\\t", tsv) of (sentence, label) rows, written as a user would, unquoted."""
    return "\n".join([header.replace(",", sep), *(f"{text}{sep}{label}" for text, label in rows)]) + "\n"


SPLIT_SIZES = (("train", 8), ("validation", 4))


def saved_dataset(folder: Path, names: list[str], label_of=lambda label: label) -> Path:
    """A save_to_disk DatasetDict of `film_rows` (SPLIT_SIZES) whose label column is a ClassLabel named `names`;
    `label_of` turns the 0 (negative) / 1 (positive) of each row into the id the data stores."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    features = Features({"sentence": Value("string"), "label": ClassLabel(names=names)})

    def columns(n: int) -> dict[str, list]:
        return {"sentence": [text for text, _ in film_rows(n)], "label": [label_of(y) for _, y in film_rows(n)]}

    splits = {split: Dataset.from_dict(columns(n), features=features) for split, n in SPLIT_SIZES}
    DatasetDict(splits).save_to_disk(folder)
    return folder


# Line 3 opens a quote, line 6 closes one: read as quoted csv, lines 3-6 would be one row, without a word.
STRAY_QUOTE = [("a good film", 1), ('"a dull start', 0), ("more of it", 1), ("not much", 0)]
STRAY_QUOTE += [('he said "fine" twice', 1), ("the end", 1)]

"""How a .csv or .tsv file is read, by training and predict.py alike: one dialect per suffix (SST-2's TSV is
unquoted: with quoting on, a `"` opening a sentence swallows the rows up to the next quote), the same refusals.
"""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from utils.common.errors import BadInput

# The data files DATASET_PATH's loader reads, by suffix -> the `datasets` builder: utils/training/data.py loads them, and the
# run identity digests these and no other file of the folder (a notes file beside them is not the data).
FILE_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
DIALECTS = {".csv": (",", csv.QUOTE_MINIMAL), ".tsv": ("\t", csv.QUOTE_NONE)}
# The csv module refuses a field over 128 KiB (a long review, a document); the loader reads it whole, and the
# tokenizer truncates it to MAX_SEQ_LENGTH.
FIELD_LIMIT = 2**31 - 1


def data_files(folder: Path, splits: tuple[str, ...]) -> list[Path]:
    """The entries of DATASET_PATH the loader reads for `splits` (`train.csv`, not `train.txt`), sorted."""
    return sorted(p for p in folder.iterdir() if p.stem in splits and p.suffix.lower() in FILE_FORMATS)


def read_records(lines: Iterable[str], path: Path, suffix: str) -> tuple[list[str] | None, Iterator[tuple[int, list]]]:
    """The header (None for an empty file) and each record after it with the line it starts on. Refused: a column
    named twice (the loader would train on one `label.1` silently), a record over several lines (a stray quote)."""
    csv.field_size_limit(FIELD_LIMIT)
    delimiter, quoting = DIALECTS[suffix]
    reader = csv.reader(lines, delimiter=delimiter, quoting=quoting)
    header = next(reader, None)
    if header is not None:
        repeated = [(name, times) for name, times in Counter(header).items() if times > 1]
        if repeated:
            name, times = repeated[0]
            raise BadInput(
                f"{path} names the column '{name}' {times} times in its header ({suffix[1:]}: {header}); which one holds the data is ambiguous: rename or remove the extra column",
            )

    def records() -> Iterator[tuple[int, list]]:
        end = reader.line_num
        for record in reader:
            start, end = end + 1, reader.line_num
            if end > start and record:
                raise BadInput(
                    f'{path} line {start}: a quoted field runs over lines {start}-{end}, merging {end - start + 1} lines into one row (a stray " at the start of a sentence swallows the rows up to the next quote); close the quote, double a quote inside a quoted field (""), or save the data as .tsv, which is read without quoting',
                )
            # The loader (pandas) skips a line of spaces and tabs as blank: counted here, it was refused as a quoting error.
            if record and not (len(record) == 1 and not record[0].strip(" \t")):
                yield start, record

    return header, records()

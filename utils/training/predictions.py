"""Answers for a file of inputs, as predict.py prints them and as the job writes its test split's
(OUTPUT_DIR/predictions/): the same functions for both, so either way gives the same lines. `read_inputs` reads
as training reads DATASET_PATH; `answer_rows` gives one row per input row, other columns carried through;
`score_answers` scores the labelled rows with the job's metrics. Imports nothing heavy until it scores.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from utils.common.delimited import DIALECTS, read_records
from utils.common.errors import BadInput, first_line
from utils.common.texts import NUL, check_texts, nul_refusal
from utils.config.tasks import CLASSIFICATION, METRIC_MODULES, MULTI_LABEL, REGRESSION

# The input is read whole: 256 MiB is millions of sentences, and `/dev/zero` stops there, not at a MemoryError.
MAX_INPUT_BYTES = 256 * 2**20
JSON_SUFFIXES = (".json", ".jsonl")
TABLE_SUFFIXES = (*DIALECTS, *JSON_SUFFIXES, ".parquet")
FORMATS = "a .csv, .tsv, .json, .jsonl or .parquet file"
ANSWER_KEYS = ("text", "text_pair", "label", "score", "labels", "scores")  # an input column so named is renamed
UNLABELLED = -1  # GLUE's test splits label every row -1: no label
DEFAULT_THRESHOLD = 0.5  # a logit of 0: for a multi-label model that records no THRESHOLD
PREDICTIONS_FILE = "predictions.jsonl"  # under OUTPUT_DIR/predictions/, beside metrics.json when labelled


@dataclass
class Inputs:
    """What `read_inputs` read: the texts as the pipeline takes them, each row's other columns, the labels (None:
    no label column) and where each row is."""

    texts: list = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    labels: list | None = None
    places: list[str] = field(default_factory=list)
    source: str = "standard input"


def is_table(file: Path | None) -> bool:
    return file is not None and file.suffix.lower() in TABLE_SUFFIXES


def read_inputs(file: Path | None, columns: list[str] | None = None, label_column: str | None = None) -> Inputs:
    """The rows of `file` (None: standard input): `columns` of a table file's records, with `label_column`'s values;
    else one sentence per non-blank line."""
    if file is None:
        if sys.stdin is None:  # started with standard input closed: nothing to classify
            return Inputs()
        if sys.stdin.isatty():
            print("reading sentences from standard input, one per line (Ctrl-D ends)", file=sys.stderr)
        return read_lines(decode_text(read_bounded(sys.stdin.buffer, "standard input"), "standard input"), None)
    data = read_file(file)
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        rows = parquet_rows(data, file)
    else:
        text = decode_text(data, str(file))
        if not is_table(file):
            return read_lines(text, file)
        rows = delimited_rows(text, file, suffix, columns) if suffix in DIALECTS else json_rows(text, file)
    return table_inputs(rows, file, columns or ["sentence"], label_column)


def read_lines(text: str, file: Path | None) -> Inputs:
    """One sentence per non-blank line, split on `\n` only: `str.splitlines` also splits on characters a sentence
    may hold (form feed, U+2028)."""
    source = str(file) if file else "standard input"
    lines = [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), start=1)]
    kept = [(n, line) for n, line in lines if line.strip()]  # blank lines are no rows (utils/common/texts.py)
    places = [f"line {n}" for n, _ in kept]
    texts = [line for _, line in kept]
    check_texts(texts, "text", source, places.__getitem__)
    return Inputs(texts, [{} for _ in texts], None, places, source)


def table_inputs(rows: list[tuple[str, object]], file: Path, columns: list[str], label_column: str | None) -> Inputs:
    places = [place for place, _ in rows]
    objects = [record for _, record in rows if isinstance(record, dict)]
    values = []
    for column in columns:
        if objects and not any(column in record for record in objects):  # a column no row has: name the right one
            names = list(dict.fromkeys(name for record in objects for name in record))
            raise BadInput(
                f"{file} has no column '{column}' (its columns: {names[:20]}); name the text column with --text-column",
            )
        column_values = []
        for place, record in rows:
            value = record.get(column) if isinstance(record, dict) else record  # a string in a JSON array is the text
            if value is not None and not isinstance(value, str):
                found = (
                    f"'{column}' is {json.dumps(value, default=str)[:60]}"
                    if isinstance(record, dict)
                    else "it is no object"
                )
                raise BadInput(
                    f"{file} {place} has no text in '{column}' ({found}); give each row a '{column}' string, "
                    "or name the text column with --text-column",
                )
            column_values.append(value)
        check_texts(column_values, column, str(file), places.__getitem__)
        values.append(column_values)
    texts = values[0] if len(values) == 1 else [{"text": a, "text_pair": b} for a, b in zip(*values, strict=True)]
    records = [
        {name: value for name, value in record.items() if name not in columns} if isinstance(record, dict) else {}
        for _, record in rows
    ]
    labelled = label_column is not None and any(isinstance(r, dict) and label_column in r for _, r in rows)
    labels = [record.get(label_column) for record in records] if labelled else None
    return Inputs(texts, records, labels, places, str(file))


def delimited_rows(text: str, file: Path, suffix: str, columns: list[str] | None) -> list[tuple[str, dict]]:
    """Each record of a .csv or .tsv as a dict by its header, read and refused as training reads it."""
    header, records = read_records(io.StringIO(text, newline=""), file, suffix)
    if header is None:
        return []
    if NUL in "".join(header):  # UTF-16 without a byte-order mark: every character of the header is followed by one
        raise nul_refusal(str(file), "a NUL character in its header (line 1)")
    for column in columns or ["sentence"]:
        if column not in header:
            raise BadInput(
                f"{file} has no column '{column}' (its header: {header}); name the text column with --text-column",
            )
    needed = max(header.index(column) for column in columns or ["sentence"])
    rows = []
    for start, record in records:
        if needed >= len(record):
            column = header[needed]
            raise BadInput(
                f"{file} line {start} has {len(record)} field(s) and no '{column}' (column {needed + 1}); "
                "give every line a value in each column of the header",
            )
        rows.append((f"line {start}", dict(zip(header, record, strict=False))))
    return rows


def json_rows(text: str, file: Path) -> list[tuple[str, object]]:
    """A JSON array's items, or JSON lines' objects (training takes either under both suffixes)."""
    array = text.lstrip().startswith("[")

    def parse(chunk: str, where: str):
        try:
            return json.loads(chunk)
        except json.JSONDecodeError as exc:
            detail = f"{exc.msg} on line {exc.lineno}" if array else exc.msg
            fix = "give a JSON array of objects, or one JSON object per line"
            raise BadInput(f"{file} {where} ({detail}); {fix}") from None

    if array:
        return [(f"item {n}", record) for n, record in enumerate(parse(text, "is not a JSON array"), start=1)]
    lines = enumerate(text.split("\n"), start=1)
    return [(f"line {n}", parse(line, f"line {n} is not JSON")) for n, line in lines if line.strip()]


def parquet_rows(data: bytes, file: Path) -> list[tuple[str, dict]]:
    import pyarrow
    import pyarrow.parquet

    try:
        table = pyarrow.parquet.read_table(io.BytesIO(data))
    except pyarrow.ArrowException as exc:
        raise BadInput(
            f"cannot read {file} as parquet ({type(exc).__name__}: {first_line(exc, 160, '')}); write it "
            "again as parquet, e.g. with pandas' DataFrame.to_parquet",
        ) from None
    return [(f"row {n}", record) for n, record in enumerate(table.to_pylist(), start=1)]


def read_file(file: Path) -> bytes:
    """The bytes of a regular file within MAX_INPUT_BYTES; a device, FIFO (opened without waiting for a writer) or
    folder is refused before a byte is read."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise BadInput(
            f"cannot read {file} ({exc.strerror or exc}); give a UTF-8 text file (one sentence a line), or {FORMATS}",
        ) from None
    info = os.fstat(fd)
    if stat.S_ISDIR(info.st_mode):  # no stream to send on standard input either
        os.close(fd)
        raise BadInput(
            f"{file} is a folder, not a file of sentences; give a regular file (UTF-8 text, one sentence a line, or "
            f"{FORMATS})",
        )
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = next((name for test, name in NOT_FILES if test(info.st_mode)), "not a regular file")
        raise BadInput(
            f"{file} is {kind}, not a file of sentences; give a regular file, or send a stream on standard input "
            f"(python predict.py MODEL < {file} reads at most {MAX_INPUT_BYTES // 2**20} MiB)",
        )
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as handle:
        return read_bounded(handle, str(file), info.st_size)


# What a FILE that is neither a regular file nor a folder is, for its refusal.
NOT_FILES = (
    (stat.S_ISFIFO, "a FIFO (a named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_bounded(handle, source: str, size: int = 0) -> bytes:
    """At most MAX_INPUT_BYTES from `handle` (`size`: the file's, refused before reading)."""
    data = b"" if size > MAX_INPUT_BYTES else handle.read(MAX_INPUT_BYTES + 1)
    if size > MAX_INPUT_BYTES or len(data) > MAX_INPUT_BYTES:
        held = f"holds {size / 2**20:.0f} MiB" if size > MAX_INPUT_BYTES else "goes on past that"
        raise BadInput(
            f"{source} {held}; at most {MAX_INPUT_BYTES // 2**20} MiB of sentences are read at a time: split "
            "the input (split -l 1000000 FILE part-) and answer each part (python predict.py MODEL PART)",
        )
    return data


def decode_text(data: bytes, source: str) -> str:
    """`data` as UTF-8 (a byte-order mark dropped); other bytes would reach the tokenizer as replacement characters."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadInput(
            f"{source} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            f"give sentences as UTF-8 text, one per line, or a UTF-8 {FORMATS.removeprefix('a ')}",
        ) from None


# ------------------------------------------------------------------------------- answers
def classify(classifier, texts: list, batch_size: int, threshold: float | None = None) -> list[dict]:
    """The answer to each text: `{"label", "score"}`, `{"score"}` (regression), or `{"labels", "scores"}`
    (multi-label: the labels scoring at least `threshold`, None: DEFAULT_THRESHOLD)."""
    if not texts:  # the pipeline fails on an empty batch
        return []
    config = classifier.model.config
    if config.problem_type == MULTI_LABEL:
        cut = DEFAULT_THRESHOLD if threshold is None else threshold
        answers = classifier(texts, batch_size=batch_size, truncation=True, top_k=None)  # every label's sigmoid
        names = [config.id2label[i] for i in sorted(config.id2label)]
        rows = []
        for answer in answers:
            scores = {entry["label"]: float(entry["score"]) for entry in answer}
            chosen = [name for name in names if scores[name] >= cut]  # before rounding
            rows.append({"labels": chosen, "scores": {name: round(scores[name], 4) for name in names}})
        return rows
    scores_only = config.problem_type == "regression"
    answers = classifier(texts, batch_size=batch_size, truncation=True)
    return [
        {**({} if scores_only else {"label": answer["label"]}), "score": round(float(answer["score"]), 4)}
        for answer in answers
    ]


def answer_rows(inputs: Inputs, answers: list[dict]) -> list[dict]:
    """One row per input row: its text, its other columns (`input_<name>` for ANSWER_KEYS), then the answer."""
    rows = []
    for text, record, answer in zip(inputs.texts, inputs.records, answers, strict=True):
        row = dict(text) if isinstance(text, dict) else {"text": text}
        for name, value in record.items():
            key = name
            while key in ANSWER_KEYS or key in row:
                key = f"input_{key}"
            row[key] = value
        rows.append({**row, **answer})
    return rows


def model_labels(classifier) -> list[str]:
    config = classifier.model.config
    if config.problem_type == "regression":
        return []
    return [config.id2label[i] for i in sorted(config.id2label)]


def is_unlabelled(value) -> bool:
    raw = value.strip() if isinstance(value, str) else value
    return raw is None or raw == "" or _number(raw) == UNLABELLED


def has_labels(inputs: Inputs) -> bool:
    return inputs.labels is not None and not all(map(is_unlabelled, inputs.labels))


def references(inputs: Inputs, labels: list[str], column: str) -> list[tuple[int, float | int]]:
    """(row index, reference) of each labelled row: a class id (from an id or a name) of `labels`, or a score
    (`labels` empty); a value that is neither is refused."""
    if inputs.labels is None:
        return []
    names = {name.strip().casefold(): index for index, name in enumerate(labels)}
    found = []
    for index, value in enumerate(inputs.labels):
        if is_unlabelled(value):
            continue
        raw = value.strip() if isinstance(value, str) else value
        number = _number(raw)
        if not labels and number is not None and math.isfinite(number):
            found.append((index, number))
        elif labels and number is not None and number.is_integer() and 0 <= number < len(labels):
            found.append((index, int(number)))
        elif labels and isinstance(raw, str) and raw.casefold() in names:
            found.append((index, names[raw.casefold()]))
        else:
            known = ", ".join(f"{i} ({name})" for i, name in enumerate(labels)) if labels else "a number (a score)"
            raise BadInput(
                f"{inputs.source} {inputs.places[index]} has the label {json.dumps(value, default=str)} in "
                f"'{column}', which the model cannot be scored against: its labels are {known}; fix the row, "
                "give -1 (or nothing) for a row without a label, or name the label column",
            )
    return found


def _number(value) -> float | None:
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def score_answers(answers: list[dict], labelled: list[tuple[int, float | int]], labels: list[str]) -> dict | None:
    """The metrics of the answers to the labelled rows; None when none is."""
    if not labelled:
        return None
    import evaluate

    metric = evaluate.load(METRIC_MODULES[CLASSIFICATION if labels else REGRESSION])
    rows = [index for index, _ in labelled]
    truth = [reference for _, reference in labelled]
    if labels:
        ids = {name: index for index, name in enumerate(labels)}
        predicted = [ids[answers[row]["label"]] for row in rows]
        scores = metric.compute(predictions=predicted, references=truth, num_labels=len(labels))
    else:
        scores = metric.compute(predictions=[answers[row]["score"] for row in rows], references=truth)
    return {**{name: round(value, 4) for name, value in scores.items()}, "samples": len(rows)}


def metrics_line(metrics: dict, source: str) -> str:
    shown = " ".join(f"{name}={value:.4f}" for name, value in metrics.items() if name != "samples")
    return f"metrics on {source} ({metrics['samples']} labelled rows): {shown}"


# ------------------------------------------------------------------------------- the job's test split
def check_test_split(path: Path, text_columns: tuple[str, ...], label_column: str, labels: list[str]) -> Inputs:
    """The test split checked at the start as it will be answered, so a bad row is refused before training."""
    inputs = read_inputs(path, list(text_columns), label_column)
    references(inputs, labels, label_column)
    return inputs


def write_test_predictions(
    run,
    path: Path,
    model_name: str,
    label_names: tuple[str, ...],
    text_columns: tuple[str, ...],
    label_column: str,
    multi_label: bool,
    batch_size: int,
    threshold: float,
) -> dict | None:
    """Rank 0, model/ saved: `path` answered by the saved model as predict.py serves it, written whole or not at all
    to OUTPUT_DIR/predictions/; the metrics, None when unlabelled."""
    from utils.run_folder.layout import replace_dir
    from utils.training.model import load_pipeline  # torch and transformers: only a run with a test split pays them

    inputs = read_inputs(path, list(text_columns), label_column)
    classifier = load_pipeline(model_name, run.model, label_names, multi_label)
    labels = model_labels(classifier)
    # A multi-label test split is answered, not scored: its labels are lists or several columns.
    labelled = [] if multi_label else references(inputs, labels, label_column)
    answers = classify(classifier, inputs.texts, batch_size, threshold)
    metrics = score_answers(answers, labelled, labels)
    staged = run.make_dir(run.root / ".predictions.partial", fresh=True)
    lines = "".join(json.dumps(row, default=str) + "\n" for row in answer_rows(inputs, answers))
    run.write_text(staged / PREDICTIONS_FILE, lines)
    if metrics is not None:
        run.write_json(staged / "metrics.json", {**metrics, "file": str(path)})
    replace_dir(staged, run.predictions)
    return metrics

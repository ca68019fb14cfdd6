"""SST-2 (or any sentence/label data shaped like it), from the Hub or local files: load, check, choose the rows,
tokenize once per shared volume. Padding is the collator's: SST-2 sentences average ~13 tokens."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy
import pyarrow
import pyarrow.compute
from datasets import DatasetDict, load_dataset, load_from_disk
from datasets.fingerprint import Hasher

from utils.common.delimited import DIALECTS, FILE_FORMATS, read_records
from utils.common.errors import BadInput, JobError, first_line, volume_state
from utils.common.texts import check_texts
from utils.config.local_inputs import check_carve, check_columns, check_splits, read_splits, split_files
from utils.config.tasks import CLASSIFICATION, MULTI_LABEL, REGRESSION, validation_splits
from utils.training.multi_label import SEPARATOR, multi_hot_labels

log = logging.getLogger(__name__)

TEXTS, LABEL = ("text", "text_pair"), "labels"
# Only an empty cell is missing (pandas would read the sentences `NA`, `null`, `None` and `nan` as missing).
CSV_OPTIONS = {"keep_default_na": False, "na_values": [""]}
JSON_TYPES = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
# datasets counts a download of its csv/json/parquet module on the Hub at every load unless told not to: where no
# offline variable is set and no network is reached (an air-gapped cluster), a DNS lookup and a 3 s timeout a file.
datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False


@dataclass(frozen=True)
class DataSource:
    """The settings the data reads (Settings.select: named as the settings are). `given`: LABEL_NAMES' and
    PROBLEM_TYPE's defaults decide less (the names of two unnamed ids; TASK's PROBLEM_TYPE does not turn classes into
    scores)."""

    dataset_name: str
    dataset_config: str
    dataset_path: str | None
    train_file: str | None
    validation_file: str | None
    validation_split: float | None
    local_data: str | None
    task: str | None
    text_columns: tuple[str, ...]
    label_column: str
    label_columns: tuple[str, ...] | None
    label_source_columns: tuple[str, ...]
    label_names: tuple[str, ...]
    problem_type: str
    max_train_samples: int | None
    max_eval_samples: int | None
    max_seq_length: int
    seed: int
    given_label_names: tuple[str, ...] | None
    given: frozenset[str]


def _not_utf8(files: dict[str, str], cause: UnicodeDecodeError) -> str:
    for path in files.values():
        try:
            Path(path).read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            line = Path(path).read_bytes()[: exc.start].count(b"\n") + 1
            return (
                f"{path} is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} on line {line}); "
                "save it as UTF-8, e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8` for a Latin-1 file"
            )
    return f"a file in DATASET_PATH is not valid UTF-8 ({cause.reason}); save the data files as UTF-8"


def _check_json_labels(loaded: DatasetDict, files: dict[str, str], column: str) -> None:
    """A JSON label column of mixed types (`1`, `"1"`, `true`) is kept by the loader as raw JSON, `"1"` read back as
    `1`: the types are read from the file."""
    for split, ds in loaded.items():
        if column in ds.column_names and isinstance(ds.features[column], datasets.Json):
            text = Path(files[split]).read_text(encoding="utf-8-sig")  # JSON Lines, or a JSON array of objects
            rows = (
                json.loads(text)
                if text.lstrip().startswith("[")
                else map(json.loads, filter(str.strip, text.splitlines()))
            )
            seen = {}
            for value in (row.get(column) for row in rows if isinstance(row, dict)):
                if value is not None:
                    seen.setdefault(JSON_TYPES.get(type(value), type(value).__name__), json.dumps(value))
            kinds = ", ".join(f"{kind} ({example})" for kind, example in seen.items())
            raise BadInput(
                f"{files[split]} mixes label types in '{column}': {kinds}; write every label the same way: "
                "the numbers 0/1, true/false, or the LABEL_NAMES names as strings",
            )


def _load_file(path: Path, split: str, suffix: str, files: dict[str, str]) -> datasets.Dataset:
    fmt, kwargs, records = FILE_FORMATS[suffix], {}, None
    if fmt == "csv":
        kwargs = {**CSV_OPTIONS, "delimiter": DIALECTS[suffix][0], "quoting": DIALECTS[suffix][1]}
        # The loader must read as many rows as predict.py does (utils/common/delimited.py).
        try:
            with path.open(encoding="utf-8-sig", newline="") as handle:
                records = sum(1 for _ in read_records(handle, path, suffix)[1])
        except UnicodeDecodeError as exc:
            raise BadInput(_not_utf8(files, exc)) from None
    try:
        loaded = load_dataset(fmt, data_files={split: str(path)}, split=split, trust_remote_code=False, **kwargs)
    except datasets.exceptions.DatasetGenerationError as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, UnicodeDecodeError):
            raise BadInput(_not_utf8(files, cause)) from None
        if "the first 0 values" not in str(cause):  # else a header and no rows: every column's type is unknown
            raise _unreadable(path, fmt, cause) from None
        raise BadInput(f"{path} has a header but no rows; each split needs at least one row") from None
    except (pyarrow.ArrowException, StopIteration) as exc:  # a file that is no parquet / JSON at all
        raise _unreadable(path, fmt, exc) from None
    except ValueError as exc:
        if "corresponds to no data" not in str(exc):
            raise
        what = "has a header but no rows" if fmt == "csv" else "holds no rows"
        raise BadInput(f"{path} {what}; each split needs at least one row") from None
    if records is not None and len(loaded) != records:
        raise BadInput(
            f"{path} holds {records} records, one per line, but was read as {len(loaded)} rows; "
            "check its quoting (a field that opens with a quote must close it, and a quote inside a quoted field is doubled)",
        )
    return loaded


FORMAT_HINTS = {
    "csv": "a header line, then one row per line",
    "json": "one JSON object per line (.jsonl) or a JSON array of objects",
    "parquet": "e.g. with pandas' DataFrame.to_parquet",
}


def _unreadable(path: Path, fmt: str, cause: BaseException) -> JobError:
    return BadInput(
        f"cannot read {path} as {path.suffix[1:]} ({type(cause).__name__}: {first_line(cause, 160, '')}); write it again as "
        f"{path.suffix[1:]}: {FORMAT_HINTS[fmt]}",
    )


def load_raw(source: DataSource) -> DatasetDict:
    """The train and validation splits (TASK=mnli: its two) from the local data, else the Hub; train alone where
    VALIDATION_SPLIT carves validation."""
    splits = read_splits(source.validation_split, validation_splits(source.task))
    if (
        files := split_files(
            source.dataset_path,
            source.train_file,
            source.validation_file,
            source.validation_split,
            validation_splits(source.task),
        )
    ) is not None:
        # One split at a time: loaded together, an extra column failed a cast naming neither file nor column.
        loaded = DatasetDict(
            {split: _load_file(Path(p), split, Path(p).suffix.lower(), files) for split, p in files.items()}
        )
        json_files = {s: p for s, p in files.items() if FILE_FORMATS[Path(p).suffix.lower()] == "json"}
        _check_json_labels(DatasetDict({s: loaded[s] for s in json_files}), json_files, source.label_column)
    elif source.dataset_path:
        folder = Path(source.dataset_path)
        try:
            loaded = load_from_disk(str(folder))
        except Exception as exc:
            raise BadInput(
                f"DATASET_PATH={folder} holds a damaged save_to_disk DatasetDict ({type(exc).__name__}: {first_line(exc, 160, '')}); "
                "write it again with DatasetDict.save_to_disk, or point DATASET_PATH at train/validation files",
            ) from None
        if isinstance(loaded, DatasetDict):
            check_carve(loaded, f"DATASET_PATH={folder}", source.validation_split, validation_splits(source.task))
    else:
        try:
            # No loading script from the Hub runs (datasets 4 runs none; said for a version that could).
            loaded = load_dataset(source.dataset_name, source.dataset_config, trust_remote_code=False)
        except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as exc:
            raise BadInput(
                f"cannot load DATASET_NAME={source.dataset_name} DATASET_CONFIG={source.dataset_config} from the Hub "
                f"({type(exc).__name__}: {first_line(exc, 160, '')}); check the names, or on an offline cluster set DATASET_PATH to a local copy",
            ) from None
    if not isinstance(loaded, DatasetDict):
        raise BadInput(f"{source.dataset_path} holds one Dataset; save a DatasetDict of the splits")
    check_splits(loaded, splits)
    if source.validation_split is not None and not source.local_data:
        log.info("VALIDATION_SPLIT=%s: the Hub's validation rows are not read", source.validation_split)
    return DatasetDict({split: loaded[split] for split in splits})


def check_and_rename(raw: DatasetDict, source: DataSource) -> DatasetDict:
    """The text column(s) and labels as `text`, `text_pair`, `labels`; empty splits and untrainable labels refused.
    Labels leave as ClassLabel ids with their names, float32 scores (regression) or float32 multi-hot vectors
    whose names ride in the feature (`label_names_of`)."""
    columns, label = source.text_columns, source.label_column
    multi = source.problem_type == MULTI_LABEL
    given = source.given_label_names
    if not multi:
        raw = DatasetDict({split: _numbers_as_numbers(ds, label) for split, ds in raw.items()})
    for split, ds in raw.items():
        check_columns(split, ds.column_names, columns, source.label_source_columns)
        if len(ds) == 0:
            raise BadInput(f"the {split} split is empty; it needs at least one row")
        for column in columns:
            _check_text(ds, split, column)
        if not multi:
            _check_label_values(ds, split, label)
    _warn_unnamed_text(raw["train"], columns, label)
    if multi:
        names, vectors = multi_hot_labels(raw, label, source.label_columns, given)
        # The names ride in the values' id, which datasets keeps through map, select and save_to_disk.
        feature = datasets.List(datasets.Value("float32", id=json.dumps(names)), length=len(names))
        texts = dict(zip(columns, TEXTS, strict=False))
        return DatasetDict(
            {
                split: ds.select_columns(list(columns))
                .add_column(LABEL, vectors[split], feature=feature)
                .rename_columns(texts)
                for split, ds in raw.items()
            }
        )
    problem = resolve_problem_type(
        raw["train"], label, source.problem_type, "problem_type" in source.given, source.task, given
    )
    if problem == REGRESSION:
        feature = datasets.Value("float32")
        labelled = {s: _scores(ds, s, label) for s, ds in raw.items()}
    else:
        _warn_joined_names(raw["train"], label)
        names = resolve_label_names(raw, label, source.label_names, given is not None or bool(source.task))
        feature = datasets.ClassLabel(names=list(names))
        labelled = {s: _labels_as_ids(ds, s, label, names) for s, ds in raw.items()}
    renamed = dict(zip([*columns, label], [*TEXTS[: len(columns)], LABEL], strict=True))
    checked = {
        split: _cast_label(ds.select_columns(list(renamed)), label, feature).rename_columns(renamed)
        for split, ds in labelled.items()
    }
    if problem != REGRESSION and len(set(checked["train"].unique(LABEL))) < 2:
        only = feature.names[checked["train"][0][LABEL]]
        raise BadInput(
            f"the train split has one class only ('{only}' in '{label}', of {list(feature.names)}): a classifier "
            "learns nothing from it; add rows of the other classes, or check LABEL_COLUMN",
        )
    return DatasetDict(checked)


def _check_text(ds: datasets.Dataset, split: str, column: str) -> None:
    """A string column, every row held to utils/common/texts.py's rule, as predict.py holds its input."""
    feature = ds.features[column]
    kind = getattr(feature, "dtype", type(feature).__name__)
    if kind not in ("string", "large_string", "null"):
        raise BadInput(
            f"the {split} split's column '{column}' holds {kind} values, not text; set TEXT_COLUMN to the column with the sentences",
        )
    check_texts(ds.with_format("arrow")[column].to_pylist(), column, f"the {split} split", lambda i: f"row {i + 1}")


def _check_label_values(ds: datasets.Dataset, split: str, column: str) -> None:
    if isinstance(ds.features[column], datasets.Json):
        kinds = sorted({JSON_TYPES.get(type(v), type(v).__name__) for v in ds[column] if v is not None})
        raise BadInput(
            f"the {split} split mixes label types in '{column}' ({', '.join(kinds)}); write every label the same way, as 0/1",
        )
    if missing := ds.with_format("arrow")[column].null_count:
        raise BadInput(
            f"the {split} split has {missing} row(s) without a label in '{column}'; give every row a label 0 or 1, or remove it",
        )
    if _is_text(ds.features[column]):
        values = ds.unique(column)
        words = sorted(v for v in values if not _digits([v]))
        if words and len(words) < len(values):
            row = next(i for i, v in enumerate(ds.with_format("arrow")[column].to_pylist()) if v in words)
            raise BadInput(
                f"the {split} split mixes class ids and words in '{column}' ({', '.join(map(repr, words[:3]))} among ids; "
                f"the first is row {row + 1}); write every label the same way: ids, or the LABEL_NAMES names",
            )


# A number as a csv reader infers one: "1.0", "-2", ".5", "3.5e2" (spaces around it aside); not "nan", "inf" or "1_0".
NUMBER = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _numbers_as_numbers(ds: datasets.Dataset, column: str) -> datasets.Dataset:
    """A text label column of numbers read as float64, as a csv's: a jsonl's "1.0"/"0.0" trained as two classes
    named so where a csv's are the ids 1 and 0. Digits alone are ids already (`_digits`)."""
    if column not in ds.column_names or not _is_text(ds.features[column]):
        return ds  # a missing column: refused below with the fix
    values = ds.unique(column)
    if _digits(values) or not all(isinstance(v, str) and NUMBER.fullmatch(v) for v in values):
        return ds
    trimmed = pyarrow.compute.utf8_trim_whitespace(ds.with_format("arrow")[column])
    numbers = pyarrow.compute.cast(trimmed, pyarrow.float64()).combine_chunks()
    return ds.remove_columns(column).add_column(column, numbers, feature=datasets.Value("float64"))


def _warn_unnamed_text(ds: datasets.Dataset, text_columns: tuple[str, ...], label_column: str) -> None:
    """Another text column that no setting names (MNLI's hypothesis): warned, it may be a note."""
    column, used = text_columns[0], {*text_columns, label_column}
    others = [name for name, feature in ds.features.items() if name not in used and _is_text(feature)]
    if others and len(text_columns) == 1:
        log.warning(
            f"the data has another text column '{others[0]}' that no setting names: only '{column}' is trained on. "
            f"For sentence pairs set TEXT_COLUMN={column},{others[0]}"
        )


def _warn_joined_names(ds: datasets.Dataset, column: str) -> None:
    """Text labels joined by `|`, as a multi-label csv writes them: warned, a class name may hold it."""
    if not _is_text(ds.features[column]):
        return
    joined = pyarrow.compute.match_substring(ds.with_format("arrow")[column], SEPARATOR)
    if pyarrow.compute.any(joined).as_py():
        first = pyarrow.compute.index(joined, True).as_py()
        log.warning(
            f"the train split's '{column}' holds labels joined by '{SEPARATOR}' (row {first + 1}: "
            f"{ds[first][column]!r}), each trained as one class: for rows with several labels set "
            "PROBLEM_TYPE=multi_label_classification"
        )


def _is_float(feature) -> bool:
    return getattr(feature, "dtype", None) in ("float16", "float32", "float64")


def _is_text(feature) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def resolve_problem_type(
    train: datasets.Dataset,
    column: str,
    problem_type: str,
    problem_type_given: bool,
    task: str | None,
    given_names: tuple[str, ...] | None,
) -> str:
    """PROBLEM_TYPE when set (TASK sets it); auto: regression for a float column of fractions, else classification.
    LABEL_NAMES given (`given_names`) means classes; a ClassLabel trains as scores only where PROBLEM_TYPE=regression
    is given outright, not by TASK."""
    feature = train.features[column]
    named = given_names is not None
    if isinstance(feature, datasets.List | datasets.LargeList):
        raise BadInput(
            f"the train split's '{column}' lists labels per row (a multi-label problem), and PROBLEM_TYPE="
            f"{problem_type} trains one label per row; set PROBLEM_TYPE=multi_label_classification",
        )
    if problem_type == REGRESSION and named:
        given = f"TASK={task}" if task else f"PROBLEM_TYPE={problem_type}"
        raise BadInput(
            f"LABEL_NAMES={','.join(given_names)} names classes, and {given} trains scores (a regression); "
            f"unset LABEL_NAMES to train scores, or unset {given.split('=')[0]} to train the classes",
        )
    if problem_type == REGRESSION:
        if isinstance(feature, datasets.ClassLabel) and not problem_type_given:
            raise BadInput(
                f"the train split's '{column}' holds classes (a ClassLabel of {feature.names}), and TASK={task} "
                "trains scores (a regression); point DATASET_PATH at the task's own scores, or set PROBLEM_TYPE=regression "
                "to train the class ids as scores",
            )
        return REGRESSION
    values = train.unique(column) if _is_float(feature) else []
    odd = sorted((v for v in values if not _is_id(v)), key=str)
    if not odd:
        return CLASSIFICATION
    if problem_type == "auto" and not named:
        log.info(
            f"the label column '{column}' holds fractions: trained as a regression (one score, MSE); "
            "PROBLEM_TYPE=classification trains classes"
        )
        return REGRESSION
    if task:
        fix = f"TASK={task} is a classification task: point DATASET_PATH at its own labels (ids or names)"
    elif named:
        fix = f"LABEL_NAMES={','.join(given_names)} names classes: fix the row, or unset LABEL_NAMES and set PROBLEM_TYPE=regression to train scores"
    else:
        fix = "set PROBLEM_TYPE=regression to train scores, or give class ids or names"
    raise BadInput(_not_ids("train", train, column, odd, fix))


def _is_id(value) -> bool:
    return math.isfinite(value) and float(value).is_integer()


def _not_ids(split: str, ds: datasets.Dataset, column: str, odd: list, fix: str) -> str:
    row = next(i for i, v in enumerate(ds.with_format("arrow")[column].to_pylist()) if v is not None and not _is_id(v))
    return f"the {split} split has labels {odd[:3]} in '{column}' that are not class ids (the first is row {row + 1}); {fix}"


def _scores(ds: datasets.Dataset, split: str, column: str) -> datasets.Dataset:
    """Regression targets: numbers, finite as float32 (one NaN makes every loss after it NaN)."""
    kind = getattr(ds.features[column], "dtype", type(ds.features[column]).__name__)
    if kind not in ("bool", "int8", "int16", "int32", "int64", "float16", "float32", "float64"):
        raise BadInput(
            f"the {split} split's '{column}' holds {kind} values; regression needs a number per row: give scores, "
            "or set PROBLEM_TYPE=classification for class names",
        )
    values = pyarrow.compute.cast(ds.with_format("arrow")[column], pyarrow.float32())
    bad = pyarrow.compute.invert(pyarrow.compute.is_finite(values))
    if count := pyarrow.compute.sum(bad).as_py():
        first = pyarrow.compute.index(bad, True).as_py()
        raise BadInput(
            f"the {split} split has {count} regression target(s) in '{column}' that are NaN or infinite as float32, the "
            f"dtype training uses (the first is row {first + 1}: {ds[first][column]!r}; float32 ends at 3.4e38); "
            "fill in, rescale or remove those rows",
        )
    return ds


def _digits(values) -> bool:
    return bool(values) and all(isinstance(v, str) and v.strip().lstrip("-").isdigit() for v in values)


# Hand-written beside datasets' class_encode_column and align_labels_with_mapping, which tell `Positive ` from
# `positive` and write a cache beside the data (tests/test_library_contract.py says when they no longer do).
def resolve_label_names(raw: DatasetDict, column: str, label_names: tuple[str, ...], decided: bool) -> tuple[str, ...]:
    """The class names in id order: LABEL_NAMES or TASK's where `decided`; else the data's (a ClassLabel's, or the
    text labels sorted, the default names in their order); unnamed ids: the default names for two, else the ids."""
    if decided:
        return label_names
    kinds = {split: _label_kind(ds.features[column], ds.unique(column)) for split, ds in raw.items()}
    if len(set(kinds.values())) > 1:
        shown = " and ".join(
            f"{kind} in the {split} split ({', '.join(map(repr, sorted(map(str, raw[split].unique(column)))[:3]))})"
            for split, kind in kinds.items()
        )
        raise BadInput(
            f"the labels in '{column}' are {shown}: which id is which name cannot be told; write every split's labels "
            "the same way, or set LABEL_NAMES (label 0 first) to name the ids",
        )
    feature = raw["train"].features[column]
    default = {_name_key(n) for n in label_names}
    if isinstance(feature, datasets.ClassLabel) and feature.names != [str(i) for i in range(len(feature.names))]:
        # SST-2's two names in any order: the default order (label 1 is the positive class F1 is scored on).
        return label_names if {_name_key(n) for n in feature.names} == default else tuple(feature.names)
    if kinds["train"] == "names":
        values = set()
        for ds in raw.values():
            named = ds.features[column]
            values.update(named.names if isinstance(named, datasets.ClassLabel) else ds.unique(column))
        by_key = {}
        for value in sorted(values):
            by_key.setdefault(_name_key(value), value.strip())
        if set(by_key) == default:
            return label_names  # the default names, whatever their case: the default order
        return tuple(by_key[key] for key in sorted(by_key))
    count = max((int(v) for v in raw["train"].unique(column)), default=-1) + 1
    return label_names if count <= 2 else tuple(str(i) for i in range(count))


def _label_kind(feature, values) -> str:
    if isinstance(feature, datasets.ClassLabel):
        return "ids" if feature.names == [str(i) for i in range(len(feature.names))] else "names"
    return "names" if _is_text(feature) and not _digits(values) else "ids"


def _labels_as_ids(ds: datasets.Dataset, split: str, column: str, label_names: tuple[str, ...]) -> datasets.Dataset:
    """Labels as ids of `label_names`: named labels mapped by name (a ClassLabel `['positive', 'negative']` as it
    stands would teach the opposite of the card); booleans, 0.0/1.0 and digit strings are ids."""
    feature = ds.features[column]
    if isinstance(feature, datasets.ClassLabel):
        ds = _class_label_by_name(ds, split, column, feature, label_names)
    else:
        values = ds.unique(column)
        odd = sorted((v for v in values if not _is_id(v)), key=str) if _is_float(feature) else []
        if _is_text(feature) and not _digits(values):
            ds = _text_labels_by_name(ds, split, column, values, label_names)
        elif odd:
            fix = "fill in or fix those rows, or set PROBLEM_TYPE=regression to train scores"
            raise BadInput(_not_ids(split, ds, column, odd, fix))
        elif _is_text(feature) or _is_float(feature) or getattr(feature, "dtype", None) == "bool":
            ds = _cast_label(ds, column, datasets.Value("int64"))
    if bad := sorted(i for i in set(ds.unique(column)) if not 0 <= i < len(label_names)):
        names = ", ".join(f"{i} ({name})" for i, name in enumerate(label_names))
        fix = ": name every class in LABEL_NAMES (label 0 first), or relabel the data"
        fix = " (GLUE's test split, labelled -1, cannot be used for training or validation)" if -1 in bad else fix
        raise BadInput(f"the {split} split has labels {bad[:5]} in '{column}'; labels must be ids {names}{fix}")
    return ds


def _cast_label(ds: datasets.Dataset, column: str, feature) -> datasets.Dataset:
    """In memory: a cast writes its cache beside the data, in the user's folder."""
    if ds.features[column] == feature:
        return ds
    return ds.cast(datasets.Features({**ds.features, column: feature}), keep_in_memory=True)


def _name_key(name: str) -> str:
    return name.strip().casefold()  # `Positive` and ` positive` name the same label


def _replace_labels(ds: datasets.Dataset, column: str, new_for_old: list[int], old_ids, feature) -> datasets.Dataset:
    ids = pyarrow.compute.take(pyarrow.array(new_for_old, pyarrow.int64()), old_ids)
    return ds.remove_columns(column).add_column(column, ids.combine_chunks(), feature=feature)


def _class_label_by_name(ds, split: str, column: str, feature: datasets.ClassLabel, label_names: tuple[str, ...]):
    names = feature.names
    if names == [str(i) for i in range(len(names))]:
        return ds  # ClassLabel(num_classes=2): unnamed, the ids are the data
    theirs, ours = [_name_key(n) for n in names], [_name_key(n) for n in label_names]
    if sorted(theirs) != sorted(ours):
        raise BadInput(
            f"the {split} split's '{column}' is a ClassLabel named {names}, and LABEL_NAMES is {list(label_names)}: "
            f"the names do not match, so which label is which cannot be told; set LABEL_NAMES={','.join(names)} "
            f"if those are the classes (id 0 first), or relabel the data as {list(label_names)}",
        )
    if theirs == ours or not set(ds.unique(column)) <= set(range(len(names))):
        return ds  # the same order; or -1 (no label) or out of range: the label check refuses it with the values
    old_ids = ds.with_format("arrow")[column]
    new_for_old = [ours.index(name) for name in theirs]
    moves = ", ".join(f"{names[old]}: {old} -> {new}" for old, new in enumerate(new_for_old))
    log.info(
        f"the {split} split's labels are a ClassLabel named {names}; remapped by name to LABEL_NAMES {list(label_names)} ({moves})"
    )
    return _replace_labels(ds, column, new_for_old, old_ids, datasets.ClassLabel(names=list(label_names)))


def _text_labels_by_name(ds, split: str, column: str, values: list[str], label_names: tuple[str, ...]):
    ours = [_name_key(n) for n in label_names]
    if unknown := sorted(v for v in values if _name_key(v) not in ours):
        raise BadInput(
            f"the {split} split has text labels {unknown[:5]} in '{column}' that are not LABEL_NAMES {list(label_names)}; "
            "labels must be ids or those names: add them to LABEL_NAMES (label 0 first), or relabel the data",
        )
    seen = sorted(values)
    log.info("the %s split's labels are words; mapped by name to LABEL_NAMES %s", split, list(label_names))
    old_ids = pyarrow.compute.index_in(ds.with_format("arrow")[column], value_set=pyarrow.array(seen))
    return _replace_labels(ds, column, [ours.index(_name_key(v)) for v in seen], old_ids, datasets.Value("int64"))


def cache_key(raw: DatasetDict, tokenizer, max_seq_length: int, text_columns: tuple[str, ...] = ()) -> str:
    fingerprints = [raw[s]._fingerprint for s in sorted(raw)]
    return Hasher.hash([Hasher.hash(tokenizer), max_seq_length, fingerprints, list(text_columns)])[:16]


def tokenize(
    raw: DatasetDict, tokenizer, max_seq_length: int, cache_dir: Path, text_columns: tuple[str, ...] = ()
) -> DatasetDict:
    """Tokenize once into `cache_dir` (the shared volume); later calls and other ranks load it."""
    target = cache_dir / f"tokenized-{cache_key(raw, tokenizer, max_seq_length, text_columns)}"
    if target.exists() and (cached := _load_cache(target, raw)) is not None:
        log.info("tokenized data found in %s", target)
        return cached

    texts = [name for name in TEXTS if name in raw["train"].column_names]

    def encode(batch):
        return tokenizer(*(batch[name] for name in texts), truncation="longest_first", max_length=max_seq_length)

    # In memory: the map's cache would go beside the data, the user's folder.
    tokenized = raw.map(encode, batched=True, remove_columns=texts, desc="tokenizing", keep_in_memory=True)
    # Written beside the target, then renamed: a reader never sees half a cache.
    partial = target.with_name(target.name + ".partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        tokenized.save_to_disk(str(partial))
    except Exception as exc:
        # The cache is derived data and never stops the job.
        if not isinstance(exc, OSError) and volume_state(exc, cache_dir) is None:
            raise
        shutil.rmtree(partial, ignore_errors=True)
        why = getattr(exc, "strerror", None) or type(exc).__name__
        log.warning(
            f"could not write the tokenized cache to {cache_dir} ({why}); training goes on from the tokenized data in memory, and the next start tokenizes again"
        )
        return tokenized
    try:
        partial.rename(target)
    except OSError:  # another writer (a second job on the volume) got there first
        shutil.rmtree(partial, ignore_errors=True)
        if not target.exists():
            return tokenized
    log.info("tokenized %s rows into %s", {k: len(v) for k, v in tokenized.items()}, target)
    return load_from_disk(str(target))


def _load_cache(target: Path, raw: DatasetDict) -> DatasetDict | None:
    """The cached tokenized splits, or None after removing a damaged one (torn JSON, truncated .arrow): rebuilt."""
    try:
        cached = load_from_disk(str(target))
        if sorted(cached) != sorted(raw):
            raise ValueError(f"it holds the splits {sorted(cached)}, the data {sorted(raw)}")
        for split in raw:
            table = cached[split].with_format("arrow")[:]  # reads every record batch: a truncated file fails here
            if table.num_rows != len(raw[split]):
                raise ValueError(f"the {split} split holds {table.num_rows} rows, the data {len(raw[split])}")
        return cached
    except Exception as exc:  # FileNotFoundError, JSONDecodeError, ArrowInvalid, KeyError: damaged either way
        log.warning(
            f"tokenized cache {target} is damaged ({type(exc).__name__}: {first_line(exc, 160, '')}); tokenizing again"
        )
        shutil.rmtree(target, ignore_errors=True)
        return None


def load_sst2(source: DataSource, tokenizer, cache_dir: Path) -> DatasetDict:
    raw = check_and_rename(load_raw(source), source)
    raw = carve_validation(raw, source.validation_split, source.seed, validation_splits(source.task)[0])
    raw = sample_rows(raw, source.max_train_samples, source.max_eval_samples, source.seed)
    data = tokenize(raw, tokenizer, source.max_seq_length, cache_dir, source.text_columns)
    report_unknown_tokens(data["train"], tokenizer)
    return data


def carve_validation(raw: DatasetDict, fraction: float | None, seed: int, split: str) -> DatasetDict:
    """`fraction` of the training rows held out as `split`, drawn with `seed`, every row of one text on the same side
    (SST-2 repeats phrases: validation would score rows trained on); at least one row each side."""
    if fraction is None:
        return raw
    train = raw["train"]
    texts = [name for name in TEXTS if name in train.column_names]
    groups: dict[tuple, list[int]] = {}
    for row, key in enumerate(zip(*(train[name] for name in texts), strict=True)):
        groups.setdefault(key, []).append(row)
    if len(groups) < 2:
        raise BadInput(
            f"VALIDATION_SPLIT={fraction} needs two different texts in the training rows, and they hold "
            f"{len(groups)}; add rows, or give the validation rows with VALIDATION_FILE",
        )
    listed = list(groups.values())  # in order of first appearance: the same file gives the same order
    wanted, held = max(1, round(fraction * len(train))), []
    for group in numpy.random.default_rng(seed).permutation(len(listed))[: len(listed) - 1]:
        if len(held) >= wanted:
            break
        held.extend(listed[group])
    held_rows = set(held)
    kept = [row for row in range(len(train)) if row not in held_rows]
    log.info(
        f"VALIDATION_SPLIT={fraction}: {len(held)} of {len(train)} training rows ({len(groups)} distinct texts) "
        f"held out as the {split} split, seed {seed}"
    )
    # In memory: an indices file would be written beside the data, perhaps in the user's read-only folder.
    return DatasetDict(
        {"train": train.select(kept, keep_in_memory=True), split: train.select(sorted(held), keep_in_memory=True)}
    )


def sample_rows(raw: DatasetDict, max_train: int | None, max_eval: int | None, seed: int) -> DatasetDict:
    """At most `max_train` / `max_eval` rows of each split, the first after a shuffle with `seed`: a file's first
    rows are often one class."""
    limited = {}
    for split, rows in raw.items():
        limit = max_train if split == "train" else max_eval
        if limit is not None and limit < len(rows):
            rows = rows.shuffle(seed=seed, keep_in_memory=True).select(range(limit), keep_in_memory=True)
            log.info(f"the {split} split limited to {limit} rows, drawn with seed {seed}")
        limited[split] = rows
    return DatasetDict(limited)


# A fitting tokenizer leaves well under 1% unknown; at 5% one word in twenty is the same [UNK] (a csv the demo's
# vocabulary did not cover: 21%, accuracy at chance).
UNKNOWN_TOKENS_WARNING = 0.05


def unknown_share(train: datasets.Dataset, tokenizer) -> tuple[int, int] | None:
    """(unknown, text tokens) of the training rows, special tokens aside; None for a tokenizer without [UNK]."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return None
    ids = pyarrow.compute.list_flatten(train.with_format("arrow")["input_ids"])
    special = sorted(set(tokenizer.all_special_ids) - {unk})
    specials = pyarrow.compute.sum(pyarrow.compute.is_in(ids, value_set=pyarrow.array(special, ids.type))).as_py()
    text = len(ids) - (specials or 0)  # the sum of no values is None
    unknown = pyarrow.compute.sum(pyarrow.compute.equal(ids, unk)).as_py() or 0
    return unknown, text


def report_unknown_tokens(train: datasets.Dataset, tokenizer) -> None:
    if (counts := unknown_share(train, tokenizer)) is None or not counts[1]:
        return
    unknown, total = counts
    share = unknown / total
    log.info(f"{share:.2%} of the training rows' tokens are {tokenizer.unk_token} ({unknown} of {total})")
    if share > UNKNOWN_TOKENS_WARNING:
        log.warning(
            f"{share:.1%} of the training rows' tokens are the unknown token {tokenizer.unk_token} ({unknown} of {total}; "
            f"above {UNKNOWN_TOKENS_WARNING:.0%}): the vocabulary of MODEL_NAME={tokenizer.name_or_path}'s tokenizer does "
            "not cover the data's text (another language, a small demo vocabulary, or capitals for a tokenizer that "
            "does not lower-case), and the model learns little from words it cannot tell apart; train a model whose "
            "tokenizer fits the data (e.g. a multilingual or cased model for such text)"
        )


def problem_type_of(data: DatasetDict) -> str:
    """What the checked data trains, read from its label feature (check_and_rename decided it)."""
    feature = data["train"].features[LABEL]
    if isinstance(feature, datasets.List):
        return MULTI_LABEL
    return CLASSIFICATION if isinstance(feature, datasets.ClassLabel) else REGRESSION


def label_names_of(data: DatasetDict) -> tuple[str, ...]:
    """The class names in id order the checked data carries, or `()` for regression (float scores)."""
    feature = data["train"].features[LABEL]
    if isinstance(feature, datasets.List) and feature.feature.id:  # multi-hot vectors (check_and_rename)
        return tuple(json.loads(feature.feature.id))
    return tuple(feature.names) if isinstance(feature, datasets.ClassLabel) else ()

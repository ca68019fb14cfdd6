"""Multi-label data (PROBLEM_TYPE=multi_label_classification): each row's labels as a float32 multi-hot vector.

The labels are one column (LABEL_COLUMN) listing each row's names (a JSON list, a list of ClassLabel ids, or
`toxic|insult` in a .csv/.tsv cell), or several 0/1 columns (LABEL_COLUMNS), one per label. The names in id
order: LABEL_COLUMNS, else LABEL_NAMES, else the training rows' names sorted. In Arrow and numpy throughout.
"""

from __future__ import annotations

import datasets
import numpy
import pyarrow
import pyarrow.compute
from datasets import DatasetDict

from utils.common.errors import BadInput

SEPARATOR = "|"  # between the names in a csv/tsv cell


def multi_hot_labels(
    raw: DatasetDict, label_column: str, label_columns: tuple[str, ...] | None, label_names: tuple[str, ...] | None
) -> tuple[tuple[str, ...], dict[str, pyarrow.Array]]:
    """The label names in id order and each split's multi-hot vectors (a fixed-size list of float32 per row).
    `label_names`: LABEL_NAMES when given, else None (the training rows' names)."""
    if label_columns:
        return label_columns, {split: _from_columns(ds, split, label_columns) for split, ds in raw.items()}
    listed = {split: _listed_names(ds, split, label_column) for split, ds in raw.items()}
    names = label_names or _names_seen(listed["train"], label_column)
    return names, {
        split: _vectors(split, label_column, *listed[split], len(raw[split]), names, label_names is not None)
        for split in raw
    }


def _listed_names(ds: datasets.Dataset, split: str, column: str) -> tuple[numpy.ndarray, pyarrow.Array]:
    """Each name a row lists (stripped, empty ones dropped) and the row it is in."""
    values = ds.with_format("arrow")[column].combine_chunks()
    kind, feature = values.type, ds.features[column]
    if pyarrow.types.is_null(kind) or pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind):
        values = pyarrow.compute.split_pattern(values.cast(pyarrow.string()), SEPARATOR)
    elif not (
        pyarrow.types.is_list(kind) or pyarrow.types.is_large_list(kind) or pyarrow.types.is_fixed_size_list(kind)
    ):
        raise BadInput(
            f"the {split} split's '{column}' holds {kind} values, and PROBLEM_TYPE=multi_label_classification reads "
            f"each row's label names there: write them as a JSON list (or separated by {SEPARATOR} in a csv/tsv "
            "cell), or set LABEL_COLUMNS to the 0/1 columns, one per label",
        )
    parents = pyarrow.compute.list_parent_indices(values).to_numpy()
    flat = pyarrow.compute.list_flatten(values)
    inner = getattr(feature, "feature", None)
    if isinstance(inner, datasets.ClassLabel):  # ids of a ClassLabel: by their names
        flat = pyarrow.compute.take(pyarrow.array(inner.names), flat)
    elif not (pyarrow.types.is_string(flat.type) or pyarrow.types.is_large_string(flat.type)):
        raise BadInput(
            f"the {split} split's '{column}' lists {flat.type} values, not label names; write each row's labels as "
            'a list of names (["toxic", "insult"]), or set LABEL_COLUMNS to the 0/1 columns, one per label',
        )
    flat = pyarrow.compute.utf8_trim_whitespace(flat.cast(pyarrow.string()))
    kept = pyarrow.compute.fill_null(pyarrow.compute.not_equal(flat, ""), False)
    return parents[kept.to_numpy(zero_copy_only=False)], flat.filter(kept)


def _names_seen(listed: tuple[numpy.ndarray, pyarrow.Array], column: str) -> tuple[str, ...]:
    names = tuple(sorted(pyarrow.compute.unique(listed[1]).to_pylist()))
    if len(names) < 2:
        raise BadInput(
            f"the train split's '{column}' lists {len(names)} label name(s) ({', '.join(names) or 'none'}): a "
            "multi-label problem has at least two labels; check LABEL_COLUMN, or name every label in LABEL_NAMES",
        )
    return names


def _vectors(
    split: str, column: str, rows: numpy.ndarray, flat: pyarrow.Array, count: int, names: tuple[str, ...], given: bool
) -> pyarrow.Array:
    """The multi-hot rows; a name that is not a label (not in LABEL_NAMES, or in no training row) is refused."""
    ids = pyarrow.compute.index_in(flat, value_set=pyarrow.array(names, pyarrow.string()))
    unknown = pyarrow.compute.is_null(ids)
    if pyarrow.compute.any(unknown).as_py():
        first = pyarrow.compute.index(unknown, True).as_py()
        odd = sorted(set(flat.filter(unknown).to_pylist()))
        where = f"LABEL_NAMES {list(names)}" if given else f"the training rows' labels {list(names)}"
        fix = (
            "add them to LABEL_NAMES, or fix those rows"
            if given
            else "a label no training row has cannot be learned: add training rows with it, remove it, or list "
            "every label in LABEL_NAMES"
        )
        raise BadInput(
            f"the {split} split's '{column}' names labels {odd[:5]} that are not among {where} (the first in row "
            f"{rows[first] + 1}); {fix}",
        )
    matrix = numpy.zeros((count, len(names)), dtype=numpy.float32)
    matrix[rows, ids.to_numpy(zero_copy_only=False)] = 1.0
    return _fixed_size(matrix)


def _from_columns(ds: datasets.Dataset, split: str, columns: tuple[str, ...]) -> pyarrow.Array:
    """LABEL_COLUMNS as the multi-hot rows: each column 0 or 1 (true/false, 0.0/1.0) in every row."""
    matrix = numpy.zeros((len(ds), len(columns)), dtype=numpy.float32)
    table = ds.with_format("arrow")
    for index, column in enumerate(columns):
        values = table[column]
        kind = values.type
        if not (pyarrow.types.is_integer(kind) or pyarrow.types.is_floating(kind) or pyarrow.types.is_boolean(kind)):
            raise BadInput(
                f"the {split} split's '{column}' (of LABEL_COLUMNS) holds {kind} values; each of LABEL_COLUMNS holds "
                f"0 or 1 per row (1: the row has that label): fix the column, or for label names listed in one "
                "column unset LABEL_COLUMNS and set LABEL_COLUMN to it",
            )
        numbers = pyarrow.compute.cast(values, pyarrow.float64()).to_numpy()  # a null reads as NaN
        bad = ~numpy.isin(numbers, (0.0, 1.0))
        if bad.any():
            first = int(numpy.flatnonzero(bad)[0])
            shown = "no value" if numpy.isnan(numbers[first]) else f"{numbers[first]:g}"
            raise BadInput(
                f"the {split} split's '{column}' (of LABEL_COLUMNS) holds {shown} in row {first + 1} "
                f"({int(bad.sum())} row(s) not 0 or 1); each of LABEL_COLUMNS holds 0 or 1 per row (1: the row has "
                "that label): fix those rows",
            )
        matrix[:, index] = numbers
    return _fixed_size(matrix)


def _fixed_size(matrix: numpy.ndarray) -> pyarrow.Array:
    return pyarrow.FixedSizeListArray.from_arrays(pyarrow.array(matrix.reshape(-1)), matrix.shape[1])

"""The rule a row's text is held to wherever it is read (training's splits, the test split, predict.py's input), in
the same words: a cell with no text is refused (the model would see `[CLS] [SEP]` alone), as is a NUL (binary
data, or UTF-16 read as UTF-8, which a tokenizer drops without a word); a blank line is no row. Imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from utils.common.errors import BadInput, JobError

NUL = "\x00"
NUL_FIX = (
    "a NUL is no text (binary data, or UTF-16 read as UTF-8): remove the NUL characters, or save the file as "
    "UTF-8 text (re-save a UTF-16 file as UTF-8)"
)


def check_texts(values: Sequence, column: str, source: str, place: Callable[[int], str]) -> None:
    """Refuse the first of `values` (a column's texts) that has no text or holds a NUL; `source` names where they
    come from (`reviews.csv`), `place(i)` the row at index i (`line 4`)."""
    empty = [i for i, value in enumerate(values) if not isinstance(value, str) or not value.strip()]
    if empty:
        raise BadInput(
            f"{source} has {len(empty)} row(s) with an empty or missing '{column}' (the first is {place(empty[0])}); "
            "a row without text would be read as nothing at all: fill in or remove those rows",
        )
    if nul := [i for i, value in enumerate(values) if NUL in value]:
        raise nul_refusal(
            source, f"{len(nul)} row(s) with a NUL character in '{column}' (the first is {place(nul[0])})"
        )


def nul_refusal(source: str, where: str) -> JobError:
    """A NUL in text, refused with the fix: `where` says which rows, or which line of a file before it is split."""
    return BadInput(f"{source} has {where}; {NUL_FIX}")

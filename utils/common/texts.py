"""The rule a row's text is held to wherever it is read: training's splits (utils/training/data.py), the test split and
predict.py's input, so a text one of them refuses the others refuse too, in the same words.

- A cell with no text (empty, missing, or only whitespace) is refused, naming the first such row: the model
  would be trained on, or answer about, `[CLS] [SEP]` alone.
- A NUL character in a text is refused, naming the first such row: it is no text (binary data, or UTF-16 read
  as UTF-8), and a tokenizer drops it without a word.
- A blank line is no row at all, skipped: in a file of one sentence a line, a line of whitespace only; in a .csv
  or .tsv, a line of spaces and tabs only, as the data loader skips it (utils/common/delimited.py).

Imports nothing heavy: predict.py checks its input before it loads a model.
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
    """Refuse the first of `values` (a column's texts, in row order) that has no text or holds a NUL. `source`
    names where they come from (`the train split`, `reviews.csv`), `place(i)` the row at index i (`row 3`,
    `line 4`)."""
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

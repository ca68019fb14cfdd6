"""The refusals docs/reliability.md shows, read as tables the tests check the job's words against."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from tests.support.env import REPO

RELIABILITY_DOC = REPO / "docs" / "reliability.md"


SETTING_WORD = re.compile(r"^(?:[A-Z][A-Z0-9_]*=[^$\s]+|--[a-z][a-z0-9-]*=[^$\s]+)$")  # no shell variable: a literal


# docs/reliability.md's "Bad input" rows whose example is settings alone but which the job refuses once it reads
# the model, the data or a file the example does not give: tests/test_refusals.py runs them, not `--dry-run`.
REFUSED_AFTER_DRY_RUN = {
    "LoRA targets not in the model",
    "a LoRA target that is the head",
    "a LoRA target LoRA cannot adapt",
    "a second text column that does not exist",
    "a DeepSpeed setting beside a config that says otherwise",
}


def shows(documented: str, printed: str) -> bool:
    """Whether `printed` is the line `documented`, each `...` in it standing for any text."""
    return re.fullmatch(".*?".join(map(re.escape, documented.split("..."))), printed) is not None


def code_spans(text: str) -> list[str]:
    return [match.group(2).strip() for match in re.finditer(r"(``?)(.+?)\1", text)]


@dataclass(frozen=True)
class DocumentedRefusal:
    example: str  # the row's second column, as written
    lines: list[str]  # every code span of its third column: the `error:` line first, then others or parts of them


def refusal_table(heading: str) -> dict[str, DocumentedRefusal]:
    """The rows of the table under `heading` in docs/reliability.md (`## Bad input`, `### \\`predict.py\\``...),
    by their case. Every row is one: a row the parser cannot split fails."""
    section = RELIABILITY_DOC.read_text().split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith(("| case |", "| --- |")):
            continue
        cells = line.removeprefix("| ").removesuffix(" |").split(" | ")
        assert len(cells) == 3 and code_spans(cells[2]), f"a row of other columns under {heading}: {line}"
        rows[cells[0]] = DocumentedRefusal(cells[1], code_spans(cells[2]))
    return rows


def assert_documented(row: str, printed: str, line: int = 0, where: Iterable[tuple[str, str]] = ()) -> None:
    """`printed` is line `line` of the "Bad input" row `row` (by its case): that line, each `...` in it any text, or,
    for a line after the first (an alternative the row shows in a parenthesis, often a part of the line), within it.
    `where`: the doc's words for what the test makes otherwise (the example's value, bert-base's size), each
    replaced by the test's first. tests/test_reliability_doc.py fails for a row no test names this way."""
    documented = refusal_table("## Bad input")[row].lines[line]
    for words, here in where:
        documented = documented.replace(words, here)
    shown = documented if line == 0 else f"...{documented}..."
    assert shows(shown, printed), f"{row}:\n  doc:  {documented}\n  job:  {printed}"


def settings_alone(example: str) -> list[str] | None:
    """The words of a "Bad input" example that is settings alone (one code span of NAME=value words and flags, then
    at most a parenthesis): what `--dry-run` resolves before torch. None for any other example."""
    spans = code_spans(example)
    if not spans or re.sub(r"\(.*\)$", "", example).strip() != f"`{spans[0]}`":
        return None
    words = spans[0].split()
    return words if words and all(SETTING_WORD.match(word) for word in words) else None

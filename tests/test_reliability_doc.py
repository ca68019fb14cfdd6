"""docs/reliability.md's "Bad input" table holds the job's own words: each row whose example is settings alone
(`NAME=value ...` or `--flag=value`, what `--dry-run` resolves before torch) is given to the job, in this process,
and the `error:` line it prints must be the one the row shows (`...` in the row stands for a path or a value the
example does not fix). A message reworded in the code and not in the doc fails here."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO, base_env, configured
from utils.errors import EXIT_BAD_INPUT, JobError

DOC = REPO / "docs" / "reliability.md"
ROW = re.compile(r"^\| (?P<case>[^|]+?) \| (?P<example>.+?) \| (?P<line>``?.+?``?)(?: \(.*\))? \|$")
SETTING = re.compile(r"^(?:[A-Z][A-Z0-9_]*=[^$\s]+|--[a-z][a-z0-9-]*=[^$\s]+)$")  # no shell variable: a literal
# Rows of settings that the job refuses once it reads the model, the data or a file the example does not give
# (tests/test_refusals.py runs those through the real process): not `--dry-run` refusals.
LATER = {
    "LoRA targets not in the model",
    "a LoRA target that is the head",
    "a LoRA target LoRA cannot adapt",
    "a second text column that does not exist",
    "a DeepSpeed setting beside a config that says otherwise",
}
LEAST_CHECKED = 15  # the table's runnable rows, so that a parser that stopped matching cannot pass


def code_spans(text: str) -> list[str]:
    return [match.group(2).strip() for match in re.finditer(r"(``?)(.+?)\1", text)]


def runnable_rows() -> list[tuple[str, list[str], str]]:
    """(case, the example's settings, the documented line) of each row whose example is settings alone: one code
    span of NAME=value words, then at most a parenthesis."""
    section = DOC.read_text().split("## Bad input", 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = ROW.match(line)
        if not match or match["case"] == "case":
            continue
        example = match["example"]
        spans = code_spans(example)
        if not spans or re.sub(r"\(.*\)$", "", example).strip() != f"`{spans[0]}`":
            continue
        words = spans[0].split()
        if words and all(SETTING.match(word) for word in words) and match["case"].strip() not in LATER:
            rows.append((match["case"].strip(), words, code_spans(match["line"])[0]))
    return rows


ROWS = runnable_rows()


@pytest.mark.check
def test_the_table_has_rows_to_check():
    assert len(ROWS) >= LEAST_CHECKED, [case for case, *_ in ROWS]


@pytest.mark.check
@pytest.mark.parametrize("case, words, documented", ROWS, ids=[case for case, *_ in ROWS])
def test_each_bad_input_row_shows_the_line_the_job_prints(tmp_path, monkeypatch, case, words, documented):
    env = base_env(tmp_path, OUTPUT_DIR=tmp_path / "out")
    flags = []
    for word in words:
        if word.startswith("--"):
            flags.append(word)
        else:
            name, value = word.split("=", 1)
            env[name] = value.strip("'")  # the shell's quotes
    with pytest.raises(JobError) as refused:
        configured(monkeypatch, env, ["--dry-run", *flags])
    assert refused.value.code == EXIT_BAD_INPUT
    pattern = ".*?".join(map(re.escape, documented.split("...")))
    assert re.fullmatch(pattern, refused.value.message), (
        f"{case}:\n  doc:  {documented}\n  job:  {refused.value.message}"
    )

"""docs/reliability.md's refusal tables hold the programs' own words, checked against what each prints.

"Bad input": each row whose example is settings alone (`NAME=value ...` or `--flag=value`, what `--dry-run`
resolves before torch) is given to the job, in this process. `predict.py` and `sweep.py`: each row's examples are
made concrete here (the files, the spec) and given to that program's `main`, in this process; the two examples that
need a trained adapter on a base of another shape run predict.py as a process on the suite's finished run. The
`error:` line printed must be the one the row shows, `...` in the row standing for text the example does not fix
(a path, a value, the rest of the fix). A message reworded in the code and not in the doc fails here, and so does a
row added to a table without an example made for it here."""

from __future__ import annotations

import io
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.make_demo_assets import write_tiny_bert
from tests.conftest import (
    REFUSED_AFTER_DRY_RUN,
    RELIABILITY_DOC,
    base_env,
    configured,
    error_lines,
    refusal_table,
    run_predict,
    settings_alone,
    shows,
)
from utils.errors import EXIT_BAD_INPUT, JobError

LEAST_CHECKED = 15  # the table's runnable rows, so that a parser that stopped matching cannot pass


def runnable_rows() -> list[tuple[str, list[str], str]]:
    """(case, the example's settings, the documented line) of each row whose example is settings alone, but for
    those refused once the model or data is read (tests/test_refusals.py holds those to their rows)."""
    rows = []
    for case, row in refusal_table("## Bad input").items():
        words = settings_alone(row.example)
        if words and case not in REFUSED_AFTER_DRY_RUN:
            rows.append((case, words, row.lines[0]))
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
    assert shows(documented, refused.value.message), f"{case}:\n  doc:  {documented}\n  job:  {refused.value.message}"


# ------------------------------------------------------------------------------- predict.py and sweep.py
def table(program: str) -> dict[str, list[str]]:
    """The documented `error:` lines (every code span of the third column) of each row of the table under
    `### \\`program\\``, by the row's case."""
    return {case: row.lines for case, row in refusal_table(f"### `{program}`").items()}


@dataclass
class Example:
    """One example of a row, made concrete in an empty working directory: `make` writes there what it needs and
    returns the command line. Its `error:` line must be the row's documented line number `line`, with each
    `placeholders` name in the doc read as its value here; an example whose line the row does not show (`line`
    None) must be refused in one line naming each of `names`."""

    make: Callable[[Path], list[str]]
    line: int | None = 0
    names: tuple[str, ...] = ()
    stdin: bytes | None = None
    placeholders: tuple[tuple[str, str], ...] = ()


def written(folder: Path, name: str, content: str | bytes) -> str:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return name


def model(folder: Path, text_column: str = "sentence") -> str:
    """OUTPUT_DIR/model as predict.py reads it before loading any weight: the record of what one input is (and the
    label names), written by the job's own writer as a run of TEXT_COLUMN=`text_column` saves it beside the adapter.
    Every example below but the base's is refused before the weights would load."""
    from utils.model_card import write_label_names
    from utils.settings import load_settings

    (folder / "OUTPUT_DIR" / "model").mkdir(parents=True)
    settings, _ = load_settings([], environ={"TEXT_COLUMN": text_column})
    write_label_names(folder / "OUTPUT_DIR" / "model", settings, {})
    return "OUTPUT_DIR/model"


PAIRS = "premise,hypothesis"
PREDICT = {
    "input that is not UTF-8 text": [
        Example(lambda d: [model(d)], stdin=b"\xff" + random.Random(0).randbytes(63)),
    ],
    "input holding NUL bytes": [
        Example(lambda d: [model(d), written(d, "sentences.txt", "a wonderful film\n".encode("utf-16-le"))]),
    ],
    "`--batch-size` outside 1-1,024": [Example(lambda d: [model(d), "--batch-size", "0"])],
    "no file, or a folder, as `FILE`": [
        Example(lambda d: [model(d), "missing.txt"]),
        Example(lambda d: [model(d), "."], line=1),
    ],
    "no such column (`--text-column`)": [
        Example(lambda d: [model(d), written(d, "no-column.csv", "text,label\na wonderful film,1\n")]),
    ],
    "a `.csv` quote open over lines, a row short of the column": [
        Example(lambda d: [model(d), written(d, "open-quote.csv", 'sentence,label\n"a dull film,0\na film,1\n')]),
    ],
    "a JSON record without text, a line that is not JSON": [
        Example(lambda d: [model(d), written(d, "no-text.json", '[{"sentence": "a film"}, {"sentence": 3}]')]),
    ],
    "input of another shape than the model's": [
        Example(lambda d: [model(d, PAIRS)], stdin=b"a wonderful film\n"),
    ],
    "what training refuses in a file": [
        Example(
            lambda d: [
                model(d, PAIRS),
                written(d, "pairs.csv", "premise,hypothesis\na film,it is good\na film, \n"),
                "--text-column",
                PAIRS,
            ]
        ),
        Example(lambda d: [model(d), written(d, "twice.csv", "sentence,sentence,label\na film,a film,1\n")], line=1),
    ],
    "an option that does not apply": [
        Example(lambda d: [model(d), written(d, "reviews.txt", "a wonderful film\n"), "--text-column", "review"]),
    ],
}
# The row whose examples need a trained adapter and a base of another shape (test_the_base_row_...).
ADAPTER_ROWS = {"a base (`--base-model`) of another shape than the adapter's"}


def spec(body: str, *args: str, before: Callable[[Path], object] = lambda d: None) -> Callable[[Path], list[str]]:
    """An example of a sweep: sweep.yaml holding `body`, output_dir `out` and, unless `body` says what to sweep, a
    grid of two trials; `before` prepares the folder first."""

    def make(folder: Path) -> list[str]:
        before(folder)
        space = "" if re.search(r"^(grid|random):", body, re.M) else "grid: {lora_r: [4, 8]}\n"
        return [written(folder, "sweep.yaml", f"output_dir: out\n{body}\n{space}"), *args]

    return make


def claimed(folder: Path) -> None:
    """`out` made the folder of a sweep of lora_r 8 (`--summarize` claims it, nothing run)."""
    from sweep import main

    assert main([written(folder, "first.yaml", "output_dir: out\ngrid: {lora_r: [8]}\n"), "--summarize"]) == 0


def planted(folder: Path) -> None:
    """`out` written by another tool: notes and a model, no sweep.json."""
    written(folder, "out/summary.md", "# my notes\n")
    written(folder, "out/trial-000/model/model.safetensors", b"theirs")


def not_a_file(folder: Path) -> list[str]:
    (folder / "examples" / "sweeps").mkdir(parents=True)
    return ["examples/sweeps"]


def fifo(folder: Path) -> list[str]:
    os.mkfifo(folder / "sweep.yaml")  # no writer: reading would wait for one
    return ["sweep.yaml"]


LIMIT_GRID = f"grid: {{lora_r: {list(range(1, 101))}, seed: {list(range(11))}}}"  # 1,100 trials
SWEEP = {
    "unknown setting": [Example(spec("settings: {learning_rat: 1}"))],
    "a value the job refuses": [Example(spec("grid: {lora_r: [0, 8]}"))],
    "empty grid": [Example(spec("grid: {learning_rate: []}"))],
    "a value listed twice": [Example(spec('grid: {lora_r: [8, "8"]}'))],
    "too many trials": [
        Example(spec("random: {lora_r: {low: 1, high: 64}}\ntrials: 100000000")),
        Example(spec(LIMIT_GRID), line=1),
    ],
    "a metric the trials do not write": [
        Example(spec("metric: acuracy"), line=None, names=("metric='acuracy'", "did you mean accuracy?")),
        Example(spec("settings: {task: stsb}\nmetric: spearmanr")),
    ],
    "bad range": [
        Example(spec("random: {learning_rate: {low: 1.0e-3, high: 1.0e-4}}\ntrials: 2")),
        Example(spec("random: {learning_rate: {low: 0, high: 1.0e-3, log: true}}\ntrials: 2"), line=1),
        Example(spec("random: {lora_r: {low: 1.2, high: 1.8, type: int}}\ntrials: 2"), line=2),
    ],
    "a key of the wrong type or range": [Example(spec("seed: abc"))],
    "unknown spec key": [Example(spec("metrics: f1"))],
    "random without a count": [Example(spec("random: {lora_r: {low: 4, high: 64}}"))],
    "a Hub repo not from `push:`": [
        Example(spec("settings: {RESULT_MERGED_MODEL_ID: me/x}")),
        Example(spec("config: r.yaml", before=lambda d: written(d, "r.yaml", "result_model_id: me/x\n")), line=1),
    ],
    "not a spec file": [
        Example(not_a_file),
        Example(fifo, line=None, names=("sweep.yaml is not a regular file",)),
        Example(lambda d: [written(d, "sweep.yaml", b"grid: {lora_r: [4]}\n\xff\xfe")], line=1),
    ],
    "nowhere to write": [
        Example(spec("", before=lambda d: written(d, "out", "someone's notes\n"))),
        Example(spec("backend: katib", "-o", "out", before=lambda d: (d / "out").mkdir()), line=1),
    ],
    "another tool's folder": [Example(spec("", before=planted))],
    "another sweep's folder": [Example(spec("grid: {lora_r: [16]}", "--summarize", before=claimed))],
    "a backend's bad option": [
        Example(spec("backend: slurm\nslurm: {gpus: true}")),
        Example(spec("backend: katib\nkatib: {image: x}"), line=1),
        Example(spec("backend: katib\nname: My_Sweep"), line=2),
    ],
    "a metric Katib cannot read": [Example(spec("backend: katib\nmetric: f1"))],
    # NAME: the sweep's name, by default its spec's stem
    "`--summarize` on Katib": [Example(spec("backend: katib", "--summarize"), placeholders=(("NAME", "sweep"),))],
}
# Each table's rows, so that a parser that stopped matching cannot pass (the examples above must cover every row).
LEAST_ROWS = {"predict.py": 11, "sweep.py": 18}
EXAMPLES = {"predict.py": PREDICT, "sweep.py": SWEEP}


@pytest.mark.check
@pytest.mark.parametrize("program", EXAMPLES)
def test_each_row_of_the_table_has_its_examples_here(program):
    """Every row is checked: each has examples here, for every line it shows, the first of them included."""
    rows = table(program)
    assert len(rows) >= LEAST_ROWS[program], list(rows)
    made = {**EXAMPLES[program], **dict.fromkeys(ADAPTER_ROWS if program == "predict.py" else (), [])}
    assert set(rows) == set(made), f"rows without examples: {set(rows) - set(made)}; gone: {set(made) - set(rows)}"
    for case, examples in EXAMPLES[program].items():
        assert {example.line for example in examples} - {None} == set(range(len(rows[case]))), case


def printed(capsys, program: str, argv: list[str], stdin: bytes | None) -> tuple[int, str]:
    """`program`'s main() on `argv` in this process (standard input `stdin`): its exit code and what it printed
    on stderr."""
    if program == "predict.py":
        from predict import main
    else:
        from sweep import main
    capsys.readouterr()  # what preparing the example printed
    if stdin is not None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
            code = main(argv)
    else:
        code = main(argv)
    return code, capsys.readouterr().err


def refusal(code: int, stderr: str) -> str:
    """The one `error:` line of a refusal (exit 2, no traceback), without its `error: `."""
    errors = error_lines(stderr)
    assert code == EXIT_BAD_INPUT and len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0].removeprefix("error: ")


def assert_shown(case: str, documented: str, line: str, placeholders=()) -> None:
    for name, value in placeholders:
        documented = documented.replace(name, value)
    assert shows(documented, line), f"{case}:\n  doc:  {documented}\n  job:  {line}"


CASES = [(program, case, i) for program, rows in EXAMPLES.items() for case in rows for i in range(len(rows[case]))]


@pytest.mark.check
@pytest.mark.parametrize(
    "program, case, index", CASES, ids=[f"{program} {case} {index}" for program, case, index in CASES]
)
def test_each_example_prints_the_line_its_row_shows(tmp_path, monkeypatch, capsys, program, case, index):
    example = EXAMPLES[program][case][index]
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in base_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    folder = tmp_path / "here"
    folder.mkdir()
    monkeypatch.chdir(folder)
    line = refusal(*printed(capsys, program, example.make(folder), example.stdin))
    if example.line is None:
        assert all(name in line for name in example.names), line
    else:
        assert_shown(case, table(program)[case][example.line], line, example.placeholders)


def test_the_base_row_shows_the_lines_predict_prints(finished_run, sst2_dir, tmp_path):
    """The adapter of the suite's finished run (trained on the 64-wide, 2-layer tiny BERT, published as
    tester/tiny-bert) on a 32-wide base, then on a 3-layer one: predict.py as a process, as a user runs it."""
    (case,) = ADAPTER_ROWS
    documented = table("predict.py")[case]
    (tmp_path / "OUTPUT_DIR").mkdir()
    (tmp_path / "OUTPUT_DIR" / "model").symlink_to(finished_run.out / "model")
    written(tmp_path, "sentences.txt", "a wonderful film\n")
    bases = [("narrow-bert", {"hidden": 32}), ("deep-bert", {"layers": 3})]
    for (name, shape), shown in zip(bases, documented, strict=True):
        write_tiny_bert(tmp_path / name, sst2_dir, **shape)
        args = ("OUTPUT_DIR/model", "sentences.txt", "--base-model", name)
        result = run_predict(base_env(tmp_path), *args, cwd=tmp_path)
        assert result.stdout == ""
        assert_shown(case, shown, refusal(result.code, result.stderr))


# ------------------------------------------------------------------------------- lines shown in the prose
@pytest.mark.check
def test_the_rendezvous_refusal_shown_is_the_one_the_ranks_print():
    """The line the doc shows for replicas started differently: rank 1 given WORLD_SIZE=3 and LORA_R=16, rank 0
    WORLD_SIZE=2 and the default, one RUN_NAME, each rank's agreement made and compared as the rendezvous does."""
    from utils.identity import agreement_refusal
    from utils.plan import build_plan
    from utils.run import agreement_of
    from utils.settings import load_settings

    def agreement(world: int, **env: str) -> dict:
        settings, _ = load_settings([], environ={"OUTPUT_DIR": "/pvc-home/output", "RUN_NAME": "sst2", **env})
        return agreement_of(settings, build_plan(settings, world), world)

    [documented] = re.findall(
        r"`error: (the replicas were started with other settings [^`]+)`", RELIABILITY_DOC.read_text()
    )
    printed = agreement_refusal(agreement(2), {1: agreement(3, LORA_R="16")})
    assert shows(documented, printed), f"doc:  {documented}\njob:  {printed}"

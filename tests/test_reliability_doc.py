"""docs/reliability.md's refusal tables hold the programs' own words, checked against what each prints.

"Bad input" rows whose example is settings alone are given to the job's `--dry-run` resolution; each `predict.py`
and `sweep.py` row's examples are made concrete here and given to that program's `main` (the adapter rows: predict.py
as a process on the suite's finished run). The printed `error:` line must be the row's, `...` standing for text the
example does not fix. Other "Bad input" rows are checked where their refusal is made (`row=`, `assert_documented`),
and a row no test names fails here. Lines the prose shows are made by the code that prints them."""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.make_demo_assets import write_tiny_bert
from tests.support.docs import (
    REFUSED_AFTER_DRY_RUN,
    RELIABILITY_DOC,
    assert_documented,
    code_spans,
    refusal_table,
    settings_alone,
    shows,
)
from tests.support.env import REPO, REPO_ID, base_env, free_port
from tests.support.harness import configured
from tests.support.outcomes import error_lines
from tests.support.processes import run_predict
from utils.common.errors import EXIT_BAD_INPUT, JobError

OUT = "OUTPUT_DIR=/out"  # the folder a restart compares its identity with
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


def refused(call: Callable[[], object], code: int = EXIT_BAD_INPUT) -> str:
    """The message of the JobError `call()` raises, with exit code `code`."""
    with pytest.raises(JobError) as raised:
        call()
    assert raised.value.code == code
    return raised.value.message


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
    message = refused(lambda: configured(monkeypatch, env, ["--dry-run", *flags]))
    assert shows(documented, message), f"{case}:\n  doc:  {documented}\n  job:  {message}"


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
    from utils.config.sources import load_settings
    from utils.publishing.model_card import write_label_names

    (folder / "OUTPUT_DIR" / "model").mkdir(parents=True)
    settings, _ = load_settings([], environ={"TEXT_COLUMN": text_column})
    write_label_names(
        folder / "OUTPUT_DIR" / "model", {}, settings.label_names, settings.text_columns, settings.label_column
    )
    return "OUTPUT_DIR/model"


PAIRS = "premise,hypothesis"
# fmt: off
PREDICT = {  # a table: a row's examples on its line, or the lines after it
    "input that is not UTF-8 text": [Example(lambda d: [model(d)], stdin=b"\xff" + random.Random(0).randbytes(63))],
    "input holding NUL characters": [
        Example(lambda d: [model(d), written(d, "sentences.txt", "a wonderful film\n".encode("utf-16-le"))])],
    "metrics asked of a file without labels": [
        Example(lambda d: [model(d), written(d, "test.tsv", "sentence\tlabel\na film\t-1\n"), "--metrics", "m.json"])],
    "`--batch-size` outside 1-1,024": [Example(lambda d: [model(d), "--batch-size", "0"])],
    "no file, or a folder, as `FILE`": [
        Example(lambda d: [model(d), "missing.txt"]), Example(lambda d: [model(d), "."], line=1)],
    "no such column (`--text-column`)": [
        Example(lambda d: [model(d), written(d, "no-column.csv", "text,label\na wonderful film,1\n")])],
    "a `.csv` quote open over lines, a row short of the column": [
        Example(lambda d: [model(d), written(d, "open-quote.csv", 'sentence,label\n"a dull film,0\na film,1\n')])],
    "a JSON record without text, a line that is not JSON": [
        Example(lambda d: [model(d), written(d, "no-text.json", '[{"sentence": "a film"}, {"sentence": 3}]')]),
        Example(lambda d: [model(d), written(d, "reviews.jsonl", '{"review": "a film"}\n')], line=1)],
    "input of another shape than the model's": [Example(lambda d: [model(d, PAIRS)], stdin=b"a wonderful film\n")],
    "what training refuses in a file": [
        Example(lambda d: [model(d, PAIRS),
                           written(d, "pairs.csv", "premise,hypothesis\na film,it is good\na film, \n"),
                           "--text-column", PAIRS]),
        Example(lambda d: [model(d), written(d, "twice.csv", "sentence,sentence,label\na film,a film,1\n")], line=1)],
    "an option that does not apply": [
        Example(lambda d: [model(d), written(d, "reviews.txt", "a wonderful film\n"), "--text-column", "review"])],
}
# fmt: on
# The row whose examples need a trained adapter and a base of another shape (test_the_base_row_...).
SHAPE_ROW = "a base (`--base-model`) of another shape than the adapter's"
CHANGED_ROW = "a base folder changed since the adapter was trained on it"
LABEL_ROW = "a label the model cannot be scored against"  # its labels are read from the loaded model
ADAPTER_ROWS = {SHAPE_ROW, CHANGED_ROW, LABEL_ROW}


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
# fmt: off
SWEEP = {
    "unknown setting": [Example(spec("settings: {learning_rat: 1}"))],
    "a value the job refuses": [Example(spec("grid: {lora_r: [0, 8]}"))],
    "empty grid": [Example(spec("grid: {learning_rate: []}"))],
    "a value listed twice": [Example(spec('grid: {lora_r: [8, "8"]}'))],
    "too many trials": [
        Example(spec("random: {lora_r: {low: 1, high: 64}}\ntrials: 100000000")),
        Example(spec(LIMIT_GRID), line=1)],
    "a metric the trials do not write": [
        Example(spec("metric: acuracy"), line=None, names=("metric='acuracy'", "did you mean accuracy?")),
        Example(spec("settings: {task: stsb}\nmetric: spearmanr"))],
    "bad range": [
        Example(spec("random: {learning_rate: {low: 1.0e-3, high: 1.0e-4}}\ntrials: 2")),
        Example(spec("random: {learning_rate: {low: 0, high: 1.0e-3, log: true}}\ntrials: 2"), line=1),
        Example(spec("random: {lora_r: {low: 1.2, high: 1.8, type: int}}\ntrials: 2"), line=2)],
    "a key of the wrong type or range": [Example(spec("seed: abc"))],
    "unknown spec key": [Example(spec("metrics: f1"))],
    "random without a count": [Example(spec("random: {lora_r: {low: 4, high: 64}}"))],
    "a Hub repo not from `push:`": [
        Example(spec("settings: {RESULT_MERGED_MODEL_ID: me/x}")),
        Example(spec("config: r.yaml", before=lambda d: written(d, "r.yaml", "result_model_id: me/x\n")), line=1)],
    "not a spec file": [
        Example(not_a_file),
        Example(fifo, line=None, names=("sweep.yaml is not a regular file",)),
        Example(lambda d: [written(d, "sweep.yaml", b"grid: {lora_r: [4]}\n\xff\xfe")], line=1)],
    "nowhere to write": [
        Example(spec("", before=lambda d: written(d, "out", "someone's notes\n"))),
        Example(spec("backend: katib", "-o", "out", before=lambda d: (d / "out").mkdir()), line=1)],
    "another tool's folder": [Example(spec("", before=planted))],
    "another sweep's folder": [Example(spec("grid: {lora_r: [16]}", "--summarize", before=claimed))],
    "a backend's bad option": [
        Example(spec("backend: slurm\nslurm: {gpus: true}")),
        Example(spec("backend: katib\nkatib: {image: x}"), line=1),
        Example(spec("backend: katib\nname: My_Sweep"), line=2)],
    "a metric Katib cannot read": [Example(spec("backend: katib\nmetric: f1"))],
    # NAME: the sweep's name, by default its spec's stem
    "`--summarize` on Katib": [Example(spec("backend: katib", "--summarize"), placeholders=(("NAME", "sweep"),))],
}
# fmt: on
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


def test_the_adapter_rows_show_the_lines_predict_prints(finished_run, sst2_dir, tiny_bert, tmp_path):
    """The adapter of the suite's finished run (trained on the 64-wide, 2-layer tiny BERT) on a 32-wide base, a
    3-layer one, a copy of its base with config.json edited, then scored on a file with a label it does not have:
    predict.py as a process, as a user runs it."""
    (tmp_path / "OUTPUT_DIR").mkdir()
    (tmp_path / "OUTPUT_DIR" / "model").symlink_to(finished_run.out / "model")
    written(tmp_path, "sentences.txt", "a wonderful film\n")
    written(tmp_path, "odd.csv", "sentence,label\na good film,1\na film,meh\n")
    write_tiny_bert(tmp_path / "narrow-bert", sst2_dir, hidden=32)
    write_tiny_bert(tmp_path / "deep-bert", sst2_dir, layers=3)
    edited = shutil.copytree(tiny_bert, tmp_path / "edited-base")
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-5}))
    shown = [(row, line) for row in (SHAPE_ROW, CHANGED_ROW, LABEL_ROW) for line in table("predict.py")[row]]
    runs = [("narrow-bert", "sentences.txt"), ("deep-bert", "sentences.txt"), ("edited-base", "sentences.txt")]
    for (row, documented), (base, file) in zip(shown, [*runs, (str(tiny_bert), "odd.csv")], strict=True):
        result = run_predict(base_env(tmp_path), "OUTPUT_DIR/model", file, "--base-model", base, cwd=tmp_path)
        assert result.stdout == ""
        assert_shown(row, documented, refusal(result.code, result.stderr))


# ------------------------------------------------------------------------------- rows run elsewhere
# A "Bad input" row that is not settings alone is checked where its refusal is made: a case of tests/test_refusals.py
# naming it (`row=`), or a test calling `assert_documented` with it (here and in other modules). Every row must be
# one of these: a row added without a test that prints its line fails here.
NAMED = re.compile(r"""(?:\brow=|assert_documented\(\s*)(["'])(?P<row>.+?)\1""")
LEAST_NAMED = 80  # rows named by a test, so that a NAMED that stopped matching cannot pass


def rows_named_by_tests() -> set[str]:
    return {match["row"] for source in (REPO / "tests").glob("*.py") for match in NAMED.finditer(source.read_text())}


@pytest.mark.check
def test_every_bad_input_row_is_checked_against_the_job():
    rows = refusal_table("## Bad input")
    at_dry_run = {case for case, *_ in ROWS}
    named = rows_named_by_tests()
    assert len(named) >= LEAST_NAMED, sorted(named)
    assert named <= set(rows), f"named by a test, in no row: {named - set(rows)}"
    assert REFUSED_AFTER_DRY_RUN <= named, REFUSED_AFTER_DRY_RUN - named
    assert not set(rows) - at_dry_run - named, f"rows no test checks: {set(rows) - at_dry_run - named}"


@pytest.mark.check
def test_the_diverging_loss_row_is_the_check_training_runs():
    """The check the Trainer calls at every loss record (utils/run.FiniteLoss, on every rank alike), given the
    record the row describes: an infinite loss logged at step 1."""
    from utils.run import FiniteLoss

    assert_documented("a training loss that is not a number", refused(lambda: FiniteLoss().check(float("inf"), 1)))


@pytest.mark.check
def test_deepspeed_not_installed_is_refused_at_dry_run(tmp_path, monkeypatch):
    """`STRATEGY=deepspeed` where the package cannot be imported (an image without it: this process's import of it
    made to find nothing), at `--dry-run`."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    printed = refused(lambda: configured(monkeypatch, base_env(tmp_path, STRATEGY="deepspeed"), ["--dry-run"]))
    assert_documented("DeepSpeed not installed", printed)


def agreement(world: int, **env: str) -> dict:
    """What a rank given `env` on `world` replicas brings to the rendezvous (utils/run.agreement_of), one RUN_NAME."""
    from utils.config.plan import build_plan
    from utils.config.sources import load_settings
    from utils.run import agreement_of

    settings, _ = load_settings([], environ={"OUTPUT_DIR": "/pvc-home/output", "RUN_NAME": "sst2", **env})
    return agreement_of(build_plan(settings, world), world, settings.output_dir)


@pytest.mark.check
def test_the_replicas_row_is_what_the_ranks_print():
    """Two replicas, one given LEARNING_RATE=5e-4 and the other 0.9: rank 1's agreement compared with rank 0's as
    the rendezvous compares them."""
    from utils.config.identity import agreement_refusal

    printed = agreement_refusal(agreement(2, LEARNING_RATE="5e-4"), {1: agreement(2, LEARNING_RATE="0.9")})
    assert_documented("replicas with different settings", printed)


# ------------------------------------------------------------------------------- lines shown in the prose
def prose(start: str) -> str:
    """The one code span of docs/reliability.md, the Bad input table's aside, that starts with `start` (a span
    broken over lines read as one line), without its `error: `."""
    lines: list[str] = []
    for line in RELIABILITY_DOC.read_text().splitlines():
        if lines and lines[-1].strip() and line.strip() and not (line.startswith("| ") or lines[-1].startswith("| ")):
            lines[-1] += " " + line.strip()  # a paragraph, or a list item, as one line
        else:
            lines.append(line)
    table = {shown for row in refusal_table("## Bad input").values() for shown in row.lines}
    [span] = [span for line in lines for span in code_spans(line) if span.startswith(start) and span not in table]
    return span.removeprefix("error: ")


def assert_prose(documented: str, printed: str, where: dict[str, str] | None = None) -> None:
    for words, here in (where or {}).items():
        documented = documented.replace(words, here)
    assert shows(documented, printed), f"doc:  {documented}\njob:  {printed}"


@pytest.mark.check
def test_the_token_check_that_cannot_reach_the_hub_says_so_as_shown(monkeypatch):
    """The token check of a start (utils/publishing/hub.Hub.check_write_access) against an endpoint where nothing listens,
    its deadline 1 s (PUSH_TIMEOUT=1, which bounds it): the row and the Hub faults section show its line."""
    from huggingface_hub import constants
    from pydantic import SecretStr

    from utils.publishing.hub import Hub

    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    printed = refused(lambda: Hub(SecretStr("hf_" + "x" * 34), max_retry_seconds=1).check_write_access(REPO_ID))
    where = {"<endpoint>": endpoint, "within 120 s": "within 1 s"}
    assert_documented("Hub unreachable at the token check", printed, where=where.items())
    assert_prose(prose("error: the Hub at"), printed, where)


@pytest.mark.check
def test_lines_the_prose_repeats_from_the_table_are_the_rows_lines():
    """A line shown twice, in the table and in the prose, is the same line: the row's is checked against the job."""
    rows = refusal_table("## Bad input")
    assert prose("error: .../run.json is damaged") == rows["torn run record"].lines[0]
    link = prose("error: .../tensorboard/<run>/x is a symbolic link")
    assert shows(rows["a link planted in the run folder"].lines[0], link), link
    for start, row in (
        ("... (data files:", "data changed since a finished run"),
        ("... (base model:", "base model replaced since a run"),
    ):
        assert shows(prose(start).replace("...", "OUTPUT_DIR=... holds another run", 1) + "...", rows[row].lines[0])
    for start, row in (
        ("OUTPUT_DIR=... is in use by another job", "`OUTPUT_DIR` in use"),
        ("OUTPUT_DIR=... is not empty and is not a run folder", "output dir that is no run of the job"),
    ):
        assert shows(prose(start) + "...", rows[row].lines[0]), start
    older = prose("OUTPUT_DIR=... holds another run (LORA_R: 8 -> 4)").replace("8 -> 4", "4 -> 8")
    assert older == rows["output dir of another run"].lines[0]


@pytest.mark.check
def test_the_identity_lines_shown_are_the_ones_a_restart_prints():
    """A restart on 2 replicas of a run of PER_DEVICE_BATCH_SIZE=16 on 1, and of a DeepSpeed run whose config file
    changed its scheduler: each run's identity as the plan derives it, compared as every place compares them."""
    from utils.config.identity import agreement_refusal, check_same_run
    from utils.config.plan import build_plan
    from utils.config.sources import load_settings

    settings, _ = load_settings([], environ={"PER_DEVICE_BATCH_SIZE": "16"})
    printed = refused(lambda: check_same_run(build_plan(settings, 1).identity, build_plan(settings, 2).identity, OUT))
    assert_prose(prose("OUTPUT_DIR=... holds another run (global batch: 16 -> 32"), printed)

    def deepspeed(scheduler: str) -> dict:
        return {
            **build_plan(settings, 1).identity,
            "strategy": "deepspeed",
            "deepspeed": {"scheduler": {"type": scheduler}},
        }

    printed = refused(lambda: check_same_run(deepspeed("WarmupDecayLR"), deepspeed("WarmupLR"), OUT))
    assert_prose(f"...{prose('... (DEEPSPEED_CONFIG: scheduler.type')}", printed)

    def stage(zero: int) -> dict:  # ZERO_STAGE, no config file
        return {**build_plan(settings, 1).identity, "strategy": "deepspeed", "zero_stage": zero}

    assert_prose(
        f"...{prose('holds another run (ZERO_STAGE: 2 -> 3)')}",
        refused(lambda: check_same_run(stage(2), stage(3), OUT)),
    )
    assert_prose(f"...{prose('rank 1: ZERO_STAGE: 2 -> 3')}...", agreement_refusal(stage(2), {1: stage(3)}))


@pytest.mark.check
@pytest.mark.parametrize(
    "errno_name, start",
    [("ENOSPC", "error: OUTPUT_DIR=/pvc-home/output is full"), ("EROFS", "error: OUTPUT_DIR=... turned read-only")],
)
def test_the_volume_lines_shown_are_the_ones_a_fault_prints(tmp_path, errno_name, start):
    """The line a checkpoint save that met a full (or read-only) volume ends with (utils/run_folder/checkpoints.py
    volume_fault), the run folder holding complete checkpoint-10 and checkpoint-20 (the doc's full volume resumes
    from 20)."""
    import errno

    from utils.run_folder.checkpoints import COMPLETE_MARKER, volume_fault
    from utils.run_folder.layout import RunDir

    run = RunDir(tmp_path / "output")
    latest = 20 if errno_name == "ENOSPC" else 10
    for step in range(10, latest + 1, 10):
        (run.checkpoints / f"checkpoint-{step}").mkdir(parents=True)
        (run.checkpoints / f"checkpoint-{step}" / COMPLETE_MARKER).write_text("{}")
    code = getattr(errno, errno_name)
    doing = "saving checkpoint-30" if errno_name == "ENOSPC" else "creating checkpoint-20"
    fault = volume_fault(run, OSError(code, os.strerror(code)), doing)
    assert fault is not None and fault.code == EXIT_BAD_INPUT
    assert_prose(prose(start), fault.message, {"/pvc-home/output": str(run.root)})


@pytest.mark.check
def test_the_lost_peer_line_shown_is_the_one_a_rank_prints():
    """Rank 0 of 4 meeting torch's DistNetworkError in a collective (a lost peer by its type; the doc's example met
    the RuntimeError gloo raises, a lost peer once the peer's heartbeat stopped), checkpoint-40 the latest."""
    import torch.distributed as td

    from utils.cluster.collectives import Collectives
    from utils.config.distributed import DistEnv

    group = Collectives(DistEnv(0, 0, 4, 0, "replica-0", 29500, "platform"), 600)
    with pytest.raises(JobError) as lost, group.peers_watched(lambda: "the run resumes from checkpoint-40"):
        raise td.DistNetworkError("Connection reset by peer")
    assert lost.value.code == 143
    assert_prose(prose("error: rank 0 lost contact"), lost.value.message, {"(RuntimeError)": "(DistNetworkError)"})


@pytest.mark.check
def test_the_missing_rank_0_line_shown_is_the_one_a_rank_prints():
    """Rank 1 waiting for a rank 0 that never listens (utils/cluster/collectives._wait_for_rank0, what the rendezvous
    waits in), its deadline 1 s into the doc's RENDEZVOUS_TIMEOUT=600s."""
    import time

    from utils.cluster.collectives import _wait_for_rank0
    from utils.config.distributed import DistEnv

    port = free_port()
    printed = refused(
        lambda: _wait_for_rank0(DistEnv(1, 0, 2, 1, "127.0.0.1", port, "platform"), 600, time.monotonic() + 1), code=1
    )
    assert_prose(prose("error: rank 1 found no rank 0"), printed, {"<addr>:<port>": f"127.0.0.1:{port}"})


@pytest.mark.check
def test_the_checkpoint_lines_shown_are_the_ones_a_restart_logs(tmp_path, caplog):
    """A restart (utils/run.resume_checkpoint) over checkpoint-60 cut short, checkpoint-160 complete and
    checkpoint-180 complete, its optimizer.pt since cut to 100 of its 9541 bytes."""
    import hashlib

    from utils.run import resume_checkpoint
    from utils.run_folder.checkpoints import COMPLETE_MARKER
    from utils.run_folder.layout import RunDir

    run = RunDir(tmp_path / "output")
    for step, written, now in ((160, 9541, 9541), (180, 9541, 100)):
        folder = run.checkpoints / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "optimizer.pt").write_bytes(b"o" * now)
        files = {"optimizer.pt": {"size": written, "sha256": hashlib.sha256(b"o" * written).hexdigest()}}
        (folder / COMPLETE_MARKER).write_text(json.dumps({"files": files, "resume": {}}))
    (run.checkpoints / "checkpoint-60").mkdir()
    with caplog.at_level("WARNING", logger="utils.run"):
        assert resume_checkpoint(run, {}) == str(run.checkpoints / "checkpoint-160")
    logged = [record.getMessage() for record in caplog.records]
    for start in ("removed checkpoint-60", "removed checkpoint-180"):
        documented = prose(start)
        assert any(shows(f"{documented}...", line) for line in logged), f"doc:  {documented}\njob:  {logged}"


@pytest.mark.check
def test_the_misspelled_setting_warning_shown_is_the_one_a_start_prints(capsys):
    """What a start prints (utils/config/sources.warn_misspelled_variables) for LEARNIG_RATE in its environment."""
    from utils.config.sources import warn_misspelled_variables

    warn_misspelled_variables({"LEARNIG_RATE": "1e-4"})
    [printed] = capsys.readouterr().err.splitlines()
    assert_prose(prose("warning: LEARNIG_RATE is set"), printed)


def test_the_failed_push_line_shown_is_the_one_a_run_prints(finished_run):
    """The suite's finished run, whose first commits the Hub stand-in refused (403): exit 3 and this line first."""
    assert finished_run.first.code == 3
    printed = error_lines(finished_run.first.stderr)[0].removeprefix("error: ")
    where = {"<repo>": REPO_ID, "<OUTPUT_DIR>": str(finished_run.out)}
    assert_prose(prose("error: push to <repo> failed"), printed, where)


def test_the_hub_retry_line_shown_is_the_one_a_push_logs(hub, hub_in_process, tmp_path, caplog):
    """A push (utils/publishing/hub.Hub.push_files) whose create_repo the Hub stand-in answers with 503 twice: the second
    retry's line, its jittered wait aside."""
    config = tmp_path / "adapter_config.json"
    config.write_text("{}")
    hub.fail("create", 503, 503)
    with caplog.at_level("WARNING", logger="utils.publishing.hub"):
        hub_in_process(60).push_files({"adapter_config.json": config}, REPO_ID, True, "upload")
    documented = prose("Hub create_repo failed").replace("1.7", "...")
    logged = [record.getMessage() for record in caplog.records]
    assert any(shows(documented, line) for line in logged), f"doc:  {documented}\njob:  {logged}"


@pytest.mark.check
def test_the_rendezvous_refusal_shown_is_the_one_the_ranks_print():
    """The line the doc shows for replicas started differently: rank 1 given WORLD_SIZE=3 and LORA_R=16, rank 0
    WORLD_SIZE=2 and the default, one RUN_NAME, each rank's agreement made and compared as the rendezvous does."""
    from utils.config.identity import agreement_refusal

    [documented] = re.findall(
        r"`error: (the replicas were started with other settings [^`]+)`", RELIABILITY_DOC.read_text()
    )
    printed = agreement_refusal(agreement(2), {1: agreement(3, LORA_R="16")})
    assert shows(documented, printed), f"doc:  {documented}\njob:  {printed}"

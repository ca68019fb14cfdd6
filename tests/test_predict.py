"""predict.py as a user runs it, on the suite's one finished run (`finished_run`): odd inputs, bad arguments, and
every `python predict.py` command the README, docs/, predict.py's help and the model card show."""

from __future__ import annotations

import ast
import csv
import json
import os
import random
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from scripts.make_demo_assets import write_tiny_bert
from tests.support.commands import runnable
from tests.support.data import STRAY_QUOTE, delimited, write_files
from tests.support.docs import assert_documented
from tests.support.env import BASE_ID, LABELS, MAX_SEQ_LENGTH, MERGED_ID, REPO, REPO_ID, base_env
from tests.support.outcomes import assert_refusal, error_lines, succeeded
from tests.support.processes import PIPE, CompletedProcess, Result, run_command, run_predict, start
from utils.common.errors import JobError

SENTENCES = ["a wonderful , moving film", "a dull and tedious mess", "the cast is superb"]
REVIEWS = ["a wonderful film", "a dull, tedious mess"]
HUB_REPO = "your-name/bert-sst2-lora"  # the docs' example repo id, served by the local Hub stand-in


@pytest.fixture
def trained(finished_run) -> Path:
    """OUTPUT_DIR of the shared finished run (read only); its adapter names its base by Hub id (BASE_ID)."""
    return finished_run.out


def predict(cwd: Path, *args: str, stdin: bytes = b"", **env: str) -> CompletedProcess:
    argv = [sys.executable, str(REPO / "predict.py"), *map(str, args)]
    return run_command(argv, input=stdin, env=base_env(cwd, **env), cwd=cwd, timeout=180, text=False)


def is_prediction(line: dict) -> bool:
    """One answer: its text, a label of the model's, a score, and only the input's other columns carried through."""
    carried = set(line) - {"text", "label", "score"}
    return carried <= {"id", "idx", "input_label"} and line["label"] in LABELS and 0.5 <= line["score"] <= 1


def answers(result: CompletedProcess) -> list[dict]:
    """The JSON lines on stdout, each checked to be one prediction (`is_prediction`)."""
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    for line in lines:
        assert is_prediction(line), line
    return lines


def test_the_model_folders_record_the_length_the_run_trained_with(trained):
    for folder in ("model", "merged"):
        config = json.loads((trained / folder / "tokenizer_config.json").read_text())
        assert config["model_max_length"] == MAX_SEQ_LENGTH, folder


@pytest.mark.parametrize(
    "source, content",
    [("file", b""), ("stdin", b""), ("file", b"\n  \n\t\n"), ("stdin", b"\n\r\n   \n")],
    ids=["empty file", "empty stdin", "blank lines in a file", "blank lines on stdin"],
)
def test_no_sentences_print_nothing_and_exit_0(trained, tmp_path, source, content):
    (tmp_path / "sentences.txt").write_bytes(content)
    args = ["sentences.txt"] if source == "file" else []
    result = predict(tmp_path, trained / "merged", *args, stdin=content)
    assert answers(result) == [] and result.stdout == b""
    assert "Traceback" not in result.stderr.decode() and not error_lines(result.stderr.decode())


@pytest.mark.parametrize(
    "source, content, names",
    [
        ("stdin", b"\xff" + random.Random(0).randbytes(4096), ["standard input", "UTF-8"]),
        ("file", b"\x89PNG\r\n\x1a\n" + random.Random(1).randbytes(4096), ["sentences.txt", "UTF-8"]),
        ("file", "a wonderful film\n".encode("utf-16-le"), ["sentences.txt", "NUL", "UTF-8"]),
    ],
    ids=["random bytes on stdin", "a binary file", "UTF-16 without a byte-order mark"],
)
def test_bytes_that_are_not_text_are_one_error_line_and_exit_2(trained, tmp_path, source, content, names):
    (tmp_path / "sentences.txt").write_bytes(content)
    args = ["sentences.txt"] if source == "file" else []
    result = predict(tmp_path, trained / "merged", *args, stdin=content)
    stderr = result.stderr.decode()
    assert result.returncode == 2 and result.stdout == b"", stderr[-3000:]
    assert_refusal(stderr, names)


def test_a_sentence_longer_than_the_model_takes_is_truncated(trained, tiny_bert, tmp_path):
    words = " ".join(SENTENCES).split()
    long = " ".join(words[i % len(words)] for i in range(5000))  # 5,000 words: ten times the 512 positions
    (tmp_path / "long.txt").write_text(f"{long}\n{SENTENCES[0]}\n")
    # A folder from before the length was recorded (tokenizer_config.json without it): the model's positions cap it.
    unrecorded = tmp_path / "unrecorded"
    shutil.copytree(trained / "merged", unrecorded)
    config = json.loads((unrecorded / "tokenizer_config.json").read_text())
    del config["model_max_length"]
    (unrecorded / "tokenizer_config.json").write_text(json.dumps(config))
    for folder, base in ((trained / "model", ["--base-model", tiny_bert]), (trained / "merged", []), (unrecorded, [])):
        result = predict(tmp_path, folder, "long.txt", *base)
        assert [line["text"] for line in answers(result)] == [long, SENTENCES[0]], folder
        assert "Traceback" not in result.stderr.decode()


def documented_commands() -> list[str]:
    """Every `python predict.py ...` command in README.md, docs/*.md and predict.py's --help, without its comment."""
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    docstring = ast.get_docstring(ast.parse((REPO / "predict.py").read_text()))
    commands = []
    for text in [path.read_text() for path in texts] + [docstring]:
        for line in text.splitlines():
            spans = re.findall(r"`([^`]*python predict\.py[^`]*)`", line)
            spans = spans or ([line] if "python predict.py" in line else [])
            commands += [re.split(r"\s+#\s", span)[0].strip() for span in spans if not span.lstrip().startswith("#")]
    return list(dict.fromkeys(commands))


# Sentence-pair commands (`--text-column premise,hypothesis`) need a pair model: tests/test_tasks.py runs them as
# written; multi-label ones (`--threshold`) a multi-label model: tests/test_multilabel.py.
DOCUMENTED = [
    c for c in documented_commands() if not re.search(r"--text-column \S+,\S+", c) and "--threshold" not in c
]


@pytest.mark.check
def test_the_docs_show_predict_commands():
    # The README's three: a local adapter, a csv column with the base named, a Hub repo on standard input.
    assert len([c for c in DOCUMENTED if "OUTPUT_DIR" in c or HUB_REPO in c]) >= 3, DOCUMENTED


def run_as_written(command: str, cwd: Path, out: Path, base: Path, hub) -> CompletedProcess:
    """`command` pasted into bash beside sentences.txt, reviews.csv and sentences.jsonl: OUTPUT_DIR is the finished
    run, the base's Hub id (or volume copy) the tiny model; the Hub stand-in serves the run under HUB_REPO."""
    (cwd / "sentences.txt").write_text("\n".join(SENTENCES) + "\n")
    (cwd / "sentences.jsonl").write_text("".join(json.dumps({"sentence": s, "label": 1}) + "\n" for s in SENTENCES))
    (cwd / "reviews.csv").write_text('id,review\n1,a wonderful film\n2,"a dull, tedious mess"\n')
    hub.serve(HUB_REPO, out / "model")
    hub.serve(BASE_ID, base)  # the base the adapter names, as the Hub serves it
    hub.serve(REPO_ID, out / "model")  # the repos the run pushed, which its model cards name
    hub.serve(MERGED_ID, out / "merged")
    command = runnable(command, out).replace("/pvc-home/models/bert-base-uncased", str(base))
    command = re.sub(r"(?<![\w/.-])bert-base-uncased(?![\w/.-])", str(base), command)
    env = base_env(cwd, HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0")
    return run_command(["bash", "-c", command], env=env, cwd=cwd, timeout=180, text=False)


def expected_texts(command: str) -> list[str]:
    if "reviews.csv" in command:
        return REVIEWS
    if "sentences." in command:
        return SENTENCES
    echoed = re.match(r"echo\s+(\"[^\"]*\"|'[^']*'|\S+)", command)
    assert echoed, f"no input file or echo in {command!r}: give the test its input"
    return shlex.split(echoed.group(1))


@pytest.mark.parametrize("command", DOCUMENTED)
def test_each_documented_predict_command_runs_as_written(trained, tiny_bert, tmp_path, hub, command):
    result = run_as_written(command, tmp_path, trained, tiny_bert, hub)
    assert [line["text"] for line in answers(result)] == expected_texts(command), command


def test_the_model_cards_predict_command_runs_as_written(trained, tiny_bert, tmp_path, hub):
    for folder in ("model", "merged"):
        [command] = re.findall(r"`(python predict\.py [^`]*)`", (trained / folder / "README.md").read_text())
        result = run_as_written(command, tmp_path, trained, tiny_bert, hub)
        assert [line["text"] for line in answers(result)] == SENTENCES, command


# ------------------------------------------------------------------------------- input read as training reads it
# Sentences holding what `str.splitlines` splits on (form feed, vertical tab, NEL, U+2028, the file separators)
# and what quoted reading merges (a sentence opening with `"`): one answer each, in order.
ODD_LINES = ["a\x0cwonderful film", "the cast\u2028is superb", "a dull\x85tedious mess"]
ODD_LINES += ["the film\x0bis flat\x1cand\x1dlong\x1e", "the end\u2029of it"]
ROWS = [*STRAY_QUOTE, *((text, index % 2) for index, text in enumerate(ODD_LINES))]


def predicted_texts(tmp_path: Path, folder: Path, *args: str | Path, stdin: str = "") -> list[str]:
    result = run_predict(base_env(tmp_path), folder, *args, stdin=stdin, cwd=tmp_path)
    assert result.code == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(is_prediction(line) for line in lines), lines
    return [line["text"] for line in lines]


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_each_line_is_one_answer_split_on_newlines_only(trained, tmp_path, source):
    lines = [text for text, _ in ROWS]
    text = "\r\n".join(lines[:3]) + "\n\n  \n" + "\n".join(lines[3:]) + "\n"  # CRLF, LF and blank lines
    (tmp_path / "sentences.txt").write_bytes(text.encode())
    args = ["sentences.txt"] if source == "file" else []
    assert predicted_texts(tmp_path, trained / "merged", *args, stdin=text) == lines


def write_rows(path: Path, rows: list[tuple[str, int]]) -> Path:
    """`rows` (sentence, label) as a user writes `path`'s format: tsv unquoted, csv by csv.writer, .json an array
    and .jsonl a line each (non-ASCII unescaped), parquet by pyarrow."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(
            pyarrow.table({"sentence": [t for t, _ in rows], "label": [y for _, y in rows]}), path
        )
    elif suffix == ".tsv":
        path.write_text(delimited(rows, sep="\t"), newline="")
    elif suffix == ".csv":
        with path.open("w", newline="") as handle:
            csv.writer(handle).writerows([("sentence", "label"), *rows])
    else:
        objects = [{"sentence": text, "label": label} for text, label in rows]
        lines = [json.dumps(objects, ensure_ascii=False)] if suffix == ".json" else objects
        texts = [line if isinstance(line, str) else json.dumps(line, ensure_ascii=False) for line in lines]
        path.write_text("".join(text + "\n" for text in texts))
    return path


@pytest.mark.parametrize(
    "name", ["VALIDATION.TSV", "Validation.Csv", "validation.JSON", "validation.JsonL", "validation.Parquet"]
)
def test_a_data_file_gives_the_sentences_training_reads_from_it(trained, tmp_path, name):
    """The same file through training's reader and predict.py: the same sentences, in order, whatever the suffix's case."""
    from utils.config.settings import Settings
    from utils.training.data import DataSource, load_raw

    suffix = Path(name).suffix.lower()
    rows = [row for row in ROWS if suffix == ".tsv" or not row[0].startswith('"')]  # a csv quotes its own
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "validation"):
        write_rows(data / f"{split}{suffix}", rows)
    trained_on = load_raw(Settings(dataset_path=str(data)).select(DataSource))["validation"]["sentence"]
    shutil.copy(data / f"validation{suffix}", tmp_path / name)
    assert trained_on == [text for text, _ in rows]
    assert predicted_texts(tmp_path, trained / "merged", name) == trained_on


def test_a_field_longer_than_the_csv_modules_limit_is_one_sentence(trained, tmp_path):
    long = " ".join(["a wonderful film"] * 20_000)  # 340 KB: the csv module's default limit is 128 KiB
    (tmp_path / "long.tsv").write_text(delimited([(long, 1), ("the end", 0)], sep="\t"))
    assert predicted_texts(tmp_path, trained / "merged", "long.tsv") == [long, "the end"]


def test_a_json_file_of_lines_and_a_jsonl_array_are_read_as_training_reads_them(trained, tmp_path):
    lines = tmp_path / "lines.json"
    lines.write_text('{"sentence": "a wonderful film"}\n\n{"sentence": "a dull\\u2028mess", "label": 0}\n')
    (tmp_path / "array.jsonl").write_text(json.dumps([{"sentence": "a wonderful film"}, "the cast is superb"]))
    assert predicted_texts(tmp_path, trained / "merged", lines) == ["a wonderful film", "a dull\u2028mess"]
    assert predicted_texts(tmp_path, trained / "merged", "array.jsonl") == ["a wonderful film", "the cast is superb"]


# ------------------------------------------------------------------------------- bad arguments
BAD_FILES = {
    "no-column.csv": "text,label\na wonderful film,1\n",
    "header-only.csv": "sentence,label\n",
    "open-quote.csv": 'sentence,label\n"a dull film,0\nthe end,1\n',
    "short-row.tsv": "label\tsentence\n1\ta wonderful film\n0\n",
    "no-text.json": '[{"sentence": "a wonderful film"}, {"sentence": 3}]',
    "not-json.jsonl": '{"sentence": "a wonderful film"}\n{"sentence": \n',
    "reviews.txt": "review,label\na wonderful film,1\n",
    "twice.csv": "sentence,sentence,label\na wonderful film,a dull film,1\n",
    "empty.tsv": "sentence\tlabel\na wonderful film\t1\n \t0\n",
    "empty.jsonl": '{"sentence": "a wonderful film"}\n{"sentence": ""}\n',
    "pairs.csv": "premise,hypothesis\na film,it is good\n",
}


# id -> (the arguments after MODEL, what the error line names)
BAD_ARGUMENTS = {
    "batch size 0": ("--batch-size 0", ["--batch-size: 0", "1 to 1024"]),
    "negative batch size": ("--batch-size -8", ["--batch-size: -8", "1 to 1024"]),
    "huge batch size": ("--batch-size 1000000000000", ["--batch-size: 1000000000000", "1 to 1024"]),
    "fractional batch size": ("--batch-size 8.5", ["--batch-size: '8.5'", "1 to 1024"]),
    "missing file": ("missing.txt", ["missing.txt", "No such file or directory", "UTF-8"]),
    "a folder as FILE": (".", [". is a folder", "regular file"]),
    "no such column": ("no-column.csv", ["no-column.csv", "'sentence'", "['text', 'label']", "--text-column"]),
    "no such column, no rows": ("header-only.csv --text-column review", ["header-only.csv", "'review'"]),
    "a quote open over lines": ("open-quote.csv", ["open-quote.csv line 2", "lines 2-3"]),
    "a row short of the column": ("short-row.tsv", ["short-row.tsv line 3", "1 field(s)", "'sentence' (column 2)"]),
    "a JSON item without text": ("no-text.json", ["no-text.json item 2", "'sentence'", "3"]),
    "a line that is not JSON": ("not-json.jsonl", ["not-json.jsonl line 2", "JSON"]),
    "a column of a text file": ("reviews.txt --text-column review", ["--text-column review", "reviews.txt"]),
    "a column of standard input": ("--text-column review", ["--text-column review", "standard input"]),
    "a base for a merged model": ("reviews.txt --base-model tiny-bert", ["--base-model", "merged"]),
    # What training refuses (utils/training/data.py), refused here too
    "a column named twice": ("twice.csv", ["twice.csv", "'sentence' 2 times", "['sentence', 'sentence', 'label']"]),
    "an empty sentence in a column": (
        "empty.tsv",
        ["empty.tsv has 1 row(s)", "empty or missing 'sentence'", "line 3", "fill in or remove"],
    ),
    "an empty sentence in JSON": (
        "empty.jsonl",
        ["empty.jsonl has 1 row(s)", "empty or missing 'sentence'", "line 2"],
    ),
    "a pair for a one-sentence model": (
        "pairs.csv --text-column premise,hypothesis",
        ["one sentence a row", "sentence", "premise,hypothesis"],
    ),
}


@pytest.mark.parametrize("args, names", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS)
def test_each_bad_argument_is_one_error_line_and_exit_2(trained, tmp_path, args, names):
    write_files(tmp_path / "in", BAD_FILES)
    result = run_predict(base_env(tmp_path), trained / "merged", *args.split(), cwd=tmp_path / "in")
    assert result.stdout == "", result.stderr[-3000:]
    assert_refusal(result, names)


@pytest.mark.parametrize("kind", ["a device", "a FIFO", "a file over the bound", "a device on standard input"])
def test_an_input_that_is_no_bounded_file_is_refused_at_once(kind, tiny_bert, tmp_path):
    """FILE is a regular file or standard input, read within MAX_INPUT_BYTES (/dev/zero ran to a MemoryError, a FIFO
    blocked for ever): refused before the model loads, in one line."""
    from utils.training.predictions import MAX_INPUT_BYTES

    env, limit = base_env(tmp_path), f"{MAX_INPUT_BYTES // 2**20} MiB"
    if kind == "a device on standard input":
        with open("/dev/zero", "rb") as zeros:
            argv = [sys.executable, REPO / "predict.py", tiny_bert]
            proc = run_command(argv, stdin=zeros, env=env, timeout=120, text=False)
        assert proc.stdout == b""
        assert_refusal(
            Result(proc.returncode, "", proc.stderr.decode()), ["standard input goes on past", limit, "split"]
        )
        return
    if kind == "a device":
        source, names = "/dev/zero", ["/dev/zero is a character device", "standard input", limit]
    elif kind == "a FIFO":
        source, names = tmp_path / "sentences.txt", ["sentences.txt is a FIFO", "standard input"]
        os.mkfifo(source)  # no writer: opening it to read would wait for one
    else:
        source, names = tmp_path / "big.txt", ["big.txt holds 257 MiB", limit, "split"]
        with open(source, "wb") as handle:
            handle.truncate(MAX_INPUT_BYTES + 2**20)  # sparse: nothing written, nothing to read before the refusal
    result = run_predict(env, tiny_bert, source, timeout=60)
    assert result.stdout == ""
    assert_refusal(result, names)


@pytest.mark.parametrize(
    "shape, names",
    [
        ({"hidden": 32}, ["{trained_on} of hidden size 64", "{base} has hidden size 32"]),
        ({"layers": 3}, ["bert.encoder.layer.2.attention.self.query", "{base}", "2 of the 6", "target_modules"]),
        ({"layers": 1}, ["bert.encoder.layer.1.attention.self.query", "{base}"]),
    ],
    ids=["narrower", "deeper", "shallower"],
)
def test_a_base_of_another_shape_than_the_adapters_is_one_error_line(
    trained, tiny_bert, sst2_dir, tmp_path, shape, names
):
    """The adapter on another base: one line naming the base it was trained on and the fix, not peft's traceback
    (narrower) or answers from layers never adapted (deeper)."""
    other = write_tiny_bert(tmp_path / "other-bert", sst2_dir, **shape)
    (tmp_path / "sentences.txt").write_text("a wonderful film\n")
    result = run_predict(base_env(tmp_path), trained / "model", "sentences.txt", "--base-model", other, cwd=tmp_path)
    assert result.stdout == "", result.stderr[-3000:]
    # The adapter, the base it was given and the one it was trained on, which the fix (--base-model) names.
    names = [str(trained / "model"), *(name.format(trained_on=BASE_ID, base=other) for name in names)]
    assert_refusal(result, [*names, f"--base-model with {BASE_ID}"])


def test_the_adapter_on_its_own_base_answers(trained, tiny_bert, tmp_path):
    (tmp_path / "sentences.txt").write_text("a wonderful film\n")
    args = ("sentences.txt", "--base-model", tiny_bert)
    assert predicted_texts(tmp_path, trained / "model", *args) == ["a wonderful film"]


def test_a_reader_that_stops_reading_ends_it_without_a_traceback(trained, tmp_path):
    """`predict.py ... | head -1`: exit 141 as a Unix tool ended by SIGPIPE, no traceback."""
    (tmp_path / "sentences.txt").write_text("".join(f"a wonderful film {i}\n" for i in range(3000)))
    argv = [sys.executable, str(REPO / "predict.py"), str(trained / "merged"), "sentences.txt"]
    proc = start(argv, stdout=PIPE, stderr=PIPE, env=base_env(tmp_path), cwd=tmp_path)
    first = json.loads(proc.stdout.readline())
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=180) == 141, stderr[-3000:]
    assert first["text"] == "a wonderful film 0" and "Traceback" not in stderr and not error_lines(stderr), stderr


def test_a_base_model_is_served_with_a_warning_that_its_head_is_untrained(trained, tiny_bert, tmp_path):
    """A base folder as MODEL answers with one warning that its head is untrained; the merged model gets none."""
    base = succeeded(run_predict(base_env(tmp_path), tiny_bert, stdin="a wonderful film\n"))
    assert [json.loads(line)["label"] for line in base.stdout.splitlines()] in (["LABEL_0"], ["LABEL_1"])
    warnings = [line for line in base.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "LABEL_0, LABEL_1 (transformers' defaults)" in warnings[0], base.stderr[-2000:]
    merged = run_predict(base_env(tmp_path), trained / "merged", stdin="a wonderful film\n")
    assert merged.code == 0 and "warning:" not in merged.stderr, merged.stderr[-2000:]


# ------------------------------------------------------------------------------- columns carried, labels scored
def predict_lines(tmp_path: Path, model: Path, *args: str | Path) -> tuple[list[dict], Result]:
    result = run_predict(base_env(tmp_path), model, *args, cwd=tmp_path)
    assert result.code == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()], result


def metric_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("metrics on ")]


def test_a_labelled_file_keeps_its_columns_and_gets_the_runs_metrics(trained, sst2_dir, tmp_path):
    """The run's validation.csv: each answer carries idx and input_label; the metrics print on stderr and go to
    --metrics, and are the run's eval_accuracy within one row."""
    with open(sst2_dir / "validation.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    shutil.copy(sst2_dir / "validation.csv", tmp_path / "validation.csv")
    lines, result = predict_lines(tmp_path, trained / "merged", "validation.csv", "--metrics", "metrics.json")
    carried = [(line["text"], line["input_label"], line["idx"]) for line in lines]
    assert carried == [(row["sentence"], row["label"], row["idx"]) for row in rows]
    assert all(is_prediction(line) for line in lines), lines
    right = sum(line["label"] == LABELS[int(line["input_label"])] for line in lines)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["samples"] == len(rows) and metrics["accuracy"] == round(right / len(rows), 4), metrics
    assert set(metrics) == {"accuracy", "f1", "precision", "recall", "matthews_correlation", "samples"}
    run_accuracy = json.loads((trained / "metrics.json").read_text())["eval_accuracy"]
    assert abs(metrics["accuracy"] - run_accuracy) <= 1 / len(rows)
    [line] = metric_lines(result.stderr)
    assert line.startswith(
        f"metrics on validation.csv ({len(rows)} labelled rows): accuracy={metrics['accuracy']:.4f}"
    )


def test_the_columns_default_to_those_the_model_records(trained, tmp_path):
    """inputs.json names the text and label columns, so no option is needed; -1 is no label; without it: `sentence`."""
    model = tmp_path / "model"
    shutil.copytree(trained / "merged", model)
    (model / "inputs.json").write_text(json.dumps({"text_columns": ["review"], "label_column": "verdict"}))
    records = [
        {"id": 1, "review": "a wonderful film", "verdict": "good", "score": 5},
        {"id": 2, "review": "a dull , tedious mess", "verdict": -1, "score": 1},
    ]
    (tmp_path / "reviews.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    lines, result = predict_lines(tmp_path, model, "reviews.jsonl")
    carried = [{key: line[key] for key in ("text", "id", "verdict", "input_score")} for line in lines]
    assert carried == [
        {"text": r["review"], "id": r["id"], "verdict": r["verdict"], "input_score": r["score"]} for r in records
    ]
    assert all(line["label"] in LABELS for line in lines)
    [line] = metric_lines(result.stderr)
    assert "(1 labelled rows): accuracy=" in line, result.stderr[-2000:]
    (model / "inputs.json").unlink()
    refused = run_predict(base_env(tmp_path), model, "reviews.jsonl", cwd=tmp_path)
    assert_refusal(
        refused, ["reviews.jsonl has no column 'sentence'", "['id', 'review', 'verdict', 'score']", "--text-column"]
    )


def test_an_unlabelled_file_gets_no_metrics_and_a_bad_label_is_refused(trained, tmp_path):
    (tmp_path / "test.tsv").write_text(delimited([("a wonderful film", -1), ("a dull film", -1)], sep="\t"))
    lines, result = predict_lines(tmp_path, trained / "merged", "test.tsv")
    assert [line["input_label"] for line in lines] == ["-1", "-1"] and metric_lines(result.stderr) == []
    asked = run_predict(base_env(tmp_path), trained / "merged", "test.tsv", "--metrics", "m.json", cwd=tmp_path)
    assert asked.stdout == "" and not (tmp_path / "m.json").exists()
    assert_refusal(asked, ["--metrics m.json", "test.tsv has no labelled row in 'label'", "--label-column"])
    (tmp_path / "odd.csv").write_text(delimited([("a wonderful film", 1), ("a dull film", "meh")]))
    odd = run_predict(base_env(tmp_path), trained / "merged", "odd.csv", cwd=tmp_path)
    assert odd.stdout == ""
    assert_refusal(odd, ['odd.csv line 3 has the label "meh"', "0 (bad), 1 (good)", "-1"])


# ------------------------------------------------------------------------------- one text rule, training's and this
def test_training_and_predict_refuse_a_nul_in_a_sentence_in_the_same_words(trained, tmp_path):
    """A NUL inside a sentence: training and predict.py both refuse it, with the row and the same fix."""
    from utils.common.texts import NUL_FIX
    from utils.config.settings import Settings
    from utils.training.data import DataSource, check_and_rename, load_raw

    data = tmp_path / "data"
    rows = [("a wonderful film", 1), ("a dull\x00film", 0), ("the end", 1)]
    write_files(data, {"train.csv": delimited(rows), "validation.csv": delimited(rows)})
    settings = Settings(dataset_path=str(data))
    with pytest.raises(JobError) as refused:
        check_and_rename(load_raw(settings.select(DataSource)), settings.select(DataSource))
    assert refused.value.code == 2
    message = f"the train split has 1 row(s) with a NUL character in 'sentence' (the first is row 2); {NUL_FIX}"
    assert refused.value.message == message
    assert_documented("a NUL in a sentence", refused.value.message)
    shutil.copy(data / "validation.csv", tmp_path / "nul.csv")
    result = run_predict(base_env(tmp_path), trained / "merged", "nul.csv", cwd=tmp_path)
    assert result.stdout == ""
    line = assert_refusal(result, ["nul.csv has 1 row(s) with a NUL character in 'sentence'", "line 3"])
    assert line.endswith(NUL_FIX), line


def test_a_line_of_spaces_in_a_csv_is_skipped_by_training_and_predict_alike(trained, tmp_path):
    """A csv line of spaces and tabs is no row: training and predict.py skip it and read the same sentences."""
    from utils.config.settings import Settings
    from utils.training.data import DataSource, check_and_rename, load_raw

    text = "sentence,label\na wonderful film,1\n   \t\na dull film,0\n"
    data = write_files(tmp_path / "data", {"train.csv": text, "validation.csv": text})
    settings = Settings(dataset_path=str(data))
    trained_on = check_and_rename(load_raw(settings.select(DataSource)), settings.select(DataSource))["train"]["text"]
    assert trained_on == ["a wonderful film", "a dull film"]
    shutil.copy(data / "train.csv", tmp_path / "spaces.csv")
    assert predicted_texts(tmp_path, trained / "merged", "spaces.csv") == trained_on

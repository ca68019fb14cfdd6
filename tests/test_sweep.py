"""sweep.py: trials as ordinary runs of main.py (the tiny model, a few steps), summaries, resumes, refusals before
any trial, the Slurm array and the Katib Experiment rendered and validated, and docs/sweeps.md's examples."""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import signal
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from scripts.make_demo_assets import write_dataset, write_pair_dataset
from tests.support.deploy import K8S, SCHEMAS, crd_schema, load_manifest, schema_errors, strict
from tests.support.env import FAKE_TOKEN, MERGED_ID, REPO, REPO_ID, base_env, push_settings
from tests.support.outcomes import assert_refusal, succeeded
from tests.support.processes import STDOUT, Result, run_command, run_script, start, wait_until
from utils.config.tasks import headline

SWEEP = REPO / "sweep.py"
KATIB_API = SCHEMAS / "katib.v1beta1.swagger.json"
FINAL_LINE = re.compile(r"^eval_accuracy=\S+ .*model=", re.M)


def write_spec(folder: Path, stem: str, **spec) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_sweep(env: dict[str, str], *args: str | Path, timeout: float = 600) -> Result:
    return run_script("sweep.py", env, *args, timeout=timeout)


def sweep_in_process(capsys, *args: str | Path) -> Result:
    """sweep.py's main() here: what is refused or rendered before any trial runs (no process start per case)."""
    from sweep import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return Result(code, out.out, out.err)


def study_states(db: Path) -> list[tuple[str, str]]:
    """(trial name, state) of each Optuna trial in the study, read while the sweep may be writing it."""
    if not db.exists():
        return []
    with sqlite3.connect(db, timeout=10) as conn:
        try:
            rows = conn.execute(
                "SELECT a.value_json, t.state FROM trials t JOIN trial_user_attributes a "
                "ON a.trial_id = t.trial_id AND a.key = 'trial' ORDER BY t.number"
            ).fetchall()
        except sqlite3.OperationalError:  # the tables are not created yet
            return []
    return [(json.loads(name), state) for name, state in rows]


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def sweep_data(tmp_path_factory, tiny_bert) -> dict[str, str]:
    """The tiny model's fixed settings over a small data set: a trial is a few optimizer steps."""
    data = write_dataset(tmp_path_factory.mktemp("sweep-data") / "small", train_rows=160, validation_rows=40)
    return {"MODEL_NAME": str(tiny_bert), "DATASET_PATH": str(data), "MAX_STEPS": "3", "PER_DEVICE_BATCH_SIZE": "16"}


@dataclass
class GridSweep:
    out: Path
    spec: Path
    env: dict[str, str]
    result: Result


@pytest.fixture(scope="module")
def grid_sweep(tmp_path_factory, sweep_data) -> GridSweep:
    """A 2x2 grid ranked by eval loss; RESULT_MODEL_ID in the shell, which a trial must not inherit."""
    tmp = tmp_path_factory.mktemp("grid-sweep")
    out = tmp / "sweep"
    spec = write_spec(
        tmp,
        "grid",
        settings=sweep_data,
        grid={"learning_rate": [1.0e-3, 1.0e-2], "LORA_R": [4, 8]},
        metric="eval_loss",
        output_dir=str(out),
    )
    env = base_env(tmp, RESULT_MODEL_ID="tester/never-pushed")
    return GridSweep(out, spec, env, run_sweep(env, spec))


def snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------- local backend
@pytest.mark.integration
def test_grid_sweep_runs_each_trial_as_the_job_and_summarizes(grid_sweep):
    out, result = grid_sweep.out, grid_sweep.result
    assert result.code == 0, result.stderr[-3000:]
    names = [f"trial-00{i}" for i in range(4)]
    assert [
        line.split()[2].rstrip(":") for line in result.stdout.splitlines() if line.startswith("sweep: start")
    ] == names
    assert len(re.findall(r"^sweep: end trial-00\d: complete, loss=", result.stdout, re.M)) == 4

    rows = read_csv(out / "summary.csv")
    assert [r["trial"] for r in rows] == names
    assert list(rows[0]) == ["trial", "learning_rate", "lora_r", "status", "loss"]
    assert [(r["learning_rate"], r["lora_r"]) for r in rows] == [(lr, r) for lr in ("0.001", "0.01") for r in "48"]
    for row in rows:
        folder = out / row["trial"]
        metrics = json.loads((folder / "metrics.json").read_text())
        assert row["status"] == "complete"
        assert float(row["loss"]) == metrics["eval_loss"]
        # an ordinary run of the job with the trial's settings, in its own folder; nothing pushed
        record = json.loads((folder / "trial.json").read_text())
        assert record["settings"]["OUTPUT_DIR"] == str(folder)
        assert record["settings"]["LEARNING_RATE"] == row["learning_rate"]
        assert record["settings"]["LORA_R"] == row["lora_r"]
        assert "RESULT_MODEL_ID" not in record["settings"]
        run = json.loads((folder / "run.json").read_text())
        assert run["settings"]["lora_r"] == int(row["lora_r"])
        assert run["settings"]["learning_rate"] == float(row["learning_rate"])
        assert not run["settings"].get("result_model_id")
        assert FINAL_LINE.search((folder / "trial.log").read_text())

    # the table ranks by the metric (lower loss first here), then names the best trial's settings
    md = (out / "summary.md").read_text()
    table = [line for line in md.splitlines() if re.match(r"^\| \d ", line)]
    losses = [float(line.split("|")[-2]) for line in table]
    assert len(table) == 4 and losses == sorted(losses)
    best = min(rows, key=lambda r: float(r["loss"]))
    assert table[0].split("|")[2].strip() == best["trial"]
    assert f"Best: {best['trial']}" in md and f"OUTPUT_DIR={out / best['trial']}" in md
    assert md in result.stdout  # the answer is printed too
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [state for _, state in study_states(out / "study.db")] == ["COMPLETE"] * 4


@pytest.mark.integration
def test_summarize_rebuilds_the_summary_from_the_trial_folders(grid_sweep):
    before = (grid_sweep.out / "summary.csv").read_text()
    for name in ("summary.csv", "summary.md", "summary.png"):
        (grid_sweep.out / name).unlink()
    result = succeeded(run_sweep(grid_sweep.env, grid_sweep.spec, "--summarize"))
    assert (grid_sweep.out / "summary.csv").read_text() == before
    assert (grid_sweep.out / "summary.png").is_file() and "| 1 | trial-" in result.stdout
    # an array task run again for a finished trial leaves it as it is
    log = grid_sweep.out / "trial-001" / "trial.log"
    kept = log.read_text()
    again = run_sweep(grid_sweep.env, grid_sweep.spec, "--run-trial", "1")
    assert again.code == 0 and "sweep: trial-001 is already complete" in again.stdout
    assert log.read_text() == kept


@pytest.mark.integration
def test_another_sweep_is_refused_on_a_sweeps_folder(grid_sweep, tmp_path):
    """A changed grid, fixed setting or shell setting variable is another sweep: resume, --summarize and
    --run-trial refuse the folder, untouched."""
    out = grid_sweep.out
    kept = snapshot(out)
    spec = yaml.safe_load(grid_sweep.spec.read_text())
    spec["grid"]["learning_rate"] = [5.0e-4, 1.0e-2]
    changed = write_spec(tmp_path, "changed", **spec)
    for args in ([], ["--summarize"], ["--run-trial", "0"]):
        result = run_sweep(grid_sweep.env, changed, *args)
        assert_refusal(result, [str(out), "trial-000: learning rates: base 0.001 -> 0.0005", "output_dir"])
        assert "sweep: start" not in result.stdout
    spec = yaml.safe_load(grid_sweep.spec.read_text())
    spec["settings"]["MAX_STEPS"] = "4"
    result = run_sweep(grid_sweep.env, write_spec(tmp_path, "longer", **spec))
    assert_refusal(result, [str(out), "MAX_STEPS: 3 -> 4", "output_dir"])
    result = run_sweep({**grid_sweep.env, "LORA_DROPOUT": "0.2"}, grid_sweep.spec)
    assert_refusal(result, [str(out), "LORA_DROPOUT: 0.05 -> 0.2", "setting variables"])
    assert snapshot(out) == kept
    assert study_states(out / "study.db") == [(f"trial-00{i}", "COMPLETE") for i in range(4)]
    # a variable the job reads but that trains nothing (main.py resumes under it) is the same sweep
    succeeded(run_sweep({**grid_sweep.env, "HUB_TIMEOUT": "30"}, grid_sweep.spec, "--summarize"))


@pytest.mark.integration
def test_killed_sweep_resumes_without_rerunning_a_finished_trial(tmp_path, sweep_data):
    """SIGKILL during trial-001; the rerun keeps trial-000, reruns trial-001, records trial-002 (a module the model
    lacks: exit 2) as failed and still runs trial-003."""
    out = tmp_path / "sweep"
    spec = write_spec(
        tmp_path,
        "resume",
        settings=sweep_data,
        grid={"lora_target_modules": ["query,value", "value", "query,vlaue", "query"]},
        output_dir=str(out),
    )
    env = base_env(tmp_path)
    log = tmp_path / "first.log"
    with open(log, "w") as first_log:
        first = start([sys.executable, str(SWEEP), str(spec)], env=env, cwd=REPO, stdout=first_log, stderr=STDOUT)
        try:
            wait_until(
                lambda: study_states(out / "study.db") == [("trial-000", "COMPLETE"), ("trial-001", "RUNNING")],
                "first trial complete and the second running",
                [first],
                log=log,
                every=0.2,
            )
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
    finished = out / "trial-000"
    kept = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (finished / "metrics.json", finished / "trial.log")}

    second = succeeded(run_sweep(env, spec))
    assert "sweep: trial-001 was left running by a stopped sweep; running it again" in second.stdout
    assert "1 trial(s) already complete" in second.stdout
    assert "sweep: start trial-000" not in second.stdout
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in kept} == kept  # trial-000 untouched

    states = study_states(out / "study.db")
    assert [s for n, s in states if n == "trial-000"] == ["COMPLETE"]
    assert [s for n, s in states if n == "trial-001"] == ["FAIL", "COMPLETE"]  # the killed run, then the rerun
    assert [s for n, s in states if n == "trial-002"] == ["FAIL"]
    rows = {r["trial"]: r for r in read_csv(out / "summary.csv")}
    assert [(n, r["status"]) for n, r in rows.items()] == [
        (f"trial-00{i}", status) for i, status in enumerate(("complete", "complete", "failed", "complete"))
    ]
    assert rows["trial-002"]["accuracy"] == ""
    assert re.search(r"^sweep: end trial-002: failed \(exit 2; see .*trial-002/trial\.log\)$", second.stdout, re.M)
    failed_log = (out / "trial-002" / "trial.log").read_text()
    assert "error: " in failed_log and "'vlaue' matches no module" in failed_log
    assert json.loads((out / "trial-002" / "trial.json").read_text())["exit_code"] == 2
    # trial-001 ran in the same folder twice: its log holds the killed run's start and the rerun's end
    rerun_log = (out / "trial-001" / "trial.log").read_text()
    assert len(FINAL_LINE.findall(rerun_log)) == 1 and json.loads((out / "trial-001" / "metrics.json").read_text())
    table = [line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| ")]
    assert "trial-002" in table[-1] and "failed" in table[-1]  # unranked trials after the ranked ones


@pytest.mark.integration
def test_a_grid_grown_in_its_first_list_extends_the_sweep(tmp_path, sweep_data):
    """docs/sweeps.md: a grown first list keeps the trials it had (Optuna parameters' value space may not change: the
    study records each trial's settings beside it instead)."""
    out = tmp_path / "sweep"
    env = base_env(tmp_path)
    first = run_sweep(
        env, write_spec(tmp_path, "grow", settings=sweep_data, grid={"lora_r": [4]}, output_dir=str(out))
    )
    assert first.code == 0, first.stderr[-3000:]
    finished = (out / "trial-000" / "metrics.json").read_bytes()
    grown = write_spec(tmp_path, "grow", settings=sweep_data, grid={"lora_r": [4, 8]}, output_dir=str(out))
    result = run_sweep(env, grown)
    assert result.code == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "sweep: start trial-000" not in result.stdout and "sweep: start trial-001" in result.stdout
    assert (out / "trial-000" / "metrics.json").read_bytes() == finished
    assert study_states(out / "study.db") == [("trial-000", "COMPLETE"), ("trial-001", "COMPLETE")]
    assert list(json.loads((out / "sweep.json").read_text())["trials"]) == ["trial-000", "trial-001"]
    rows = read_csv(out / "summary.csv")
    assert [(r["trial"], r["lora_r"], r["status"]) for r in rows] == [
        ("trial-000", "4", "complete"),
        ("trial-001", "8", "complete"),
    ]


@pytest.mark.integration
def test_trials_push_only_where_the_spec_says_and_a_failed_push_is_a_failed_trial(tmp_path, sweep_data, hub):
    """The shell's RESULT_*MODEL_ID reach no trial; `push:` is where each pushes. The Hub refuses the commits: each
    trial writes metrics.json and exits 3, so it failed, and the sweep, with none complete, exits 1."""
    hub.fail("commit", 400, 400)
    out = tmp_path / "sweep"
    env = base_env(tmp_path, **push_settings(hub), RESULT_MERGED_MODEL_ID=MERGED_ID, MERGE_ADAPTER="true")
    spec = write_spec(
        tmp_path, "push", settings=sweep_data, grid={"lora_r": [4, 8]}, push="tester/sweep", output_dir=str(out)
    )
    result = run_sweep(env, spec)
    assert result.code == 1, result.stderr[-3000:]
    assert "sweep: no trial completed" in result.stderr and "Traceback" not in result.stderr
    touched = {m.group(1) for _, path in hub.requests if (m := re.search(r"/api/models/([^/]+/[^/]+)/", path))}
    assert touched == {"tester/sweep-trial-000", "tester/sweep-trial-001"}
    assert not any(REPO_ID in path or MERGED_ID in path for _, path in hub.requests) and hub.commits == []
    rows = read_csv(out / "summary.csv")
    assert [(r["trial"], r["status"], r["accuracy"]) for r in rows] == [
        ("trial-000", "failed", ""),
        ("trial-001", "failed", ""),
    ]
    for row in rows:
        folder = out / row["trial"]
        assert "eval_accuracy" in json.loads((folder / "metrics.json").read_text())
        assert json.loads((folder / "trial.json").read_text())["exit_code"] == 3
        assert not json.loads((folder / "run.json").read_text())["settings"].get("result_merged_model_id")


@pytest.mark.integration
def test_sigterm_and_ctrl_c_stop_the_sweep_once_the_running_trial_is_told(tmp_path, sweep_data):
    """The running trial is told (checkpoints, exits 143 or 130), no other starts, the sweep exits the same after one
    line; run again, it resumes the trial."""
    out = tmp_path / "sweep"
    settings = {**sweep_data, "MAX_STEPS": "1000000", "SAVE_STEPS": "1000000"}  # trains until told to stop
    spec = write_spec(tmp_path, "stop", settings=settings, grid={"lora_r": [4, 8]}, output_dir=str(out))
    trial_log = out / "trial-000" / "trial.log"
    for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        log = tmp_path / f"sweep-{code}.log"
        started = trial_log.read_text().count("first training step") if trial_log.exists() else 0
        with open(log, "w") as handle:
            sweep = start(
                [sys.executable, str(SWEEP), str(spec)], env=base_env(tmp_path), cwd=REPO, stdout=handle, stderr=handle
            )
            try:
                wait_until(
                    lambda started=started: (
                        trial_log.exists() and trial_log.read_text().count("first training step") > started
                    ),
                    "trial-000 training",
                    [sweep],
                    log=log,
                    every=0.2,
                )
                sweep.send_signal(signum)
                assert sweep.wait(timeout=300) == code, log.read_text()[-3000:]
            finally:
                if sweep.poll() is None:
                    sweep.kill()
        text = log.read_text()
        assert "Traceback" not in text and "sweep: start trial-001" not in text, text[-3000:]
        assert len(re.findall(r"^sweep: stopped by ", text, re.M)) == 1
        assert json.loads((out / "trial-000" / "trial.json").read_text())["exit_code"] == code
        assert not (out / "trial-001").exists()
        assert list((out / "trial-000" / "checkpoints").glob("checkpoint-*/COMPLETE"))  # what the rerun resumes from
    assert "sweep: start trial-000" in (tmp_path / "sweep-130.log").read_text()  # the second run resumed it


# ------------------------------------------------------------------------------- refusals
def random(**space) -> dict:
    """A random search of `space` in place of the grid."""
    return {"grid": None, "random": space, "trials": 2}


# Each refusal by what it must name: the spec's key, the value, what to use instead.
REFUSALS = [
    ({"settings": {"learning_rat": 1}}, ["settings", "learning_rat", "learning_rate"]),
    ({"grid": {"lora_r": [0, 8]}}, ["trial-000", "LORA_R=0", "1 to 4096"]),
    ({"grid": {"learning_rate": []}}, ["grid.learning_rate", "learning_rate: ["]),
    ({"grid": {}}, ["grid: ", "grid: {learning_rate"]),
    ({"grid": {"lora_r": [8, "8"]}}, ["grid.lora_r", "8", "list each value once"]),
    ({"grid": {"lora_r": list(range(1, 101)), "seed": list(range(11))}}, ["grid: 1100 points", "1000"]),
    ({"metric": "acuracy"}, ["metric='acuracy'", "did you mean accuracy?", "accuracy, f1"]),
    ({"metric": "accuracy_mm"}, ["metric='accuracy_mm'", "accuracy, f1"]),  # MNLI's name in other tools, not here
    ({"settings": {"task": "stsb"}, "metric": "spearmanr"}, ["spearmanr", "TASK=stsb", "did you mean spearman?"]),
    ({"direction": "up"}, ["direction='up'", "maximize", "minimize"]),
    ({"metrics": "f1"}, ["bad.yaml", "unknown key 'metrics'", "did you mean metric?"]),
    ({"parallel": True}, ["parallel=True", "valid integer", "1 to 1000"]),  # strict: `true` is no count
    # a count past any sweep's trials: accepted once, it was a MemoryError after the folder was claimed
    ({"parallel": 1000000000000}, ["parallel=1000000000000", "1 to 1000"]),
    (random(learning_rate={"low": 1e-3, "high": 1e-4}), ["random.learning_rate", "low=0.001", "high=0.0001"]),
    (random(learning_rate={"low": 0, "high": 1e-3, "log": True}), ["random.learning_rate", "log", "low=0;"]),
    (
        random(lora_r={"low": 1.2, "high": 1.8, "type": "int"}),
        ["random.lora_r", "whole numbers", "low=1.2", "type: float"],
    ),
    (random(lora_r={"low": 0.5, "high": 8, "log": True, "type": "int"}), ["random.lora_r", "low=0.5"]),
    # .nan passes every order check and .inf overflows the draw: each was a traceback
    (
        random(learning_rate={"low": float("nan"), "high": 1e-3}),
        ["random.learning_rate.low", "nan is not a finite number"],
    ),
    (
        random(learning_rate={"low": 1e-5, "high": float("inf")}),
        ["random.learning_rate.high", "inf is not a finite number"],
    ),
    (random(lora_r={"low": 1, "high": 10**400}), ["random.lora_r.high", "(401 digits) is not a finite number"]),
    ({"grid": None, "random": {"lora_r": [4, 8]}}, ["trials: N", "trials=None"]),
    ({"grid": None, "random": {"lora_r": [4, 8]}, "trials": 100000000}, ["trials=100000000", "1 to 1000"]),
    ({"seed": "abc"}, ["seed='abc'", "seed: 0"]),
    ({"seed": -1}, ["seed=-1", "seed: 0"]),
    ({"seed": "null"}, ["seed=None", "seed: 0"]),
    ({"random": {"seed": [1, 2]}, "trials": 2}, ["grid and random"]),
    ({"settings": {"OUTPUT_DIR": "/tmp/x"}}, ["settings", "OUTPUT_DIR", "output_dir"]),
    ({"settings": {"result_model_id": "me/x"}}, ["settings", "result_model_id", "push: OWNER/NAME"]),
    ({"settings": {"RESULT_MERGED_MODEL_ID": "me/x"}}, ["settings", "RESULT_MERGED_MODEL_ID", "push: OWNER/NAME"]),
    ({"output_dir": None}, ["bad.yaml", "output_dir"]),
    ({"backend": "ray"}, ["backend='ray'", "local, slurm, katib"]),
    ({"config": "no-such-recipe.yaml"}, ["trial-000", "CONFIG_FILE=no-such-recipe.yaml", "--config"]),
    ({"backend": "slurm", "slurm": {"gpus": True}}, ["slurm.gpus=True", "gpus: 0"]),
    ({"backend": "katib", "katib": {"image": "me/x"}}, ["katib: unknown key(s) ['image']", "k8s/pytorchjob.yaml"]),
    ({"backend": "katib", "name": "My_Sweep"}, ["name='My_Sweep'", "Kubernetes name", "name: sst2-sweep"]),
]


@pytest.mark.check
@pytest.mark.parametrize(("change", "names"), REFUSALS, ids=[" ".join(names)[:40] for _, names in REFUSALS])
def test_bad_spec_is_refused_before_any_trial_starts(change, names, tmp_path, capsys, sweep_data):
    out = tmp_path / "sweep"
    spec = {"settings": dict(sweep_data), "grid": {"lora_r": [4, 8]}, "output_dir": str(out)}
    for key, value in change.items():
        if key == "settings":
            spec["settings"].update(value)
        elif value is None:
            spec.pop(key)
        else:
            spec[key] = None if value == "null" else value
    result = sweep_in_process(capsys, write_spec(tmp_path, "bad", **spec))
    assert_refusal(result, names)
    assert not out.exists()  # before anything was run or written


# A YAML "billion laughs" under 350 bytes: each line nine times the last, 9^7 values once expanded.
ALIAS_BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdef", "bcdefg", strict=True)
)


@pytest.mark.check
def test_a_spec_says_each_key_once_and_writes_its_values_out(tmp_path, capsys, sweep_data):
    """A key given twice (YAML keeps the last silently) and an alias (nested ones made a 28 MB error line) are
    refused in one line, nothing claimed."""
    out = tmp_path / "sweep"
    head = f"output_dir: {out}\nsettings:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in sweep_data.items())
    cases = {
        "grid-twice": (head + "grid:\n  lora_r: [4]\ngrid:\n  lora_r: [4, 8]\n", ["sets grid twice", "keep one"]),
        "name-twice": (head + "  LORA_R: 8\n  lora_r: 4\ngrid:\n  seed: [1]\n", ["sets lora_r twice", "lines"]),
        "in-grid-twice": (head + "grid:\n  lora_r: [4]\n  LORA_R: [8]\n", ["sets lora_r twice", "keep one"]),
        "bomb": (ALIAS_BOMB + "output_dir: *g\ngrid: {lora_r: [4]}\n", ["line 2", "alias *a", "write the value out"]),
    }
    assert len(ALIAS_BOMB) < 350
    for stem, (text, names) in cases.items():
        spec = tmp_path / f"{stem}.yaml"
        spec.write_text(text)
        for args in ([], ["--dry-run"]):
            started = time.monotonic()
            result = sweep_in_process(capsys, spec, *args)
            line = assert_refusal(result, [f"{spec} ", *names])
            assert len(result.stderr) < 300 and time.monotonic() - started < 5, line
    assert not out.exists()


@pytest.mark.check
def test_what_is_not_a_spec_or_a_place_to_write_is_refused_in_one_line(tmp_path, capsys, sweep_data):
    """A folder, binary bytes or a FIFO (read, it waits for ever) as the spec; output_dir a file; -o a folder;
    --summarize on a Katib sweep: one error: line each."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    (tmp_path / "binary.yaml").write_bytes(b"grid: {lora_r: [4]}\n\xff\xfe")
    for path, names in [
        (tmp_path, [str(tmp_path), "not a regular file"]),
        (fifo, [str(fifo), "not a regular file"]),
        (tmp_path / "binary.yaml", ["binary.yaml", "not UTF-8"]),
    ]:
        assert_refusal(sweep_in_process(capsys, path), names)
    a_file = tmp_path / "taken"
    a_file.write_text("someone's notes\n")
    spec = write_spec(tmp_path, "onfile", settings=sweep_data, grid={"lora_r": [4]}, output_dir=str(a_file))
    assert_refusal(sweep_in_process(capsys, spec), [f"output_dir={a_file}", "is a file"])
    assert a_file.read_text() == "someone's notes\n"
    katib = write_spec(tmp_path, "katib", grid={"lora_r": [4, 8]}, backend="katib", output_dir="/pvc-home/s")
    assert_refusal(sweep_in_process(capsys, katib, "-o", tmp_path), ["-o", str(tmp_path), "is a folder"])
    assert_refusal(sweep_in_process(capsys, katib, "--summarize"), ["--summarize", "kubectl get experiment katib"])


@pytest.mark.check
def test_grid_values_stay_the_text_they_are_written_as(tmp_path, capsys, sweep_data):
    """ "001" and "1" are two run names; only the exponent form YAML 1.1 misses (1e-3) is read as a number."""
    grid = {"run_name": ["001", "1"], "learning_rate": ["1e-3"]}
    spec = write_spec(tmp_path, "names", settings=sweep_data, grid=grid, output_dir=str(tmp_path / "out"))
    trials = sweep_in_process(capsys, spec, "--dry-run").json()["trials"]
    assert [(t["settings"]["RUN_NAME"], t["params"]["learning_rate"]) for t in trials] == [("001", 1e-3), ("1", 1e-3)]


def test_a_sweep_claims_only_an_empty_folder_or_its_own(tmp_path, capsys, sweep_data):
    """Another tool's folder is refused and left as it was, as main.py refuses one; so is a trial folder the sweep
    did not make."""
    out = tmp_path / "sweep"
    planted = {
        out / "trial-000" / "checkpoints" / "checkpoint-500" / "optimizer.pt": b"theirs",
        out / "trial-000" / "model" / "model.safetensors": b"theirs",
        out / "summary.md": b"# my notes\n",
    }
    for path, data in planted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    spec = write_spec(tmp_path, "theirs", settings=sweep_data, grid={"lora_r": [4, 8]}, output_dir=str(out))
    for args in ([], ["--summarize"], ["--run-trial", "0"]):
        result = sweep_in_process(capsys, spec, *args)
        assert_refusal(result, [f"output_dir={out}", "summary.md, trial-000", "sweep.json", "empty or new folder"])
        assert snapshot(out) == planted

    fresh = tmp_path / "fresh"
    spec = write_spec(tmp_path, "ours", settings=sweep_data, grid={"lora_r": [4, 8]}, output_dir=str(fresh))
    env = base_env(tmp_path)
    summary = run_sweep(env, spec, "--summarize")  # claims the empty folder: nothing run yet
    assert summary.code == 0 and "2 pending" in summary.stdout
    assert json.loads((fresh / "sweep.json").read_text())["trials"]["trial-001"]["lora_r"] == 8
    theirs = fresh / "trial-001" / "model" / "model.safetensors"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"theirs")
    result = run_sweep(env, spec, "--run-trial", "1")
    assert_refusal(result, [str(fresh / "trial-001"), "not a run folder of this job", "model"])
    assert sorted(p.name for p in (fresh / "trial-001").rglob("*")) == ["model", "model.safetensors"]

    # Nor does another tool's run.json make a trial folder the job's: refused, every byte as it was.
    theirs = {
        fresh / "trial-000" / "run.json": b'{"tool": "another-trainer"}',
        fresh / "trial-000" / "checkpoints" / "checkpoint-500" / "optimizer.pt": b"theirs",
    }
    for path, data in theirs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    result = run_sweep(env, spec, "--run-trial", "0")
    assert_refusal(result, [str(fresh / "trial-000"), "run.json is not one the job writes"])
    assert snapshot(fresh / "trial-000") == theirs


def test_a_link_planted_at_the_sweeps_lock_is_refused_not_written_through(tmp_path, capsys, sweep_data):
    """.sweep.lock is opened as the job opens its own lock: a planted link is refused, its target untouched."""
    out = tmp_path / "sweep"
    out.mkdir()
    theirs = tmp_path / "notes.txt"
    theirs.write_text("mine\n")
    (out / ".sweep.lock").symlink_to(theirs)
    spec = write_spec(tmp_path, "s", settings=sweep_data, grid={"lora_r": [4]}, output_dir=str(out))
    result = sweep_in_process(capsys, spec)
    assert_refusal(result, [str(out / ".sweep.lock"), "symbolic link"])
    assert theirs.read_text() == "mine\n" and not (out / "trial-000").exists()


@pytest.mark.check
def test_the_recipe_and_its_content_belong_to_the_sweep(tmp_path, capsys, monkeypatch, sweep_data):
    """A sweep is each trial's job identity plus its draws' space: a recipe edited in what it trains (`config:` or
    the shell's CONFIG_FILE) is another sweep, HUB_TIMEOUT is not; more draws of one space extend it. A Hub repo
    in a recipe is refused (push: is the spec's)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lora_alpha: 16\n")
    out = tmp_path / "out"
    spec = write_spec(
        tmp_path, "uses-recipe", settings=sweep_data, config=str(recipe), grid={"lora_r": [4, 8]}, output_dir=str(out)
    )
    assert sweep_in_process(capsys, spec, "--summarize").code == 0
    recipe.write_text("lora_alpha: 32\n")
    assert_refusal(sweep_in_process(capsys, spec, "--summarize"), [str(out), "trial-000: LORA_ALPHA: 16 -> 32"])
    recipe.write_text("lora_alpha: 16\n")
    assert sweep_in_process(capsys, spec, "--summarize").code == 0  # restored: the same sweep again
    assert json.loads((out / "sweep.json").read_text())["recipe"]["path"] == str(recipe)

    # the shell's CONFIG_FILE, which every trial inherits: recorded, and held to what it trains
    shell_recipe = tmp_path / "shell-recipe.yaml"
    shell_recipe.write_text("lora_dropout: 0.1\n")
    monkeypatch.setenv("CONFIG_FILE", str(shell_recipe))
    inherited = write_spec(
        tmp_path, "inherits", settings=sweep_data, grid={"lora_r": [4]}, output_dir=str(tmp_path / "i")
    )
    assert sweep_in_process(capsys, inherited, "--summarize").code == 0
    assert json.loads((tmp_path / "i" / "sweep.json").read_text())["recipe"]["path"] == str(shell_recipe)
    shell_recipe.write_text("lora_dropout: 0.3\n")
    assert_refusal(sweep_in_process(capsys, inherited, "--summarize"), ["trial-000: LORA_DROPOUT: 0.1 -> 0.3"])
    shell_recipe.write_text("lora_dropout: 0.1\n")
    monkeypatch.setenv("HUB_TIMEOUT", "30")
    assert sweep_in_process(capsys, inherited, "--summarize").code == 0
    monkeypatch.delenv("CONFIG_FILE")

    # more draws of the same seed extend the sweep, as more trials extend an Optuna study: the first two are kept
    draws = {"settings": sweep_data, "random": {"learning_rate": {"low": 1e-4, "high": 1e-2}}, "seed": 7}
    spec = write_spec(tmp_path, "draws", trials=2, output_dir=str(tmp_path / "draws"), **draws)
    assert sweep_in_process(capsys, spec, "--summarize").code == 0
    first = json.loads((tmp_path / "draws" / "sweep.json").read_text())["trials"]
    spec = write_spec(tmp_path, "draws", trials=3, output_dir=str(tmp_path / "draws"), **draws)
    assert sweep_in_process(capsys, spec, "--summarize").code == 0
    extended = json.loads((tmp_path / "draws" / "sweep.json").read_text())["trials"]
    assert list(extended) == ["trial-000", "trial-001", "trial-002"] and {**extended, **first} == extended
    draws["random"]["learning_rate"]["high"] = 1e-1  # another space: its draws are other trials
    spec = write_spec(tmp_path, "draws", trials=3, output_dir=str(tmp_path / "draws"), **draws)
    assert_refusal(sweep_in_process(capsys, spec, "--summarize"), ["random.learning_rate was", "'high': 0.01"])

    pushing = tmp_path / "pushing-recipe.yaml"
    pushing.write_text("result_merged_model_id: me/merged\nmerge_adapter: true\n")
    spec = write_spec(
        tmp_path, "pushing", settings=sweep_data, config=str(pushing), grid={"lora_r": [4]}, output_dir=str(out)
    )
    result = sweep_in_process(capsys, spec)
    assert_refusal(result, [f"CONFIG_FILE={pushing}", "result_merged_model_id: me/merged", "push: OWNER/NAME"])


@pytest.mark.check
def test_a_state_file_the_sweep_cannot_read_is_refused_before_the_folder_is_claimed(tmp_path, capsys, sweep_data):
    """A malformed sweep.json or a torn or garbage study.db: one line naming the file and the fix, the folder as it
    was, even for a spec that would extend the sweep."""
    out = tmp_path / "sweep"
    spec = write_spec(tmp_path, "state", settings=sweep_data, grid={"lora_r": [4]}, output_dir=str(out))
    assert sweep_in_process(capsys, spec, "--summarize").code == 0
    recorded = (out / "sweep.json").read_text()
    grown = write_spec(tmp_path, "grown", settings=sweep_data, grid={"lora_r": [4, 8]}, output_dir=str(out))
    malformed = ("{}", "[]", '{"trials": [], "space": {}}', '{"trials": {"trial-000": 4}, "space": {}}', "{not")
    # the last: a record of the sweep.py before the job's identity (each trial's variables), compared by nothing
    for text in (*malformed, '{"trials": {"trial-000": {"LORA_R": "4"}}, "recipe": null}'):
        (out / "sweep.json").write_text(text)
        kept = snapshot(out)
        for args in ([], ["--summarize"], ["--run-trial", "0"]):
            result = sweep_in_process(capsys, grown, *args)
            line = assert_refusal(result, [str(out / "sweep.json"), "new output_dir"])
            assert ("earlier sweep.py" in line) == (text not in malformed), line
            assert snapshot(out) == kept, (text, args)

    (out / "sweep.json").write_text(recorded)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="sweep", storage=f"sqlite:///{tmp_path / 'whole.db'}")
    for _ in range(3):
        study.tell(study.ask(), 0.5)
    whole = (tmp_path / "whole.db").read_bytes()
    for why, data in [("torn", whole[: len(whole) // 2]), ("garbage", b"\x00not a database" * 64)]:
        (out / "study.db").write_bytes(data)
        kept = snapshot(out)
        result = sweep_in_process(capsys, grown)
        assert_refusal(result, [str(out / "study.db"), "move it aside", "new study"])
        assert snapshot(out) == kept, why
        assert "sweep: start" not in result.stdout


@pytest.mark.check
def test_a_push_the_job_would_refuse_is_refused_before_the_first_trial(tmp_path, capsys, monkeypatch, sweep_data):
    """`push:` without a token, under HF_HUB_OFFLINE, or of a local base without BASE_MODEL_ID: refused once, in the
    job's words, nothing claimed (Katib's trials read the token from the cluster)."""
    out = tmp_path / "sweep"
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "BASE_MODEL_ID"):
        monkeypatch.delenv(name, raising=False)

    def pushing(**settings) -> Path:
        keys = {"settings": {**sweep_data, **settings}, "grid": {"lora_r": [4, 8]}, "output_dir": str(out)}
        return write_spec(tmp_path, "push", push="tester/sweep", **keys)

    for args in ([], ["--dry-run"]):
        refusal = ["push: tester/sweep (trial-000)", "no token is set", "HF_TOKEN", "push: false"]
        assert_refusal(sweep_in_process(capsys, pushing(), *args), refusal)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    assert_refusal(
        sweep_in_process(capsys, pushing()),
        ["(trial-000)", f"MODEL_NAME={sweep_data['MODEL_NAME']}", "set BASE_MODEL_ID"],
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_refusal(sweep_in_process(capsys, pushing(base_model_id="bert-base-uncased")), ["HF_HUB_OFFLINE"])
    assert not out.exists()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    planned = sweep_in_process(capsys, pushing(base_model_id="bert-base-uncased"), "--dry-run")
    assert planned.code == 0, planned.stderr
    pushes = [t["settings"]["RESULT_MODEL_ID"] for t in planned.json()["trials"]]
    assert pushes == ["tester/sweep-trial-000", "tester/sweep-trial-001"]
    monkeypatch.delenv("HF_TOKEN")
    katib = write_spec(tmp_path, "katib", grid={"lora_r": [4]}, push="me/x", backend="katib", output_dir="/pvc-home/s")
    assert sweep_in_process(capsys, katib).code == 0


def test_the_token_is_masked_in_what_the_sweep_prints(tmp_path, sweep_data):
    spec = write_spec(tmp_path, "token", settings=sweep_data, grid={"lora_r": [4]}, metric=FAKE_TOKEN, output_dir=".")
    result = run_sweep(base_env(tmp_path, HF_TOKEN=FAKE_TOKEN), spec)
    assert_refusal(result, ["metric='***'"])
    assert FAKE_TOKEN not in result.stdout + result.stderr


@pytest.mark.check
def test_metrics_are_the_tasks_own_and_checked_before_any_trial(tmp_path, capsys):
    """A spec ranks by what the task's metrics.json holds (on MNLI `accuracy` is the matched split's); Katib's
    objective is the metric as the job's last stdout line names it."""

    def planned(task: str, metric: str, **spec) -> Result:
        path = write_spec(
            tmp_path, "metric", settings={"task": task}, grid={"lora_r": [4, 8]}, metric=metric, output_dir="o", **spec
        )
        return sweep_in_process(capsys, path, *(() if spec else ("--dry-run",)))

    for task, metric, key, direction in [
        ("mnli", "accuracy", "eval_matched_accuracy", "maximize"),
        ("mnli", "eval_mismatched_accuracy", "eval_mismatched_accuracy", "maximize"),
        ("mnli", "loss", "eval_matched_loss", "minimize"),
        ("stsb", "spearman", "eval_spearman", "maximize"),
        ("stsb", "mse", "eval_mse", "minimize"),
        ("cola", "matthews_correlation", "eval_matthews_correlation", "maximize"),
    ]:
        shown = planned(task, metric).json()
        assert (shown["metric_key"], shown["direction"]) == (key, direction), (task, metric)
    assert_refusal(planned("mnli", "matched_acc"), ["TASK=mnli", "did you mean matched_accuracy?"])
    assert_refusal(planned("stsb", "accuracy"), ["metric='accuracy'", "TASK=stsb", "pearson, spearman, mse"])

    mnli = yaml.safe_load(planned("mnli", "accuracy", backend="katib").stdout)
    assert schema_errors(katib_schema(), mnli) == []
    objective = {"objectiveMetricName": "eval_matched_accuracy", "additionalMetricNames": ["eval_mismatched_accuracy"]}
    assert mnli["spec"]["objective"] == {"type": "maximize", **objective}
    # the collector's pattern reads both from the line the job prints (utils/config/tasks.headline)
    line = headline({"eval_matched_accuracy": 0.71, "eval_mismatched_accuracy": 0.69, "eval_matched_f1": 0.7})
    (pattern,) = mnli["spec"]["metricsCollectorSpec"]["source"]["filter"]["metricsFormat"]
    assert dict(re.findall(pattern, line)) == {"eval_matched_accuracy": "0.7100", "eval_mismatched_accuracy": "0.6900"}
    stsb = yaml.safe_load(planned("stsb", "pearson", backend="katib").stdout)
    assert stsb["spec"]["objective"] == {"type": "maximize", "objectiveMetricName": "eval_pearson"}
    assert_refusal(planned("stsb", "spearman", backend="katib"), ["metric=spearman", "metric: pearson"])


@pytest.mark.check
def test_random_search_draws_the_same_trials_in_range(tmp_path, capsys, sweep_data):
    space = {
        "learning_rate": {"low": "1e-5", "high": 1.0e-2, "log": True},
        "lora_r": [4, 8],
        "seed": {"low": 1, "high": 99},
    }
    spec = write_spec(tmp_path, "random", settings=sweep_data, random=space, trials=6, output_dir=str(tmp_path / "s"))
    first = sweep_in_process(capsys, spec, "--dry-run")
    again = sweep_in_process(capsys, spec, "--dry-run")
    assert first.code == 0, first.stderr
    assert first.stdout == again.stdout  # seeded: a rerun plans the same trials
    trials = first.json()["trials"]
    assert [t["trial"] for t in trials] == [f"trial-00{i}" for i in range(6)]
    for t in trials:
        assert 1e-5 <= t["params"]["learning_rate"] <= 1e-2 and t["params"]["lora_r"] in (4, 8)
        assert isinstance(t["params"]["seed"], int) and 1 <= t["params"]["seed"] <= 99
        assert t["settings"]["LEARNING_RATE"] == str(t["params"]["learning_rate"])
    assert len({t["params"]["learning_rate"] for t in trials}) == 6


# ------------------------------------------------------------------------------- the docs' examples
DOC_SPECS = re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "sweeps.md").read_text(), re.S)
EXAMPLE_SPECS = sorted((REPO / "examples" / "sweeps").glob("*.yaml"))


@pytest.mark.check
def test_every_example_spec_plans_as_written(tmp_path, capsys, monkeypatch):
    """Each spec of docs/sweeps.md and examples/sweeps/, run from the checkout, plans, its metric the task's."""
    assert len(DOC_SPECS) == 3 and len(EXAMPLE_SPECS) == 4
    monkeypatch.chdir(REPO)
    for index, text in enumerate(DOC_SPECS):
        path = tmp_path / f"doc-{index}.yaml"
        path.write_text(text)
        EXAMPLE_SPECS.append(path)
    for path in EXAMPLE_SPECS:
        result = sweep_in_process(capsys, path, "--dry-run")
        assert result.code == 0, (path, result.stderr)
        planned = result.json()
        assert planned["trials"] and planned["metric_key"].startswith("eval_"), path


@pytest.mark.integration
def test_the_docs_mnli_sweep_runs_as_written(tmp_path, tiny_bert):
    """docs/sweeps.md's first spec as written on MNLI-shaped pairs; the tiny model and data come from the shell."""
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    spec = tmp_path / "mnli-lr.yaml"
    spec.write_text(DOC_SPECS[0])
    data = write_pair_dataset(tmp_path / "mnli", "mnli", train_rows=64, validation_rows=24)
    env = base_env(tmp_path, MODEL_NAME=str(tiny_bert), DATASET_PATH=str(data), MAX_STEPS="2", REPORT_TO="none")
    succeeded(run_script("sweep.py", env, spec, cwd=tmp_path, timeout=600))
    out = tmp_path / "output" / "sweeps" / "mnli-lr"
    rows = read_csv(out / "summary.csv")
    assert [(r["trial"], r["learning_rate"], r["status"]) for r in rows] == [
        ("trial-000", "0.0001", "complete"),
        ("trial-001", "0.0003", "complete"),
    ]
    for row in rows:
        metrics = json.loads((out / row["trial"] / "metrics.json").read_text())
        assert float(row["accuracy"]) == metrics["eval_matched_accuracy"]  # on MNLI, `accuracy` is the matched split's
        assert json.loads((out / row["trial"] / "run.json").read_text())["settings"]["task"] == "mnli"
    assert re.search(r"^Best: trial-00\d, accuracy = ", (out / "summary.md").read_text(), re.M)
    # the docs' Katib spec for MNLI reads its objective and the mismatched accuracy from the line a trial printed
    katib = tmp_path / "mnli-katib.yaml"
    katib.write_text(DOC_SPECS[2])
    objective = yaml.safe_load(run_script("sweep.py", env, katib, cwd=tmp_path, timeout=120).stdout)["spec"]
    (pattern,) = objective["metricsCollectorSpec"]["source"]["filter"]["metricsFormat"]
    final = re.findall(r"^eval_matched_accuracy=.*$", (out / "trial-000" / "trial.log").read_text(), re.M)[-1]
    found = {name: float(value) for name, value in re.findall(pattern, final)}
    metrics = json.loads((out / "trial-000" / "metrics.json").read_text())
    for name in (objective["objective"]["objectiveMetricName"], *objective["objective"]["additionalMetricNames"]):
        assert found[name] == pytest.approx(metrics[name], abs=1e-4), name


# ------------------------------------------------------------------------------- slurm backend
@pytest.mark.integration
def test_slurm_backend_renders_one_array_whose_indexes_are_the_trials(tmp_path, capsys, sweep_data):
    out = tmp_path / "sweep"
    spec = write_spec(
        tmp_path,
        "array",
        settings=sweep_data,
        grid={"learning_rate": [1.0e-4, 1.0e-3, 1.0e-2], "lora_r": [4, 8]},
        parallel=2,
        backend="slurm",
        slurm={"time": "00:30:00", "partition": "gpu", "gpus": 1},
        output_dir=str(out),
    )
    result = sweep_in_process(capsys, spec)
    assert result.code == 0, result.stderr
    script = (out / "sweep.sbatch").read_text()
    assert run_command(["bash", "-n", str(out / "sweep.sbatch")]).returncode == 0
    assert not re.search(r"@[A-Z_]+@", script)
    directives = re.findall(r"^#SBATCH (\S+)$", script, re.M)
    for expected in ("--array=0-5%2", "--gpus-per-task=1", "--time=00:30:00", "--partition=gpu", "--requeue"):
        assert expected in directives
    assert f'python sweep.py {spec} --run-trial "$SLURM_ARRAY_TASK_ID" &' in script
    assert f"cd {REPO}" in script
    planned = sweep_in_process(capsys, spec, "--dry-run").json()["trials"]
    for index, trial in enumerate(planned):
        task = sweep_in_process(capsys, spec, "--run-trial", str(index), "--dry-run").json()
        assert task == trial
        assert task["settings"]["OUTPUT_DIR"] == str(out / f"trial-00{index}")
    assert [t["params"] for t in planned[:2]] == [{"learning_rate": 1e-4, "lora_r": r} for r in (4, 8)]
    beyond = sweep_in_process(capsys, spec, "--run-trial", "6")
    assert beyond.code == 2 and "the sweep has trials 0..5" in beyond.stderr


@pytest.mark.check
def test_values_rendered_into_the_slurm_script_are_quoted_or_refused(tmp_path, capsys, sweep_data):
    """A newline in the name, slurm.partition, slurm.time or a path would start a shell line of the user's choosing:
    refused, nothing written. A space or `$(...)` in the name stays one quoted word."""
    out = tmp_path / "sweep"

    def spec(stem: str, **keys) -> Path:
        keys = {"settings": sweep_data, "grid": {"lora_r": [4]}, "backend": "slurm", "output_dir": str(out), **keys}
        return write_spec(tmp_path, stem, **keys)

    for stem, keys, names in [
        ("name", {"name": "lr\ntouch /tmp/owned"}, ["name", "control character", "one line"]),
        ("partition", {"slurm": {"partition": "gpu\ntouch /tmp/owned"}}, ["slurm.partition", "partition: gpu"]),
        ("partition-space", {"slurm": {"partition": "gpu $(id)"}}, ["slurm.partition", "Slurm partition name"]),
        ("time", {"slurm": {"time": "02:00:00\n"}}, ["slurm.time", "HH:MM:SS"]),
        ("log-dir", {"slurm": {"log_dir": str(tmp_path / "logs\nid")}}, ["slurm.log_dir", "control character"]),
    ]:
        assert_refusal(sweep_in_process(capsys, spec(stem, **keys)), names)
        assert not out.exists(), stem
    newline_file = tmp_path / "lr\nid.yaml"  # the name, when the spec gives none, is the file's
    newline_file.write_text(spec("copied").read_text())
    assert_refusal(sweep_in_process(capsys, newline_file), ["the spec's path", "control character"])
    assert not out.exists()

    result = sweep_in_process(capsys, spec("spaced", name="lr sweep $(id)", slurm={"partition": "gpu,debug"}))
    assert result.code == 0, result.stderr
    script = (out / "sweep.sbatch").read_text()
    assert "#SBATCH --job-name='lr sweep $(id)'\n" in script and "#SBATCH --partition=gpu,debug\n" in script


# ------------------------------------------------------------------------------- katib backend
def katib_schema() -> dict:
    """Katib's Experiment as its API defines it, unknown fields errors; the Kubernetes types it embeds left open."""
    text = KATIB_API.read_text()
    definitions = json.loads(text)["definitions"]
    for name in set(re.findall(r'"#/definitions/([^"]+)"', text)) | set(definitions):
        if not name.startswith("v1beta1."):
            definitions[name] = {}
    return strict({**definitions["v1beta1.Experiment"], "definitions": definitions})


def check_katib_enums(experiment: dict) -> list[str]:
    # the values Katib's Go types accept (pkg/apis/controller/...); the OpenAPI definitions only say `string`
    spec, errors = experiment["spec"], []
    if spec["objective"]["type"] not in ("minimize", "maximize"):
        errors.append(f"objective.type {spec['objective']['type']}")
    for p in spec["parameters"]:
        if p["parameterType"] not in ("double", "int", "discrete", "categorical"):
            errors.append(f"{p['name']}: parameterType {p['parameterType']}")
        if p["feasibleSpace"].get("distribution", "uniform") not in ("uniform", "logUniform", "normal", "logNormal"):
            errors.append(f"{p['name']}: distribution {p['feasibleSpace']['distribution']}")
    if spec["metricsCollectorSpec"]["collector"]["kind"] not in (
        "StdOut",
        "File",
        "TensorFlowEvent",
        "PrometheusMetric",
        "Custom",
        "Push",
    ):
        errors.append("collector kind")
    return errors


@pytest.mark.integration
def test_katib_experiment_is_valid_and_runs_the_jobs_pytorchjob(tmp_path, capsys, grid_sweep):
    space = {"learning_rate": {"low": 1.0e-5, "high": 1.0e-3, "log": True}, "lora_r": [8, 16]}
    space["max_steps"] = {"low": 10, "high": 50}
    keys = {"settings": {"num_epochs": 2}, "random": space, "trials": 6, "parallel": 3, "backend": "katib"}
    spec = write_spec(
        tmp_path, "katib", name="sst2-sweep", push="me/bert-sst2", output_dir="/pvc-home/sweeps/sst2", **keys
    )
    result = sweep_in_process(capsys, spec, "-o", tmp_path / "experiment.yaml")
    assert result.code == 0, result.stderr
    experiment = load_manifest(tmp_path / "experiment.yaml")
    assert schema_errors(katib_schema(), experiment) == []
    assert check_katib_enums(experiment) == []
    body = experiment["spec"]
    assert body["algorithm"] == {
        "algorithmName": "random",
        "algorithmSettings": [{"name": "random_state", "value": "0"}],
    }
    assert (body["maxTrialCount"], body["parallelTrialCount"]) == (6, 3)
    assert body["objective"] == {"type": "maximize", "objectiveMetricName": "eval_accuracy"}
    rate = {"min": "1e-05", "max": "0.001", "distribution": "logUniform"}
    assert body["parameters"] == [
        {"name": "learning_rate", "parameterType": "double", "feasibleSpace": rate},
        {"name": "lora_r", "parameterType": "categorical", "feasibleSpace": {"list": ["8", "16"]}},
        {"name": "max_steps", "parameterType": "int", "feasibleSpace": {"min": "10", "max": "50"}},
    ]
    # the metric comes from the line a real trial printed: the collector's pattern reads it as metrics.json has it
    trial = grid_sweep.out / "trial-000"
    final = FINAL_LINE.search((trial / "trial.log").read_text()).group(0)
    (pattern,) = body["metricsCollectorSpec"]["source"]["filter"]["metricsFormat"]
    found = float(dict(re.findall(pattern, final))["eval_accuracy"])
    assert found == pytest.approx(json.loads((trial / "metrics.json").read_text())["eval_accuracy"], abs=1e-4)

    # the trial is the deployed PyTorchJob: valid against its CRD, the same pods but for the settings and command
    job = body["trialTemplate"]["trialSpec"]
    assert schema_errors(crd_schema(job["apiVersion"], job["kind"]), job) == []
    deployed = load_manifest(K8S / "pytorchjob.yaml")
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        pod = copy.deepcopy(replica)
        (container,) = pod["template"]["spec"]["containers"]
        env = {var["name"]: var.get("value") for var in container.pop("env")}
        assert container.pop("command") == ["python", "/app/main.py"]
        original = copy.deepcopy(deployed["spec"]["pytorchReplicaSpecs"][role])
        original["template"]["spec"]["containers"][0].pop("env")
        assert pod == original
        # HF_TOKEN still from the Secret; RESULT_MERGED_MODEL_ID blank over the ConfigMap's: the job reads it as unset
        drawn = {name.upper(): f"${{trialParameters.{name}}}" for name in ("learning_rate", "lora_r", "max_steps")}
        trial = {"OUTPUT_DIR": "/pvc-home/sweeps/sst2/${trialSpec.Name}", "RUN_NAME": "${trialSpec.Name}"}
        pushes = {"RESULT_MODEL_ID": "me/bert-sst2-${trialSpec.Name}", "RESULT_MERGED_MODEL_ID": ""}
        assert env == {"HF_TOKEN": None, "NUM_EPOCHS": "2", **drawn, **trial, **pushes}
    assert body["trialTemplate"]["primaryPodLabels"] == {"training.kubeflow.org/job-role": "master"}
    referenced = {m.group(1) for m in re.finditer(r"\$\{trialParameters\.(\w+)\}", json.dumps(job))}
    declared = {p["name"] for p in body["trialTemplate"]["trialParameters"]}
    assert referenced == declared == {p["name"] for p in body["parameters"]}


@pytest.mark.check
def test_katib_schema_check_catches_an_unknown_field(tmp_path):
    experiment = load_manifest(K8S / "katib" / "experiment.yaml")
    experiment["spec"]["objective"]["objectiveMetric"] = "eval_accuracy"
    experiment["spec"]["parameters"][0]["feasibleSpace"]["min"] = 1e-5
    errors = schema_errors(katib_schema(), experiment)
    assert any("objectiveMetric" in e for e in errors), errors
    assert any("1e-05 is not of type 'string'" in e for e in errors), errors


@pytest.mark.check
def test_committed_katib_experiment_is_the_example_spec_rendered(tmp_path, capsys):
    result = sweep_in_process(capsys, REPO / "examples" / "sweeps" / "sst2-katib.yaml", "-o", tmp_path / "exp.yaml")
    assert result.code == 0, result.stderr
    assert (tmp_path / "exp.yaml").read_text() == (K8S / "katib" / "experiment.yaml").read_text()
    committed = load_manifest(K8S / "katib" / "experiment.yaml")
    assert schema_errors(katib_schema(), committed) == [] and check_katib_enums(committed) == []
    # a grid spec: Katib's grid over the same lists
    grid = write_spec(tmp_path, "grid", grid={"lora_r": [4, 8]}, backend="katib", output_dir="/pvc-home/s")
    rendered = yaml.safe_load(sweep_in_process(capsys, grid).stdout)
    assert rendered["spec"]["algorithm"] == {"algorithmName": "grid"}
    assert rendered["spec"]["maxTrialCount"] == 2


@pytest.mark.check
def test_katib_refuses_a_metric_its_collector_cannot_read(tmp_path, capsys):
    spec = write_spec(tmp_path, "f1", grid={"lora_r": [4, 8]}, metric="f1", backend="katib", output_dir="/pvc-home/s")
    result = sweep_in_process(capsys, spec)
    assert_refusal(result, ["metric=f1", "eval_accuracy", "metric: accuracy", "backend: katib"])

"""What a newcomer meets first: `make demo` for each pair task (TASK=mnli, TASK=stsb), offline, through the Makefile
into the test's own folder, beside the other tasks' demos: its metrics, one console line per evaluation and a final
line (no bars without a terminal, no dict per log, no Trainer banners). A run on a (pseudo-)terminal draws bars."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests.support.env import REPO, base_env, tiny_run_env
from tests.support.processes import CompletedProcess, run_command, start_main_on_terminal

EVALUATION_LINE = re.compile(r"INFO utils\.run: step (\d+)/(\d+) \(epoch [\d.]+\): eval_\S+=[\d.]+ ", re.M)
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's `42%|████▏     | 47/111`
TASKS = {
    # task: (the metrics it reports, with a floor the bundled sample reaches; the loss logged once per evaluation)
    "mnli": ({"eval_matched_accuracy": 0.8, "eval_mismatched_accuracy": 0.8}, "eval_matched_loss"),
    "stsb": ({"eval_pearson": 0.5}, "eval_loss"),
}


def make_demo(tmp, task: str) -> CompletedProcess:
    """`make demo TASK=task`, as the README gives it, with its outputs under `tmp` and this interpreter's venv."""
    venv = sys.prefix  # the venv this test runs in is the demo's: -o, never rebuilt from here
    command = ["make", "-o", f"{venv}/.job", "demo", f"VENV={venv}", f"PY={sys.executable}", f"TASK={task}"]
    return run_command([*command, f"DEMO={tmp / 'demo'}"], cwd=REPO, env=base_env(tmp), timeout=600)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_make_demo_trains_a_pair_task_offline_with_one_line_per_evaluation(tmp_path, task):
    # The other tasks' demos, made before this one: their models and outputs are theirs (DEMO/TASK/...), and this
    # demo leaves them as they were (a pair task's 3-class or 1-score model once replaced SST-2's 2-class one).
    others = {
        tmp_path / "demo" / other / part / "made-before": f"{other} {part}"
        for other in ("sst2", *TASKS)
        if other != task
        for part in ("tiny-bert", "output")
    }
    for path, text in others.items():
        path.parent.mkdir(parents=True)
        path.write_text(text)
    result = make_demo(tmp_path, task)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "demo" / task / "output"
    assert (tmp_path / "demo" / task / "tiny-bert" / "config.json").is_file()
    assert {path: path.read_text() for path in others if path.exists()} == others
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == sorted(["sst2", *TASKS])
    metrics = json.loads((out / "metrics.json").read_text())
    floors, loss = TASKS[task]
    assert {name: metrics[name] > floor for name, floor in floors.items()} == dict.fromkeys(floors, True), metrics
    if task == "mnli":
        assert metrics["labels"] == ["entailment", "neutral", "contradiction"]
    else:
        assert metrics["problem_type"] == "regression" and metrics["labels"] == []
    # The final line on stdout: the task's headline metrics, the speed and where the model is.
    shown = " ".join(f"{name}={metrics[name]:.4f}" for name in floors)
    assert re.search(rf"^{shown} train_samples_per_second=\S+ model={out}/model$", result.stdout, re.M), result.stdout

    console = result.stdout + result.stderr
    assert not PROGRESS_BAR.search(console) and "\r" not in console, console[-3000:]  # stderr is not a terminal
    assert "{'loss'" not in console and "{'eval_" not in console  # the dict of every log stays in the rank log
    log = (out / "logs" / "rank-0.log").read_text()
    # One console line per evaluation, at the steps the rank log records one (the final evaluation included).
    evaluated = [int(step) for step in re.findall(rf"step (\d+): \{{'{loss}'", log)]
    lines = EVALUATION_LINE.findall(result.stderr)
    assert [int(step) for step, _ in lines] == evaluated and len(evaluated) >= 3, (lines, evaluated)
    assert lines[-1][0] == lines[-1][1]  # the last one after the last step
    # The Trainer's banners are filtered where they are logged.
    for banner in ("***** Running", "Num examples", "Do not forget to share"):
        assert banner not in log and banner not in console, banner


def test_a_terminal_gets_progress_bars(tmp_path, tiny_bert, sst2_dir):
    env = tiny_run_env(tmp_path, tiny_bert, sst2_dir, MAX_STEPS=6, EVAL_STEPS=3)
    proc = start_main_on_terminal(env, tmp_path / "terminal.txt")
    assert proc.wait(timeout=300) == 0
    proc.copied.join(timeout=30)
    text = (tmp_path / "terminal.txt").read_text(errors="replace")
    assert PROGRESS_BAR.search(text), text[-3000:]
    log = (tmp_path / "out" / "logs" / "rank-0.log").read_text()
    assert len(EVALUATION_LINE.findall(text)) == log.count("{'eval_loss'") == 2  # at step 3, and the final one
    assert "{'loss'" not in text  # the bars come without the dict of every log
    assert re.search(r"^eval_accuracy=\S+ .*model=", text, re.M), text[-3000:]


def test_make_help_lists_every_target_on_one_line():
    # As a user types it: not as a make run inside `make test`, which would print "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    result = run_command(["make", "help"], cwd=REPO, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    targets = re.search(r"^\.PHONY: (.*)$", (REPO / "Makefile").read_text(), re.M)[1].split()
    listed = [re.match(r"  make (\S+) +\S", line)[1] for line in result.stdout.splitlines()]
    assert sorted(listed) == sorted(targets), result.stdout

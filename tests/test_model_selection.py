"""LOAD_BEST_MODEL and EARLY_STOPPING_PATIENCE through the real entry point on the tiny model: the saved model is
the best checkpoint's, chosen by the task's metric, never pruned, named in metrics.json and the card; early stopping
ends training once the patience is spent, and a run stopped and restarted stops where the whole run did."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.support.env import base_env, tiny_run_settings
from tests.support.numerics import adapter_weights
from tests.support.outcomes import complete_steps, rank_record
from tests.support.processes import run_main, start_main, wait_all, wait_for

pytestmark = pytest.mark.slow


def evaluations(out: Path) -> dict[int, float]:
    """Every evaluation during training (step -> eval_accuracy) from the newest checkpoint's trainer_state.json."""
    newest = max(complete_steps(out))
    history = json.loads((out / "checkpoints" / f"checkpoint-{newest}" / "trainer_state.json").read_text())
    return {entry["step"]: entry["eval_accuracy"] for entry in history["log_history"] if "eval_accuracy" in entry}


def test_the_saved_model_is_the_best_checkpoint_s(tmp_path, tiny_bert, sst2_dir):
    extra = dict(MAX_STEPS=30, EVAL_STEPS=5, SAVE_TOTAL_LIMIT=1, LOAD_BEST_MODEL="true")
    settings = tiny_run_settings(tiny_bert, sst2_dir, tmp_path / "out", **extra)
    settings.pop("NUM_EPOCHS")
    result = run_main(base_env(tmp_path, **settings))
    assert result.code == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    scores = evaluations(out)
    assert sorted(scores) == [5, 10, 15, 20, 25, 30], scores  # the last step is a candidate too
    best = max(scores, key=lambda step: (scores[step], -step))  # the first of the best: a later tie is no better
    selected = json.loads((out / "metrics.json").read_text())["selected_checkpoint"]
    assert selected == {"step": best, "metric": "eval_accuracy", "score": scores[best], "steps_trained": 30}
    # Kept beside the newest despite SAVE_TOTAL_LIMIT=1, and the saved adapter is its weights.
    assert best in complete_steps(out) and 30 in complete_steps(out)
    from safetensors.torch import load_file

    saved = adapter_weights(out)
    chosen = load_file(out / "checkpoints" / f"checkpoint-{best}" / "adapter_model.safetensors")
    assert saved.keys() == chosen.keys() and all((saved[k] == chosen[k]).all() for k in saved)
    card = (out / "model" / "README.md").read_text()
    assert f"the checkpoint of step {best} of 30, the best eval_accuracy" in card


def test_early_stopping_stops_where_a_restarted_run_stops(tmp_path, tiny_bert, sst2_dir):
    extra = dict(
        MAX_STEPS=120, EVAL_STEPS=4, SAVE_TOTAL_LIMIT=1, EARLY_STOPPING_PATIENCE=2, MODEL_DROPOUT=0, LORA_DROPOUT=0
    )
    settings = tiny_run_settings(tiny_bert, sst2_dir, tmp_path / "unused", **extra)
    settings.pop("NUM_EPOCHS")
    whole = tmp_path / "whole"
    result = run_main(base_env(tmp_path, **{**settings, "OUTPUT_DIR": str(whole)}))
    assert result.code == 0, result.stderr[-3000:]
    scores = evaluations(whole)
    steps = sorted(scores)
    stopped = rank_record(whole, 0)
    selected = json.loads((whole / "metrics.json").read_text())["selected_checkpoint"]
    assert selected["steps_trained"] == steps[-1] < 120, (selected, scores)  # stopped before the last step
    best = max(steps, key=lambda step: (scores[step], -step))
    # Two evaluations after the best, none of them better: the patience, spent at the last one.
    assert selected["step"] == best and steps[-3] == best and steps[-1] == best + 2 * 4, scores
    assert "early stopping at step" in (whole / "logs" / "rank-0.log").read_text()

    # The same run stopped (SIGTERM) after its first checkpoint and started again: the same stop, the same model.
    resumed = tmp_path / "resumed"
    env = base_env(tmp_path, **{**settings, "OUTPUT_DIR": str(resumed)})
    proc = start_main(env, log=tmp_path / "first.txt")
    wait_for(resumed / "checkpoints" / "checkpoint-4" / "COMPLETE", [proc])
    proc.send_signal(signal.SIGTERM)
    assert wait_all([proc]) == [143], (tmp_path / "first.txt").read_text()[-3000:]
    again = run_main(env)
    assert again.code == 0, again.stderr[-3000:]
    assert json.loads((resumed / "metrics.json").read_text())["selected_checkpoint"] == selected
    assert rank_record(resumed, 0)["trainable_checksum"] == stopped["trainable_checksum"]

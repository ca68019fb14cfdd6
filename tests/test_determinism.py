"""The same seed and training settings train the same model whatever the evaluation, logging and checkpoint
cadence; and a run that dies in its final evaluation keeps its training: real processes on the tiny BERT."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from tests.support.env import job_settings
from tests.support.outcomes import complete_steps, rank_record
from tests.support.processes import run_main, start_main, wait_until


def test_evaluation_logging_and_checkpoint_cadence_leave_the_trained_weights_alone(job_env, tmp_path):
    """Each evaluation's data loader draws its seed from the global RNG: without a forked RNG every evaluation
    shifted the dropout masks of every later step, so EVAL_STEPS (free to change on a restart) changed the model."""
    cadences = {
        "busy": dict(EVAL_STEPS="1", SAVE_STEPS="1", SAVE_TOTAL_LIMIT="1", LOGGING_STEPS="1", REPORT_TO="tensorboard"),
        "quiet": dict(EVAL_STEPS="0", SAVE_STEPS="100", SAVE_TOTAL_LIMIT="3", LOGGING_STEPS="100", REPORT_TO="none"),
    }
    for name, cadence in cadences.items():
        result = run_main(job_settings(job_env, OUTPUT_DIR=str(tmp_path / name), **cadence))
        assert result.code == 0, result.stderr[-3000:]
    busy_log = (tmp_path / "busy" / "logs" / "rank-0.log").read_text()
    quiet_log = (tmp_path / "quiet" / "logs" / "rank-0.log").read_text()
    # Evaluated after steps 1-3 and at the end (the last step's evaluation is the final one), against once at the
    # end; dropout on (LORA_DROPOUT's 0.05).
    assert busy_log.count("{'eval_loss'") == 4, busy_log[-3000:]  # each evaluation's record in the rank log
    assert quiet_log.count("{'eval_loss'") == 1
    assert complete_steps(tmp_path / "busy") == [4]
    busy_sum, quiet_sum = (rank_record(tmp_path / name, 0)["trainable_checksum"] for name in ("busy", "quiet"))
    assert busy_sum == quiet_sum


@pytest.mark.integration
def test_a_run_killed_in_its_final_evaluation_resumes_at_its_last_step_and_only_evaluates(job_env, tmp_path):
    """An evaluation that runs out of memory (a huge PER_DEVICE_EVAL_BATCH_SIZE, the kernel's OOM killer) lost
    every step since the last checkpoint: the last step was evaluated before it was saved. Now the last step is
    checkpointed first; the restart (with a batch that fits) trains nothing again and finishes."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(Path(job_env["DATASET_PATH"]) / "train.csv", data / "train.csv")
    # 2,000 rows a row at a time: seconds of evaluation, so the kill lands inside it.
    shutil.copy(data / "train.csv", data / "validation.csv")
    # The last step (5) is an evaluation step too.
    cadence = dict(MAX_STEPS="5", EVAL_STEPS="5", SAVE_STEPS="3", SAVE_TOTAL_LIMIT="1", PER_DEVICE_EVAL_BATCH_SIZE="1")
    env = job_settings(job_env, DATASET_PATH=str(data), **cadence)
    out = Path(env["OUTPUT_DIR"])
    proc = start_main(env, log=tmp_path / "first.txt")
    try:
        # The last step is checkpointed, then evaluated: killed once the checkpoint is complete.
        wait_until(lambda: complete_steps(out) == [5], "checkpoint-5 complete", [proc], every=0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "model").exists()
    assert complete_steps(out) == [5]  # SAVE_TOTAL_LIMIT=1: the last step's checkpoint replaced step 3's

    again = run_main({**env, "PER_DEVICE_EVAL_BATCH_SIZE": "256"})
    assert again.code == 0, again.stderr[-3000:]
    assert "resuming from step 5" in again.stderr
    assert rank_record(out, 0)["samples_trained"] == 0  # no step trained twice
    assert (out / "model" / "adapter_model.safetensors").is_file()
    assert "eval_accuracy=" in again.stdout
    # A restart of the finished run changes nothing.
    assert "already holds a finished run" in run_main(env).stderr

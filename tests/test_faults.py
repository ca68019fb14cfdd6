"""The job at its edges, in real processes: malformed tokens, a Hub that never answers, replicas that
disagree, resumes that would continue another run, two jobs on one folder, damaged checkpoints, stop
signals in native code, peers lost outside training, a token path that is no file, a rendezvous port
already taken, and a lost peer's error after a progress bar. Each asserts the exit code, the one `error:`
line, what was or was not written, and that the token appears nowhere.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest

from scripts.make_demo_assets import write_dataset
from tests.conftest import (
    REPO,
    REPO_ID,
    SAVE_STEPS,
    TIMEOUT,
    assert_token_absent,
    base_env,
    complete_steps,
    error_lines,
    free_port,
    job_settings,
    log_time,
    push_settings,
    rank_env,
    rank_record,
    run_main,
    start_main,
    training_settings,
    wait_all,
    wait_for,
)

SECRET = "hf_fault_secret_0123456789abcdef"


def one_error(result_or_text, says: str) -> str:
    text = result_or_text if isinstance(result_or_text, str) else result_or_text.stderr
    errors = error_lines(text)
    assert len(errors) == 1 and says in errors[0], text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    return errors[0]


# ------------------------------------------------------------------------------- 1, 2, 12: the token
@pytest.mark.parametrize(
    "how",
    ["newline-in-env", "header-injection-in-env", "two-line-file", "binary-file", "too-short"],
)
def test_a_malformed_token_is_refused_first_and_never_echoed(how, job_env, hub, tmp_path):
    env = {**job_env, **push_settings(hub)}
    env.pop("HF_TOKEN")
    secret_part = "hf_abcdefghijk"
    if how == "newline-in-env":
        env["HF_TOKEN"] = f"{secret_part}\nsecond"
    elif how == "header-injection-in-env":
        env["HF_TOKEN"] = f"{secret_part}\r\nX-Injected: yes"
    elif how == "two-line-file":
        (tmp_path / "token").write_text(f"{secret_part}\nX: y\n")
        env["HF_TOKEN_PATH"] = str(tmp_path / "token")
    elif how == "binary-file":
        (tmp_path / "token").write_bytes(b"\xff\xfe\x00hf_\x80\x81" + secret_part.encode())
        env["HF_TOKEN_PATH"] = str(tmp_path / "token")
    else:
        env["HF_TOKEN"] = "hf_abc"
        secret_part = "hf_abc"
    for args in ([], ["--dry-run"]):
        started = time.monotonic()
        result = run_main(env, *args)
        assert result.code == 2, result.stderr
        one_error(result, "HF_TOKEN")
        assert time.monotonic() - started < 15  # refused before torch is imported, let alone a retry loop
        assert secret_part not in result.stdout + result.stderr
        assert repr(secret_part)[1:-1] not in result.stdout + result.stderr
    assert hub.requests == [] and not (tmp_path / "out" / "model").exists()


@pytest.mark.parametrize("setting", ["RUN_NAME", "MODEL_NAME", "DATASET_PATH"])
def test_a_setting_holding_the_token_in_any_form_is_refused_without_showing_it(setting, job_env, tmp_path):
    forms = {
        "RUN_NAME": SECRET,
        "MODEL_NAME": f"/models/{urllib.parse.quote(SECRET + '/x', safe='')}",
        "DATASET_PATH": f"/data/{SECRET}",
    }
    env = {**job_env, "HF_TOKEN": SECRET, setting: forms[setting]}
    for args in ([], ["--dry-run"]):
        result = run_main(env, *args)
        assert result.code == 2, result.stderr
        error = one_error(result, "the Hub token; the token belongs only in HF_TOKEN")
        assert setting in error.split(" hold")[0]  # named (a RUN_NAME derived from it is named too)
        assert SECRET not in result.stdout + result.stderr and urllib.parse.quote(SECRET) not in result.stderr
    assert not (tmp_path / "out" / "tensorboard").exists() and not (tmp_path / "out" / "run.json").exists()


def test_every_form_of_the_token_is_masked_in_what_the_job_prints():
    """The masking itself, on the forms libraries produce: repr-escaped in exceptions, percent-encoded in URLs."""
    sys.path.insert(0, str(REPO))
    from pydantic import SecretStr

    from utils.hub_token import Masker

    token = "hf_Ab+c/d=e%f_0123456789"
    mask = Masker(SecretStr(token))
    text = f"raw {token} repr {token!r} url {urllib.parse.quote(token, safe='')} form {urllib.parse.quote_plus(token)} json {json.dumps(token)}"
    masked = mask(text)
    for form in (token, urllib.parse.quote(token, safe=""), urllib.parse.quote_plus(token)):
        assert form not in masked
    assert masked.count("***") == 5


def test_dry_run_refuses_a_push_it_could_not_make(job_env):
    result = run_main({**job_env, "RESULT_MODEL_ID": REPO_ID}, "--dry-run")
    assert result.code == 2 and result.stdout == ""
    one_error(result, "set HF_TOKEN")


# ------------------------------------------------------------------------------- 3: a Hub that never answers
def test_silent_hub_at_the_token_check_fails_both_replicas_with_one_line_and_no_hang(
    hub, tmp_path, tiny_bert, sst2_dir
):
    hub.go_silent("whoami")
    settings = {
        **training_settings(tiny_bert, sst2_dir, tmp_path / "out"),
        **push_settings(hub),
        "HUB_TIMEOUT": "2",
        "PUSH_TIMEOUT": "8",
    }
    port = free_port()
    procs = [
        start_main(rank_env(tmp_path, rank, 2, port, **settings), log=tmp_path / f"rank{rank}.txt") for rank in (0, 1)
    ]
    started = time.monotonic()
    try:
        codes = wait_all(procs, timeout=120)
    finally:
        for proc in procs:
            proc.kill()
    assert codes == [2, 2]
    assert time.monotonic() - started < 8 + 40  # the check's bound, plus imports on a loaded machine
    for rank in (0, 1):
        error = one_error(
            (tmp_path / f"rank{rank}.txt").read_text(), "could not be reached to check HF_TOKEN within 8 s"
        )
        assert "HF_ENDPOINT" in error and "unset RESULT_MODEL_ID" in error
    assert not (tmp_path / "out" / "run.json").exists() and hub.commits == []


def test_silent_hub_at_the_push_ends_in_exit_3_within_the_deadline_with_the_model_kept(job_env, hub, tmp_path):
    hub.go_silent("commit")
    env = job_settings(job_env, **push_settings(hub), HUB_TIMEOUT="2", PUSH_TIMEOUT="10")
    log = tmp_path / "stream.txt"
    proc = start_main(env, log=log)
    try:
        assert proc.wait(timeout=300) == 3
    finally:
        proc.kill()
    rank_log = tmp_path / "out" / "logs" / "rank-0.log"
    took = log_time(rank_log, "push to") - log_time(rank_log, "pushing ")
    assert took <= 10 + 3, f"the push gave up after {took:.0f} s; PUSH_TIMEOUT=10"
    one_error(log.read_text(), "--push-only")
    assert (tmp_path / "out" / "model" / "adapter_model.safetensors").exists() and (
        tmp_path / "out" / "metrics.json"
    ).exists()
    assert_token_absent(hub.token, [tmp_path], hub)


# ------------------------------------------------------------------------------- 4, 6: replicas that disagree
def test_replicas_with_different_settings_all_stop_with_exit_2_naming_them(replicas, tmp_path, tiny_bert, sst2_dir):
    # Rank 1 differs in a training setting and in the world size it was told: both are named, on both ranks.
    out = tmp_path / "out"
    port = free_port()
    settings = training_settings(tiny_bert, sst2_dir, out)
    procs = []
    for rank, extra in ((0, {"LEARNING_RATE": "5e-4"}), (1, {"LEARNING_RATE": "0.9", "WORLD_SIZE": "3"})):
        env = {**rank_env(tmp_path, rank, 2, port, **settings), **extra}
        procs.append(start_main(env, log=tmp_path / f"rank{rank}.txt"))
    replicas.started += procs
    started = time.monotonic()
    assert wait_all(procs, timeout=120) == [2, 2]
    assert time.monotonic() - started < TIMEOUT + 30  # RENDEZVOUS_TIMEOUT holds on both: neither waits for the other
    for rank in (0, 1):
        error = one_error((tmp_path / f"rank{rank}.txt").read_text(), "LEARNING_RATE: 0.0005 on rank 0, 0.9 on rank 1")
        assert "WORLD_SIZE: 2 on rank 0, 3 on rank 1" in error, error
    assert not list(out.glob("checkpoints/checkpoint-*")) and not (out / "run.json").exists()


# ------------------------------------------------------------------------------- 5: stop signals
def test_sigterm_while_waiting_in_the_rendezvous_exits_143_within_seconds(tmp_path, tiny_bert, sst2_dir):
    """Rank 0 waits in the store's native wait for a peer that never comes: the Python handler cannot run there."""
    log = tmp_path / "rank0.txt"
    env = rank_env(
        tmp_path, 0, 2, free_port(), **training_settings(tiny_bert, sst2_dir, tmp_path / "out", RENDEZVOUS_TIMEOUT=300)
    )
    proc = start_main(env, log=log)
    try:
        deadline = time.monotonic() + 120
        while "device cpu" not in log.read_text():  # past the imports: in the rendezvous
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert proc.wait(timeout=30) == 143
        assert time.monotonic() - signalled < 10  # well inside a 30 s grace period
    finally:
        proc.kill()
    assert "preempted: SIGTERM" in log.read_text()


@pytest.mark.slow
def test_sigint_checkpoints_like_sigterm_and_says_so(job_env, tmp_path):
    out = tmp_path / "out"
    env = job_settings(
        job_env, MAX_STEPS=str(4 * SAVE_STEPS), SAVE_STEPS=str(SAVE_STEPS)
    )  # stopped in the 2nd interval
    log = tmp_path / "stream.txt"
    proc = start_main(env, log=log)
    try:
        wait_for(out / "checkpoints" / f"checkpoint-{SAVE_STEPS}" / "COMPLETE", [proc])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    text = log.read_text()
    assert "preempted: SIGINT (Ctrl-C) during training, checkpoint saved" in text and "Traceback" not in text
    steps = complete_steps(out)
    assert steps[-1] > SAVE_STEPS  # saved where it stopped, not only at the last interval
    again = run_main(env)
    assert again.code == 0, again.stderr[-3000:]
    assert f"resuming from step {steps[-1]}" in (out / "logs" / "rank-0.log").read_text()
    assert rank_record(out, 0)["first_step"] == steps[-1] + 1


# ------------------------------------------------------------------------------- 8, 13: resume continues the same run
RESUME_ROWS, RESUME_SAVE_STEPS = 640, 10  # 40 steps an epoch at batch 16, 80 in the run: 8 checkpoints


@pytest.mark.slow
def test_resume_refuses_another_shape_and_other_data_and_survives_damaged_checkpoints(replicas, tmp_path, tiny_bert):
    data = write_dataset(tmp_path / "data", train_rows=RESUME_ROWS, validation_rows=31)
    total_steps = 2 * RESUME_ROWS // 16
    # The uninterrupted one-process run of 2 epochs the resumed one must match.
    reference = base_env(
        tmp_path, **training_settings(tiny_bert, data, tmp_path / "reference", SAVE_STEPS=RESUME_SAVE_STEPS)
    )
    result = run_main(reference)
    assert result.code == 0, result.stderr[-3000:]
    one_replica_reference = rank_record(tmp_path / "reference", 0)

    out = tmp_path / "out"
    settings = training_settings(tiny_bert, data, out, SAVE_STEPS=RESUME_SAVE_STEPS)
    env = base_env(tmp_path, **settings)
    proc = start_main(env, log=tmp_path / "first.txt")
    try:
        wait_for(out / "checkpoints" / "checkpoint-50" / "COMPLETE", [proc])  # epoch 2 of 2
        proc.kill()
        proc.wait()
    finally:
        proc.kill()

    # Restarted as 2 replicas: refused on both, with the fix.
    procs = replicas.start("two", settings)
    assert wait_all(procs, timeout=200) == [2, 2]
    for rank in (0, 1):
        one_error(
            (tmp_path / f"two-rank{rank}.txt").read_text(),
            "written by a run with 1 replica(s), this start has 2; global batch 16, this start 32; resuming would skip or repeat rows: restart with 1 replica(s)",
        )

    # The data changed between kill and restart: refused; the same rows copied again (new mtime): resumed.
    original = (data / "train.csv").read_text()
    lines = original.splitlines()
    (data / "train.csv").write_text("\n".join([lines[0], *lines[2:], lines[1]]) + "\n")  # same rows, other order
    changed = run_main(env)
    assert changed.code == 2
    one_error(changed, "other training or validation data")
    (data / "train.csv").write_text(original)

    # The newest checkpoint damaged after it was marked complete: the previous one is used, with a warning.
    *_, previous, newest = complete_steps(out)
    with open(out / "checkpoints" / f"checkpoint-{newest}" / "optimizer.pt", "r+b") as handle:
        handle.truncate(100)
    resumed = run_main(env)
    assert resumed.code == 0, resumed.stderr[-3000:]
    log = (out / "logs" / "rank-0.log").read_text()
    assert (
        f"removed checkpoint-{newest}: optimizer.pt has 100 bytes" in log and f"resuming from step {previous}" in log
    )
    # Two epochs, killed in the second, resumed from a fallback: bit-identical to the uninterrupted run.
    record = rank_record(out, 0)
    assert record["trainable_checksum"] == one_replica_reference["trainable_checksum"]
    assert record["first_step"] == previous + 1 and record["samples_trained"] == (total_steps - previous) * 16


@pytest.mark.slow
def test_a_missing_checkpoint_file_falls_back_to_a_fresh_start_not_a_traceback(job_env, tmp_path):
    out = tmp_path / "out"
    env = job_settings(job_env, MAX_STEPS="100", SAVE_STEPS="10", SAVE_TOTAL_LIMIT="1")
    proc = start_main(env, log=tmp_path / "first.txt")
    try:
        wait_for(out / "checkpoints" / "checkpoint-20" / "COMPLETE", [proc])
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    steps = complete_steps(out)
    for step in steps:  # a missing optimizer state was resumed silently with a fresh optimizer
        (out / "checkpoints" / f"checkpoint-{step}" / "optimizer.pt").unlink()
    result = run_main(env)
    assert result.code == 0, result.stderr[-3000:]
    log = (out / "logs" / "rank-0.log").read_text()
    assert f"removed checkpoint-{steps[0]}: optimizer.pt is missing; falling back to a fresh start" in log
    assert "resuming from" not in log.split("falling back")[-1]
    assert rank_record(out, 0)["first_step"] == 1  # trained from the start, not from a checkpoint


# ------------------------------------------------------------------------------- 9, 10: one job per OUTPUT_DIR
LOCK_STEPS = 1000  # the holder's run: long enough to still train while a second job imports torch on a busy machine


@pytest.mark.slow
def test_a_second_job_on_a_folder_in_use_is_refused_and_a_killed_holder_never_locks_out(job_env, tmp_path):
    out = tmp_path / "out"
    env = job_settings(job_env, MAX_STEPS=str(LOCK_STEPS), SAVE_STEPS="50")
    first = start_main(env, log=tmp_path / "first.txt")
    try:
        wait_for(out / ".job.lock", [first])  # the holder has the lock: the second job starts at once
        second = start_main(env, log=tmp_path / "second.txt")
        assert second.wait(timeout=300) == 2
        one_error((tmp_path / "second.txt").read_text(), "is in use by another job (host")
        assert first.poll() is None, f"the holder finished its {LOCK_STEPS} steps before a second job started"
        # The holder goes on; killed near its end, so the restart has little left to train.
        while max(complete_steps(out), default=0) < LOCK_STEPS - 100:
            assert first.poll() is None, f"the holder ended ({first.returncode}) before it was killed"
            time.sleep(0.05)
        first.kill()  # SIGKILL: the lock file stays, with a heartbeat that stops
        first.wait()
    finally:
        first.kill()
    assert (out / ".job.lock").exists()
    restarted = run_main(env)  # a restart after a kill: never locked out
    assert restarted.code == 0, restarted.stderr[-3000:]
    assert "took over the lock" in restarted.stderr and not (out / ".job.lock").exists()
    log = (out / "logs" / "rank-0.log").read_text()
    assert log.count("already holds a finished run") == 0 and "resuming from step" in log


def test_a_start_refused_for_bad_input_leaves_the_folder_reusable(job_env, tmp_path):
    bad = run_main(job_settings(job_env, LORA_TARGET_MODULES="q_proj,v_proj"))
    assert bad.code == 2
    one_error(bad, "linear layers are named")
    assert not (tmp_path / "out" / "run.json").exists() and not (tmp_path / "out" / ".job.lock").exists()
    fixed = run_main(job_settings(job_env))
    assert fixed.code == 0, fixed.stderr[-3000:]


# ------------------------------------------------------------------------------- 15, 16: lost peers outside training
def test_a_peer_lost_before_training_is_143_on_the_survivor(replicas, tmp_path, tiny_bert, sst2_dir):
    out = tmp_path / "out"
    procs = replicas.start("early", training_settings(tiny_bert, sst2_dir, out))
    wait_for(out / "logs" / "rank-1.log", procs, timeout=120)  # past the rendezvous: loading data and model
    procs[1].kill()
    assert procs[0].wait(timeout=TIMEOUT + 60) == 143
    one_error((tmp_path / "early-rank0.txt").read_text(), "lost contact with its peers")


CLASSIFY = r"""
import os, sys
sys.path.insert(0, {repo!r})
from utils.collectives import rendezvous
from utils.distributed import DistEnv
from utils.errors import JobError
rank, what = int(sys.argv[1]), sys.argv[2]
dist = DistEnv(rank, 0, 2, rank, "127.0.0.1", int(sys.argv[3]), "platform")
group = rendezvous(dist, 20, False, {{"same": 1}})
import torch, torch.distributed as td
try:
    with group.peers_watched(lambda: "resumes"):
        if rank == 1 and what == "crash":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")  # local, not a peer
        if rank == 1 and what == "die":
            os._exit(9)
        td.barrier()
except JobError as exc:
    print("exit", exc.code, flush=True)
    os._exit(exc.code)
except RuntimeError:
    print("exit 1", flush=True)
    os._exit(1)
print("exit 0", flush=True)
"""


@pytest.mark.parametrize("what, expected", [("die", [143, 9]), ("crash", [143, 1])])
def test_failures_are_classified_by_type_and_heartbeat_not_by_message(what, expected, tmp_path):
    """A peer that dies is 143 on the survivor; a rank whose own step fails with a RuntimeError that merely
    mentions CUDA (no peer lost) is exit 1 there, never mistaken for a lost peer."""
    script = tmp_path / "classify.py"
    script.write_text(CLASSIFY.format(repo=str(REPO)))
    port = free_port()
    env = base_env(tmp_path)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), what, str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    codes = [proc.wait(timeout=90) for proc in procs]
    assert codes == expected, [proc.stdout.read()[-2000:] for proc in procs]


# ------------------------------------------------------------------------------- a token path that is no file
def test_a_token_path_naming_a_fifo_is_refused_at_once_not_read_for_ever(job_env, tmp_path):
    fifo = tmp_path / "token-pipe"
    os.mkfifo(fifo)  # no writer ever comes: reading it would block the job for good
    result = run_main({**job_env, "HF_TOKEN_PATH": str(fifo)}, timeout=60)
    assert result.code == 2, result.stderr[-3000:]
    error = one_error(result, f"HF_TOKEN_PATH={fifo} is a FIFO")
    assert "regular file" in error and "HF_TOKEN" in error


# ------------------------------------------------------------------------------- the rendezvous port already taken
def test_master_port_taken_on_rank_0s_host_is_bad_input_naming_the_port(tmp_path, tiny_bert, sst2_dir):
    with socket.socket() as holder:  # another process listening on MASTER_PORT
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = rank_env(tmp_path, 0, 2, port, **training_settings(tiny_bert, sst2_dir, tmp_path / "out"))
        result = run_main(env, timeout=180)
    assert result.code == 2, result.stderr[-3000:]
    error = one_error(result, f"MASTER_PORT={port}")
    assert f"127.0.0.1:{port}" in error and "Address already in use" in error and "free port" in error, error
    assert "RENDEZVOUS_TIMEOUT" not in error  # it waited for nobody: no timeout to claim


# ------------------------------------------------------------------------------- an error line after a progress bar
@pytest.mark.slow
def test_a_lost_peer_error_during_the_evaluation_bar_starts_its_own_line(replicas, tmp_path, tiny_bert):
    # A validation split long enough that the final evaluation's progress bar is on screen when the peer goes.
    data = write_dataset(tmp_path / "data", train_rows=400, validation_rows=30000)
    out = tmp_path / "out"
    settings = training_settings(tiny_bert, data, out, MAX_STEPS=2, EVAL_STEPS=1000, SAVE_STEPS=1000)
    settings.pop("NUM_EPOCHS")
    procs = replicas.start("bar", settings)
    stream, log = tmp_path / "bar-rank0.txt", out / "logs" / "rank-0.log"
    deadline = time.monotonic() + 300
    while True:  # the last evaluation (trainer.evaluate, after training) has begun and its bar is being drawn
        assert procs[0].poll() is None and procs[1].poll() is None, stream.read_text()[-3000:]
        assert time.monotonic() < deadline, "the final evaluation did not start within 300 s"
        evaluating = log.exists() and log.read_text().count("Running Evaluation") >= 2
        if evaluating and "%|" in stream.read_text().rsplit("\n", 1)[-1]:
            break
        time.sleep(0.05)
    procs[1].kill()
    assert procs[0].wait(timeout=TIMEOUT + 60) == 143
    lines = stream.read_text().splitlines()
    glued = [line for line in lines if "error:" in line and not line.startswith("error: ")]
    assert not glued, glued
    [index] = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert "lost contact with its peers" in lines[index]
    assert "%|" in lines[index - 1]  # the bar was on the line the error would have been glued to

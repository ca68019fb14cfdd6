"""The job at its edges, in real processes (bad tokens, a silent Hub, replicas that disagree, resumes, two jobs on one
folder, damaged checkpoints, signals in native code, lost peers): the exit code, the one `error:` line, what was
written, and the token nowhere."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from scripts.make_demo_assets import write_dataset
from tests.support.env import (
    REPO,
    REPO_ID,
    TIMEOUT,
    base_env,
    free_port,
    job_settings,
    push_settings,
    rank_env,
    training_settings,
)
from tests.support.harness import configured
from tests.support.outcomes import (
    assert_refusal,
    assert_token_absent,
    complete_steps,
    log_time,
    rank_record,
    succeeded,
)
from tests.support.processes import (
    PIPE,
    STDOUT,
    Result,
    patiently,
    run_main,
    slowness,
    start,
    start_main,
    start_main_on_terminal,
    wait_all,
    wait_for,
    wait_until,
)
from utils.cluster.preemption import STOP_GRACE

SECRET = "hf_fault_secret_0123456789abcdef"


# ------------------------------------------------------------------------------- 1, 2, 12: the token
# main.py checks the token before it parses the command line, so `main.py` and `main.py --dry-run` are refused
# alike: each case runs as a process once (with or without --dry-run), and both command lines in this process.
def assert_configure_refuses(monkeypatch, env: dict[str, str], names: list[str], hidden: list[str]) -> list[str]:
    """main.configure, with and without --dry-run: exit 2, naming each of `names`, holding none of `hidden`."""
    from utils.common.errors import JobError

    messages = []
    for argv in ([], ["--dry-run"]):
        with pytest.raises(JobError) as refused:
            configured(monkeypatch, env, argv)
        missing = [name for name in names if name not in refused.value.message]
        assert refused.value.code == 2 and not missing, refused.value.message
        assert not [part for part in hidden if part in refused.value.message], refused.value.message
        messages.append(refused.value.message)
    return messages


TOKEN_FORMS = [("newline-in-env", []), ("header-injection-in-env", ["--dry-run"]), ("two-line-file", [])]


@pytest.mark.parametrize("how, args", [*TOKEN_FORMS, ("binary-file", ["--dry-run"]), ("too-short", [])])
def test_a_malformed_token_is_refused_first_and_never_echoed(how, args, job_env, hub, tmp_path, monkeypatch):
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
    hidden = [secret_part, repr(secret_part)[1:-1]]
    result = run_main(env, *args)
    assert result.code == 2, result.stderr
    assert_refusal(result, ["HF_TOKEN"])
    assert not [part for part in hidden if part in result.stdout + result.stderr]
    assert_configure_refuses(monkeypatch, env, ["HF_TOKEN"], hidden)
    assert hub.requests == [] and not (tmp_path / "out" / "model").exists()


@pytest.mark.parametrize("setting, args", [("RUN_NAME", []), ("MODEL_NAME", ["--dry-run"]), ("DATASET_PATH", [])])
def test_a_setting_holding_the_token_in_any_form_is_refused_without_showing_it(
    setting, args, job_env, tmp_path, monkeypatch
):
    quoted = urllib.parse.quote(SECRET + "/x", safe="")
    forms = {"RUN_NAME": SECRET, "MODEL_NAME": f"/models/{quoted}", "DATASET_PATH": f"/data/{SECRET}"}
    env = {**job_env, "HF_TOKEN": SECRET, setting: forms[setting]}
    names = [setting, "HF_TOKEN"]  # the setting holding it, and the one it belongs in
    result = run_main(env, *args)
    error = assert_refusal(result, names)
    assert SECRET not in result.stdout + result.stderr and urllib.parse.quote(SECRET) not in result.stderr
    for message in [error, *assert_configure_refuses(monkeypatch, env, names, [SECRET, urllib.parse.quote(SECRET)])]:
        assert setting in message.split(" hold")[0]  # named (a RUN_NAME derived from it is named too)
    assert not (tmp_path / "out" / "tensorboard").exists() and not (tmp_path / "out" / "run.json").exists()


@pytest.mark.check
def test_every_form_of_the_token_is_masked_in_what_the_job_prints():
    """The masking itself, on the forms libraries produce: repr-escaped in exceptions, percent-encoded in URLs."""
    sys.path.insert(0, str(REPO))
    from pydantic import SecretStr

    from utils.common.hub_token import Masker

    token = "hf_Ab+c/d=e%f_0123456789"
    mask = Masker(SecretStr(token))
    text = f"raw {token} repr {token!r} url {urllib.parse.quote(token, safe='')} form {urllib.parse.quote_plus(token)} json {json.dumps(token)}"
    masked = mask(text)
    for form in (token, urllib.parse.quote(token, safe=""), urllib.parse.quote_plus(token)):
        assert form not in masked
    assert masked.count("***") == 5


def test_dry_run_refuses_a_push_it_could_not_make(job_env):
    result = run_main({**job_env, "RESULT_MODEL_ID": REPO_ID}, "--dry-run")
    assert result.stdout == ""
    assert_refusal(result, [f"RESULT_MODEL_ID={REPO_ID}", "HF_TOKEN", "HF_TOKEN_PATH"])


# ------------------------------------------------------------------------------- 3: a Hub that never answers
def test_silent_hub_at_the_token_check_fails_both_replicas_with_one_line_and_no_hang(
    hub, tmp_path, tiny_bert, sst2_dir
):
    hub.go_silent("whoami")
    settings = {**training_settings(tiny_bert, sst2_dir, tmp_path / "out"), **push_settings(hub)}
    settings |= {"HUB_TIMEOUT": "2", "PUSH_TIMEOUT": "8"}
    port = free_port()
    procs = [start_main(rank_env(tmp_path, r, 2, port, **settings), log=tmp_path / f"rank{r}.txt") for r in (0, 1)]
    try:
        codes = wait_all(procs, timeout=120)
    finally:
        for proc in procs:
            proc.kill()
    assert codes == [2, 2]
    # Each rank's check by the job's own clock, from its first failed attempt (2 s in) to its error line (the
    # stream's last write): not imports and shutdown; one that ignored its bound would run to 120 s.
    allowance = 2 * slowness()  # logging the failure and printing the line
    for rank in (0, 1):
        stream = tmp_path / f"rank{rank}.txt"
        took = stream.stat().st_mtime - (log_time(stream, "Hub whoami failed") - 2)
        assert took < 8 + allowance, f"rank {rank}'s token check gave up after {took:.1f} s; PUSH_TIMEOUT=8"
        names = [hub.url, "HF_TOKEN", "8 s", "HF_ENDPOINT", "RESULT_MODEL_ID"]  # PUSH_TIMEOUT's bound, and the fixes
        assert_refusal(stream.read_text(), names)
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
    assert took <= 10 + 3 * slowness(), f"the push gave up after {took:.0f} s; PUSH_TIMEOUT=10"  # + logging it
    assert_refusal(log.read_text(), ["--push-only"])
    assert (tmp_path / "out" / "model" / "adapter_model.safetensors").exists()
    assert (tmp_path / "out" / "metrics.json").exists()
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
    assert wait_all(procs, timeout=120) == [2, 2]
    for rank in (0, 1):
        # The rates follow the global batch, which the count changed: the batch and the count are named first.
        names = ["rank 1: ", "global batch: 32 -> 48", "replica count: 2 -> 3"]
        assert_refusal((tmp_path / f"rank{rank}.txt").read_text(), names)
    assert not list(out.glob("checkpoints/checkpoint-*")) and not (out / "run.json").exists()


# ------------------------------------------------------------------------------- 5: stop signals
def test_sigterm_while_waiting_in_the_rendezvous_exits_143_within_seconds(tmp_path, tiny_bert, sst2_dir):
    """Rank 0 waits in the store's native wait for a peer that never comes: the Python handler cannot run there."""
    log, port = tmp_path / "rank0.txt", free_port()
    env = rank_env(
        tmp_path, 0, 2, port, **training_settings(tiny_bert, sst2_dir, tmp_path / "out", RENDEZVOUS_TIMEOUT=300)
    )
    proc = start_main(env, log=log)
    rank0 = psutil.Process(proc.pid)

    def waiting_in_the_store() -> bool:
        """Its store's three clients connected and its main thread asleep: in the store's wait for the peer."""
        clients = [c for c in rank0.net_connections("tcp") if c.raddr and c.raddr.port == port]
        return len(clients) >= 3 and rank0.status() == psutil.STATUS_SLEEPING

    try:
        wait_until(waiting_in_the_store, "wait in rank 0's store", [proc], 120, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143  # RENDEZVOUS_TIMEOUT=300 would end the wait otherwise
    finally:
        proc.kill()
    # The watcher ends it after its grace, which its line names, inside an orchestrator's 30 s before SIGKILL.
    text = log.read_text()
    assert f"preempted: SIGTERM and no exit within {STOP_GRACE[False]:.0f} s" in text, text[-3000:]
    assert STOP_GRACE[False] < 30


# ------------------------------------------------------------------------------- 5, 8, 13: stop, restart, resume
RESUME_ROWS, RESUME_SAVE_STEPS = 640, 10  # 40 steps an epoch at batch 16, 80 in the run: 8 checkpoints
RESUME_STEPS = 2 * RESUME_ROWS // 16


@pytest.fixture(scope="module")
def resume_data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("resume") / "data", train_rows=RESUME_ROWS, validation_rows=31)


@dataclass
class FreshStart:
    out: Path
    steps: list[int]  # the complete checkpoints whose optimizer.pt was deleted
    result: Result  # the start after the deletion


@pytest.fixture(scope="module")
def fresh_start_after_a_missing_optimizer(tmp_path_factory, tiny_bert, resume_data) -> FreshStart:
    """A run killed after checkpoint-20, its checkpoints' optimizer.pt deleted, started again: a fresh start, so
    also the uninterrupted one-process run a resumed run must match."""
    tmp = tmp_path_factory.mktemp("fresh-start")
    out = tmp / "out"
    env = base_env(
        tmp, **training_settings(tiny_bert, resume_data, out, SAVE_STEPS=RESUME_SAVE_STEPS, SAVE_TOTAL_LIMIT=1)
    )
    proc = start_main(env, log=tmp / "first.txt")
    try:
        wait_for(out / "checkpoints" / "checkpoint-20" / "COMPLETE", [proc])
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    steps = complete_steps(out)
    for step in steps:  # a missing optimizer state was resumed silently with a fresh optimizer
        (out / "checkpoints" / f"checkpoint-{step}" / "optimizer.pt").unlink()
    return FreshStart(out, steps, run_main(env))


@pytest.mark.slow
def test_a_missing_checkpoint_file_falls_back_to_a_fresh_start_not_a_traceback(fresh_start_after_a_missing_optimizer):
    fresh = fresh_start_after_a_missing_optimizer
    out, steps, result = fresh.out, fresh.steps, fresh.result
    assert result.code == 0, result.stderr[-3000:]
    log = (out / "logs" / "rank-0.log").read_text()
    assert f"removed checkpoint-{steps[0]}: optimizer.pt is missing; falling back to a fresh start" in log
    assert "resuming from" not in log.split("falling back")[-1]
    record = rank_record(out, 0)
    assert record["first_step"] == 1  # trained from the start, not from a checkpoint
    assert record["samples_trained"] == RESUME_STEPS * 16  # both epochs in this one process


@pytest.mark.integration
@pytest.mark.slow
def test_sigint_checkpoints_where_it_stops_and_a_resume_refuses_another_shape_or_other_data_and_survives_damage(
    replicas, tmp_path, tiny_bert, resume_data, fresh_start_after_a_missing_optimizer
):
    """One run through every kind of restart: SIGINT in epoch 2 (exit 130, a checkpoint where it stopped), a resume
    killed after its next checkpoint, 2 replicas (refused), changed data (refused), the later checkpoints damaged
    (dropped; it resumes from the SIGINT one and ends bit-identical to the uninterrupted run)."""
    reference = fresh_start_after_a_missing_optimizer.result
    assert reference.code == 0, reference.stderr[-3000:]
    one_replica_reference = rank_record(fresh_start_after_a_missing_optimizer.out, 0)

    data, out = resume_data, tmp_path / "out"
    # Every checkpoint kept: the SIGINT one stays, however many the killed restart saves after it.
    settings = training_settings(
        tiny_bert, data, out, SAVE_STEPS=RESUME_SAVE_STEPS, SAVE_TOTAL_LIMIT=RESUME_STEPS // RESUME_SAVE_STEPS
    )
    env = base_env(tmp_path, **settings)
    rank_log = out / "logs" / "rank-0.log"

    # Ctrl-C after the last checkpoint of epoch 1: saved at the step where it stopped, not only at the interval.
    stream = tmp_path / "sigint.txt"
    proc = start_main(env, log=stream)
    try:
        wait_for(out / "checkpoints" / "checkpoint-40" / "COMPLETE", [proc])
        proc.send_signal(signal.SIGINT)
        assert patiently(proc.wait, 60) == 130
    finally:
        proc.kill()
    text = stream.read_text()
    assert "preempted: SIGINT (Ctrl-C) during training, checkpoint saved" in text and "Traceback" not in text
    stopped = complete_steps(out)[-1]
    assert stopped > 40  # saved where it stopped, not only at the last interval
    assert stopped < RESUME_STEPS - RESUME_SAVE_STEPS, f"SIGINT took effect only at step {stopped}"

    # Restarted: resumes from the SIGINT checkpoint; killed once it has saved another.
    before = len(rank_log.read_text())
    proc = start_main(env, log=tmp_path / "resumed.txt")
    try:
        wait_for(out / "checkpoints" / f"checkpoint-{(stopped // 10 + 1) * 10}" / "COMPLETE", [proc])
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    assert f"resuming from step {stopped}" in rank_log.read_text()[before:]

    # Restarted as 2 replicas: refused on both, with the fix.
    procs = replicas.start("two", settings)
    assert wait_all(procs, timeout=200) == [2, 2]
    for rank in (0, 1):
        names = [f"OUTPUT_DIR={out}", "1 replica(s)", "global batch: 16 -> 32", "GLOBAL_BATCH_SIZE"]
        assert_refusal((tmp_path / f"two-rank{rank}.txt").read_text(), names)

    # The data changed between kill and restart: refused; the same rows copied again (new mtime): resumed.
    original = (data / "train.csv").read_bytes()  # the bytes: csv.writer ends its lines in \r\n
    lines = original.splitlines()
    (data / "train.csv").write_bytes(b"\r\n".join([lines[0], *lines[2:], lines[1]]) + b"\r\n")  # other order
    try:
        changed = run_main(env)
    finally:
        (data / "train.csv").write_bytes(original)
    assert_refusal(changed, [f"OUTPUT_DIR={out}", "data files: train.csv added, removed or edited"])

    # The checkpoints after the SIGINT one damaged once complete: each dropped with a warning.
    damaged = [step for step in complete_steps(out) if step > stopped]
    assert damaged, complete_steps(out)
    for step in damaged:
        with open(out / "checkpoints" / f"checkpoint-{step}" / "optimizer.pt", "r+b") as handle:
            handle.truncate(100)
    before = len(rank_log.read_text())
    succeeded(run_main(env))
    log = rank_log.read_text()[before:]
    for step in damaged:
        assert f"removed checkpoint-{step}: optimizer.pt has 100 bytes" in log, log[-3000:]
    assert f"resuming from step {stopped}" in log
    # Two epochs, stopped in the second, resumed from a fallback: bit-identical to the uninterrupted run.
    record = rank_record(out, 0)
    assert record["trainable_checksum"] == one_replica_reference["trainable_checksum"]
    assert record["first_step"] == stopped + 1 and record["samples_trained"] == (RESUME_STEPS - stopped) * 16


# ------------------------------------------------------------------------------- 9, 10: one job per OUTPUT_DIR
LOCK_STEPS = 1000  # the holder's run: long enough to still train while a second job imports torch on a busy machine


@pytest.mark.integration
@pytest.mark.slow
def test_a_folder_refuses_a_second_job_while_in_use_but_a_refused_start_or_a_killed_holder_never_locks_it(
    job_env, tmp_path
):
    """A start refused for bad input leaves no lock; a second job while one trains is refused; a SIGKILLed holder's
    lock is taken over by the restart, which finishes the run."""
    out = tmp_path / "out"
    env = job_settings(job_env, MAX_STEPS=str(LOCK_STEPS), SAVE_STEPS="50")
    bad = run_main({**env, "LORA_TARGET_MODULES": "q_proj,v_proj"})
    assert_refusal(bad, ["LORA_TARGET_MODULES=q_proj,v_proj", "classifier, dense, key, query, value"])
    assert not (out / "run.json").exists() and not (out / ".job.lock").exists()

    first = start_main(env, log=tmp_path / "first.txt")  # the corrected job, in the same folder
    try:
        wait_for(out / ".job.lock", [first])  # the holder has the lock: the second job starts at once
        second = start_main(env, log=tmp_path / "second.txt")
        assert second.wait(timeout=300) == 2
        names = [f"OUTPUT_DIR={out}", f"host {socket.gethostname()}", f"pid {first.pid}"]  # the holder
        assert_refusal((tmp_path / "second.txt").read_text(), names)
        assert first.poll() is None, f"the holder finished its {LOCK_STEPS} steps before a second job started"
        # The holder goes on; killed near its end, so the restart has little left to train.
        wait_until(lambda: max(complete_steps(out), default=0) >= LOCK_STEPS - 100, "checkpoint near the end", [first])
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


# ------------------------------------------------------------------------------- 15, 16: lost peers outside training
def test_a_peer_lost_before_training_is_143_on_the_survivor(replicas, tmp_path, tiny_bert, sst2_dir):
    out = tmp_path / "out"
    procs = replicas.start("early", training_settings(tiny_bert, sst2_dir, out))
    wait_for(out / "logs" / "rank-1.log", procs, timeout=120)  # past the rendezvous: loading data and model
    procs[1].kill()
    assert patiently(procs[0].wait, TIMEOUT + 60) == 143
    assert_refusal(
        (tmp_path / "early-rank0.txt").read_text(), ["rank 0", f"RENDEZVOUS_TIMEOUT={TIMEOUT}s", "2 replicas"]
    )


CLASSIFY = r"""
import os, sys
sys.path.insert(0, {repo!r})
from utils.cluster.collectives import rendezvous
from utils.config.distributed import DistEnv
from utils.common.errors import JobError
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
    """A peer that dies is 143 on the survivor; a rank's own RuntimeError that mentions CUDA is exit 1 there."""
    script = tmp_path / "classify.py"
    script.write_text(CLASSIFY.format(repo=str(REPO)))
    port = free_port()
    env = base_env(tmp_path)
    argv = [[sys.executable, str(script), str(rank), what, str(port)] for rank in (0, 1)]
    procs = [start(args, env=env, stdout=PIPE, stderr=STDOUT, text=True) for args in argv]
    codes = [patiently(proc.wait, 90) for proc in procs]
    assert codes == expected, [proc.stdout.read()[-2000:] for proc in procs]


# ------------------------------------------------------------------------------- a token path that is no file
def test_a_token_path_naming_a_fifo_is_refused_at_once_not_read_for_ever(job_env, tmp_path):
    fifo = tmp_path / "token-pipe"
    os.mkfifo(fifo)  # no writer ever comes: reading it would block the job for good
    result = run_main({**job_env, "HF_TOKEN_PATH": str(fifo)}, timeout=60)
    assert_refusal(result, [f"HF_TOKEN_PATH={fifo}", "FIFO"])


# ------------------------------------------------------------------------------- the rendezvous port already taken
def test_master_port_taken_on_rank_0s_host_is_bad_input_naming_the_port(tmp_path, tiny_bert, sst2_dir):
    with socket.socket() as holder:  # another process listening on MASTER_PORT
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = rank_env(tmp_path, 0, 2, port, **training_settings(tiny_bert, sst2_dir, tmp_path / "out"))
        result = run_main(env, timeout=180)
    error = assert_refusal(result, [f"MASTER_PORT={port}", f"127.0.0.1:{port}", "Address already in use"])
    assert "RENDEZVOUS_TIMEOUT" not in error  # it waited for nobody: no timeout to claim


# ------------------------------------------------------------------------------- an error line after a progress bar
@pytest.mark.slow
def test_a_lost_peer_error_during_the_evaluation_bar_starts_its_own_line(replicas, tmp_path, tiny_bert):
    # A validation split long enough that the final evaluation's progress bar is on screen when the peer goes.
    data = write_dataset(tmp_path / "data", train_rows=400, validation_rows=30000)
    out = tmp_path / "out"
    settings = training_settings(tiny_bert, data, out, MAX_STEPS=2, EVAL_STEPS=1000, SAVE_STEPS=1000)
    settings.pop("NUM_EPOCHS")
    # Rank 0 on a terminal, where the job draws its bars; rank 1 as the platform starts it.
    port = free_port()
    stream, log = tmp_path / "bar-rank0.txt", out / "logs" / "rank-0.log"
    procs = [start_main_on_terminal(rank_env(tmp_path, 0, 2, port, **settings), stream)]
    procs.append(start_main(rank_env(tmp_path, 1, 2, port, **settings), log=tmp_path / "bar-rank1.txt"))
    replicas.started += procs

    def drawing_the_evaluation_bar() -> bool:  # the last evaluation (trainer.evaluate, after training) has begun
        trained = log.exists() and "'train_runtime'" in log.read_text()  # the only evaluation: EVAL_STEPS > MAX_STEPS
        return trained and "%|" in stream.read_text().rsplit("\n", 1)[-1]

    wait_until(drawing_the_evaluation_bar, "final evaluation's progress bar", procs, log=stream)
    procs[1].kill()
    assert patiently(procs[0].wait, TIMEOUT + 60) == 143
    lines = stream.read_text().splitlines()
    glued = [line for line in lines if "error:" in line and not line.startswith("error: ")]
    assert not glued, glued
    [index] = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert "lost contact with its peers" in lines[index]
    assert "%|" in lines[index - 1]  # the bar was on the line the error would have been glued to


def test_a_hub_host_that_does_not_resolve_is_said_once_and_refused_within_its_bound(job_env, tmp_path):
    """An HF_ENDPOINT host that does not resolve: one warning, a retry bounded by NAME_RESOLUTION_SECONDS, one error
    line naming the host and the fix; nothing trained."""
    from utils.publishing.hub import NAME_RESOLUTION_SECONDS

    env = {**job_env, "HF_ENDPOINT": "http://no-such-hub.invalid", "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_" + "a" * 34}
    env.update(RESULT_MODEL_ID=REPO_ID, BASE_MODEL_ID="tester/tiny-bert")
    result = run_main(env)
    line = assert_refusal(result, ["no-such-hub.invalid", "does not resolve", "HF_ENDPOINT", "RESULT_MODEL_ID"])
    assert f"retried for {NAME_RESOLUTION_SECONDS} s" in line
    warnings = [text for text in result.stderr.splitlines() if "Hub whoami failed" in text]
    assert len(warnings) == 1, warnings  # said once, however many tries
    assert not (tmp_path / "out" / "model").exists()

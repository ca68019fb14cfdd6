"""Reliability in real processes: replicas killed, preempted, stopped or missing (two `main.py` processes with the
platform's variables, held to an uninterrupted run), Hub faults, and the token written nowhere."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.support.docs import assert_documented
from tests.support.env import REPO, REPO_ID, SAVE_STEPS, TIMEOUT, push_settings, training_settings
from tests.support.outcomes import (
    assert_refusal,
    assert_token_absent,
    complete_steps,
    error_lines,
    log_time,
    rank_record,
    succeeded,
)
from tests.support.processes import (
    PIPE,
    Replicas,
    patiently,
    run_main,
    slowness,
    start,
    start_main,
    wait_all,
    wait_for,
    wait_until,
)
from utils.cluster.collectives import PROBE_SECONDS, WATCHDOG_GRACE
from utils.run_folder.record import RUN_MARKER


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_bert, sst2_dir):
    """An uninterrupted two-replica run with the same settings and seed."""
    tmp = tmp_path_factory.mktemp("reference")
    group = Replicas(tmp)
    try:
        procs = group.start("run", training_settings(tiny_bert, sst2_dir, tmp / "out"))
        assert wait_all(procs) == [0, 0], (tmp / "run-rank0.txt").read_text()[-3000:]
    finally:
        group.cleanup()
    metrics = json.loads((tmp / "out" / "metrics.json").read_text())
    return metrics["eval_accuracy"], rank_record(tmp / "out", 0)["trainable_checksum"]


# ------------------------------------------------------------------------------- SIGTERM, then SIGKILL, then done
@pytest.mark.integration
@pytest.mark.slow
def test_a_run_preempted_then_killed_resumes_each_time_and_ends_bit_identical_to_the_reference(
    reference, replicas, hub, tmp_path, tiny_bert, sst2_dir
):
    """SIGTERM to one replica in epoch 1 (both checkpoint, exit 143), SIGKILL of one in epoch 2 (the survivor exits
    143), a restart that finishes: the final weights vouch for both resumes."""
    out = tmp_path / "out"
    settings = {**training_settings(tiny_bert, sst2_dir, out), **push_settings(hub)}
    # The final push meets a rate limit past RENDEZVOUS_TIMEOUT and three 503s: no collective may wait on rank 0.
    hub.retry_after = str(TIMEOUT + 2)
    hub.fail("create", 429, 503, 503, 503)

    # --- SIGTERM to one replica: both checkpoint at the same step and exit 143
    procs = replicas.start("preempted", settings)
    wait_for(out / "checkpoints" / f"checkpoint-{SAVE_STEPS}" / "COMPLETE", procs)
    procs[1].send_signal(signal.SIGTERM)  # an eviction of one pod: its peer must stop with it
    assert wait_all(procs, timeout=120) == [143, 143]

    # The checkpoint of the stop, past the interval's, with both ranks' RNG states: both stopped at one step.
    step = complete_steps(out)[-1]
    assert SAVE_STEPS < step < 80
    rng_states = {p.name for p in (out / "checkpoints" / f"checkpoint-{step}").glob("rng_state_*.pth")}
    assert rng_states == {"rng_state_0.pth", "rng_state_1.pth"}
    said = "preempted: SIGTERM during training, checkpoint saved; a restart of all 2 replicas: the run resumes from"
    for rank in (0, 1):
        stream = (tmp_path / f"preempted-rank{rank}.txt").read_text()
        assert f"{said} checkpoint-{step}" in stream
        assert "Traceback" not in stream and not error_lines(stream)
    assert not (out / "model").exists() and not (out / "metrics.json").exists()  # nothing half-trained is published

    # --- the restart, with one replica killed in epoch 2: the survivor exits 143
    procs = replicas.start("killed", settings)
    wait_for(out / "checkpoints" / "checkpoint-80" / "COMPLETE", procs)  # epoch 2 of 2 (62 steps an epoch)
    procs[1].kill()
    assert patiently(procs[0].wait, TIMEOUT + 60) == 143  # restartable, like a preemption: a restart resumes
    assert_refusal(
        (tmp_path / "killed-rank0.txt").read_text(), ["rank 0", f"RENDEZVOUS_TIMEOUT={TIMEOUT}s", "2 replicas"]
    )
    assert not (out / "model").exists() and hub.commits == []
    # It had resumed from the checkpoint of the stop, both ranks at the step after it.
    for rank in (0, 1):
        log = (out / "logs" / f"rank-{rank}.log").read_text()
        assert f"resuming from step {step}" in log
        assert f"first training step {step + 1} began" in log

    # What a kill mid-save leaves (a checkpoint without its marker, a staged model/): never loaded or published.
    torn = out / "checkpoints" / "checkpoint-100"
    torn.mkdir()
    (torn / "trainer_state.json").write_text('{"global_step": 100, "trunc')
    (torn / "optimizer.pt").write_bytes(b"\0" * 10)
    (out / ".model.partial").mkdir()
    (out / ".model.partial" / "junk.bin").write_bytes(b"half an adapter")

    # --- the second restart finishes
    procs = replicas.start("restart", settings)
    assert wait_all(procs) == [0, 0], (tmp_path / "restart-rank0.txt").read_text()[-3000:]
    log0 = (out / "logs" / "rank-0.log").read_text()
    assert "resuming from step 80" in log0 and "removed checkpoint-100" in log0
    assert "resuming from step 80" in (out / "logs" / "rank-1.log").read_text()
    # The data position restored, in epoch 2: 62 whole global batches of 2 x 16 rows an epoch, 80 - 62 into it.
    assert "Fast-forwarding the dataloader past 1 epochs and 18 batches" in log0

    accuracy, checksum = reference
    metrics = json.loads((out / "metrics.json").read_text())
    assert abs(metrics["eval_accuracy"] - accuracy) <= 0.02, (metrics["eval_accuracy"], accuracy)
    # Everything restored exactly at both resumes: the same weights bit for bit.
    records = [rank_record(out, rank) for rank in (0, 1)]
    assert [r["trainable_checksum"] for r in records] == [checksum, checksum]
    assert [r["first_step"] for r in records] == [81, 81]  # both ranks began where the checkpoint ended
    # only the steps after the checkpoint were trained again
    assert [r["samples_trained"] for r in records] == [(2 * 62 - 80) * 16] * 2  # 2 epochs of 62 steps

    # The push rode out the rate limit and the 503s, visibly, and published a whole model/ once.
    assert log0.count("Hub create_repo failed (the Hub answered HTTP 503") == 3
    rank0_log = out / "logs" / "rank-0.log"
    assert log_time(rank0_log, "pushed to") - log_time(rank0_log, "pushing ") > TIMEOUT + 2
    assert len(hub.commits) == 1 and "junk.bin" not in hub.commits[0]["files"]
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= set(hub.commits[0]["files"])
    assert not (out / ".model.partial").exists() and not (out / "model" / "junk.bin").exists()
    # Nowhere in three runs' outputs, checkpoints, logs and streams, nor in what was pushed.
    assert_token_absent(hub.token, [tmp_path], hub)


def test_sigterm_before_training_exits_143_at_once(job_env, tmp_path):
    proc = start_main(job_env, log=tmp_path / "stream.txt")
    wait_for(tmp_path / "out" / "logs", [proc], timeout=60)  # settings checked, torch and transformers still importing
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert "preempted: SIGTERM received outside the training loop" in (tmp_path / "stream.txt").read_text()


# ------------------------------------------------------------------------------- rendezvous faults
@pytest.mark.slow
def test_stopped_or_missing_peer_fails_within_rendezvous_timeout(replicas, tmp_path, tiny_bert, sst2_dir):
    """A replica stopped in training; a rank 0 whose worker never comes; a worker whose rank 0 never comes (three
    jobs, RENDEZVOUS_TIMEOUT=15 each, their waits overlapping)."""
    out = tmp_path / "out"
    procs = replicas.start("stopped", training_settings(tiny_bert, sst2_dir, out, RENDEZVOUS_TIMEOUT=15))
    wait_for(out / "checkpoints" / f"checkpoint-{SAVE_STEPS}" / "COMPLETE", procs)
    procs[1].send_signal(signal.SIGSTOP)  # alive but silent: no connection is closed, only the timeout can tell
    stopped_at, busy = time.time(), slowness()
    lone_settings = [
        training_settings(tiny_bert, sst2_dir, tmp_path / f"out{r}", RENDEZVOUS_TIMEOUT=15) for r in (0, 1)
    ]
    alone = [replicas.start(f"alone{rank}", lone_settings[rank], ranks=(rank,))[0] for rank in (0, 1)]
    [code, *lone] = [patiently(proc.wait, 200) for proc in [procs[0], *alone]]

    # The stopped replica's peer: 143 after the timeout and not much later, by its own log's clock.
    assert code == 143
    waited = log_time(out / "logs" / "rank-0.log", "(exit 143)") - stopped_at
    # RENDEZVOUS_TIMEOUT (less the probe window) to the watchdog's grace, with 5 idle-machine seconds to log it.
    allowance = 5 * max(busy, slowness())
    assert 15 - PROBE_SECONDS <= waited <= 15 + WATCHDOG_GRACE + allowance, f"rank 0 gave up after {waited:.1f} s"
    assert_refusal((tmp_path / "stopped-rank0.txt").read_text(), ["rank 0", "RENDEZVOUS_TIMEOUT=15s", "checkpoint-"])

    # The lone ranks: exit 1 at the rendezvous timeout, and no rank log (the folder is not known to be the job's).
    assert lone == [1, 1]
    for rank in (0, 1):
        assert_refusal(
            (tmp_path / f"alone{rank}-rank{rank}.txt").read_text(), ["RENDEZVOUS_TIMEOUT=15s", "MASTER_ADDR"]
        )
        assert not (tmp_path / f"out{rank}" / "logs" / f"rank-{rank}.log").exists()


# Rank 1 ends with an error while its heartbeat waits on a silent rank 0's store: the beat must leave the C++ call
# before the interpreter shuts down, or the exit is SIGABRT ("terminate called ...") instead of the error's code.
HEARTBEAT_RANK1 = """
import sys, time
from datetime import timedelta
import torch.distributed as td
from utils.cluster.collectives import BEAT_CALL_SECONDS, Collectives
from utils.config.distributed import DistEnv
port = int(sys.argv[1])
store = lambda seconds: td.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=seconds))
dist = DistEnv(rank=1, local_rank=0, world_size=2, node_rank=1, master_addr="127.0.0.1", master_port=port, source="env")
group = Collectives(dist, 60, beat_store=store(60), pulse=store(BEAT_CALL_SECONDS))


class SlowTeardown:  # keeps the interpreter shutting down for 3 s: any beat still waiting wakes up inside it
    def __del__(self, sleep=time.sleep):  # module globals may be gone by then
        sleep(3)


teardown = SlowTeardown()
print("beating", flush=True)
sys.stdin.readline()  # rank 0 is stopped now, and a beat waits on it
print("leaving", flush=True)
group.leave()
sys.exit(2)
"""
STORE_RANK0 = """
import signal
from datetime import timedelta
import torch.distributed as td
from utils.cluster.collectives import BEAT_KEY
store = td.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
print(store.port, flush=True)
store.wait([BEAT_KEY.format(rank=1)])
print("beaten", flush=True)
signal.pause()
"""


def beat_waiting(port: int, pid: int) -> bool:
    """Whether a beat of `pid` waits on the stopped store on `port`: unread in the store's socket (rx_queue), or
    read and unanswered, a thread of `pid` asleep in a socket read (wchan wait_woken; between beats: a futex)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)  # the header
            for row in rows:
                _, local, _, _, queues, *_ = row.split()
                if int(local.rsplit(":", 1)[1], 16) == port and int(queues.split(":")[1], 16):
                    return True
    threads = [tid for tid in os.listdir(f"/proc/{pid}/task") if tid != str(pid)]
    return any(Path(f"/proc/{pid}/task/{tid}/wchan").read_text() == "wait_woken" for tid in threads)


def test_an_error_exit_while_a_heartbeat_waits_on_a_silent_rank0_keeps_its_exit_code():
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    rank0 = start([sys.executable, "-c", STORE_RANK0], stdout=PIPE, text=True, env=env)
    rank1 = None
    try:
        port = int(rank0.stdout.readline().strip())
        argv = [sys.executable, "-c", HEARTBEAT_RANK1, str(port)]
        rank1 = start(argv, stdin=PIPE, stdout=PIPE, stderr=PIPE, text=True, env=env)
        assert rank1.stdout.readline().strip() == "beating", rank1.stderr.read()
        assert rank0.stdout.readline().strip() == "beaten"  # a beat reached rank 0
        rank0.send_signal(signal.SIGSTOP)
        wait_until(lambda: beat_waiting(port, rank1.pid), "beat waiting on the stopped store", [rank1], timeout=60)
        rank1.stdin.write("exit\n")
        rank1.stdin.close()
        # Rank 1 is on its way out; now rank 0 dies, and the beat still waiting fails.
        assert rank1.stdout.readline().strip() == "leaving", rank1.stderr.read()
        rank0.kill()
        stderr = rank1.stderr.read()
        rank1.wait(timeout=60)
        assert rank1.returncode == 2, stderr[-2000:]
        assert "terminate called" not in stderr
    finally:
        for proc in (rank0, rank1):
            if proc is not None:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------------------------- Hub faults
def test_push_refused_with_401_keeps_the_model_and_push_only_publishes_it_once(job_env, hub, tmp_path):
    env = {**job_env, **push_settings(hub), "NUM_EPOCHS": "1"}
    hub.fail("create", 401)  # the token was revoked during training
    result = run_main(env)
    assert_refusal(result, [REPO_ID, "401", str(tmp_path / "out" / "model"), "--push-only"], code=3)
    assert hub.count("/api/repos/create") == 1  # a permanent failure is not retried
    out = tmp_path / "out"
    kept = {p.name for p in (out / "model").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md"} <= kept
    assert "eval_accuracy" in json.loads((out / "metrics.json").read_text()) and hub.commits == []

    succeeded(run_main(env, "--push-only"))
    assert len(hub.commits) == 1 and "adapter_model.safetensors" in hub.commits[0]["files"]

    restart = run_main(env)  # the orchestrator restarts the finished job: no training, no second push
    assert restart.code == 0 and "already holds a finished run" in restart.stderr
    assert len(hub.commits) == 1 and hub.count("/api/repos/create") == 2
    assert_token_absent(hub.token, [tmp_path], hub)


def test_push_only_without_a_finished_model_is_bad_input(job_env, hub, tmp_path):
    (tmp_path / "out" / "model").mkdir(parents=True)  # model/ without metrics.json: never a finished run
    (tmp_path / "out" / RUN_MARKER).write_text("")  # of a run of the job's (another folder is refused as not one)
    result = run_main({**job_env, **push_settings(hub)}, "--push-only")
    assert_refusal(result, [str(tmp_path / "out" / "model"), "--push-only"])
    assert hub.commits == [] and hub.count("/api/repos/create") == 0


def test_push_only_on_a_missing_output_dir_leaves_nothing_behind(job_env, hub, tmp_path):
    """Refused before the folder is claimed (an empty claimed folder was taken for a run of the job's)."""
    out = tmp_path / "out"
    for args in (["--push-only", "--dry-run"], ["--push-only"]):
        assert_refusal(run_main({**job_env, **push_settings(hub)}, *args), [str(out / "model"), "--push-only"])
        assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    assert hub.commits == [] and hub.count("/api/repos/create") == 0


def test_one_publisher_at_a_time_on_a_finished_run(job_env, hub, tmp_path):
    """Two starts on a finished, unpushed run, the first's push slowed by a 429: the second is refused naming the
    first, which holds the lock while it pushes (a restart and --push-only alike); one commit, no lock left."""
    out = tmp_path / "out"
    env = {**job_env, **push_settings(hub), "MAX_STEPS": "4"}
    env.pop("NUM_EPOCHS")
    hub.fail("create", 401)  # the first push refused: a finished run on the volume, not pushed
    first = run_main(env)
    assert first.code == 3, first.stderr[-3000:]
    assert not (out / ".job.lock").exists() and hub.commits == []

    # The next push waits before its commit goes through: long enough for a second start to reach the lock, which
    # takes seconds on an idle machine and several times that on a loaded one (seen: the push done first at load 7).
    hub.retry_after = str(round(15 * slowness()))
    hub.fail("commit", 429)
    stream = tmp_path / "publisher.txt"
    for args in ([], ["--push-only"]):
        publisher = start_main(env, *args, log=stream)
        wait_until(lambda: "pushing " in stream.read_text(), "the first publisher's push", [publisher], 120, stream)
        assert (out / ".job.lock").exists()
        second = run_main(env)  # a restart of the same finished run, while the first one pushes
        assert_refusal(second, [f"OUTPUT_DIR={out}", "in use by another job", f"pid {publisher.pid}"])
        assert wait_all([publisher], [stream]) == [0]
        assert len(hub.commits) == 1 and hub.commits[0]["repo"] == REPO_ID
        assert not (out / ".job.lock").exists()
        if not args:  # pushed: --push-only publishes the run again, which the same lock guards
            hub.commits.clear()
            hub.fail("commit", 429)
            run_record = json.loads((out / "run.json").read_text())
            run_record.pop("pushed")  # as if that push were not recorded: --push-only sends it again
            (out / "run.json").write_text(json.dumps(run_record))
    restart = run_main(env)  # pushed and recorded: nothing left to do
    assert restart.code == 0 and "already holds a finished run" in restart.stderr, restart.stderr[-3000:]
    assert len(hub.commits) == 1 and not (out / ".job.lock").exists()


@pytest.mark.check
def test_a_lock_taken_over_while_watched_is_refused_naming_its_new_holder(tmp_path):
    """A dead host's lock taken over by another job while this one watches: the refusal names the new holder."""
    import threading

    from utils.cluster.run_lock import LOCK_NAME, RunLock
    from utils.common.errors import JobError
    from utils.run_folder.layout import RunDir

    lock = tmp_path / LOCK_NAME
    dead = {"job": "a", "host": "node-gone", "pid": 11, "since": "2026-01-01T00:00:00Z", "beat": 7}
    lock.write_text(json.dumps(dead))
    stop = threading.Event()

    def new_holder():  # takes the stale lock over a second later, and beats
        beat = 0
        while not stop.wait(0.5 if beat else 1.0):
            beat += 1
            staged = tmp_path / ".lock.partial"  # whole or not at all, as the job writes it
            staged.write_text(json.dumps({**dead, "job": "b", "host": "node-new", "pid": 22, "beat": beat}))
            os.replace(staged, lock)

    thread = threading.Thread(target=new_holder)
    thread.start()
    try:
        with pytest.raises(JobError) as refused:
            RunLock(RunDir(tmp_path)).acquire()
    finally:
        stop.set()
        thread.join()
    assert "host node-new, pid 22" in refused.value.message and "node-gone" not in refused.value.message
    assert_documented("`OUTPUT_DIR` in use", refused.value.message)


def test_hub_retries_honour_retry_after_and_stop_at_the_bound(hub, hub_in_process, tmp_path):
    from huggingface_hub.errors import HfHubHTTPError

    config = tmp_path / "adapter_config.json"
    config.write_text("{}")
    files = {"adapter_config.json": config}

    hub.retry_after = "3"
    hub.fail("create", 429, 503)
    assert "commit" in hub_in_process(60).push_files(files, REPO_ID, True, "upload")
    creates = [t for t, route in hub.attempts if route == "create"]
    assert len(creates) == 3 and creates[1] - creates[0] >= 3  # not sooner than the Hub asked

    hub.fail("create", *[503] * 1000)  # an outage: give up within the bound, not after it
    seen = len(hub.attempts)
    with pytest.raises(HfHubHTTPError):
        hub_in_process(4).push_files(files, REPO_ID, True, "upload")
    outage = [when for when, route in hub.attempts[seen:] if route == "create"]
    assert len(outage) > 1  # it did retry
    # No retry sent past the 4 s bound, as the Hub saw them (half a second for a request to arrive under load).
    assert outage[-1] - outage[0] <= 4 + 0.5, outage

    hub.failures.clear()
    hub.fail("create", 403)
    before = hub.count("/api/repos/create")
    with pytest.raises(HfHubHTTPError):
        hub_in_process(60).push_files(files, REPO_ID, True, "upload")
    assert hub.count("/api/repos/create") == before + 1  # permanent: no retry


@pytest.mark.check
@pytest.mark.parametrize("choosing", [False, True], ids=["curve-only", "choosing-the-checkpoint"])
def test_a_stop_at_an_evaluation_step_evaluates_first_only_where_evaluations_choose(tmp_path, choosing):
    """A stop signal at an evaluation step: where the evaluation only draws the curve, the grace period goes to the
    checkpoint; under LOAD_BEST_MODEL or EARLY_STOPPING_PATIENCE it chooses the checkpoint and the stop, and a resume
    never evaluates that step again (a restarted run stopped 4 steps later than the whole run), so it runs first."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from utils.cluster.collectives import Collectives
    from utils.cluster.preemption import Preemption
    from utils.config.distributed import DistEnv
    from utils.run_folder.layout import RunDir
    from utils.training.trainer import Checkpoints

    single = DistEnv(0, 0, 1, 0, None, None, "single")
    run = RunDir(tmp_path)
    run.checkpoints.mkdir()
    preemption = Preemption()
    preemption.signum = signal.SIGTERM
    callback = Checkpoints(run, Collectives(single, 60), 1, {}, preemption)
    args = TrainingArguments(
        output_dir=str(run.checkpoints), use_cpu=True, report_to="none", eval_strategy="steps", eval_steps=4,
        save_steps=4, load_best_model_at_end=choosing, metric_for_best_model="accuracy",
    )  # fmt: skip
    control = TrainerControl(should_evaluate=True)
    callback.on_step_end(args, TrainerState(global_step=8, max_steps=120), control)
    assert control.should_save and control.should_training_stop
    assert control.should_evaluate is choosing
    assert (run.checkpoints / "checkpoint-8").is_dir()

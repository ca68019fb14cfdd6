"""A replica lost after the final barrier, and the restart `restartPolicy: ExitCode` performs (only pods that exited
128 or more): each test kills or stops one replica at a real moment, restarts what the policy restarts, and checks
that the run then finishes (model/ and metrics.json on the volume, exit 0, one push)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from scripts.make_demo_assets import write_dataset
from tests.support.env import REPO_ID, TIMEOUT, base_env, free_port, push_settings, rank_env, training_settings
from tests.support.outcomes import assert_refusal, log_time, rank_record
from tests.support.processes import Popen, Replicas, patiently, run_code, slowness, start_main, wait_all, wait_until
from utils.cluster.collectives import BEAT_CALL_SECONDS, PROBE_SECONDS, WATCHDOG_GRACE

# One epoch of a small data set: 10 optimizer steps (160 rows per rank, batch 16), and the checkpoint the Trainer
# saves at the last step. (A MAX_STEPS that ends mid-epoch is not used here: transformers 5.23, resumed from the
# checkpoint of the last step, trains one step more than asked.)
STEPS = 10


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    return write_dataset(
        tmp_path_factory.mktemp("restart-data") / "sst2", train_rows=2 * 16 * STEPS, validation_rows=101
    )


def container_code(proc: Popen) -> int:
    """The exit code Kubernetes reports: 128 + N for a process ended by signal N."""
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def restarted_by_policy(codes: dict[int, int]) -> tuple[int, ...]:
    """The ranks `restartPolicy: ExitCode` restarts: those that exited with 128 or more."""
    return tuple(rank for rank, code in sorted(codes.items()) if code >= 128)


def poll_until(condition, procs: list[Popen], what: str, timeout: float = 300) -> None:
    """Wait (polling every 2 ms, so a moment that lasts a fraction of a second is caught) until `condition()`."""
    wait_until(condition, what, procs, timeout, every=0.002)


def finish_by_policy(replicas: Replicas, settings: dict, codes: dict[int, int], tmp: Path) -> tuple[int, ...]:
    """Restart the replicas the policy restarts and run them to completion; the ranks restarted."""
    ranks = restarted_by_policy(codes)
    procs = replicas.start("restart", settings, ranks=ranks)
    wait_all(procs, [tmp / f"restart-rank{rank}.txt" for rank in ranks])
    return ranks


@pytest.mark.integration
@pytest.mark.slow
def test_rank0_killed_while_writing_model_is_finished_by_restarting_both(
    replicas, hub, tmp_path, tiny_bert, small_data
):
    out = tmp_path / "out"
    settings = {**training_settings(tiny_bert, small_data, out, NUM_EPOCHS=1), **push_settings(hub)}
    procs = replicas.start("first", settings)
    # Rank 0 has passed the final barrier and is writing model/: kill it there, as the kernel's OOM killer
    # or a lost node would.
    poll_until((out / ".model.partial").exists, procs, "model/ being written")
    procs[0].kill()
    procs[0].wait(timeout=30)
    assert not (out / "metrics.json").exists(), "rank 0 finished model/ before it could be killed"
    killed_at = time.time()
    patiently(procs[1].wait, 60)
    codes = {rank: container_code(proc) for rank, proc in enumerate(procs)}

    # Rank 1 must not complete its pod: it exits 143 so the policy restarts it with rank 0.
    assert codes == {0: 137, 1: 143}, codes
    # Rank 1 noticed the loss (its heartbeat to rank 0's store), rather than wait out RENDEZVOUS_TIMEOUT: when, by
    # its own log.
    noticed = log_time(out / "logs" / "rank-1.log", "(exit 143)") - killed_at
    assert noticed < TIMEOUT, (
        f"rank 1 noticed rank 0's loss {noticed:.1f} s after the kill; RENDEZVOUS_TIMEOUT={TIMEOUT}"
    )
    stream1 = (tmp_path / "first-rank1.txt").read_text()
    assert_refusal(stream1, ["rank 1", "rank 0", "model/", "2 replicas", f"checkpoint-{STEPS}"])
    assert not (out / "model").exists() and not (out / "metrics.json").exists() and hub.commits == []

    assert finish_by_policy(replicas, settings, codes, tmp_path) == (0, 1)
    assert (out / "model" / "adapter_config.json").is_file() and (out / "metrics.json").is_file()
    assert not (out / ".model.partial").exists()
    assert len(hub.commits) == 1 and hub.commits[0]["repo"] == REPO_ID
    assert "adapter_model.safetensors" in hub.commits[0]["files"]
    # The Trainer checkpointed the final step: the restart resumed there and trained nothing again.
    assert f"resuming from step {STEPS}" in (out / "logs" / "rank-0.log").read_text()
    assert [rank_record(out, rank)["samples_trained"] for rank in (0, 1)] == [0, 0]
    assert json.loads((out / "metrics.json").read_text())["eval_samples"] > 0


@pytest.mark.integration
@pytest.mark.slow
def test_rank0_stopped_while_writing_model_is_143_on_rank_1_within_its_bounds(
    replicas, tmp_path, tiny_bert, small_data
):
    out = tmp_path / "out"
    procs = replicas.start("first", training_settings(tiny_bert, small_data, out, NUM_EPOCHS=1))
    poll_until((out / ".model.partial").exists, procs, "model/ being written")
    procs[0].send_signal(signal.SIGSTOP)  # alive but silent (a frozen node): no connection closes
    stopped_at, busy = time.time(), slowness()
    assert patiently(procs[1].wait, 120) == 143
    # The collective's RENDEZVOUS_TIMEOUT, then the heartbeat probe, ended by the watchdog; when: rank 1's error
    # line (its stream's last write), not its exit, with an allowance for writing it on a busy machine.
    waited = (tmp_path / "first-rank1.txt").stat().st_mtime - stopped_at
    bound = TIMEOUT + PROBE_SECONDS + BEAT_CALL_SECONDS + WATCHDOG_GRACE + 5 * max(busy, slowness())
    assert waited <= bound, f"rank 1 waited {waited:.1f} s"
    assert_refusal((tmp_path / "first-rank1.txt").read_text(), ["rank 1", "rank 0", "restart all 2 replicas"])


@pytest.mark.integration
@pytest.mark.slow
def test_rank0_killed_during_the_push_is_finished_by_restarting_it_alone(
    replicas, hub, tmp_path, tiny_bert, small_data
):
    out = tmp_path / "out"
    settings = {**training_settings(tiny_bert, small_data, out, NUM_EPOCHS=1), **push_settings(hub)}
    hub.retry_after = "120"  # the push waits out a rate limit: rank 0 is killed in the middle of it
    hub.fail("create", 429)
    procs = replicas.start("first", settings)
    poll_until(lambda: any(route == "create" for _, route in hub.attempts), procs[:1], "push")
    # model/ was saved before the push began, so rank 1 is done.
    assert patiently(procs[1].wait, 60) == 0
    assert (out / "model" / "adapter_config.json").is_file() and (out / "metrics.json").is_file()
    procs[0].kill()
    procs[0].wait(timeout=30)
    codes = {rank: container_code(proc) for rank, proc in enumerate(procs)}
    assert codes == {0: 137, 1: 0}, codes
    assert "waiting for rank 0 to save" in (out / "logs" / "rank-1.log").read_text()
    assert hub.commits == []

    # The policy restarts rank 0 alone; it finds the finished run on the volume and publishes it.
    assert finish_by_policy(replicas, settings, codes, tmp_path) == (0,)
    assert len(hub.commits) == 1 and hub.commits[0]["repo"] == REPO_ID
    assert "already holds a finished run" in (tmp_path / "restart-rank0.txt").read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_rank1_killed_while_waiting_for_the_model_is_finished_by_restarting_it_alone(
    replicas, hub, tmp_path, tiny_bert, small_data
):
    out = tmp_path / "out"
    settings = {**training_settings(tiny_bert, small_data, out, NUM_EPOCHS=1), **push_settings(hub)}
    port = free_port()  # a restarted pod comes back at the same MASTER_PORT
    procs = [
        start_main(rank_env(tmp_path, r, 2, port, **settings), log=tmp_path / f"first-rank{r}.txt") for r in (0, 1)
    ]
    replicas.started += procs
    rank1_log = out / "logs" / "rank-1.log"

    def waiting() -> bool:
        return rank1_log.exists() and "waiting for rank 0 to save" in rank1_log.read_text()

    poll_until(waiting, procs, "rank 1 waiting for model/")
    procs[1].kill()
    # Restarted at once, as the operator does, while rank 0 may still be writing model/.
    procs[1].wait()
    assert restarted_by_policy({1: container_code(procs[1])}) == (1,)
    restarted = [start_main(rank_env(tmp_path, 1, 2, port, **settings), log=tmp_path / "restart-rank1.txt")]
    replicas.started += restarted
    assert patiently(procs[0].wait, 120) == 0
    assert wait_all(restarted, [tmp_path / "restart-rank1.txt"]) == [0]
    assert (out / "model" / "adapter_config.json").is_file() and (out / "metrics.json").is_file()
    assert len(hub.commits) == 1


WAITING_RANK = """
import sys, threading
from datetime import timedelta
from pathlib import Path
import torch.distributed as td
from utils.cluster.collectives import rendezvous
from utils.config.distributed import DistEnv

port, finished_marker, timeout = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
# Rank 0's store, listening, while rank 0 itself is busy saving model/ for the run this rank was lost from: it never
# comes to this rendezvous.
store = td.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)
dist = DistEnv(rank=1, local_rank=0, world_size=2, node_rank=1, master_addr="127.0.0.1", master_port=port,
               source="platform")
if sys.argv[4] == "finishes":  # rank 0 writes metrics.json two seconds in: the run is finished
    threading.Timer(2.0, finished_marker.write_text, args=("{}",)).start()
rendezvous(dist, timeout, False, {"run": "one"}, finished=finished_marker.exists)
print("met")
"""


@pytest.mark.parametrize("outcome", ["finishes", "never"])
def test_a_restarted_rank_waiting_at_the_rendezvous_exits_as_the_run_did(tmp_path, outcome):
    """A rank restarted while rank 0 saves model/ waits at the rendezvous for a rank 0 that will not come: once
    metrics.json is written it exits 0, as the run did; a run that never finishes fails it at the timeout (exit 1)."""
    timeout = 12
    proc = run_code(
        WAITING_RANK, base_env(tmp_path), free_port(), tmp_path / "metrics.json", timeout, outcome, timeout=120
    )
    assert "met" not in proc.stdout.split(), proc.stdout
    if outcome == "finishes":
        assert proc.code == 0, proc.stderr[-2000:]
        # Its own words, not the timeout's (which would be exit 1 and "could not meet").
        assert "rank 1: the run finished while this rank was away (exit 0)" in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.code == 1 and "could not meet its 1 peers" in proc.stderr, proc.stderr[-2000:]

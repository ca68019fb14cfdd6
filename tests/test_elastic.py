"""GLOBAL_BATCH_SIZE: 1, 2 and 4 replicas at one global batch train the same model, and a run checkpointed on 2
continues on 1 or 4. The sentences have many lengths and the split is no multiple of the global batch: the one
global order (GlobalOrderSampler) alone makes step k's rows the same on every count. Dropout is off."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.support.data import write_fixed_length_data
from tests.support.deploy import config_maps, container_env, kustomize
from tests.support.env import REPO, base_env, free_port, pod_env, push_settings, rank_env
from tests.support.numerics import LOSS_RTOL, WEIGHT_ATOL, WEIGHT_RTOL, adapter_weights, first_divergence
from tests.support.outcomes import complete_steps, error_lines, succeeded
from tests.support.processes import Popen, Replicas, run_main, start, start_main, wait_all, wait_for, wait_until

GLOBAL_BATCH, MICRO = 16, 4  # 1 replica: 4 micro-batches a step, 2: 2, 4: 1
EPOCHS, STEPS_PER_EPOCH = 2, 4
LEFT_OVER = 5  # rows past the last whole global batch of an epoch: drawn anew each epoch, never trained twice
TRAIN_ROWS, VALIDATION_ROWS = GLOBAL_BATCH * STEPS_PER_EPOCH + LEFT_OVER, 32
STEPS = EPOCHS * STEPS_PER_EPOCH
EPOCHS_ELASTIC = 10  # the elastic torchrun run: 40 steps, a node lost after the first checkpoint (step 5)


def write_mixed_length_data(folder: Path) -> Path:
    """Sentences of 4 to 14 words from the tiny model's vocabulary, labelled by their adjective."""
    counts = (TRAIN_ROWS, VALIDATION_ROWS)
    return write_fixed_length_data(folder, seed=3, counts=counts, extra_words=lambda rng: rng.randint(0, 10))


def settings(tiny_bert: Path, data: Path, out: Path, **extra) -> dict[str, str]:
    values = dict(MODEL_NAME=tiny_bert, DATASET_PATH=data, OUTPUT_DIR=out, NUM_EPOCHS=EPOCHS, LEARNING_RATE="3e-3")
    values |= dict(GLOBAL_BATCH_SIZE=GLOBAL_BATCH, PER_DEVICE_BATCH_SIZE=MICRO, LORA_DROPOUT=0, MODEL_DROPOUT=0)
    values |= dict(LOGGING_STEPS=1, EVAL_STEPS=1, PER_DEVICE_EVAL_BATCH_SIZE=8, SAVE_STEPS=2, SAVE_TOTAL_LIMIT=10)
    values |= dict(REPORT_TO="none", RENDEZVOUS_TIMEOUT=120)
    return {k: str(v) for k, v in {**values, **extra}.items()}


def start_replicas(tmp: Path, world: int, env: dict[str, str], tag: str, group: Replicas):
    port = free_port()
    procs = []
    for rank in range(world):
        log = tmp / f"{tag}-rank{rank}.txt"
        procs.append(start_main(rank_env(tmp, rank, world, port, **env), log=log))
        group.streams.append(log)
    group.started += procs
    return procs, [tmp / f"{tag}-rank{rank}.txt" for rank in range(world)]


def curves(out: Path) -> dict[str, dict[int, float]]:
    history = json.loads((out / "checkpoints" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    entries = history["log_history"]
    return {key: {e["step"]: e[key] for e in entries if key in e} for key in ("loss", "eval_loss", "learning_rate")}


def samples_trained(out: Path) -> int:
    return sum(json.loads(p.read_text())["samples_trained"] for p in (out / "logs").glob("rank-*.json"))


def differences(reference: Path, other: Path, name: str) -> list[str]:
    import torch

    problems = []
    one, two = curves(reference), curves(other)
    for key, rtol in (("learning_rate", 0), ("loss", LOSS_RTOL), ("eval_loss", LOSS_RTOL)):
        if where := first_divergence(one[key], two[key], rtol):
            problems.append(f"{name}: {key} {where}")
    weights_one, weights_two = adapter_weights(reference), adapter_weights(other)
    close = {
        k: torch.allclose(weights_one[k], weights_two[k], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL) for k in weights_one
    }
    far = [key for key, near in close.items() if not near]
    if far:
        problems.append(f"{name}: {len(far)} adapter tensors differ, e.g. {far[0]}")
    return problems


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory) -> Path:
    return write_mixed_length_data(tmp_path_factory.mktemp("elastic") / "data")


def replica_processes(procs: list[Popen]) -> list[psutil.Process]:
    roots = [psutil.Process(proc.pid) for proc in procs]
    return [*roots, *(child for root in roots for child in root.children(recursive=True))]


def freeze(procs: list[Popen]) -> None:
    """SIGSTOP every replica (and child) and wait until each is stopped: OUTPUT_DIR then holds what a SIGKILL now
    would leave."""
    stopped = replica_processes(procs)
    for process in stopped:
        process.send_signal(signal.SIGSTOP)
    what = "stop of every replica after SIGSTOP"
    wait_until(lambda: all(p.status() == psutil.STATUS_STOPPED for p in stopped), what, timeout=30, every=0.01)


def thaw(procs: list[Popen]) -> None:
    for process in replica_processes(procs):
        process.send_signal(signal.SIGCONT)


@dataclass
class Runs:
    uninterrupted: dict[int, Path]  # world size -> OUTPUT_DIR of the whole run on that many replicas
    checkpointed_on_two: Path  # OUTPUT_DIR as the 2-replica run left it once its first checkpoint was complete


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_bert, mixed_data) -> Runs:
    """The same run, uninterrupted, on 1, 2 and 4 replicas, and the 2-replica run's OUTPUT_DIR as a kill after its
    first complete checkpoint leaves it (read only): copied while both replicas are stopped (SIGSTOP), so byte
    for byte what SIGKILL then would have left, without a second 2-replica start to kill."""
    tmp = tmp_path_factory.mktemp("one-global-batch")
    group = Replicas(tmp)
    outs = {world: tmp / f"out-{world}" for world in (1, 2, 4)}
    checkpointed = tmp / "checkpointed-on-two"
    try:
        for world, out in outs.items():  # one after another: 4 ranks on 2 cores is enough at once
            procs, logs = start_replicas(tmp, world, settings(tiny_bert, mixed_data, out), f"w{world}", group)
            if world == 2:
                wait_for(out / "checkpoints" / "checkpoint-2" / "COMPLETE", procs)
                freeze(procs)
                try:
                    shutil.copytree(out, checkpointed, symlinks=True)
                finally:
                    thaw(procs)
            wait_all(procs, logs)
    finally:
        group.cleanup()  # SIGCONT before SIGKILL: a replica left stopped is ended too
    return Runs(outs, checkpointed)


@pytest.fixture(scope="module")
def one_run_on_each_count(runs) -> dict[int, Path]:
    """OUTPUT_DIR of the same run, uninterrupted, on 1, 2 and 4 replicas (read only)."""
    return runs.uninterrupted


@pytest.fixture(scope="module")
def checkpointed_on_two(runs) -> Path:
    """OUTPUT_DIR of the run on 2 replicas, killed after its first complete checkpoint (read only: copy it)."""
    return runs.checkpointed_on_two


@pytest.mark.integration
@pytest.mark.slow
def test_one_global_batch_trains_the_same_model_on_1_2_and_4_replicas(one_run_on_each_count):
    outs = one_run_on_each_count
    problems = []
    for world, out in outs.items():
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["world_size"] == world and metrics["global_batch"] == GLOBAL_BATCH, metrics
        # Whole global batches only: each epoch leaves LEFT_OVER rows out, and no row is trained twice.
        assert samples_trained(out) == EPOCHS * GLOBAL_BATCH * STEPS_PER_EPOCH, world
        assert sorted(curves(out)["loss"]) == list(range(1, STEPS + 1)), "a training loss every step"
        if world != 1:
            problems += differences(outs[1], out, f"{world} replicas against 1")
    assert not problems, "\n".join(problems)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    "new_world, cap", [(1, MICRO), (4, MICRO), (1, 2)], ids=["on-1", "on-4", "on-1-under-a-lower-cap"]
)
def test_a_two_replica_run_continues_on_another_count(
    tmp_path, tiny_bert, mixed_data, one_run_on_each_count, checkpointed_on_two, new_world, cap
):
    """Killed after its first checkpoint on 2 replicas, restarted on `new_world`: it trains every remaining row once
    and follows the uninterrupted curve. PER_DEVICE_BATCH_SIZE only caps the micro-batch: a restart may lower it."""
    reference, out = one_run_on_each_count[2], tmp_path / "resumed"
    shutil.copytree(checkpointed_on_two, out, symlinks=True)
    group = Replicas(tmp_path)
    try:
        # The copy may have been taken after a later checkpoint: resume from whichever is the newest complete one.
        env = settings(tiny_bert, mixed_data, out, PER_DEVICE_BATCH_SIZE=cap)
        procs, logs = start_replicas(tmp_path, new_world, env, "again", group)
        wait_all(procs, logs)
    finally:
        group.cleanup()

    log = (tmp_path / "again-rank0.txt").read_text()
    assert "resuming a run checkpointed on 2 replica(s)" in log, log[-3000:]
    resumed_at = int(log.split("resuming from step ", 1)[1].split()[0])
    records = [json.loads(p.read_text()) for p in (out / "logs").glob("rank-*.json")]
    assert {r["world_size"] for r in records} == {new_world}
    # Only the rows after the checkpoint, each once (the steps before it are not trained again).
    assert sum(r["samples_trained"] for r in records) == (STEPS - resumed_at) * GLOBAL_BATCH
    problems = differences(reference, out, f"resumed on {new_world}")
    assert not problems, "\n".join(problems)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == new_world and metrics["global_batch"] == GLOBAL_BATCH
    # Which replica count trained which steps: in metrics.json, run.json and the model card.
    segments = [
        {"steps": [1, resumed_at], "world_size": 2},
        {"steps": [resumed_at + 1, STEPS], "world_size": new_world},
    ]
    assert metrics["segments"] == segments
    record = json.loads((out / "run.json").read_text())
    assert record["plan"]["batch"]["global_batch"] == GLOBAL_BATCH
    assert [s["world_size"] for s in record["segments"]] == [2, new_world]
    # Under GLOBAL_BATCH_SIZE the replica count and the micro-batch cap are not the run's: one identity on any count.
    assert record["settings"]["per_device_batch_size"] == cap and record["identity"]["world_size"] is None
    assert record["identity"]["per_device_batch_size"] is None  # every field is held, None where the run ignores it
    card = (out / "model" / "README.md").read_text()
    assert f"steps 1-{resumed_at} on 2, {resumed_at + 1}-{STEPS} on {new_world}" in card


def test_a_count_that_cannot_share_the_global_batch_is_refused(tmp_path):
    env = rank_env(tmp_path, 0, 3, free_port(), GLOBAL_BATCH_SIZE=GLOBAL_BATCH)
    result = run_main(env, "--dry-run")
    assert result.code == 2, result.stderr
    assert result.stderr.startswith("error: GLOBAL_BATCH_SIZE=16 cannot be shared by 3 replicas"), result.stderr
    assert "1, 2, 4, 8, 16" in result.stderr
    plan = run_main(base_env(tmp_path, GLOBAL_BATCH_SIZE=GLOBAL_BATCH, PER_DEVICE_BATCH_SIZE=3), "--dry-run")
    assert "warning:" not in plan.stderr, plan.stderr  # micro-batches of 2 under a cap of 3: no row to spare
    # micro_batch: the largest share of 16 rows that fits 3 and leaves every micro-batch full
    fixed = {"fixed": True, "source": "GLOBAL_BATCH_SIZE=16, on any replica count"}
    assert plan.json()["batch"] == {"global_batch": 16, "micro_batch": 2, "accumulation": 8, "world_size": 1, **fixed}


def test_a_global_batch_that_splits_into_tiny_micro_batches_is_warned_about(tmp_path, tiny_bert, mixed_data):
    """997 rows (a prime) under a cap of 64: micro-batches of 1, many times slower. Warned at --dry-run and in the
    run's log, with the nearby global batches that split well."""
    plan = succeeded(run_main(base_env(tmp_path, GLOBAL_BATCH_SIZE=997, PER_DEVICE_BATCH_SIZE=64), "--dry-run"))
    assert plan.json()["batch"]["micro_batch"] == 1
    [warning] = [line for line in plan.stderr.splitlines() if line.startswith("warning:")]
    assert "GLOBAL_BATCH_SIZE=997 on 1 replica(s)" in warning and "micro-batches of 1" in warning, warning
    assert "GLOBAL_BATCH_SIZE=992 or 999" in warning, warning  # 992 = 16 x 62, 999 = 27 x 37
    # A real run says it in its log too (13 rows, a prime, under a cap of 8: micro-batches of 1).
    out = tmp_path / "out"
    env = base_env(tmp_path, **settings(tiny_bert, mixed_data, out, GLOBAL_BATCH_SIZE=13, PER_DEVICE_BATCH_SIZE=8))
    run = succeeded(run_main({**env, "MAX_STEPS": "1", "EVAL_STEPS": "1000", "SAVE_STEPS": "1000"}))
    assert "GLOBAL_BATCH_SIZE=13 on 1 replica(s) is 13 rows a replica" in run.stderr, run.stderr[-3000:]
    assert json.loads((out / "metrics.json").read_text())["global_batch"] == 13


def test_a_restart_on_another_count_without_a_global_batch_names_the_count(tmp_path, tiny_bert, mixed_data):
    """Without GLOBAL_BATCH_SIZE the global batch (and rate) follows the count: a restart on another is refused
    naming the count and the fix."""
    out = tmp_path / "out"
    env = settings(tiny_bert, mixed_data, out, GLOBAL_BATCH_SIZE="", LEARNING_RATE="", MAX_STEPS=1, EVAL_STEPS=1000)
    succeeded(run_main(base_env(tmp_path, **env)))
    again = run_main(rank_env(tmp_path, 0, 2, free_port(), **env), "--dry-run")
    assert again.code == 2, again.stderr
    [line] = error_lines(again.stderr)
    differs = f"(global batch: {MICRO} -> {2 * MICRO}; replica count: 1 -> 2); "
    assert line.startswith(f"error: OUTPUT_DIR={out} holds another run {differs}"), line
    assert (
        "learning rate" in line and "restart with 1 replica(s) to resume" in line and "set GLOBAL_BATCH_SIZE" in line
    )


def kill_tree(proc: Popen) -> None:
    """SIGKILL a torchrun agent and its workers (torchrun starts them in sessions of their own)."""
    try:
        root = psutil.Process(proc.pid)
        for process in [*root.children(recursive=True), root]:
            process.kill()
    except psutil.NoSuchProcess:
        pass
    proc.wait()


@pytest.mark.integration
@pytest.mark.slow
def test_elastic_torchrun_finishes_on_the_node_that_is_left(tmp_path, tiny_bert, hub):
    """`torchrun --nnodes 1:2`, two agents here: the second killed with its worker after the first checkpoint, the
    first re-forms the group alone, resumes at the same global batch, finishes and publishes one model."""
    data = write_mixed_length_data(tmp_path / "data")
    out = tmp_path / "out"
    # EVAL_STEPS: the final evaluation only
    longer = dict(NUM_EPOCHS=EPOCHS_ELASTIC, SAVE_STEPS=5, SAVE_TOTAL_LIMIT=2, EVAL_STEPS=1000, LOGGING_STEPS=10)
    env = base_env(tmp_path, **settings(tiny_bert, data, out, RENDEZVOUS_TIMEOUT=60, **longer), **push_settings(hub))
    port = free_port()
    torchrun = [str(Path(sys.executable).with_name("torchrun"))]

    def agent(is_host: bool) -> list[str]:
        # is_host: the first agent hosts the rendezvous store, the second (the node that is lost) only connects
        # to it, as an agent on another machine would; so both start at once and meet within seconds.
        # last_call_timeout: how long a round that has fewer than 2 nodes waits for more. The first round ends
        # as soon as the second agent joins (its imports take seconds even on a loaded machine: 15 s leaves room);
        # the one after the loss waits all of it for a node that never comes.
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test"]
        rendezvous.append(f"--rdzv-conf=is_host={str(is_host).lower()},last_call_timeout=15,join_timeout=120")
        return [
            *torchrun,
            "--nnodes=1:2",
            "--nproc-per-node=1",
            *rendezvous,
            "--max-restarts=3",
            "--monitor-interval=1",
            "main.py",
        ]

    logs = [tmp_path / f"agent-{n}.txt" for n in (0, 1)]
    agents = []
    try:
        for log, is_host in zip(logs, (True, False), strict=True):
            agents.append(start(agent(is_host), env=env, cwd=REPO, log=log, start_new_session=True))
        # The kill lands within 50 ms of the first checkpoint (step 5), 35 steps before the end.
        wait_until(lambda: complete_steps(out), "first checkpoint", agents, timeout=600)
        kill_tree(agents[1])  # the node and its worker, at once
        agents[1].wait()
        assert agents[0].wait(timeout=600) == 0, logs[0].read_text()[-4000:]
    finally:
        for agent in agents:
            kill_tree(agent)

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 1 and metrics["global_batch"] == GLOBAL_BATCH, metrics
    assert "resuming a run checkpointed on 2 replica(s) on 1" in logs[0].read_text()
    [first, then] = metrics["segments"]
    assert (first["world_size"], then["world_size"], then["steps"][1]) == (2, 1, EPOCHS_ELASTIC * STEPS_PER_EPOCH)
    assert len([c for c in hub.commits if c["repo"] == push_settings(hub)["RESULT_MODEL_ID"]]) == 1
    assert (out / "model" / "adapter_model.safetensors").is_file()


def test_the_elastic_pytorchjob_trains_one_global_batch_on_every_count_it_allows(tmp_path):
    """A pod of k8s/elastic (PET_NNODES=MIN:MAX from its elasticPolicy): the same global batch and rate on every
    count in the range, in full micro-batches; a global batch one count cannot share is refused on any count."""
    docs = kustomize(REPO / "k8s" / "elastic")
    [job] = [doc for doc in docs if doc["kind"] == "PyTorchJob"]
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    [container] = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    low, high = policy["minReplicas"], policy["maxReplicas"]
    pet = {"PET_NNODES": f"{low}:{high}", "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"]}
    env = container_env(container, config_maps(docs)) | pet

    def dry_run(world: int, **extra):
        torchrun = dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=world, LOCAL_WORLD_SIZE=1, TORCHELASTIC_RUN_ID="job")
        torchrun |= dict(GROUP_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
        return run_main(pod_env(tmp_path, **{**env, **extra}, **torchrun), "--dry-run")

    resolved = {}
    for world in range(low, high + 1):
        result = dry_run(world)
        assert result.code == 0, result.stderr
        assert "warning:" not in result.stderr, result.stderr
        payload = result.json()
        batch = payload["batch"]
        resolved[world] = (batch["global_batch"], payload["plan"]["learning_rate"])
        assert batch["micro_batch"] * batch["accumulation"] * world == batch["global_batch"], batch
        assert batch["micro_batch"] <= payload["config"]["per_device_batch_size"]
    assert sorted(resolved) == list(range(low, high + 1)) and len(set(resolved.values())) == 1, resolved
    assert resolved[low][0] == int(env["GLOBAL_BATCH_SIZE"])

    # 256 (what the manifest held before): 3 pods, one loss from 4, cannot share it. Refused on 4 pods already.
    refused = dry_run(high, GLOBAL_BATCH_SIZE="256")
    assert refused.code == 2, refused.stderr
    [line] = error_lines(refused.stderr)
    assert line.startswith(
        f"error: GLOBAL_BATCH_SIZE=256 cannot be shared by 3 replica(s), a count PET_NNODES={low}:{high}"
    )
    assert "e.g. 252 or 264" in line, line
    # Without GLOBAL_BATCH_SIZE the default, 64, which 3 pods cannot share either; with PER_DEVICE_BATCH_SIZE alone
    # the global batch follows the count: a restart after a loss could never resume.
    unset = dry_run(high, GLOBAL_BATCH_SIZE="")
    assert unset.code == 2 and "the default global batch (64) cannot be shared by 3 replica(s)" in unset.stderr
    per_device = dry_run(high, GLOBAL_BATCH_SIZE="", PER_DEVICE_BATCH_SIZE="64")
    assert per_device.code == 2, per_device.stderr
    assert "no GLOBAL_BATCH_SIZE the global batch follows the replica count" in per_device.stderr

"""Every launcher the job supports, run for real on the CPU (torchrun, accelerate and its configs, the Slurm batch
script under a stand-in `srun`, submitit, `deepspeed`), and the environments a PyTorchJob and a Trainer v2 TrainJob
give their pods. Training runs assert who each process thought it was and that the ranks trained one model."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.support.deploy import K8S, config_maps, container_env, crd_schema, kustomize, load_manifest, schema_errors
from tests.support.env import REPO, STEPS, base_env, free_port, job_settings, pod_env
from tests.support.harness import configured
from tests.support.outcomes import rank_report, succeeded
from tests.support.processes import (
    ACCELERATE,
    DEVNULL,
    PIPE,
    STDOUT,
    TORCHRUN,
    CompletedProcess,
    run_command,
    run_main,
    start,
    wait_all,
    wait_until,
)

LAUNCHERS = REPO / "launchers"
FAKE_SLURM = REPO / "tests" / "support" / "fake_slurm"  # srun and scontrol stand-ins, put first on PATH


def launch(tmp_path: Path, env: dict[str, str], *commands: list) -> None:
    """Start each command (one per node or machine) and wait for all: every one must exit 0."""
    logs = [tmp_path / f"launcher-{i}.txt" for i in range(len(commands))]
    wait_all([start(cmd, env, log) for cmd, log in zip(commands, logs, strict=True)], logs)


def assert_one_model(out: Path, ranks: list[tuple[str, int, int]]) -> None:
    """Each rank's (launcher, local rank, node) is `ranks`' and all trained one model in sync; rank 0 saved it."""
    reports = rank_report(out, len(ranks))
    assert [(r["source"], r["local_rank"], r["node"]) for r in reports] == ranks
    world = len(reports)
    assert [r["rank"] for r in reports] == list(range(world)) and {r["world"] for r in reports} == {world}
    assert len({r["checksum"] for r in reports}) == 1, f"trainable weights differ between ranks: {reports}"
    # every rank did every step on its own batches
    assert {r["samples"] for r in reports} == {int(STEPS) * 16}, reports
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == world and metrics["eval_samples"] == 101
    assert (out / "model" / "adapter_model.safetensors").is_file()


def two_ranks(source: str, nodes: int) -> list[tuple[str, int, int]]:
    """(source, local rank, node) of two ranks on `nodes` nodes."""
    return [(source, rank % (2 // nodes), rank // (2 // nodes)) for rank in range(2)]


# ------------------------------------------------------------------------------- torchrun
@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2], ids=["one-node", "two-nodes-on-loopback"])
def test_torchrun_trains_one_model(nodes, job_env, tmp_path):
    """Two processes of one torchrun, or two torchruns as on two machines (node 0 hosting the rendezvous)."""
    port = free_port()
    commands = [
        [*TORCHRUN, "--nnodes", str(nodes), "--nproc-per-node", str(2 // nodes), "--master-port", str(port)]
        + (["--node-rank", str(node), "--master-addr", "127.0.0.1"] if nodes > 1 else [])
        + ["main.py"]
        for node in range(nodes)
    ]
    launch(tmp_path, job_settings(job_env), *commands)
    assert_one_model(tmp_path / "out", two_ranks("torchrun", nodes))


# ------------------------------------------------------------------------------- accelerate launch
# What a process started by `accelerate launch` with one of the repo's configs is given: a stand-in for main.py
# writes its environment (the launcher's variables included), and main.configure resolves it here.
REPORT_ENV = """import json, os, pathlib, sys
pathlib.Path(sys.argv[1], f"env-{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ)))
"""


def launched_environments(tmp_path: Path, config: Path, *args: str, machines: int = 1) -> list[dict[str, str]]:
    """Each process's environment under `accelerate launch --config_file CONFIG --num_processes 2 ARGS`, started
    `machines` times as machine 0, 1, ... on loopback; in rank order."""
    script, out = tmp_path / "report_env.py", tmp_path / "environments"
    script.write_text(REPORT_ENV)
    out.mkdir()
    port, procs = free_port(), []
    for machine in range(machines):
        machine_args = ["--machine_rank", str(machine), "--main_process_ip", "127.0.0.1"] if machines > 1 else []
        cmd = [*ACCELERATE, "--config_file", str(config), "--num_processes", "2", "--main_process_port", str(port)]
        # RUN_NAME left to be derived: the same name whether STRATEGY came from the config or by hand
        env = base_env(tmp_path, OUTPUT_DIR=tmp_path / "out")
        argv = [*cmd, *machine_args, *args, str(script), str(out)]
        procs.append(start(argv, env=env, cwd=REPO, stdout=PIPE, stderr=STDOUT, text=True))
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-3000:]
    return [json.loads((out / f"env-{rank}.json").read_text()) for rank in range(2)]


ZERO = [(f"deepspeed-zero{n}.yaml", 1, {"STRATEGY": "deepspeed", "ZERO_STAGE": str(n)}) for n in (2, 3)]


@pytest.mark.parametrize("name, machines, same_as", [("multi-gpu.yaml", 1, {}), ("multi-node.yaml", 2, {}), *ZERO])
def test_an_accelerate_config_launches_and_leaves_training_to_the_job(name, machines, same_as, tmp_path, monkeypatch):
    """Each config of launchers/accelerate/, launched: its processes get their ranks and resolve the settings they
    would without it (a DeepSpeed config: with STRATEGY and ZERO_STAGE set), under every PRECISION."""
    from utils.config.distributed import launcher_options
    from utils.training.strategy import check_strategy

    environments = launched_environments(tmp_path, LAUNCHERS / "accelerate" / name, machines=machines)
    for rank, env in enumerate(environments):
        # without what the config exported (ACCELERATE_*), the settings it stands for set instead
        plain = {k: v for k, v in env.items() if not k.startswith("ACCELERATE_")} | same_as
        alone = configured(monkeypatch, plain)[0].as_dict()
        settings, dist, _, _ = configured(monkeypatch, env)
        node, local = (rank, 0) if machines > 1 else (0, rank)
        assert (dist.rank, dist.local_rank, dist.node_rank, dist.world_size) == (rank, local, node, 2)
        assert (dist.source, dist.master_addr) == ("torchrun", "127.0.0.1")
        differ = {k: (v, alone[k]) for k, v in settings.as_dict().items() if alone[k] != v}
        assert not differ, f"under {name} the job resolves (launched, {same_as or 'no config'}): {differ}"
        assert not launcher_options()["cpu"], f"{name}: Accelerate would train on the CPU beside the GPUs"
        for precision in ("fp32", "bf16", "fp16"):  # check_strategy raises JobError on a launcher that disagrees
            options = {"cuda": False, "quantize": False, "precision": precision, "launcher": launcher_options()}
            check_strategy(settings.strategy, settings.quantization, dist, **options)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, machines",
    [("multi-gpu.yaml", 1), pytest.param("multi-node.yaml", 2, marks=pytest.mark.integration)],
)
def test_accelerate_launch_trains_one_model(config, machines, job_env, tmp_path):
    """`accelerate launch --multi_gpu` with a config of the repo; the multi-node one as two machines on loopback."""
    launcher = [*ACCELERATE, "--config_file", str(LAUNCHERS / "accelerate" / config), "--multi_gpu"]
    launcher += ["--num_processes", "2", "--main_process_port", str(free_port())]
    commands = [
        [*launcher, *(["--machine_rank", str(m), "--main_process_ip", "127.0.0.1"] if machines > 1 else []), "main.py"]
        for m in range(machines)
    ]
    launch(tmp_path, job_settings(job_env, ACCELERATE_USE_CPU="1"), *commands)
    assert_one_model(tmp_path / "out", two_ranks("torchrun", machines))


# ------------------------------------------------------------------------------- DeepSpeed
DEEPSPEED = [sys.executable, "-m", "deepspeed.launcher.runner"]  # the `deepspeed` command
DEEPSPEED_CONFIGS = {
    2: LAUNCHERS / "accelerate" / "deepspeed-zero2.yaml",
    3: LAUNCHERS / "accelerate" / "deepspeed-zero3.yaml",
}


def dry_run_answers(output: str) -> list[dict]:
    """Every `--dry-run` JSON document in a launcher's combined output, in rank order."""
    decoder, answers = json.JSONDecoder(), []
    for match in re.finditer(r"^\{$", output, re.M):
        answers.append(decoder.raw_decode(output, match.start())[0])
    return sorted(answers, key=lambda answer: answer["distributed"]["rank"])


def accelerate_dry_run(tmp_path: Path, config: Path, **settings) -> tuple[int, list[dict], list[str]]:
    """`accelerate launch --config_file CONFIG --num_processes 2 main.py --dry-run`: its exit code, each rank's
    answer, and each rank's stderr."""
    logs = tmp_path / "logs"
    cmd = [*ACCELERATE, "--config_file", str(config), "--num_processes", "2", "--main_process_port", str(free_port())]
    # with --tee 3: each process's stdout and stderr also in its own files, never interleaved
    cmd += ["--log_dir", str(logs), "--tee", "3", "main.py", "--dry-run"]
    env = base_env(tmp_path, OUTPUT_DIR=tmp_path / "out", **settings)
    result = run_command(cmd, env=env, cwd=REPO, timeout=300)
    stdout, stderr = (
        [log.read_text() for log in sorted(logs.glob(f"*/attempt_0/*/{name}"))]
        for name in ("stdout.log", "stderr.log")
    )
    assert len(stderr) == 2, result.stdout[-3000:] + result.stderr[-3000:]
    return result.returncode, dry_run_answers("".join(stdout)), stderr


@pytest.mark.parametrize("stage", sorted(DEEPSPEED_CONFIGS))
def test_accelerate_launch_with_a_deepspeed_config_resolves_the_strategy_and_ranks(tmp_path, stage):
    """What accelerate exports from the config becomes STRATEGY=deepspeed and ZERO_STAGE; the ranks are torchrun's."""
    code, answers, stderr = accelerate_dry_run(tmp_path, DEEPSPEED_CONFIGS[stage])
    assert code == 0, stderr
    assert [(a["distributed"]["rank"], a["distributed"]["local_rank"]) for a in answers] == [(0, 0), (1, 1)]
    assert {(a["distributed"]["source"], a["distributed"]["world_size"]) for a in answers} == {("torchrun", 2)}
    configs = {(a["config"]["strategy"], a["config"]["zero_stage"], a["config"]["zero_offload"]) for a in answers}
    assert configs == {("deepspeed", stage, "none")}

    # A ZERO_STAGE that says otherwise: refused on every rank, naming both, before anything loads.
    other = 1 if stage != 1 else 2
    code, answers, stderr = accelerate_dry_run(tmp_path / "other", DEEPSPEED_CONFIGS[stage], ZERO_STAGE=other)
    assert code != 0 and not answers  # accelerate turns the ranks' exit 2 into its own failure
    # torchrun stops the other rank once one has failed, sometimes before it has printed its own line.
    refusals = [[line for line in text.splitlines() if line.startswith("error: ")] for text in stderr]
    assert any(refusals), stderr
    for errors in filter(None, refusals):
        assert len(errors) == 1 and f"ZERO_STAGE={other}" in errors[0] and f"zero_stage {stage}" in errors[0], errors


def test_deepspeed_launcher_processes_resolve_to_their_ranks_and_nodes(tmp_path):
    """`deepspeed --num_gpus 2 main.py` for real (its CPU accelerator here): each process gets RANK, LOCAL_RANK,
    WORLD_SIZE, CROSS_RANK (its node), MASTER_* and a `--local_rank=N` argument the job takes off."""
    port, logs = free_port(), tmp_path / "rank-logs"
    cmd = [*DEEPSPEED, "--num_gpus", "2", "--master_port", str(port), "--enable_each_rank_log", str(logs)]
    env = base_env(tmp_path, STRATEGY="deepspeed", ZERO_STAGE="3", OUTPUT_DIR=tmp_path / "out")
    result = run_command([*cmd, "main.py", "--dry-run"], env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "--local_rank=1" in result.stdout + result.stderr  # the launcher did append it
    answers = dry_run_answers("".join(log.read_text() for log in sorted(logs.glob("*_rank*.log"))))
    ranks = [
        (a["distributed"]["rank"], a["distributed"]["local_rank"], a["distributed"]["node_rank"]) for a in answers
    ]
    assert ranks == [(0, 0, 0), (1, 1, 0)]
    masters = {
        (a["distributed"]["source"], a["distributed"]["master_addr"], a["distributed"]["master_port"]) for a in answers
    }
    assert masters == {("deepspeed", "127.0.0.1", port)}
    assert {(a["config"]["strategy"], a["config"]["zero_stage"]) for a in answers} == {("deepspeed", 3)}


# DeepSpeed's CPU ops, compiled once per venv (tests/test_deepspeed.py keeps them there too).
EXTENSIONS = Path(sys.prefix) / "torch-extensions"


@pytest.mark.integration
@pytest.mark.slow
def test_accelerate_launch_with_the_zero2_config_trains_under_deepspeed(job_env, tmp_path):
    """The ZeRO-2 config file for real, no STRATEGY set: both ranks train one model under DeepSpeed (the job stops
    at the first step unless the Trainer really built a DeepSpeed engine), and run.json records it."""
    cmd = [*ACCELERATE, "--config_file", str(DEEPSPEED_CONFIGS[2]), "--num_processes", "2"]
    cmd += ["--main_process_port", str(free_port()), "main.py"]
    launch(tmp_path, job_settings(job_env, TORCH_EXTENSIONS_DIR=str(EXTENSIONS)), cmd)
    assert_one_model(tmp_path / "out", two_ranks("torchrun", 1))
    settings = json.loads((tmp_path / "out" / "run.json").read_text())
    assert '"strategy": "deepspeed"' in json.dumps(settings) and '"zero_stage": 2' in json.dumps(settings)


@pytest.mark.integration
@pytest.mark.slow
def test_deepspeed_launcher_trains_zero3(job_env, tmp_path):
    """`deepspeed --num_gpus 2 main.py` for real with STRATEGY=deepspeed ZERO_STAGE=3: one model, two ranks."""
    cmd = [*DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "main.py"]
    env = job_settings(job_env, STRATEGY="deepspeed", ZERO_STAGE="3", TORCH_EXTENSIONS_DIR=str(EXTENSIONS))
    launch(tmp_path, env, cmd)
    assert_one_model(tmp_path / "out", two_ranks("deepspeed", 1))


def test_deepspeed_launcher_on_two_nodes_resolves_node_ranks(tmp_path):
    """What deepspeed's launch.py gives each process on 2 nodes x 2 GPUs: its node comes from CROSS_RANK."""
    resolved, launcher = [], dict(WORLD_SIZE=4, CROSS_SIZE=2, LOCAL_SIZE=2, MASTER_ADDR="worker-0", MASTER_PORT=29500)
    for rank in range(4):
        node, local = divmod(rank, 2)
        env = base_env(tmp_path, RANK=rank, LOCAL_RANK=local, CROSS_RANK=node, STRATEGY="deepspeed", **launcher)
        result = succeeded(run_main(env, f"--local_rank={local}", "--dry-run"))
        resolved.append(result.json()["distributed"])
    assert [(d["rank"], d["local_rank"], d["node_rank"]) for d in resolved] == [(r, r % 2, r // 2) for r in range(4)]
    assert {(d["source"], d["world_size"], d["master_addr"]) for d in resolved} == {("deepspeed", 4, "worker-0")}
    # A --local_rank that is not the launcher's (it disagrees with LOCAL_RANK) was typed: refused as any unknown flag.
    refused = run_main(
        base_env(tmp_path, RANK=1, LOCAL_RANK=1, WORLD_SIZE=2, CROSS_RANK=0, CROSS_SIZE=1, MASTER_ADDR="h"),
        "--local_rank=0",
        "--dry-run",
    )
    assert refused.code == 2 and refused.stderr.startswith("error: ") and "--local_rank=0" in refused.stderr


# ------------------------------------------------------------------------------- Slurm
def test_slurm_tasks_of_a_2_node_x_4_gpu_allocation_resolve_to_ranks_0_to_7(tmp_path):
    """The variables srun gives each of the 8 tasks (no MASTER_*: the job derives the address itself)."""
    resolved = []
    for task in range(8):
        allocation = dict(SLURM_NTASKS=8, SLURM_NNODES=2, SLURM_NTASKS_PER_NODE=4, SLURM_JOB_ID=731)
        allocation |= dict(SLURM_PROCID=task, SLURM_LOCALID=task % 4, SLURM_NODEID=task // 4)
        env = base_env(tmp_path, SLURM_JOB_NODELIST="gpu-node-[07-08]", **allocation)
        result = succeeded(run_main(env, "--dry-run"))
        resolved.append(result.json()["distributed"])
    assert [(d["rank"], d["local_rank"], d["node_rank"]) for d in resolved] == [(t, t % 4, t // 4) for t in range(8)]
    assert {(d["world_size"], d["master_addr"], d["master_port"], d["source"]) for d in resolved} == {
        (8, "gpu-node-07", 29500, "slurm")
    }


def render_sbatch(*args: str) -> CompletedProcess:
    return run_command([sys.executable, str(LAUNCHERS / "slurm" / "render_sbatch.py"), *args], cwd=REPO)


def sbatch_lines(script: str) -> dict[str, str]:
    lines = [line.removeprefix("#SBATCH ").strip() for line in script.splitlines() if line.startswith("#SBATCH ")]
    return dict(line.lstrip("-").split("=", 1) if "=" in line else (line.lstrip("-"), "") for line in lines)


def test_rendered_batch_script_passes_bash_n_and_holds_the_allocation(tmp_path):
    target = tmp_path / "job.sbatch"
    allocation = "--nodes 2 --gpus-per-node 4 --time 04:00:00 --partition gpu".split()
    result = render_sbatch(
        *allocation, "--set", "NUM_EPOCHS=2", "--set", "RESULT_MODEL_ID=me/sst2-lora", "-o", str(target)
    )
    assert result.returncode == 0, result.stderr
    script = target.read_text()
    assert run_command(["bash", "-n", str(target)]).returncode == 0
    assert not re.search(r"@[A-Z_]+@", script)  # every placeholder filled
    expected = {"nodes": "2", "ntasks-per-node": "4", "gpus-per-node": "4", "time": "04:00:00", "partition": "gpu"}
    expected |= {"requeue": "", "signal": "B:USR1@180", "open-mode": "append", "job-name": "sst2-lora"}
    assert expected.items() <= sbatch_lines(script).items()
    assert "--output=" in script and "%x-%j-task%t.out" in script  # one log per task
    assert "export NUM_EPOCHS=2" in script and "export RESULT_MODEL_ID=me/sst2-lora" in script
    assert "srun --kill-on-bad-exit=1" in script and "scontrol requeue" in script

    container = render_sbatch("--container", "registry.example.com/sst2-lora:1.0", "--shared-dir", str(tmp_path))
    assert container.returncode == 0, container.stderr
    assert f"--container-mounts={tmp_path}:/pvc-home" in container.stdout
    assert "export OUTPUT_DIR=/pvc-home/output" in container.stdout
    assert "partition" not in sbatch_lines(container.stdout)  # unset: the cluster's default


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "HF_TOKEN=hf_abc"], "secret"),
        (["--set", "NUM_EPOCHS=many"], "NUM_EPOCHS"),
        (["--set", "LORA_RR=8"], "LORA_RR is not a setting of the job (did you mean LORA_R?)"),  # as sweep.py
        (["--time", "two hours"], "--time"),
        (["--container", "img"], "--shared-dir"),
    ],
)
def test_render_refuses_bad_input_with_one_error_line(args, message):
    result = render_sbatch(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and message in result.stderr and "hf_abc" not in result.stderr


def slurm_job(job_env: dict[str, str], tmp_path: Path, **settings: str) -> tuple[Path, dict[str, str]]:
    """The rendered batch script for 1 node x 2 tasks, and the environment Slurm would run it in."""
    env = job_settings(job_env, **settings)
    names = dict.fromkeys(
        ("MODEL_NAME", "DATASET_PATH", "OUTPUT_DIR", "MAX_STEPS", "PER_DEVICE_BATCH_SIZE", "LEARNING_RATE", *settings)
    )
    pairs = [f"{name}={env[name]}" for name in names]
    script = tmp_path / "job.sbatch"
    allocation = [
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--venv",
        sys.prefix,
        "--log-dir",
        str(tmp_path / "slurm-logs"),
    ]
    result = render_sbatch(*allocation, *[arg for pair in pairs for arg in ("--set", pair)], "-o", str(script))
    assert result.returncode == 0, result.stderr
    slurm = dict(SLURM_JOB_ID="4242", SLURM_JOB_NAME="sst2-lora", SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1")
    slurm |= dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_CPUS_PER_TASK="1", MASTER_PORT=str(free_port()))
    slurm |= dict(SCONTROL_LOG=str(tmp_path / "requeued"))
    return script, {**base_env(tmp_path), **slurm, "PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.slow
def test_batch_script_runs_the_job_one_task_per_gpu(job_env, tmp_path):
    script, env = slurm_job(job_env, tmp_path)
    result = run_command(["bash", str(script)], env=env, cwd=tmp_path, timeout=300)
    task_logs = sorted((tmp_path / "slurm-logs").glob("sst2-lora-4242-task*.out"))
    assert result.returncode == 0, result.stderr + "".join(log.read_text()[-2000:] for log in task_logs)
    assert [log.name for log in task_logs] == ["sst2-lora-4242-task0.out", "sst2-lora-4242-task1.out"]
    assert_one_model(tmp_path / "out", two_ranks("slurm", 1))
    assert "eval_accuracy=" in task_logs[0].read_text() and "eval_accuracy=" not in task_logs[1].read_text()
    assert not (tmp_path / "requeued").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_batch_script_requeues_the_job_near_the_time_limit(job_env, tmp_path):
    """Slurm's USR1 (--signal=B:USR1@lead): the tasks get SIGTERM, end >= 128, and the script requeues the job."""
    script, env = slurm_job(job_env, tmp_path, MAX_STEPS="100000")
    proc = start(["bash", str(script)], env=env, cwd=tmp_path, stdout=PIPE, stderr=STDOUT, text=True)
    try:
        logs = [tmp_path / "out" / "logs" / f"rank-{r}.log" for r in (0, 1)]
        wait_until(
            lambda: all(log.exists() and "trainable parameters" in log.read_text() for log in logs),
            "model built on both ranks",
            [proc],
            timeout=120,
            every=0.5,
        )
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read()
    assert code >= 128, output
    assert "checkpointing and requeueing" in output
    assert (tmp_path / "requeued").read_text().split() == ["4242"]


@pytest.mark.integration
@pytest.mark.slow
def test_submitit_runs_the_job_with_its_torch_environment(job_env, tmp_path):
    """launchers/slurm/submit.py on submitit's local cluster: the same submission code, tasks as local processes."""
    log = tmp_path / "submit.txt"
    cmd = [sys.executable, str(LAUNCHERS / "slurm" / "submit.py"), "--cluster", "local", "--tasks-per-node", "2"]
    cmd += ["--gpus-per-node", "0", "--folder", str(tmp_path / "submitit"), "--wait", "--", "--max-steps", STEPS]
    env = job_settings(job_env)
    env.pop("MAX_STEPS")  # given as a flag after `--`: flags reach main.py unchanged
    wait_all([start(cmd, env, log)], lambda: [log, *sorted((tmp_path / "submitit").glob("*_log.*"))])
    # TorchDistributedEnvironment().export() sets torchrun's variables (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, ...).
    assert_one_model(tmp_path / "out", two_ranks("torchrun", 1))
    assert "exit codes [0, 0]" in log.read_text()


def test_submitit_refuses_bad_settings_before_submitting(tmp_path):
    submit = [
        sys.executable,
        str(LAUNCHERS / "slurm" / "submit.py"),
        "--cluster",
        "local",
        "--folder",
        str(tmp_path / "s"),
    ]
    result = run_command([*submit, "--", "--num-epochs", "zero"], env=base_env(tmp_path), cwd=REPO)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "--num-epochs" in result.stderr
    assert not (tmp_path / "s").exists()  # nothing was queued


# ------------------------------------------------------------------------------- Kubernetes
def pod_command(container: dict, main_args: list[str]) -> list[str]:
    """The container's command as the pod runs it, here: dumb-init (PID 1 in the image) left out, the image's
    /app/main.py pointing at this checkout, `args:` replaced by `main_args`."""
    command = list(container["command"])
    assert command[:2] == ["dumb-init", "--"], "dumb-init forwards SIGTERM to the whole process group"
    return [part.replace("/app/main.py", str(REPO / "main.py")) for part in command[2:]] + main_args


def shared_config_maps() -> dict[str, dict[str, str]]:
    """The ConfigMaps the variants share (k8s/base), name -> data."""
    return config_maps(kustomize(K8S / "base"))


def run_pods(command: list[str], pod_envs: list[dict[str, str]], tmp_path: Path) -> list[list[dict]]:
    """Start one shell per pod (torchrun inside), concurrently; the --dry-run answers, by pod then local rank."""
    bin_dir = str(Path(sys.executable).parent)  # torchrun
    procs = []
    for pod, env in enumerate(pod_envs):
        # PET_LOG_DIR + PET_REDIRECTS (torchrun's --log-dir --redirects 1): each process's stdout in its own file.
        extra = {
            "PET_LOG_DIR": str(tmp_path / f"pod-{pod}"),
            "PET_REDIRECTS": "1",
            "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
        }
        procs.append(start(command, env={**env, **extra}, cwd=tmp_path, stdout=PIPE, stderr=STDOUT, text=True))
    answers = []
    for pod, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
        files = sorted(
            (tmp_path / f"pod-{pod}").glob("*/attempt_0/*/stdout.log"), key=lambda path: int(path.parent.name)
        )
        answers += [json.loads(path.read_text()) for path in files]
    return answers


def test_pytorchjob_with_several_gpus_per_pod_is_valid_against_the_crd():
    job = load_manifest(K8S / "multi-gpu-per-pod" / "pytorchjob.yaml")
    schema = crd_schema(job["apiVersion"], job["kind"])
    assert schema_errors(schema, job) == []
    broken = copy.deepcopy(job)
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["gpus"] = 4
    assert schema_errors(schema, broken), "an unknown field must be an error"

    # What the operator relies on (the pod security and volumes every manifest shares: tests/test_deploy.py).
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "ExitCode"  # restarts on preemption (143), not on bad settings (2)
        container = replica["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch" and container["ports"][0]["name"] == "pytorchjob-port"
        # one process per GPU
        assert container["resources"]["limits"]["nvidia.com/gpu"] == int(job["spec"]["nprocPerNode"])


def test_pytorchjob_pods_run_torchrun_and_every_process_gets_its_own_rank(tmp_path):
    """The operator's variables for each pod and the manifest's own command: torchrun makes 8 distinct ranks."""
    job = load_manifest(K8S / "multi-gpu-per-pod" / "pytorchjob.yaml")
    specs = job["spec"]["pytorchReplicaSpecs"]
    pods = specs["Master"]["replicas"] + specs["Worker"]["replicas"]
    nproc = int(job["spec"]["nprocPerNode"])
    assert nproc > 1, "k8s/multi-gpu-per-pod/ is the variant with several processes (GPUs) per pod"
    container = specs["Master"]["template"]["spec"]["containers"][0]
    shared = shared_config_maps()
    port = free_port()  # stands in for the pytorchjob-port
    # what the operator adds to each pod's variables, over the image's and the manifest's
    operator = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=pods * nproc, PET_NNODES=pods)
    operator |= dict(PET_NPROC_PER_NODE=job["spec"]["nprocPerNode"], PYTHONUNBUFFERED="0")
    pod_envs = [
        pod_env(tmp_path, **(container_env(container, shared) | operator | {"RANK": pod, "PET_NODE_RANK": pod}))
        for pod in range(pods)
    ]
    answers = run_pods(pod_command(container, ["--dry-run"]), pod_envs, tmp_path)
    configs, ranks = [a["config"] for a in answers], [a["distributed"] for a in answers]
    resolved = [(d["rank"], d["local_rank"], d["node_rank"], d["world_size"]) for d in ranks]
    assert resolved == [(p * nproc + local, local, p, pods * nproc) for p in range(pods) for local in range(nproc)]
    assert {(d["source"], d["master_port"]) for d in ranks} == {("torchrun", port)}
    # Its own run folder, and the shared settings: a folder holds one run (the 4-replica job uses another).
    settings = shared["sst2-lora-settings"]
    own = container_env(container, shared)["OUTPUT_DIR"]
    assert {c["output_dir"] for c in configs} == {own} != {settings["OUTPUT_DIR"]}
    assert {(c["model_name"], c["hf_token"]) for c in configs} == {(settings["MODEL_NAME"], "***")}

    # The same pod environment without torchrun (the image's default command) is refused, not mis-ranked.
    refused = run_main(pod_envs[1], "--dry-run")
    assert refused.code == 2 and "torchrun" in refused.stderr


def test_pod_wrapper_turns_sigterm_into_the_restart_code(tmp_path):
    """torchrun exits 1 whatever stopped its workers; the wrapper reports SIGTERM as 143, which ExitCode restarts."""
    stub = tmp_path / "main.py"
    stub.write_text(
        "import os, pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
        "pathlib.Path(os.environ['READY'] + os.environ['LOCAL_RANK']).touch()\n"
        "time.sleep(60)\n"
    )
    job = load_manifest(K8S / "multi-gpu-per-pod" / "pytorchjob.yaml")
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    command = [part.replace(str(REPO / "main.py"), str(stub)) for part in pod_command(container, [])]
    torchrun = dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), PET_NNODES=1, PET_NODE_RANK=0, PET_NPROC_PER_NODE=2
    )
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = base_env(tmp_path, READY=str(tmp_path / "ready-"), PATH=path, **torchrun)
    proc = start(command, env=env, cwd=tmp_path, start_new_session=True, stdout=DEVNULL, stderr=DEVNULL)
    try:
        wait_until(lambda: all((tmp_path / f"ready-{r}").exists() for r in (0, 1)), "ready files", [proc], 60)
        os.killpg(proc.pid, signal.SIGTERM)  # what dumb-init does with the kubelet's SIGTERM
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.check
def test_trainjob_is_valid_against_the_trainer_v2_crd():
    job = load_manifest(K8S / "trainer-v2" / "trainjob.yaml")
    schema = crd_schema(job["apiVersion"], job["kind"])
    assert schema_errors(schema, job) == []
    broken = copy.deepcopy(job)
    broken["spec"]["podTemplateOverrides"] = []  # the older field name: not in this CRD version
    assert schema_errors(schema, broken), "an unknown field must be an error"

    # What the runtime relies on (what every manifest shares: tests/test_deploy.py).
    trainer = job["spec"]["trainer"]
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == trainer["numProcPerNode"]  # one process per GPU
    assert not [e["name"] for e in trainer["env"] if e["name"].startswith("PET_")]  # reserved: Trainer sets them


def test_trainjob_nodes_resolve_from_trainer_v2_pet_variables(tmp_path):
    """What Trainer v2's torch plugin gives node i: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_*."""
    job = load_manifest(K8S / "trainer-v2" / "trainjob.yaml")
    runtime = {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": "torch-distributed"}
    assert job["spec"]["runtimeRef"] == runtime  # the runtime whose variables this gives each node
    trainer = job["spec"]["trainer"]
    nodes, nproc = trainer["numNodes"], trainer["numProcPerNode"]
    env = container_env(trainer, shared_config_maps())
    port = free_port()  # stands in for 29400 on the node-0 pod
    pet = dict(PET_NNODES=nodes, PET_NPROC_PER_NODE=nproc, PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port)
    pod_envs = [pod_env(tmp_path, **env, **pet, PET_NODE_RANK=node) for node in range(nodes)]
    answers = run_pods(pod_command(trainer, ["--dry-run", *trainer.get("args", [])]), pod_envs, tmp_path)
    ranks = [
        (d["rank"], d["local_rank"], d["node_rank"], d["world_size"], d["master_port"])
        for d in (a["distributed"] for a in answers)
    ]
    assert ranks == [(n, 0, n, nodes, port) for n in range(nodes)]
    configs = [a["config"] for a in answers]
    assert {c["output_dir"] for c in configs} == {env["OUTPUT_DIR"]} and {c["hf_token"] for c in configs} == {"***"}
    # The shared settings arrive key by key (a TrainJob has no envFrom): every key of the ConfigMap, resolved.
    shared = shared_config_maps()["sst2-lora-settings"]
    overridden = {e["name"] for e in trainer["env"] if "value" in e}
    assert set(shared) - overridden <= {e["name"] for e in trainer["env"]}, (
        "a ConfigMap key the TrainJob does not read"
    )
    assert {(c["model_name"], c["num_epochs"]) for c in configs} == {
        (shared["MODEL_NAME"], float(shared["NUM_EPOCHS"]))
    }

    # The image's default command (python main.py, no torchrun) under the same variables: a clear refusal.
    refused = run_main(pod_envs[0], "--dry-run")
    assert refused.code == 2 and "torchrun" in refused.stderr


def test_deepspeed_pytorchjob_pods_resolve_to_ranks_under_zero3(tmp_path):
    """k8s/deepspeed/: each pod gets its rank, STRATEGY=deepspeed at ZeRO-3 and the variant's own run folder."""
    job = load_manifest(K8S / "deepspeed" / "pytorchjob.yaml")
    specs = job["spec"]["pytorchReplicaSpecs"]
    shared = shared_config_maps()
    pods = [(0, specs["Master"])] + [(1 + i, specs["Worker"]) for i in range(specs["Worker"]["replicas"])]
    world = len(pods)
    resolved = []
    for rank, spec in pods:
        container = spec["template"]["spec"]["containers"][0]
        operator = dict(MASTER_ADDR="sst2-lora-deepspeed-master-0", MASTER_PORT=23456, RANK=rank, WORLD_SIZE=world)
        operator |= dict(PET_NODE_RANK=rank, PET_NNODES=world, PET_NPROC_PER_NODE=job["spec"]["nprocPerNode"])
        result = succeeded(run_main(pod_env(tmp_path, **(container_env(container, shared) | operator)), "--dry-run"))
        resolved.append(result.json())
    assert [(a["distributed"]["rank"], a["distributed"]["source"]) for a in resolved] == [
        (r, "pytorchjob") for r in range(world)
    ]
    configs = {(a["config"]["strategy"], a["config"]["zero_stage"], a["config"]["output_dir"]) for a in resolved}
    assert configs == {("deepspeed", 3, "/pvc-home/output-deepspeed")}
    assert shared["sst2-lora-settings"]["OUTPUT_DIR"] != "/pvc-home/output-deepspeed"
    assert {a["deepspeed"]["zero_optimization"]["stage"] for a in resolved} == {3}

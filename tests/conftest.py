"""Shared fixtures: a tiny BERT and small SST-2-shaped data built here, a runner for the real entry
point in real processes, free ports, and the local Hub stand-in. Everything is offline and CPU-only."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.make_demo_assets import write_dataset, write_tiny_bert  # noqa: E402
from tests.hub_stub import HubStub  # noqa: E402

# Variables a launcher or the developer's shell may have set; a test starts from none of them.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PET_NODE_RANK",
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "HF_TOKEN",
    "HF_TOKEN_PATH",
    "RESULT_MODEL_ID",
    "OUTPUT_DIR",
)


def base_env(tmp: Path, **extra: str) -> dict[str, str]:
    """A clean, offline environment for one job process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(
        HF_HOME=str(tmp / "hf-home"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1",  # two ranks on two cores must not fight over threads
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        DATALOADER_NUM_WORKERS="0",
        CUDA_VISIBLE_DEVICES="",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


FAKE_TOKEN = "hf_" + "x" * 34  # a Secret's value in the simulated pods; must come back masked


def pod_env(tmp: Path, **extra: str) -> dict[str, str]:
    """What a deployed container sees: `base_env` without the test sandbox's offline switches, which no
    manifest sets (a push asked for under HF_HUB_OFFLINE is refused, even by --dry-run)."""
    env = base_env(tmp, **extra)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if name not in extra:
            env.pop(name)
    return env


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        return json.loads(self.stdout)


def run_main(env: dict[str, str], *args: str, timeout: float = 300) -> Result:
    """Run `python main.py` as the launcher would, and wait for it."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def start_main(env: dict[str, str], *args: str, log: Path | None = None) -> subprocess.Popen:
    """Start `python main.py` without waiting (for multi-rank runs); output goes to `log`."""
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), *args], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(tmp: Path, rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """The environment the managed platform gives replica `rank` (RANK, WORLD_SIZE, NODE_RANK, MASTER_*)."""
    return base_env(
        tmp, RANK=rank, WORLD_SIZE=world, NODE_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra
    )


@pytest.fixture(scope="session")
def sst2_dir(tmp_path_factory) -> Path:
    """A small learnable SST-2-shaped csv data set (odd-sized validation split)."""
    return write_dataset(tmp_path_factory.mktemp("data") / "sst2", train_rows=2000, validation_rows=101)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory, sst2_dir) -> Path:
    """A 2-layer, 64-wide BERT with a word-level vocabulary, saved with save_pretrained."""
    return write_tiny_bert(tmp_path_factory.mktemp("model") / "tiny-bert", sst2_dir)


@pytest.fixture
def job_env(tmp_path, tiny_bert, sst2_dir):
    """Settings for a fast, learnable one-process run on the tiny model; tests override what they need."""
    return base_env(
        tmp_path,
        MODEL_NAME=tiny_bert,
        DATASET_PATH=sst2_dir,
        OUTPUT_DIR=tmp_path / "out",
        NUM_EPOCHS=2,
        PER_DEVICE_BATCH_SIZE=16,
        LEARNING_RATE="3e-3",  # a tiny randomly initialised model needs a higher rate than bert-base
    )


@pytest.fixture
def hub():
    stub = HubStub()
    stub.url = stub.start()
    yield stub
    stub.stop()


# ------------------------------------------------------------------------------- multi-replica runs
CHECKSUM = re.compile(r"rank (\d+) processed (\d+) training samples; trainable weights checksum ([0-9a-f]+)")
TIMEOUT = 20  # RENDEZVOUS_TIMEOUT in these tests: long enough for a loaded 2-core machine, short enough to wait for
SAVE_STEPS = 20  # 126 optimizer steps in the run (2 epochs of 1000 rows per rank, batch 16)
REPO_ID = "tester/sst2-lora"
BASE_ID = "tester/tiny-bert"  # the Hub id the tests' local tiny model stands for


# ------------------------------------------------------------------------------- helpers
def training_settings(tiny_bert: Path, sst2_dir: Path, out: Path, **extra) -> dict[str, str]:
    settings = dict(
        MODEL_NAME=tiny_bert,
        DATASET_PATH=sst2_dir,
        OUTPUT_DIR=out,
        NUM_EPOCHS=2,
        PER_DEVICE_BATCH_SIZE=16,
        LEARNING_RATE="3e-3",
        SAVE_STEPS=SAVE_STEPS,
        RENDEZVOUS_TIMEOUT=TIMEOUT,
    )
    return {k: str(v) for k, v in {**settings, **extra}.items()}


def push_settings(hub: HubStub) -> dict[str, str]:
    # The tiny model is a local folder, which records no Hub id: a push names its base explicitly.
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": hub.token,
        "RESULT_MODEL_ID": REPO_ID,
        "BASE_MODEL_ID": BASE_ID,
    }


class Replicas:
    """Two replicas started by hand; every process this test started is killed at the end, whatever happens."""

    def __init__(self, tmp: Path):
        self.tmp, self.started, self.streams = tmp, [], []

    def start(self, tag: str, settings: dict[str, str], world: int = 2, ranks=(0, 1)) -> list[subprocess.Popen]:
        port = free_port()
        procs = []
        for rank in ranks:
            stream = self.tmp / f"{tag}-rank{rank}.txt"
            procs.append(start_main(rank_env(self.tmp, rank, world, port, **settings), log=stream))
            self.streams.append(stream)
        self.started += procs
        return procs

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()


@pytest.fixture
def replicas(tmp_path):
    group = Replicas(tmp_path)
    yield group
    group.cleanup()


def wait_all(procs: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    return [proc.wait(timeout=timeout) for proc in procs]


def wait_for(path: Path, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    """Wait until `path` exists; fail early if a replica exits first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        ended = [proc.returncode for proc in procs if proc.poll() is not None]
        assert not ended, f"a replica exited ({ended}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def summary(log: Path) -> tuple[int, str]:
    _, samples, checksum = CHECKSUM.search(log.read_text().strip().splitlines()[-1]).groups()
    return int(samples), checksum


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def assert_refused_as_bad_input(env: dict[str, str], args: list[str], says: str, hub: HubStub) -> Result:
    """Run the job with `env` (None values: variables removed) and check the bad-input contract: exit 2, one
    `error:` line saying `says`, no traceback, no training step, nothing pushed, the token not shown."""
    env = {name: value for name, value in env.items() if value is not None}
    result = run_main(env, *args, timeout=180)
    assert result.code == 2, result.stderr[-3000:]
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and says in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert hub.commits == [] and hub.count("/api/repos/create") == 0  # nothing pushed
    out = Path(env["OUTPUT_DIR"])
    assert not list(out.glob("checkpoints/checkpoint-*")) and not (out / "model").exists()  # no training step taken
    assert not any("Running training" in log.read_text() for log in out.glob("logs/rank-*.log"))
    assert hub.token not in result.stderr + result.stdout
    return result


def log_time(log: Path, fragment: str) -> float:
    """Epoch seconds of the first log line (rank log or console stream) containing `fragment`."""
    line = next(line for line in log.read_text().splitlines() if fragment in line)
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def assert_token_absent(token: str, roots: list[Path], hub: HubStub | None = None) -> None:
    """Every file under `roots` (outputs, checkpoints, TensorBoard events, logs, captured stdout/stderr,
    HF_HOME) and every file pushed to the Hub, searched as bytes."""
    needle = token.encode()
    files = [path for root in roots for path in root.rglob("*") if path.is_file()]
    names = " ".join(path.name for path in files)
    for kind in (
        "events.out.tfevents",
        "optimizer.pt",
        "rng_state",
        "training_args.bin",
        "rank-0.log",
        "run.json",
        "metrics.json",
        "README.md",
    ):
        assert kind in names, f"nothing like {kind} was searched"  # the search really covered a run's outputs
    leaks = [str(path) for path in files if needle in path.read_bytes()]
    if hub is not None:
        leaks += [f"hub:{name}" for commit in hub.commits for name, data in commit["files"].items() if needle in data]
    assert not leaks, f"HF_TOKEN found in {leaks}"

"""Shared fixtures: a tiny BERT and small SST-2-shaped data built here, a runner for the real entry
point in real processes, free ports, and the local Hub stand-in. Everything is offline and CPU-only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.make_demo_assets import write_dataset, write_tiny_bert  # noqa: E402
from tests.hub_stub import HubStub  # noqa: E402

# Variables a launcher or the developer's shell may have set; a test starts from none of them.
LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "PET_NODE_RANK", "PET_NNODES", "PET_NPROC_PER_NODE", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_NODELIST", "HF_TOKEN", "HF_TOKEN_PATH", "RESULT_MODEL_ID", "OUTPUT_DIR",
)  # fmt: skip


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


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        return json.loads(self.stdout)


def run_main(env: dict[str, str], *args: str, timeout: float = 300) -> Result:
    """Run `python main.py` as the launcher would, and wait for it."""
    proc = subprocess.run([sys.executable, str(REPO / "main.py"), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def start_main(env: dict[str, str], *args: str, log: Path | None = None) -> subprocess.Popen:
    """Start `python main.py` without waiting (for multi-rank runs); output goes to `log`."""
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, str(REPO / "main.py"), *args], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(tmp: Path, rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """The environment the managed platform gives replica `rank` (RANK, WORLD_SIZE, NODE_RANK, MASTER_*)."""
    return base_env(tmp, RANK=rank, WORLD_SIZE=world, NODE_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)


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

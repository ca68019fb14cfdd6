"""The environments and settings a test gives the job: a clean, offline process environment (`base_env`) and
what a launcher, a pod or the tiny run adds to it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests.support.hub_stub import HubStub
from utils.config.distributed import LAUNCHER_VARIABLES

REPO = Path(__file__).resolve().parents[2]


# Variables a launcher or the developer's shell may have set; a test starts from none of them.
LAUNCHER_VARS = (*LAUNCHER_VARIABLES, "HF_TOKEN", "HF_TOKEN_PATH", "RESULT_MODEL_ID", "OUTPUT_DIR")


# pytest.ini's filter (a deprecation attributed to this repo's code is an error) reaches this process only; the job
# processes the tests start get it through PYTHONWARNINGS, which matches module names exactly, so each module is
# listed. main.py runs as __main__, which is left out: every launcher's own script is __main__ too.
REPO_MODULES = (
    "main",
    "predict",
    *sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for p in (REPO / "utils").rglob("*.py")
    ),
)


REPO_WARNINGS = ",".join(
    f"error::{category}:{module}" for category in ("DeprecationWarning", "FutureWarning") for module in REPO_MODULES
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
        PYTHONWARNINGS=REPO_WARNINGS,
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(tmp: Path, rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """The environment the managed platform gives replica `rank` (RANK, WORLD_SIZE, NODE_RANK, MASTER_*)."""
    return base_env(
        tmp, RANK=rank, WORLD_SIZE=world, NODE_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra
    )


def unavailable(reason: str):
    """Skip a test that needs what a machine may lack by design (root and mount(8), the container tools, a kernel
    switch); under CI (CI=true), whose machine provides them, fail instead: a skip there drops the test unseen."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; CI=true, where a missing tool fails the suite rather than skip the test")
    pytest.skip(reason)


TIMEOUT = 20  # RENDEZVOUS_TIMEOUT in these tests: long enough for a loaded 2-core machine, short enough to wait for


SAVE_STEPS = 20  # 126 optimizer steps in the run (2 epochs of 1000 rows per rank, batch 16)


REPO_ID = "tester/sst2-lora"


BASE_ID = "tester/tiny-bert"  # the Hub id the tests' local tiny model stands for


def tiny_run_settings(tiny_bert: Path, sst2_dir: Path, out: Path, **extra) -> dict[str, str]:
    """A fast, learnable run of the tiny model on the small data set (2 epochs, batch 16), plus `extra`."""
    settings = dict(
        MODEL_NAME=tiny_bert,
        DATASET_PATH=sst2_dir,
        OUTPUT_DIR=out,
        NUM_EPOCHS=2,
        PER_DEVICE_BATCH_SIZE=16,
        LEARNING_RATE="3e-3",  # a tiny randomly initialised model needs a higher rate than bert-base
    )
    return {k: str(v) for k, v in {**settings, **extra}.items()}


def tiny_run_env(tmp: Path, tiny_bert: Path, data: Path, **extra) -> dict[str, str]:
    """`base_env` for the tiny run (`tiny_run_settings`) on `data` into `tmp`/out, plus `extra`: the `job_env`
    fixture's settings where a test picks the model, the data or the folder."""
    return base_env(tmp, **tiny_run_settings(tiny_bert, data, tmp / "out", **extra))


def training_settings(tiny_bert: Path, sst2_dir: Path, out: Path, **extra) -> dict[str, str]:
    """The tiny run as the multi-replica fault tests start it: checkpoints every SAVE_STEPS, a short rendezvous."""
    return tiny_run_settings(
        tiny_bert, sst2_dir, out, **{"SAVE_STEPS": SAVE_STEPS, "RENDEZVOUS_TIMEOUT": TIMEOUT, **extra}
    )


def push_settings(hub: HubStub) -> dict[str, str]:
    # The tiny model is a local folder, which records no Hub id: a push names its base explicitly.
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": hub.token,
        "RESULT_MODEL_ID": REPO_ID,
        "BASE_MODEL_ID": BASE_ID,
    }


MERGED_ID = "tester/sst2-merged"


LABELS = ("bad", "good")  # not the default: proves the names come from LABEL_NAMES


MAX_SEQ_LENGTH = 48  # not the default 128 nor the tiny model's 512 positions: proves the run's own length is recorded


STEPS = "4"  # optimizer steps of a launcher run: enough to see the ranks stay in sync, little enough for 2 cores


def job_settings(job_env: dict[str, str], **extra: str) -> dict[str, str]:
    """`job_env` cut to STEPS optimizer steps (MAX_STEPS instead of epochs), plus `extra`."""
    env = {**job_env, "MAX_STEPS": STEPS, **extra}
    env.pop("NUM_EPOCHS", None)
    return env

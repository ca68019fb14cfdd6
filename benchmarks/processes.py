"""Child processes of the speed benchmark: a clean offline environment, free ports, the machine's name."""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import time
from pathlib import Path

from utils.config.distributed import LAUNCHER_VARIABLES
from utils.config.settings import FIELDS, env_name

REPO = Path(__file__).resolve().parents[1]

# Variables that would make a child think it is one of several replicas, or change the job's settings.
LAUNCHER_VARS = (*LAUNCHER_VARIABLES, "HF_TOKEN", "HF_TOKEN_PATH")


def clean_env(**extra) -> dict[str, str]:
    """This environment without launcher variables or job settings, offline, plus `extra`."""
    drop = set(LAUNCHER_VARS) | {env_name(field) for field in FIELDS}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_command(argv: list[str], repeats: int) -> float:
    """Median wall seconds of `argv` run from the repository root in a clean environment."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 3)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"

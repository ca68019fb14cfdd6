"""Every process a test starts goes through here: the job (`main.py`), predict.py, the launchers, one-off tools
(`run_command`), and the waits on them, stretched on a loaded machine (`patiently`)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path

# Test modules take these from here: what they name of a process (its type, its streams), never starting one.
from subprocess import DEVNULL, PIPE, STDOUT, CompletedProcess, Popen, TimeoutExpired
from typing import TypeVar
from unittest import mock

import pytest

from tests.support.env import REPO, base_env, free_port, rank_env


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        return json.loads(self.stdout)


def run_script(
    script: str, env: dict[str, str], *args: str | Path, stdin: str | None = None, cwd: Path = REPO, timeout: float
) -> Result:
    """Run one of the repo's entry points (`python main.py`, `python predict.py`) in a process, and wait for it."""
    return run_python([str(REPO / script), *map(str, args)], env, stdin=stdin, cwd=cwd, timeout=timeout)


def run_code(code: str, env: dict[str, str], *args: str | Path, timeout: float) -> Result:
    """Run `python -c code args...` from the repository (a test's own script over the job's modules), and wait."""
    return run_python(["-c", code, *map(str, args)], env, timeout=timeout)


def run_python(
    argv: list[str], env: dict[str, str], stdin: str | None = None, cwd: Path = REPO, *, timeout: float
) -> Result:
    """`python argv...`, waited for `timeout` idle-machine seconds (`patiently`), killed past them."""
    pipes = dict(stdin=None if stdin is None else PIPE, stdout=PIPE, stderr=PIPE)
    proc = subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, text=True, **pipes)
    unsent = [stdin]

    def communicate(seconds: float) -> tuple[str, str]:
        # The input goes with the first call only: a retried communicate() keeps what was read, but sends nothing.
        data, unsent[0] = unsent[0], None
        return proc.communicate(data, timeout=seconds)

    try:
        stdout, stderr = patiently(communicate, timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return Result(proc.returncode, stdout, stderr)


def run_main(env: dict[str, str], *args: str, timeout: float = 300) -> Result:
    """Run `python main.py` as the launcher would, and wait for it."""
    return run_script("main.py", env, *args, timeout=timeout)


def run_predict(
    env: dict[str, str], *args: str | Path, stdin: str = "", cwd: Path = REPO, timeout: float = 180
) -> Result:
    """Run `python predict.py` as a user would (sentences on standard input), and wait for it."""
    return run_script("predict.py", env, *args, stdin=stdin, cwd=cwd, timeout=timeout)


def start_main_on_terminal(env: dict[str, str], log: Path, columns: int = 100) -> Popen:
    """Start `python main.py` with stdout and stderr on a pseudo-terminal `columns` wide (what a person at a terminal
    sees: the job draws progress bars there), copied to `log` as it comes; `.copied` is the copy's thread."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))  # a new one has no width
    proc = subprocess.Popen([sys.executable, REPO / "main.py"], env=env, cwd=REPO, stdout=follower, stderr=follower)
    os.close(follower)

    def copy() -> None:
        with open(leader, "rb", buffering=0) as terminal, open(log, "wb", buffering=0) as out:
            with suppress(OSError):  # EIO: the job closed the terminal
                shutil.copyfileobj(terminal, out, 65536)

    proc.copied = threading.Thread(target=copy, daemon=True)
    proc.copied.start()
    return proc


def start_main(env: dict[str, str], *args: str, log: Path | None = None) -> Popen:
    """Start `python main.py` without waiting (for multi-rank runs); output goes to `log`."""
    out = open(log, "w") if log else DEVNULL
    return subprocess.Popen([sys.executable, REPO / "main.py", *args], env=env, cwd=REPO, stdout=out, stderr=STDOUT)


# `make check` is one process, fast because nothing it runs imports the training stack again: a test marked
# `check` that starts Python (the job, predict.py, a launcher), in a fixture or in its body, fails; it belongs
# to the process-level suite.
class PythonStartInCheck(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        command = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
        if Path(os.fsdecode(command[0]).split()[0]).name.startswith("python"):
            pytest.fail(f"a test marked `check` started {' '.join(map(str, command[:3]))}: mark it otherwise")
        super().__init__(args, *rest, **kwargs)


def python_starts_refused(item: pytest.Item):
    return mock.patch("subprocess.Popen", PythonStartInCheck) if item.get_closest_marker("check") else nullcontext()


class Replicas:
    """Two replicas started by hand; every process this test started is killed at the end, whatever happens."""

    def __init__(self, tmp: Path):
        self.tmp, self.started, self.streams = tmp, [], []

    def start(self, tag: str, settings: dict[str, str], world: int = 2, ranks=(0, 1)) -> list[Popen]:
        port, streams = free_port(), {rank: self.tmp / f"{tag}-rank{rank}.txt" for rank in ranks}
        procs = [start_main(rank_env(self.tmp, rank, world, port, **settings), log=streams[rank]) for rank in ranks]
        self.streams += streams.values()
        self.started += procs
        return procs

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()


def train_one_and_two(tmp: Path, settings: dict, batch: int, timeout: float = 300) -> tuple[Path, Path]:
    """The same settings trained by one process at batch 2B and by two replicas at B each (DDP on gloo): the
    comparison every task and strategy is held to. Returns the two OUTPUT_DIRs (one process, two replicas);
    both runs must succeed within `timeout` idle-machine seconds."""
    one_out, two_out = tmp / "one", tmp / "two"
    settings = {k: str(v) for k, v in settings.items()}
    group = Replicas(tmp)
    try:
        procs = group.start("ddp", {**settings, "OUTPUT_DIR": str(two_out), "PER_DEVICE_BATCH_SIZE": str(batch)})
        one = {**settings, "OUTPUT_DIR": one_out, "PER_DEVICE_BATCH_SIZE": 2 * batch}
        single = run_main(base_env(tmp, **one), timeout=timeout)
        codes = wait_all(procs, timeout=timeout)
    finally:
        group.cleanup()
    assert single.code == 0, single.stderr[-3000:]
    assert codes == [0, 0], [(tmp / f"ddp-rank{r}.txt").read_text()[-3000:] for r in (0, 1)]
    return one_out, two_out


# A test's bound on a duration has two parts: the job's own bound (a timeout, a deadline, a grace: timers, which a
# loaded machine does not stretch much) and an allowance for the CPU work around it (imports, logging, shutdown),
# which it does. Only the allowance is scaled, by `slowness()` measured in the test: on 2 cores at load 8 the work
# takes about four times as long, and a job that really hangs still fails the bound.
IDLE_CALIBRATION_S = 0.045  # the workload below on an idle core of the 2-core machine these bounds were set on
MOST_SLOWNESS = 8.0  # the most a bound is stretched: load 16 on 2 cores; a hang still ends within 8x its bound
T = TypeVar("T")


def slowness() -> float:
    """How many times slower than idle this machine runs Python now (at least 1): the median of three timings of a
    pure-Python workload (what imports and logging are made of) against its idle time; about 0.15 s when idle."""
    took = []
    for _ in range(3):
        start = time.perf_counter()
        sum(i * i for i in range(1_500_000))
        took.append(time.perf_counter() - start)
    return min(MOST_SLOWNESS, max(1.0, sorted(took)[1] / IDLE_CALIBRATION_S))


def stretched(timeout: float, limit: float) -> float:
    """A wait's limit, once `limit` has run out: `timeout` idle-machine seconds at the slowness measured now, never
    less than before."""
    return max(limit, timeout * slowness())


def patiently(wait: Callable[[float], T], timeout: float) -> T:
    """`wait(seconds)` (a Popen's wait or communicate) for `timeout` idle-machine seconds, stretched by the slowness
    measured when they run out, then TimeoutExpired: a hang still fails, a process only slow on a loaded one not."""
    start, limit = time.monotonic(), timeout
    while True:
        try:
            return wait(max(start + limit - time.monotonic(), 0.01))
        except TimeoutExpired:
            if time.monotonic() - start >= (limit := stretched(timeout, limit)):
                raise


def wait_all(procs: list[Popen], logs: list[Path] | Callable[[], list[Path]] | None = None, timeout=300) -> list[int]:
    """Wait for every process and return the exit codes; any still running at the end is killed. With `logs`
    (the paths, or a function listing them once the processes are over): fail unless every code is 0, showing
    the tail of each log. `timeout` is in idle-machine seconds (`patiently`)."""
    try:
        codes = [patiently(proc.wait, timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if logs is not None and codes != [0] * len(procs):
        logs = logs() if callable(logs) else logs
        tails = "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
        pytest.fail(f"exit codes {codes}\n{tails}")
    return codes


def wait_until(condition: Callable[[], object], what: str, procs=(), timeout=300, log: Path | None = None, every=0.05):
    """Poll `condition()` every `every` s until it returns something true, and return that. Fail as soon as one
    of `procs` has exited, or once `timeout` idle-machine seconds have passed (stretched as `patiently` does),
    saying which `what` never came (and `log`'s tail)."""
    start, limit = time.monotonic(), timeout
    while not (value := condition()):
        ended = [proc.returncode for proc in procs if proc.poll() is not None]
        elapsed = time.monotonic() - start
        overdue = elapsed > limit and elapsed > (limit := stretched(timeout, limit))
        if ended or overdue:
            tail = f"\n{log.read_text(errors='replace')[-3000:]}" if log and log.exists() else ""
            pytest.fail((f"exit codes {ended} before {what}" if ended else f"no {what} within {limit:.0f} s") + tail)
        time.sleep(every)
    return value


def wait_for(path: Path, procs: list[Popen], timeout: float = 300) -> None:
    """Wait until `path` exists; fail early if a replica exits first."""
    wait_until(path.exists, f"{path}", procs, timeout)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def start(cmd: list, env: dict[str, str] | None = None, log: Path | None = None, cwd: Path = REPO, **kwargs) -> Popen:
    """Start `cmd` (a launcher, torchrun, a batch script, a test's own Python) in `cwd` without waiting for it; its
    output (stdout and stderr) goes to `log`, or where `kwargs` send it (stdout=PIPE...)."""
    if log is not None:
        kwargs = {"stdout": open(log, "w"), "stderr": STDOUT, **kwargs}
    return subprocess.Popen(cmd, env=env, cwd=cwd, **kwargs)


def start_mlflow_server(mlflow: Path, store: Path, port: int, log: Path) -> Popen:
    """`mlflow server` as users run it (sqlite backend in `store`, `port`), output to `log`, in a process group of
    its own: `stop_process_group` ends its workers with it."""
    command = [mlflow, "server", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}", "--host", "127.0.0.1"]
    command += ["--default-artifact-root", store / "artifacts", "--port", str(port), "--workers", "1"]
    return subprocess.Popen(
        command,
        stdout=open(log, "w"),
        stderr=STDOUT,
        # No job runner: its queue consumers (MLflow's own background jobs) take seconds of CPU and serve no run.
        env={**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        start_new_session=True,
    )


def stop_process_group(proc: Popen, grace: float = 15) -> None:
    """SIGTERM to `proc`'s process group, SIGKILL after `grace` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_command(
    argv: list, env: dict[str, str] | None = None, cwd: Path = REPO, timeout: float | None = None, **kwargs
) -> CompletedProcess:
    """`argv` (a tool: bash, make, hadolint, mount; or a Python the test picks) run to its end in `cwd`, its output
    captured as text; `kwargs` go to subprocess.run (input=, text=False, capture_output=False)."""
    options = {"capture_output": True, "text": True, **kwargs}
    return subprocess.run(argv, env=env, cwd=cwd, timeout=timeout, check=False, **options)

"""Shared fixtures and helpers: a tiny BERT and small SST-2-shaped data built here, runners for the real entry
point, predict.py and the launchers in real processes, what each rank reports (logs/rank-R.json), free ports, the
local Hub stand-in, an MLflow tracking server, and the deployment readers (Dockerfile, k8s manifests, CRD schemas)
the deploy and launcher tests share. Everything is offline and runs on the CPU (tests/test_gpu.py aside). Test modules import helpers from here; the one exception is the numerics
kit of tests/test_ddp_numerics.py (data of known token lengths, loss curves, tolerances), which the elastic and
DeepSpeed comparisons reuse so that every strategy is held to the same yardstick."""

from __future__ import annotations

import copy
import csv
import fcntl
import json
import logging
import os
import pty
import random
import re
import shlex
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TypeVar
from unittest import mock

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
K8S = REPO / "k8s"
DOCKERFILE = REPO / "Dockerfile"
SCHEMAS = REPO / "tests" / "schemas"  # the Kubeflow CRDs, vendored (their source in the README beside them)

from scripts.make_demo_assets import (  # noqa: E402
    FILLER,
    NEGATIVE,
    NOUNS,
    POSITIVE,
    VERBS,
    write_dataset,
    write_tiny_bert,
)
from tests.hub_stub import HubStub  # noqa: E402
from utils.common.errors import EXIT_BAD_INPUT  # noqa: E402
from utils.config.distributed import LAUNCHER_VARIABLES  # noqa: E402

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
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdin=None if stdin is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        text=True,
    )
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


def start_main_on_terminal(env: dict[str, str], log: Path, columns: int = 100) -> subprocess.Popen:
    """Start `python main.py` with stdout and stderr on a pseudo-terminal `columns` wide (what a person at a terminal
    sees: the job draws progress bars there), copied to `log` as it comes; `.copied` is the copy's thread."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))  # a new one has no width
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "main.py")], env=env, cwd=REPO, stdout=follower, stderr=follower
    )
    os.close(follower)

    def copy() -> None:
        with open(log, "wb") as out:
            while True:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the job closed the terminal
                    break
                if not chunk:
                    break
                out.write(chunk)
                out.flush()
        os.close(leader)

    proc.copied = threading.Thread(target=copy, daemon=True)
    proc.copied.start()
    return proc


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


def configured(monkeypatch, env: dict[str, str], argv: list[str] | None = None):
    """What main.py resolves before torch (`main.configure`: settings, ranks, the plan) in a process whose
    environment is exactly `env`; bad input raises JobError."""
    from main import configure

    for name in list(os.environ):
        if name not in env:
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    return configure(list(argv or []))


def unavailable(reason: str):
    """Skip a test that needs what a machine may lack by design (root and mount(8), the container tools, a kernel
    switch); under CI (CI=true), whose machine provides them, fail instead: a skip there drops the test unseen."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; CI=true, where a missing tool fails the suite rather than skip the test")
    pytest.skip(reason)


# ------------------------------------------------------------------------------- the job's start-up, in process
class ReachedTraining(BaseException):
    """Raised where `start_in_process` stops the job: every check of its start-up passed. Not an Exception, so
    main() lets it through, and the run's own clean-up (the OUTPUT_DIR lock, the process group) runs on the way."""

    def __init__(self, ready):
        super().__init__("the start-up accepted the run")
        self.ready = ready


@dataclass
class InProcessStart:
    code: int | None  # main()'s exit code; None: it reached the first training step
    layer: (
        str | None
    )  # the part of the start-up whose call refused: settings, output, device, join, model, data, set_up
    error: str | None  # the `error:` line's message
    stderr: str
    ready: object | None  # utils.run.Ready, when it reached training


# Where a refusal is attributed: the innermost of these calls it leaves (main.py's and utils/run.py's own names).
STARTUP_LAYERS = (
    ("main", "install_masking", "settings"),  # HF_TOKEN or HF_TOKEN_PATH, read before the other settings
    ("main", "configure", "settings"),
    ("main", "open_run_dir", "output"),
    ("utils.cluster.job", "Job.start", "device"),
    ("utils.run", "join", "join"),
    ("utils.run", "set_up", "set_up"),
    ("utils.run", "load_tokenizer", "model"),
    ("utils.run", "load_sst2", "data"),
    ("utils.cluster.job", "Job.with_rows", "data"),
    ("utils.run", "build_model", "model"),
)


def start_in_process(monkeypatch, env: dict[str, str], argv: list[str] | tuple = ()) -> InProcessStart:
    """`main.main(argv)` in this process, whose environment is exactly `env`, up to the first training step: the
    job's own start-up in its order (settings, OUTPUT_DIR, device and numerics, the strategy, Hub and tracker checks,
    the rendezvous, tokenizer, data, model, the checkpoint to resume, the Trainer, run.json), nothing re-implemented.
    Training is replaced by a stop. What a start changes in the process (its stop-signal handlers, masked streams,
    logging, exported variables, libraries left out, the frozen heap) is undone or kept out, so that `make check`
    stays one process."""
    import gc
    import io
    from contextlib import redirect_stderr, redirect_stdout
    from importlib import import_module

    import main
    import utils.run
    from utils.cluster.preemption import Preemption
    from utils.common.errors import JobError

    for name in list(os.environ):
        if name not in env:
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    refused: list[tuple[str, JobError]] = []

    def spied(call, layer):
        def spy(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            except JobError as exc:
                if not any(exc is seen for _, seen in refused):
                    refused.append((layer, exc))
                raise

        return spy

    for module, name, layer in STARTUP_LAYERS:
        owner = import_module(module)
        if "." in name:
            cls, method = name.split(".")
            owner, name = getattr(owner, cls), method
            call = getattr(owner, name)  # bound for a classmethod, a function for a method
            wrapped = spied(call, layer)
            monkeypatch.setattr(owner, name, staticmethod(wrapped) if hasattr(call, "__self__") else wrapped)
        else:
            monkeypatch.setattr(owner, name, spied(getattr(owner, name), layer))

    def stop(job, group, ready):
        raise ReachedTraining(ready)

    monkeypatch.setattr(utils.run, "train", stop)
    monkeypatch.setattr(Preemption, "install", lambda self: None)  # no signal reaches this process's test
    monkeypatch.setattr(gc, "freeze", lambda: None)
    environ = dict(os.environ)
    modules = {name: sys.modules.get(name, REMOVED) for name in ("deepspeed", "bitsandbytes")}
    root, transformers_log = logging.getLogger(), logging.getLogger("transformers")
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in ("utils", "transformers.trainer")}
    library = (list(transformers_log.handlers), transformers_log.propagate)
    out, err = io.StringIO(), io.StringIO()
    ready = None
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main.main(list(argv))
    except ReachedTraining as reached:
        code, ready = None, reached.ready
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for name, module in modules.items():
            if module is REMOVED and sys.modules.get(name, REMOVED) is None:  # left out by the start
                del sys.modules[name]
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, was in levels.items():
            logging.getLogger(name).setLevel(was)
        transformers_log.handlers[:], transformers_log.propagate = library
    errors = error_lines(err.getvalue())
    layer = refused[0][0] if refused else None
    return InProcessStart(code, layer, errors[0].removeprefix("error: ") if errors else None, err.getvalue(), ready)


REMOVED = object()


# ------------------------------------------------------------------------------- the order files run in
# `make test` hands whole files to its workers in collection order (`--no-loadscope-reorder`): the longest go
# first, so that no worker is left alone with one at the end. xdist's own order, most tests first, started the
# image build (one test, minutes) last. The rest follow in their usual order; `--durations` shows what is long.
LONGEST_FIRST = (
    "test_container.py",  # one test of minutes (the image build): handed out last, it ran alone at the end
    "test_deepspeed.py",
    "test_faults.py",
    "test_launchers.py",
    "test_reliability.py",
    "test_elastic.py",
    "test_sweep.py",  # nine trials of the tiny model, a killed sweep resumed
    "test_tasks.py",
    "test_performance.py",
    "test_determinism.py",
    "test_tracking.py",
    "test_predict.py",
    "test_secrets_and_code.py",
    "test_published_model.py",
    "test_restart_after_barrier.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: tests keep their order


# Files that share a session fixture go to the same worker, one after the other, so it is built once, not once on
# each worker that asks: the suite's one finished run (`finished_run`), the MLflow tracking server (`mlflow_server`).
SHARING = {
    **dict.fromkeys(("test_predict.py", "test_published_model.py", "test_job.py"), "finished_run readers"),
    **dict.fromkeys(("test_tracking.py", "test_secrets_and_code.py"), "mlflow_server users"),
}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin (a GPU machine's own pytest) unused
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileSharingFixtures(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return f"tests/{SHARING[Path(path).name]}" if Path(path).name in SHARING else path

    return LoadFileSharingFixtures(config, log)


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with python_starts_refused(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with python_starts_refused(item):
        return (yield)


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
    return base_env(tmp_path, **tiny_run_settings(tiny_bert, sst2_dir, tmp_path / "out"))


@pytest.fixture
def hub():
    stub = HubStub()
    stub.url = stub.start()
    yield stub
    stub.stop()


@pytest.fixture
def hub_in_process(hub, monkeypatch):
    """The job's Hub class (utils/hub.Hub) in this process, pointed at the stand-in: `hub_in_process(seconds,
    token=None)` gives one that retries for up to `seconds` with `token` (default: the stand-in's own)."""
    from huggingface_hub import constants
    from pydantic import SecretStr

    from utils.publishing.hub import Hub

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # read from HF_ENDPOINT when huggingface_hub is imported
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return lambda seconds, token=None: Hub(SecretStr(token or hub.token), max_retry_seconds=seconds)


# The full mlflow, in a venv of its own (the Makefile makes it): the job's venv has the image's client alone.
MLFLOW_SERVER = Path(sys.prefix) / "mlflow-server" / "bin" / "mlflow"
MLFLOW_START_SECONDS = 120  # the first start creates and migrates the sqlite database


@dataclass
class TrackingServer:
    url: str  # http://127.0.0.1:PORT, no credentials
    store: Path  # its sqlite database and artifacts: what reached the tracker is in files here


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> TrackingServer:
    """`mlflow server` as users run it (sqlite backend, a free port), one per worker that asks; killed at the end
    with its workers. Tests that share it report to experiments of their own."""
    assert MLFLOW_SERVER.exists(), f"no {MLFLOW_SERVER}: `make venv` installs the server there"
    store = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = store / "server.log"
    server = subprocess.Popen(
        [
            *(str(MLFLOW_SERVER), "server"),
            *("--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}"),
            *("--default-artifact-root", str(store / "artifacts")),
            *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        # No job runner: its queue consumers (MLflow's own background jobs) take seconds of CPU and serve no run.
        env={**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        start_new_session=True,  # its own process group: the server's workers end with it
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    return answer.status == 200
            except OSError:
                return False

        wait_until(healthy, "answer from the mlflow server", [server], MLFLOW_START_SECONDS, log, every=0.5)
        yield TrackingServer(url, store)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


# ------------------------------------------------------------------------------- multi-replica runs
TIMEOUT = 20  # RENDEZVOUS_TIMEOUT in these tests: long enough for a loaded 2-core machine, short enough to wait for
SAVE_STEPS = 20  # 126 optimizer steps in the run (2 epochs of 1000 rows per rank, batch 16)
REPO_ID = "tester/sst2-lora"
BASE_ID = "tester/tiny-bert"  # the Hub id the tests' local tiny model stands for


# ------------------------------------------------------------------------------- helpers
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


@dataclass
class FinishedRun:
    """A finished run's folder and what reached the Hub; read it only (copy `out` to change anything)."""

    tmp: Path  # HF_HOME and the captured streams live here too
    out: Path  # OUTPUT_DIR
    hub: HubStub
    env: dict[str, str]  # the settings it ran with (OUTPUT_DIR and HF_ENDPOINT point at the shared run)
    first: Result  # the run itself: trained, the push refused (exit 3)
    push_only: Result  # `--push-only`: the same files sent again, accepted


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, tiny_bert, sst2_dir) -> FinishedRun:
    """One tiny run every test that only reads a finished run shares: one process, 2 epochs, TensorBoard,
    label names, a merged export, both models pushed to the local Hub stand-in. The Hub refuses its first
    pushes (403), so the run ends in exit 3 and `--push-only` publishes what the volume holds, the way a
    user recovers: what reached the Hub is what a retry sends."""
    tmp = tmp_path_factory.mktemp("finished-run")
    hub = HubStub()
    hub.url = hub.start()
    hub.fail("commit", 403, 403)  # the adapter's and the merged model's first commits
    env = base_env(
        tmp,
        **tiny_run_settings(tiny_bert, sst2_dir, tmp / "out"),
        LABEL_NAMES=",".join(LABELS),
        MAX_SEQ_LENGTH=MAX_SEQ_LENGTH,
        MERGE_ADAPTER="true",
        RESULT_MERGED_MODEL_ID=MERGED_ID,
        **push_settings(hub),
    )
    first = run_main(env)
    assert first.code == 3, first.stderr[-3000:]
    assert hub.commits == []
    push_only = run_main(env, "--push-only")
    assert push_only.code == 0, push_only.stderr[-3000:]
    for name, result in (("first", first), ("push-only", push_only)):
        (tmp / f"{name}.stdout").write_text(result.stdout)
        (tmp / f"{name}.stderr").write_text(result.stderr)
    yield FinishedRun(tmp, tmp / "out", hub, env, first, push_only)
    hub.stop()


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


def train_one_and_two(tmp: Path, settings: dict, batch: int) -> tuple[Path, Path]:
    """The same settings trained by one process at batch 2B and by two replicas at B each (DDP on gloo): the
    comparison every task and strategy is held to. Returns the two OUTPUT_DIRs (one process, two replicas);
    both runs must succeed."""
    one_out, two_out = tmp / "one", tmp / "two"
    settings = {k: str(v) for k, v in settings.items()}
    group = Replicas(tmp)
    try:
        procs = group.start("ddp", {**settings, "OUTPUT_DIR": str(two_out), "PER_DEVICE_BATCH_SIZE": str(batch)})
        single = run_main(base_env(tmp, **settings, OUTPUT_DIR=one_out, PER_DEVICE_BATCH_SIZE=2 * batch))
        codes = wait_all(procs)
    finally:
        group.cleanup()
    assert single.code == 0, single.stderr[-3000:]
    assert codes == [0, 0], [(tmp / f"ddp-rank{r}.txt").read_text()[-3000:] for r in (0, 1)]
    return one_out, two_out


WORDS = 8  # every fixed-length sentence: a subject, a verb, an adjective, filler: [CLS] + 8 word tokens + [SEP]
# DDP against one process (tests/test_ddp_numerics.py), measured on 2 CPU cores (fp32, gloo): losses within 9e-8
# relative, adapter weights within 3.4e-7 absolute (values up to 0.17). The tolerances sit a few times above that;
# a rate x2 moves step 2's eval loss by 1e-2 (relative) and the weights by up to 0.3.
LOSS_RTOL = 1e-6
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-6


def write_fixed_length_data(folder: Path, counts: tuple[int, int], seed: int = 1, extra_words=None) -> Path:
    """`counts` (train, validation) sentences of exactly WORDS words from the tiny model's vocabulary, labelled
    by their adjective; with `extra_words` (rng -> a count), that many filler words instead, for sentences of
    many lengths."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    for split, rows in zip(("train", "validation"), counts, strict=True):
        with open(folder / f"{split}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["sentence", "label"])
            for _ in range(rows):
                label = rng.randint(0, 1)
                words = ["the", rng.choice(NOUNS), rng.choice(VERBS), rng.choice(POSITIVE if label else NEGATIVE)]
                fill = extra_words(rng) if extra_words else WORDS - len(words)
                words += [rng.choice(FILLER + NOUNS) for _ in range(fill)]
                writer.writerow([" ".join(words), label])
    return folder


def adapter_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "model" / "adapter_model.safetensors")


def first_divergence(one: dict[int, float], two: dict[int, float], rtol: float) -> str | None:
    """Where two curves (step -> value) first differ by more than `rtol` (relative), in words; None if nowhere."""
    assert one.keys() == two.keys(), f"logged at different steps: {sorted(one)} vs {sorted(two)}"
    for step in sorted(one):
        a, b = one[step], two[step]
        if abs(a - b) > rtol * max(abs(a), abs(b)):
            later = ", ".join(f"{s}: {one[s]:.6g} vs {two[s]:.6g}" for s in sorted(one) if s > step)
            return (
                f"first differs at step {step}: {a:.8g} (1 process) vs {b:.8g} (2 replicas), "
                f"relative difference {abs(a - b) / max(abs(a), abs(b)):.2e} > {rtol:g}"
                + (
                    " (before any update: other rows, other initial weights or another loss scale)"
                    if step == 1
                    else ""
                )
                + (f"; later: {later}" if later else "")
            )
    return None


@pytest.fixture
def replicas(tmp_path):
    group = Replicas(tmp_path)
    yield group
    group.cleanup()


# ------------------------------------------------------------------------------- durations on a busy machine
# A test's bound on a duration has two parts: the job's own bound (a timeout, a deadline, a grace: timers, which a
# loaded machine does not stretch much) and an allowance for the CPU work around it (imports, logging, shutdown),
# which it does. Only the allowance is scaled, by `slowness()` measured in the test: on 2 cores at load 8 the work
# takes about four times as long, and a job that really hangs still fails the bound.
IDLE_CALIBRATION_S = 0.045  # the workload below on an idle core of the 2-core machine these bounds were set on
MOST_SLOWNESS = 8.0  # the most a bound is stretched: load 16 on 2 cores; a hang still ends within 8x its bound


T = TypeVar("T")


def slowness() -> float:
    """How many times slower than idle this machine runs Python now: at least 1, about 4 at load 8 on 2 cores.
    The median of three timings of a fixed pure-Python workload (what imports and logging are made of), against its
    idle time; it takes about 0.15 s on an idle machine."""
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
    """`wait(seconds)` (a Popen's wait or communicate) for `timeout` idle-machine seconds: when they run out, it
    waits on for as long as the slowness measured then stretches them, then lets TimeoutExpired through. A wait
    for a process that really hangs still fails; one for a process that is only slow on a loaded machine does not."""
    start, limit = time.monotonic(), timeout
    while True:
        try:
            return wait(max(start + limit - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            if time.monotonic() - start >= (limit := stretched(timeout, limit)):
                raise


def wait_all(
    procs: list[subprocess.Popen],
    logs: list[Path] | Callable[[], list[Path]] | None = None,
    timeout: float = 300,
) -> list[int]:
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
        pytest.fail(
            f"exit codes {codes}\n"
            + "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
        )
    return codes


def wait_until(
    condition: Callable[[], object],
    what: str,
    procs: list[subprocess.Popen] | tuple = (),
    timeout: float = 300,
    log: Path | None = None,
    every: float = 0.05,
):
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
            pytest.fail(
                f"exit codes {ended} before {what}{tail}" if ended else f"no {what} within {limit:.0f} s{tail}"
            )
        time.sleep(every)
    return value


def wait_for(path: Path, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    """Wait until `path` exists; fail early if a replica exits first."""
    wait_until(path.exists, f"{path}", procs, timeout)


def rank_record(out: Path, rank: int) -> dict:
    """What rank `rank` of the run in `out` wrote at its end (OUTPUT_DIR/logs/rank-R.json): rank, local_rank,
    node_rank, world_size, source, samples_trained, trainable_checksum, first_step, seconds_to_first_step,
    trained_with."""
    path = out / "logs" / f"rank-{rank}.json"
    assert path.is_file(), f"{path} is missing: rank {rank} did not finish a run in {out}"
    return json.loads(path.read_text())


def trained_plan(out: Path, ranks=(0,)) -> dict:
    """run.json's plan, once every rank in `ranks` is seen to have trained with it: the batch split, the steps, the
    warm-up, each optimizer group's rate and the precision each Trainer read back at the end of training
    (logs/rank-R.json's `trained_with`)."""
    plan = json.loads((out / "run.json").read_text())["plan"]
    planned = {
        "micro_batch": plan["batch"]["micro_batch"],
        "accumulation": plan["batch"]["accumulation"],
        "steps": plan["steps"],
        "warmup_steps": plan["warmup_steps"],
        "rates": sorted(set(plan["rates"].values())),
        "precision": plan["precision"],
    }
    for rank in ranks:
        assert rank_record(out, rank)["trained_with"] == planned, f"rank {rank} trained otherwise than planned"
    return plan


def complete_steps(out: Path) -> list[int]:
    """The steps of the checkpoints in `out` marked complete (a resume may use them), oldest first."""
    return sorted(
        int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("checkpoint-*") if (p / "COMPLETE").exists()
    )


# ------------------------------------------------------------------------------- the refusals the docs show
RELIABILITY_DOC = REPO / "docs" / "reliability.md"
SETTING_WORD = re.compile(r"^(?:[A-Z][A-Z0-9_]*=[^$\s]+|--[a-z][a-z0-9-]*=[^$\s]+)$")  # no shell variable: a literal
# docs/reliability.md's "Bad input" rows whose example is settings alone but which the job refuses once it reads
# the model, the data or a file the example does not give: tests/test_refusals.py runs them, not `--dry-run`.
REFUSED_AFTER_DRY_RUN = {
    "LoRA targets not in the model",
    "a LoRA target that is the head",
    "a LoRA target LoRA cannot adapt",
    "a second text column that does not exist",
    "a DeepSpeed setting beside a config that says otherwise",
}


def shows(documented: str, printed: str) -> bool:
    """Whether `printed` is the line `documented`, each `...` in it standing for any text."""
    return re.fullmatch(".*?".join(map(re.escape, documented.split("..."))), printed) is not None


def code_spans(text: str) -> list[str]:
    return [match.group(2).strip() for match in re.finditer(r"(``?)(.+?)\1", text)]


@dataclass(frozen=True)
class DocumentedRefusal:
    example: str  # the row's second column, as written
    lines: list[str]  # every code span of its third column: the `error:` line first, then others or parts of them


def refusal_table(heading: str) -> dict[str, DocumentedRefusal]:
    """The rows of the table under `heading` in docs/reliability.md (`## Bad input`, `### \\`predict.py\\``...),
    by their case. Every row is one: a row the parser cannot split fails."""
    section = RELIABILITY_DOC.read_text().split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith(("| case |", "| --- |")):
            continue
        cells = line.removeprefix("| ").removesuffix(" |").split(" | ")
        assert len(cells) == 3 and code_spans(cells[2]), f"a row of other columns under {heading}: {line}"
        rows[cells[0]] = DocumentedRefusal(cells[1], code_spans(cells[2]))
    return rows


def assert_documented(row: str, printed: str, line: int = 0, where: Iterable[tuple[str, str]] = ()) -> None:
    """`printed` is line `line` of the "Bad input" row `row` (by its case): that line, each `...` in it any text, or,
    for a line after the first (an alternative the row shows in a parenthesis, often a part of the line), within it.
    `where`: the doc's words for what the test makes otherwise (the example's value, bert-base's size), each
    replaced by the test's first. tests/test_reliability_doc.py fails for a row no test names this way."""
    documented = refusal_table("## Bad input")[row].lines[line]
    for words, here in where:
        documented = documented.replace(words, here)
    shown = documented if line == 0 else f"...{documented}..."
    assert shows(shown, printed), f"{row}:\n  doc:  {documented}\n  job:  {printed}"


def settings_alone(example: str) -> list[str] | None:
    """The words of a "Bad input" example that is settings alone (one code span of NAME=value words and flags, then
    at most a parenthesis): what `--dry-run` resolves before torch. None for any other example."""
    spans = code_spans(example)
    if not spans or re.sub(r"\(.*\)$", "", example).strip() != f"`{spans[0]}`":
        return None
    words = spans[0].split()
    return words if words and all(SETTING_WORD.match(word) for word in words) else None


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def assert_refusal(result: Result | str, names: Iterable[str] = (), code: int | None = EXIT_BAD_INPUT) -> str:
    """A refusal checked by what it must name, not by its wording: exit `code` (for a `Result`; a stream's code is
    the test's to check), one `error:` line, no traceback, and each of `names` in that line: the setting (its
    variable or flag), the offending value, the path, what the user acts on. Returns the line."""
    text = result if isinstance(result, str) else result.stderr
    if not isinstance(result, str) and code is not None:
        assert result.code == code, text[-3000:]
    errors = error_lines(text)
    assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
    missing = [name for name in names if name not in errors[0]]
    assert not missing, f"{missing} not named in: {errors[0]}"
    return errors[0]


def assert_refused_as_bad_input(env: dict[str, str], args: list[str], names: Iterable[str], hub: HubStub) -> Result:
    """Run the job with `env` (None values: variables removed) and check the bad-input contract: exit 2, one
    `error:` line naming each of `names` (`assert_refusal`), no training step, nothing pushed, the token not shown."""
    env = {name: value for name, value in env.items() if value is not None}
    result = run_main(env, *args, timeout=180)
    assert_refusal(result, names)
    assert "Traceback" not in result.stdout
    assert hub.commits == [] and hub.count("/api/repos/create") == 0  # nothing pushed
    out = Path(env["OUTPUT_DIR"])
    assert not list(out.glob("checkpoints/checkpoint-*")) and not (out / "model").exists()  # no training step taken
    assert not any("first training step" in log.read_text() for log in out.glob("logs/rank-*.log"))
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


# ------------------------------------------------------------------------------- small data sets
def write_files(folder: Path, files: dict[str, str]) -> Path:
    """`files` (name -> text) written into a new `folder`."""
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def film_rows(rows: int) -> list[tuple[str, int]]:
    """`rows` sentences of the tiny BERT's vocabulary, labelled 0 (a dull film) and 1 (a wonderful film) in turn."""
    return [(("a wonderful film" if i % 2 else "a dull film") + " x" * (i % 5), i % 2) for i in range(rows)]


def delimited(rows, sep: str = ",", header: str = "sentence,label") -> str:
    """A csv (or, with sep="\\t", tsv) of (sentence, label) rows, written as a user would, unquoted."""
    return "\n".join([header.replace(",", sep), *(f"{text}{sep}{label}" for text, label in rows)]) + "\n"


SPLIT_SIZES = (("train", 8), ("validation", 4))


def saved_dataset(folder: Path, names: list[str], label_of=lambda label: label) -> Path:
    """A save_to_disk DatasetDict of `film_rows` (SPLIT_SIZES) whose label column is a ClassLabel named `names`;
    `label_of` turns the 0 (negative) / 1 (positive) of each row into the id the data stores."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    features = Features({"sentence": Value("string"), "label": ClassLabel(names=names)})
    splits = {
        split: Dataset.from_dict(
            {"sentence": [text for text, _ in film_rows(n)], "label": [label_of(y) for _, y in film_rows(n)]},
            features=features,
        )
        for split, n in SPLIT_SIZES
    }
    DatasetDict(splits).save_to_disk(folder)
    return folder


# Line 3 opens a quote, line 6 closes one: read as quoted csv, lines 3-6 would be one row, without a word.
STRAY_QUOTE = [
    ("a good film", 1),
    ('"a dull start', 0),
    ("more of it", 1),
    ("not much", 0),
    ('he said "fine" twice', 1),
    ("the end", 1),
]


# ------------------------------------------------------------------------------- launchers
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
STEPS = "4"  # optimizer steps of a launcher run: enough to see the ranks stay in sync, little enough for 2 cores


def job_settings(job_env: dict[str, str], **extra: str) -> dict[str, str]:
    """`job_env` cut to STEPS optimizer steps (MAX_STEPS instead of epochs), plus `extra`."""
    env = {**job_env, "MAX_STEPS": STEPS, **extra}
    env.pop("NUM_EPOCHS", None)
    return env


def start(cmd: list[str], env: dict[str, str], log: Path, **kwargs) -> subprocess.Popen:
    """Start a launcher command (torchrun, accelerate launch, a batch script) in the repo; output goes to `log`."""
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, **kwargs)


def rank_report(out: Path, world: int) -> list[dict]:
    """Per rank, from its logs/rank-R.json: who it was (rank, world, local rank, node, launcher) and what it trained."""
    return [
        {
            "rank": record["rank"],
            "world": record["world_size"],
            "local_rank": record["local_rank"],
            "node": record["node_rank"],
            "source": record["source"],
            "samples": record["samples_trained"],
            "checksum": record["trainable_checksum"],
        }
        for record in (rank_record(out, rank) for rank in range(world))
    ]


# ------------------------------------------------------------------------------- the image (Dockerfile)
@cache
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        current += " " + stripped.removesuffix("\\").strip() if current else stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            lines.append(current)
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def docker_env() -> dict[str, str]:
    """The image's ENV."""
    env = {}
    for instruction, args in dockerfile():
        if instruction == "ENV":
            env.update(dict(item.split("=", 1) for item in shlex.split(args)))
    return env


def docker_user() -> tuple[int, int]:
    """The image's USER as (uid, gid)."""
    users = [args for instruction, args in dockerfile() if instruction == "USER"]
    assert users, "the Dockerfile sets no USER: the job would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), f"USER {users[-1]}: give a numeric uid:gid, so runAsNonRoot can verify it"
    return int(uid), int(gid)


def shared_output_dir() -> str:
    """OUTPUT_DIR's default where the shared volume is mounted, as the code computes it."""
    from utils.config.settings import SHARED_VOLUME, default_output_dir

    real_isdir = os.path.isdir
    with mock.patch("os.path.isdir", lambda path: path == SHARED_VOLUME or real_isdir(path)):
        return default_output_dir()


# ------------------------------------------------------------------------------- Kubernetes manifests and CRDs
def yaml_docs(path: Path) -> list[dict]:
    return [
        doc for doc in yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader) if doc
    ]  # libyaml: the vendored CRDs (2 MB) took 10 s


def load_manifest(path: Path) -> dict:
    """A manifest file holding one document."""
    documents = yaml_docs(path)
    assert len(documents) == 1, path
    return documents[0]


def kustomize(folder: Path) -> list[dict]:
    """What `kubectl apply -k folder` creates: the resources of its kustomization, folders recursively."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    out = []
    for entry in kustomization.get("resources", []):
        target = (folder / entry).resolve()
        out += kustomize(target) if target.is_dir() else yaml_docs(target)
    return out


def config_maps(docs: list[dict]) -> dict[str, dict[str, str]]:
    """The ConfigMaps among `docs`: name -> data."""
    return {doc["metadata"]["name"]: doc.get("data", {}) for doc in docs if doc.get("kind") == "ConfigMap"}


def container_env(container: dict, configmaps: dict[str, dict[str, str]]) -> dict[str, str]:
    """The variables the kubelet gives a container: the image's ENV < envFrom ConfigMaps < `env` (which wins);
    ConfigMap keys resolved from `configmaps` (name -> data), Secret keys to FAKE_TOKEN (it must come back masked)."""
    env = docker_env()
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        value_from = var.get("valueFrom", {})
        ref = value_from.get("configMapKeyRef")
        if "value" in var:
            env[var["name"]] = var["value"]
        elif ref and ref["key"] in configmaps.get(ref["name"], {}):
            env[var["name"]] = configmaps[ref["name"]][ref["key"]]
        elif "secretKeyRef" in value_from:
            env[var["name"]] = FAKE_TOKEN
    return env


def strict(schema):
    """An openAPIV3Schema with unknown fields made errors, as the API server's pruning would drop them silently."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict schema, for every CRD vendored in tests/schemas."""
    found = {}
    for path in sorted(SCHEMAS.glob("*.yaml")):
        for crd in yaml_docs(path):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            for version in crd["spec"]["versions"]:
                api = f"{crd['spec']['group']}/{version['name']}"
                found[(api, crd["spec"]["names"]["kind"])] = strict(
                    copy.deepcopy(version["schema"]["openAPIV3Schema"])
                )
    return found


def crd_schema(api_version: str, kind: str) -> dict:
    """The strict schema of one custom resource, from the vendored CRDs."""
    schemas = crd_schemas()
    assert (api_version, kind) in schemas, f"no CRD for {api_version} {kind} in {SCHEMAS}"
    return schemas[(api_version, kind)]


def schema_errors(schema: dict, document: dict) -> list[str]:
    """Every way `document` breaks `schema`, as `path: message` (a message that quotes a whole object, cut short)."""
    import jsonschema

    return [
        f"{'/'.join(map(str, error.absolute_path)) or '/'}: {error.message[:300]}"
        for error in jsonschema.Draft7Validator(schema).iter_errors(document)
    ]


def step_losses(out: Path) -> dict[int, float]:
    """Every step's training loss (LOGGING_STEPS=1) from the last checkpoint's trainer_state.json."""
    last = max((out / "checkpoints").glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    history = json.loads((last / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}

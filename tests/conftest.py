"""The fixtures and hooks the tests share (the tiny BERT and data, the Hub stand-in, an MLflow server, the suite's one
finished run, replicas killed at the end, the order files run in), offline and on the CPU (tests/test_gpu.py aside).
Helpers live in tests/support/, by concern; test modules import them from there, never from one another."""

from __future__ import annotations

import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the job's modules and tests.support, from any cwd

from scripts.make_demo_assets import write_dataset, write_tiny_bert  # noqa: E402
from tests.support.env import (  # noqa: E402
    LABELS,
    MAX_SEQ_LENGTH,
    MERGED_ID,
    free_port,
    push_settings,
    tiny_run_env,
)
from tests.support.hub_stub import HubStub  # noqa: E402
from tests.support.processes import (  # noqa: E402
    Replicas,
    Result,
    python_starts_refused,
    run_main,
    start_mlflow_server,
    stop_process_group,
    wait_until,
)

# `make test` hands whole files to its workers in collection order (`--no-loadscope-reorder`): the longest go
# first, so that no worker is left alone with one at the end. xdist's own order, most tests first, started the
# image build (test_container.py: one test of minutes) last, and it ran alone at the end. test_sweep.py runs nine
# trials and resumes a killed sweep. The rest follow in their usual order; `--durations` shows what is long.
LONGEST_FIRST = [
    f"test_{name}.py"
    for name in "container deepspeed faults launchers reliability elastic sweep tasks performance determinism tracking"
    " predict secrets_and_code published_model restart_after_barrier".split()
]


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with python_starts_refused(item):
        return (yield)


pytest_runtest_call = pytest_runtest_setup


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
    return tiny_run_env(tmp_path, tiny_bert, sst2_dir)


@pytest.fixture
def hub():
    stub = HubStub()
    stub.url = stub.start()
    yield stub
    stub.stop()


@pytest.fixture
def hub_in_process(hub, monkeypatch):
    """The job's Hub class (utils/publishing/hub.Hub) in this process, pointed at the stand-in: `hub_in_process(seconds,
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
    server = start_mlflow_server(MLFLOW_SERVER, store, port, log)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False

    try:
        wait_until(healthy, "answer from the mlflow server", [server], MLFLOW_START_SECONDS, log, every=0.5)
        yield TrackingServer(url, store)
    finally:
        stop_process_group(server)


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
    env = tiny_run_env(
        tmp,
        tiny_bert,
        sst2_dir,
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


@pytest.fixture
def replicas(tmp_path):
    group = Replicas(tmp_path)
    yield group
    group.cleanup()

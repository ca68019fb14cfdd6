"""MLflow as users run it: a real tracking server (sqlite, a free port) a two-replica job reports to, read back with
MlflowClient; and a tracking URI MLflow refuses, stopped before data and model load: once end to end, and every way
of refusing in this process (a silent server given 2 s, not the job's 30). MLflow 3 deprecates the file store."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.support.env import FAKE_TOKEN, TIMEOUT, free_port, tiny_run_settings
from tests.support.outcomes import assert_refused_as_bad_input
from tests.support.processes import wait_all

URL_SECRET = "s3cret-in-url"  # a password inside MLFLOW_TRACKING_URI: it authenticates, and is shown nowhere


def test_two_replicas_report_one_run_to_a_real_tracking_server_and_no_secret(
    mlflow_server, tmp_path, tiny_bert, sst2_dir, replicas
):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    tracking = {
        "REPORT_TO": "tensorboard,mlflow",
        "MLFLOW_TRACKING_URI": mlflow_server.url.replace("http://", f"http://alice:{URL_SECRET}@"),
        "MLFLOW_EXPERIMENT_NAME": "sst2-lora",
        "HF_TOKEN": FAKE_TOKEN,  # not used without a push, and still never to reach the tracker
        "RENDEZVOUS_TIMEOUT": str(TIMEOUT),
    }
    # 8 steps, a loss and an evaluation every 2: a training and a validation curve of 4 points each.
    settings = tiny_run_settings(tiny_bert, sst2_dir, out, MAX_STEPS=8, LOGGING_STEPS=2, EVAL_STEPS=2, **tracking)
    settings.pop("NUM_EPOCHS")
    procs = replicas.start("mlflow", settings)
    wait_all(procs, replicas.streams)

    client = MlflowClient(tracking_uri=mlflow_server.url)
    experiment = client.get_experiment_by_name("sst2-lora")
    assert experiment is not None, [e.name for e in client.search_experiments()]
    runs = client.search_runs([experiment.experiment_id])
    run_name = json.loads((out / "run.json").read_text())["run_name"]
    # One run: rank 0 reports, rank 1 does not; training and the final evaluation in the same run.
    [run] = runs
    assert run.info.run_name == run_name and run.info.status == "FINISHED"
    final = json.loads((out / "metrics.json").read_text())
    assert run.data.metrics["eval_accuracy"] == pytest.approx(final["eval_accuracy"], abs=1e-6)
    assert "loss" in run.data.metrics and len(client.get_metric_history(run.info.run_id, "loss")) >= 2
    assert len(client.get_metric_history(run.info.run_id, "eval_accuracy")) >= 4  # the validation curve
    assert float(run.data.params["learning_rate"]) == 0.003 and run.data.params["per_device_train_batch_size"] == "16"
    recorded = json.dumps({"params": run.data.params, "tags": run.data.tags, "metrics": run.data.metrics})
    for secret in (FAKE_TOKEN, URL_SECRET):
        assert secret not in recorded
        for stream in replicas.streams:
            assert secret not in stream.read_text()


def test_a_tracking_uri_mlflow_refuses_stops_the_job_before_loading(job_env, hub):
    uri = f"http://alice:{URL_SECRET}@127.0.0.1:{free_port()}"  # nothing listens there
    env = {**job_env, "REPORT_TO": "mlflow", "MLFLOW_TRACKING_URI": uri}
    masked = uri.replace(URL_SECRET, "***")
    result = assert_refused_as_bad_input(env, [], [f"MLFLOW_TRACKING_URI={masked}", "REPORT_TO"], hub)
    assert URL_SECRET not in result.stderr + result.stdout
    # Refused before the data was loaded: nothing was tokenized into the run folder.
    assert not list((Path(env["OUTPUT_DIR"]) / "cache").glob("tokenized-*"))


@pytest.fixture
def silent_server():
    """A server that accepts connections and never answers: MLflow's client would wait and retry for minutes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        yield f"http://127.0.0.1:{silent.getsockname()[1]}"


TRACKER_CHECK_TEST_SECONDS = 2  # the bound the check is given here; the job's own is TRACKER_CHECK_SECONDS
UNSUPPORTED, MASKED = "htp://mlflow.example:5000", "MLFLOW_TRACKING_URI=http://alice:***@"  # MASKED: URL_SECRET's


@pytest.mark.check
@pytest.mark.parametrize(
    "uri, says",
    [
        (UNSUPPORTED, f"MLflow has no tracking store for MLFLOW_TRACKING_URI={UNSUPPORTED}"),
        ("http://", "names no host"),
        (f"http://alice:{URL_SECRET}@127.0.0.1:{{port}}", f"no tracking server answers at {MASKED}"),
        ("{silent}", f"did not answer within {TRACKER_CHECK_TEST_SECONDS} s"),
    ],
    ids=["unsupported-scheme", "no-host", "nothing-listening", "never-answers"],
)
def test_tracking_uris_mlflow_cannot_use_are_bad_input_with_the_fix(monkeypatch, silent_server, uri, says):
    """`check_tracker_uri`, which main.py runs before loading: a JobError, exit 2, the fix, the password masked."""
    from utils.common.errors import EXIT_BAD_INPUT, JobError
    from utils.config.preflight import check_tracker_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri.format(port=free_port(), silent=silent_server))
    with pytest.raises(JobError) as refused:  # given up on (MLflow alone retries for minutes)
        check_tracker_uri(("mlflow",), timeout_s=TRACKER_CHECK_TEST_SECONDS)
    assert refused.value.code == EXIT_BAD_INPUT
    assert says in refused.value.message, refused.value.message
    assert "set MLFLOW_TRACKING_URI to a running MLflow tracking server" in refused.value.message
    assert URL_SECRET not in refused.value.message

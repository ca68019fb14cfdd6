"""What the job never prints and never runs: credentials inside the URLs it is given (the Hub endpoint, a
tracking server, a proxy), code shipped in a model folder, and weights that would run code when unpickled.
Real processes on the tiny model; each asserts the exit code, the one `error:` line, and that nothing was
printed, written or run that should not have been."""

from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.env import REPO, free_port, push_settings
from tests.support.outcomes import assert_refused_as_bad_input, assert_token_absent, error_lines
from tests.support.processes import run_command, run_main
from tests.support.weights import pickled_weights

PASSWORD = "s3cret-pass-0123"  # alice's password in every URL below
PROXY_PASSWORD = "pr0xy-pass-4567"


def assert_secrets_absent(root: Path, *texts: str) -> None:
    """Neither password appears in `texts` (what the job printed) or in any file under `root`, raw or as the
    Basic-auth header a client makes of it."""
    needles = [PASSWORD, PROXY_PASSWORD, base64.b64encode(f"alice:{PASSWORD}".encode()).decode()]
    for needle in needles:
        assert not any(needle in text for text in texts), f"{needle} printed"
        leaks = [str(path) for path in root.rglob("*") if path.is_file() and needle.encode() in path.read_bytes()]
        assert not leaks, f"{needle} found in {leaks}"


# ------------------------------------------------------------------------------- credentials in URLs
def test_credentials_in_an_unreachable_hub_endpoint_are_masked_in_the_error(job_env, hub, tmp_path):
    port = free_port()  # nothing listens there
    env = {
        **job_env,
        **push_settings(hub),
        "HF_ENDPOINT": f"http://alice:{PASSWORD}@127.0.0.1:{port}",
        "PUSH_TIMEOUT": "5",  # the token check gives up within min(120 s, this)
    }
    # The user still sees which endpoint failed, its password masked.
    names = [f"http://alice:***@127.0.0.1:{port}", "HF_ENDPOINT", "RESULT_MODEL_ID"]
    result = assert_refused_as_bad_input(env, [], names, hub)
    assert_secrets_absent(tmp_path, result.stdout, result.stderr)


def test_credentials_in_the_tracking_uri_and_the_proxy_never_reach_output_or_the_tracker(
    job_env, mlflow_server, tmp_path
):
    tracking = mlflow_server.url.replace("http://", f"http://alice:{PASSWORD}@")
    env = {
        **job_env,
        "MAX_STEPS": "4",
        "SAVE_STEPS": "2",
        "REPORT_TO": "tensorboard,mlflow",
        "MLFLOW_TRACKING_URI": tracking,
        "MLFLOW_EXPERIMENT_NAME": "secrets",  # the server is shared with tests/test_tracking.py
        "HTTPS_PROXY": f"http://bob:{PROXY_PASSWORD}@127.0.0.1:9",  # nothing here goes out over https
        "NO_PROXY": "127.0.0.1,localhost",
    }
    env.pop("NUM_EPOCHS")
    result = run_main(env, timeout=600)
    assert result.code == 0, result.stderr[-3000:]
    # MLflow prints a link to the run, the tracking URI included: the proof this run had a URL to mask.
    assert f"{mlflow_server.url.replace('http://', 'http://alice:***@')}/#/experiments/" in result.stdout
    (tmp_path / "stdout.txt").write_text(result.stdout)
    (tmp_path / "stderr.txt").write_text(result.stderr)
    for secret in (PASSWORD, PROXY_PASSWORD):
        # Outputs, checkpoints, logs, the card, run.json, TensorBoard, HF_HOME, and the tracking server's store.
        assert_token_absent(secret, [tmp_path, mlflow_server.store])
    for root in (tmp_path, mlflow_server.store):
        assert_secrets_absent(root)


# ------------------------------------------------------------------------------- code in a model folder
CUSTOM_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("custom code ran")
from transformers import BertConfig, BertForSequenceClassification
class CustomConfig(BertConfig):
    model_type = "custom-bert"
class CustomModel(BertForSequenceClassification):
    config_class = CustomConfig
"""


def custom_code_model(tiny_bert: Path, folder: Path, marker: Path) -> Path:
    """The tiny model with an auto_map to a module of its own that writes `marker` when imported."""
    shutil.copytree(tiny_bert, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "custom-bert"  # not one transformers knows: only the folder's code could load it
    classes = {"AutoConfig": "CustomConfig", "AutoModelForSequenceClassification": "CustomModel"}
    config["auto_map"] = {auto: f"custom_bert.{name}" for auto, name in classes.items()}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom_bert.py").write_text(CUSTOM_CODE.format(marker=str(marker)))
    return folder


def test_a_model_folder_with_custom_code_is_refused_without_running_it_or_asking(job_env, tiny_bert, tmp_path):
    marker = tmp_path / "custom-code-ran"
    model = custom_code_model(tiny_bert, tmp_path / "custom-model", marker)
    # "y" on stdin is what made transformers run the folder's code when it was asked whether it might.
    proc = run_command(
        [sys.executable, str(REPO / "main.py"), "--model-name", str(model)],
        env=job_env,
        cwd=REPO,
        input="y\n",
        timeout=180,  # a prompt waiting for an answer would fail here
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    [error] = error_lines(proc.stderr)
    assert str(model) in error and "auto_map" in error and "custom code" in error, error
    assert "Traceback" not in proc.stderr and "[y/N]" not in proc.stdout + proc.stderr
    assert not marker.exists()
    assert not list(Path(job_env["HF_HOME"]).glob("modules/transformers_modules/*/**/custom_bert.py"))
    assert not (Path(job_env["OUTPUT_DIR"]) / "run.json").exists()

    # predict.py, given the same folder as a merged model, does not run it either.
    (tmp_path / "sentences.txt").write_text("a superb film\n")
    predict = run_command(
        [sys.executable, str(REPO / "predict.py"), str(model), str(tmp_path / "sentences.txt")],
        env=job_env,
        cwd=REPO,
        input="y\n",
        timeout=180,
    )
    assert predict.returncode == 2, predict.stderr[-3000:]
    assert len(error_lines(predict.stderr)) == 1 and "Traceback" not in predict.stderr
    assert not marker.exists()


# ------------------------------------------------------------------------------- weights that are not weights
@pytest.mark.check
@pytest.mark.parametrize(
    "how, says", [("malicious", "is a pickle that would run code when loaded"), ("truncated", "is damaged")]
)
def test_pickled_weights_that_would_run_code_or_are_damaged_are_refused_in_one_line(how, says, tiny_bert, tmp_path):
    """The model check the job runs before training (`check_model`, first thing in load_tokenizer), in this
    process (a payload that ran would leave its marker here too); a refused start through main.py at the model
    layer is tests/test_refusals.py's `model` case."""
    from utils.common.errors import EXIT_BAD_INPUT, JobError
    from utils.training.model import check_model

    marker = tmp_path / "payload-ran"
    model = pickled_weights(shutil.copytree(tiny_bert, tmp_path / "model"), how, marker)
    with pytest.raises(JobError) as refused:
        check_model(str(model), max_seq_length=128, lora_r=8)
    error = refused.value.message
    assert refused.value.code == EXIT_BAD_INPUT and "\n" not in error
    assert f"the weights file pytorch_model.bin {says}" in error and "safetensors" in error and str(model) in error
    assert not marker.exists()

"""An adapter goes on the base it was trained on, and only on it: model/base_model.json records the SHA-256 of each
weights, config and tokenizer file of a local MODEL_NAME, and the merge and predict.py refuse a base whose files
changed since, naming it and the fix; another copy of the same bytes is the same base."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.docs import assert_documented
from tests.support.env import base_env, tiny_run_settings
from tests.support.outcomes import assert_refusal
from tests.support.processes import Result, run_main, run_predict, start_main, wait_all, wait_until

SENTENCES = "a wonderful film\na dull film\n"


def other_weights(folder: Path, staged: Path) -> Path:
    """`folder`'s model.safetensors with each weight moved by 0.01 (the same shapes), written to `staged`: moved over
    the original (a new file, as a copy or a download makes), it replaces them while a job keeps what it read."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    moved = {name: tensor + 0.01 if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}
    save_file(moved, staged, metadata={"format": "pt"})
    return staged


@dataclass
class BaseReplaced:
    out: Path  # OUTPUT_DIR: model/ saved, no merged/
    base: Path  # MODEL_NAME, a copy of the tiny BERT whose weights were replaced while the run trained
    original: bytes  # the weights the adapter was trained on
    env: dict[str, str]
    first: Result


@pytest.fixture(scope="module")
def base_replaced(tmp_path_factory, tiny_bert, sst2_dir) -> BaseReplaced:
    """A run with MERGE_ADAPTER whose base's weights are replaced once it loaded them: its merge meets the new ones."""
    tmp = tmp_path_factory.mktemp("base-replaced")
    base = shutil.copytree(tiny_bert, tmp / "base")
    settings = tiny_run_settings(base, sst2_dir, tmp / "out", MAX_STEPS=20, MERGE_ADAPTER="true")
    settings.pop("NUM_EPOCHS")
    env = base_env(tmp, **settings)
    original, staged = (base / "model.safetensors").read_bytes(), other_weights(base, tmp / "other.safetensors")
    log = tmp / "run.log"
    proc = start_main(env, log=log)
    # Logged once the base's weights are loaded: training, the evaluation and saving model/ are still to come, and
    # the new weights, written beforehand, take their place at once.
    wait_until(lambda: "trainable parameters" in log.read_text(), "the base model loaded", [proc], log=log)
    os.replace(staged, base / "model.safetensors")
    assert f"saved {tmp / 'out' / 'model'}" not in log.read_text(), "the run saved model/ before its base was replaced"
    [code] = wait_all([proc])
    return BaseReplaced(tmp / "out", base, original, env, Result(code, "", log.read_text()))


def test_the_merge_refuses_a_base_replaced_since_the_adapter_was_trained(base_replaced):
    out, base = base_replaced.out, base_replaced.base
    # model/ records the weights it was trained on, the ones the run loaded (and fingerprinted) at its start.
    recorded = json.loads((out / "model" / "base_model.json").read_text())["sha256"]
    assert recorded["model.safetensors"] == hashlib.sha256(base_replaced.original).hexdigest()
    assert set(recorded) >= {"config.json", "vocab.txt"}
    # The run saved its model, then refused the merge: nothing staged or merged.
    names = [f"MODEL_NAME={base}", "model.safetensors", "base_model.json", "restore"]
    line = assert_refusal(base_replaced.first, names)
    assert_documented("base model replaced while a run trained", line.removeprefix("error: "))
    assert (out / "model" / "adapter_model.safetensors").is_file() and (out / "metrics.json").is_file()
    assert not (out / "merged").exists() and not (out / ".merged.partial").exists()

    # A restart that would merge onto the changed base: refused by the run's identity before anything is loaded.
    again = run_main(base_replaced.env)
    assert_refusal(again, [f"OUTPUT_DIR={out}", "base model: model.safetensors", "restore the base model"])
    assert not (out / "merged").exists() and not (out / ".merged.partial").exists()

    # The base restored (the same bytes): the restart merges, and predict.py takes the adapter on its recorded base.
    (base / "model.safetensors").write_bytes(base_replaced.original)
    merged = run_main(base_replaced.env)
    assert merged.code == 0, merged.stderr[-3000:]
    assert (out / "merged" / "model.safetensors").is_file() and not (out / ".merged.partial").exists()
    answers = run_predict(base_env(out.parent), out / "model", stdin=SENTENCES)
    assert answers.code == 0 and len(answers.stdout.splitlines()) == 2, answers.stderr[-3000:]
    assert "note:" not in answers.stderr


def test_predict_refuses_a_base_whose_weights_or_config_changed(base_replaced, tiny_bert, tmp_path):
    out, env = base_replaced.out, base_env(tmp_path)
    # Another copy of the same bytes is the same base.
    same = run_predict(env, out / "model", "--base-model", tiny_bert, stdin=SENTENCES)
    assert same.code == 0 and len(same.stdout.splitlines()) == 2, same.stderr[-3000:]

    # The base the adapter names, its weights replaced in place (other values, the same shapes).
    adapter, named = tmp_path / "adapter", shutil.copytree(tiny_bert, tmp_path / "named-base")
    shutil.copytree(out / "model", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(named)}))
    os.replace(other_weights(named, tmp_path / "other.safetensors"), named / "model.safetensors")
    weights = run_predict(env, adapter, stdin=SENTENCES)
    assert weights.stdout == ""
    assert_refusal(weights, [f"the base model {named} is not the one", "model.safetensors", "--base-model"])

    # A base given by --base-model whose config changed (the same shapes).
    edited = shutil.copytree(tiny_bert, tmp_path / "edited-base")
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-5}))
    refused = run_predict(env, out / "model", "--base-model", edited, stdin=SENTENCES)
    assert refused.stdout == ""
    assert_refusal(refused, [str(edited), "config.json", "--base-model"])

    # An adapter saved before the base was recorded: answered, with a note that the base is not checked.
    (adapter / "base_model.json").unlink()
    older = run_predict(env, adapter, "--base-model", tiny_bert, stdin=SENTENCES)
    assert older.code == 0 and len(older.stdout.splitlines()) == 2, older.stderr[-3000:]
    notes = [line for line in older.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "base_model.json" in notes[0] and "Traceback" not in older.stderr, older.stderr

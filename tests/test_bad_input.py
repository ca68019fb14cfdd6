"""Bad input that used to train, or to die later with a traceback, in real `python main.py` processes on
the tiny BERT: each is exit 2 with one `error:` line that says the fix, before any training step and
before anything is pushed. Also what is accepted instead of refused (0.0/1.0 and boolean labels) and
damaged state that is worked around (a torn tokenized cache is rebuilt).

Settings cases fail before torch is imported (well under a second each); model and data cases pay
the imports but never a training step.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import assert_refused_as_bad_input, base_env, error_lines, push_settings, run_main

GOOD_ROWS = [("a wonderful film", 1), ("a dull film", 0)] * 4


def write_csvs(folder: Path, train: list, validation: list, header=("sentence", "label")) -> Path:
    folder.mkdir(parents=True)
    for split, rows in (("train", train), ("validation", validation)):
        with open(folder / f"{split}.csv", "w", newline="") as handle:
            csv.writer(handle).writerows([header, *rows])
    return folder


def data(train: list, validation: list = GOOD_ROWS):
    return lambda tmp, env: {"DATASET_PATH": str(write_csvs(tmp / "bad-data", train, validation))}


def not_utf8(tmp: Path, env: dict) -> dict:
    folder = write_csvs(tmp / "bad-data", GOOD_ROWS, GOOD_ROWS)
    (folder / "train.csv").write_bytes(b"sentence,label\na wonderful film,1\na caf\xe9 film,0\n")  # Latin-1, not UTF-8
    return {"DATASET_PATH": str(folder)}


def torn_saved_dataset(tmp: Path, env: dict) -> dict:
    folder = tmp / "saved"
    folder.mkdir()
    (folder / "dataset_dict.json").write_text('{"splits": ["tra')  # a save_to_disk copy cut short
    return {"DATASET_PATH": str(folder)}


def model_copy(change):
    """A copy of the tiny BERT, changed by `change(folder)`."""

    def setup(tmp: Path, env: dict) -> dict:
        folder = tmp / "model"
        shutil.copytree(env["MODEL_NAME"], folder)
        change(folder)
        return {"MODEL_NAME": str(folder)}

    return setup


def without_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)


def short_positions(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))


def truncated_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short


def empty_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"")


def dangling_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("/nonexistent/blobs/0123abcd")  # a Hub cache snapshot without its blob


def unreadable_weights(folder: Path) -> None:
    (folder / "model.safetensors").chmod(0)


def torn_run_record(tmp: Path, env: dict) -> dict:
    out = Path(env["OUTPUT_DIR"])
    out.mkdir(parents=True)
    (out / "run.json").write_text('{"training_settings": {"model_na')  # a write cut short
    return {}


AS_ROOT = os.geteuid() == 0

# (id, extra env (None: remove the variable), setup(tmp, env) -> extra env, what the error line must say)
# Settings: refused before torch is imported, a second each, so `make check` runs them.
BAD_SETTINGS = [
    ("num-epochs-inf", {"NUM_EPOCHS": "inf"}, None, "NUM_EPOCHS=inf is invalid: Input should be a finite number"),
    ("num-epochs-absurd", {"NUM_EPOCHS": "1e9"}, None, "less than or equal to 1000"),
    ("max-steps-absurd", {"MAX_STEPS": "1000000000"}, None, "less than or equal to 100000000"),
    (
        "lora-r-absurd",
        {"LORA_R": "100000"},
        None,
        "LORA_R=100000 is invalid: Input should be less than or equal to 4096",
    ),
    ("seed-above-32-bits", {"SEED": str(2**32)}, None, "less than or equal to 4294967295"),
    ("run-name-with-path", {"RUN_NAME": "../../x"}, None, "(no '/' or '..'); fix RUN_NAME"),
    ("run-name-too-long", {"RUN_NAME": "r" * 101}, None, "use 1-100 letters"),
    (
        "text-column-is-label-column",
        {"TEXT_COLUMN": "label"},
        None,
        "must be two different columns: fix TEXT_COLUMN or LABEL_COLUMN",
    ),
    ("world-size-without-rank", {"WORLD_SIZE": "4"}, None, "WORLD_SIZE=4 is set but RANK is not; set RANK"),
    ("rank-without-world-size", {"RANK": "1"}, None, "RANK=1 is set but WORLD_SIZE is not; set WORLD_SIZE"),
    ("master-addr-alone", {"MASTER_ADDR": "replica-0", "NODE_RANK": "2"}, None, "set RANK and WORLD_SIZE as well"),
    (
        "scaled-learning-rate-out-of-bounds",
        {"LEARNING_RATE": None, "LEARNING_RATE_SCALING": "linear", "PER_DEVICE_BATCH_SIZE": "100000000"},
        None,
        "LEARNING_RATE_SCALING=linear resolves the learning rate to 1562.5 at global batch 100000000",
    ),
]
# The model and the data: refused after the imports, before any training step.
BAD_MODEL_AND_DATA = [
    # the model folder and its config
    ("model-without-tokenizer", {}, model_copy(without_tokenizer), "has no tokenizer files"),
    (
        "max-seq-length-above-positions",
        {"MAX_SEQ_LENGTH": "128"},
        model_copy(short_positions),
        "set MAX_SEQ_LENGTH to 64 or less",
    ),
    ("lora-r-above-hidden-size", {"LORA_R": "128"}, None, "set LORA_R to 64 or less"),
    ("lora-target-typo", {"LORA_TARGET_MODULES": "query,vlaue"}, None, "'vlaue' matches no module (closest: value)"),
    (
        "lora-target-head-only",
        {"LORA_TARGET_MODULES": "query,classifier"},
        None,
        "'classifier' matches only modules that take no adapter",
    ),
    ("truncated-weights", {}, model_copy(truncated_weights), "weights file model.safetensors is damaged or truncated"),
    ("empty-weights", {}, model_copy(empty_weights), "weights file model.safetensors is empty"),
    (
        "dangling-weights-link",
        {},
        model_copy(dangling_weights),
        "is a link to /nonexistent/blobs/0123abcd, which does not exist",
    ),
    pytest.param(
        ("unreadable-weights", {}, model_copy(unreadable_weights), "model.safetensors is not readable by uid"),
        marks=pytest.mark.skipif(
            AS_ROOT, reason="root reads a mode-000 file: see test_unreadable_weights_as_another_user"
        ),
    ),
    # the data
    (
        "empty-sentence",
        {},
        data([*GOOD_ROWS, ("", 1), ("   ", 0)]),
        "has 2 row(s) with an empty or missing 'sentence' (the first is row 9)",
    ),
    (
        "numeric-text-column",
        {},
        data([(1, 1), (2, 0)], [(3, 1)]),
        "column 'sentence' holds int64 values, not text; set TEXT_COLUMN",
    ),
    ("fractional-label", {}, data([*GOOD_ROWS, ("so-so", 0.5)]), "labels must be 0 (negative) or 1 (positive)"),
    (
        "text-labels",
        {},
        data([("a wonderful film", "good"), ("a dull film", "bad")]),
        "text labels ['bad', 'good'] in 'label' that are not LABEL_NAMES ['negative', 'positive']",
    ),
    ("missing-label", {}, data([*GOOD_ROWS, ("a dull film", "")]), "1 row(s) without a label in 'label'"),
    ("data-not-utf8", {}, not_utf8, "train.csv is not valid UTF-8 (byte 0xe9 on line 3); save it as UTF-8"),
    ("torn-saved-dataset", {}, torn_saved_dataset, "holds a damaged save_to_disk DatasetDict (JSONDecodeError"),
    ("torn-run-json", {}, torn_run_record, "run.json is damaged (not valid JSON"),
    # the data and the settings together
    (
        "global-batch-above-train-split",
        {"PER_DEVICE_BATCH_SIZE": "100000000"},
        None,
        "the global batch is 100000000 rows (PER_DEVICE_BATCH_SIZE=100000000 x 1 replica(s) x GRADIENT_ACCUMULATION_STEPS=1) "
        "but the training split has only 2000",
    ),
]
BAD_INPUT = [pytest.param(case, marks=pytest.mark.check) for case in BAD_SETTINGS] + BAD_MODEL_AND_DATA


def _case_id(case) -> str:
    return case.values[0][0] if hasattr(case, "values") else case[0]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[_case_id(case) for case in BAD_INPUT])
def test_bad_input_gives_one_error_line_exit_2_and_pushes_nothing(case, job_env, hub, tmp_path):
    _, extra, setup, says = case
    env = {**job_env, **push_settings(hub)}
    env.update(setup(tmp_path, env) if setup else {})
    # Event files other tests of the session wrote are theirs: only new ones count.
    before = set(tmp_path.parent.glob("**/*tfevents*"))
    assert_refused_as_bad_input({**env, **extra}, [], says, hub)
    # RUN_NAME=../../x wrote nothing, inside OUTPUT_DIR or out of it
    assert set(tmp_path.parent.glob("**/*tfevents*")) == before


@pytest.mark.skipif(
    not (AS_ROOT and shutil.which("setpriv")), reason="needs root and setpriv to start the job as another user"
)
def test_unreadable_weights_as_another_user(tiny_bert, sst2_dir, tmp_path_factory):
    """Mode 000 weights, as the platform's uid-10000 jobs meet them; under root the job runs as nobody."""
    import subprocess
    import sys
    import tempfile

    from tests.conftest import REPO

    tmp = Path(tempfile.mkdtemp(prefix="unreadable-"))  # /tmp itself: pytest's own folders are closed to other users
    try:
        tmp.chmod(0o777)
        shutil.copytree(tiny_bert, tmp / "model")
        shutil.copytree(sst2_dir, tmp / "data")
        for path in [tmp, *tmp.rglob("*")]:
            path.chmod(0o777 if path.is_dir() else 0o644)
        (tmp / "model" / "model.safetensors").chmod(0)
        env = base_env(tmp, HOME=str(tmp), MODEL_NAME=tmp / "model", DATASET_PATH=tmp / "data", OUTPUT_DIR=tmp / "out")
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable]
        # A checkout under a private folder (mode 700, as `mktemp -d` makes) cannot be run by another user at all.
        probe = [*nobody, "-c", f"import transformers; open({str(REPO / 'main.py')!r}).close()"]
        if subprocess.run(probe, env=env, cwd=tmp, capture_output=True, timeout=120, check=False).returncode:
            pytest.skip(
                f"uid 65534 cannot read this checkout ({REPO}) or its packages: make its folders world-readable"
            )
        as_nobody = [*nobody, str(REPO / "main.py")]
        result = subprocess.run(as_nobody, env=env, cwd=tmp, capture_output=True, text=True, timeout=180, check=False)
        assert result.returncode == 2, result.stderr[-3000:]
        [error] = error_lines(result.stderr)
        assert (
            "the weights file model.safetensors is not readable by uid 65534 (mode ----------)" in error
            and "make them readable" in error
        )
        assert "Traceback" not in result.stderr and not (tmp / "out" / "model").exists()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------- accepted, not refused
def test_float_and_boolean_labels_train_as_0_and_1(job_env, tmp_path):
    """0.0/1.0 (a csv label column with a blank filled in, a pandas export) and true/false are the two classes."""
    folder = tmp_path / "data"
    folder.mkdir()
    train = [(sentence, f"{label:.1f}") for sentence, label in GOOD_ROWS * 4]
    write_csvs(folder / "csv", train, [(s, "true" if label else "false") for s, label in GOOD_ROWS])
    env = {**job_env, "DATASET_PATH": str(folder / "csv"), "MAX_STEPS": "2", "PER_DEVICE_BATCH_SIZE": "4"}
    result = run_main(env, timeout=300)
    assert result.code == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["eval_samples"] == len(GOOD_ROWS) and "Traceback" not in result.stderr


# ------------------------------------------------------------------------------- damaged cache
def _truncate_arrow(cache: Path) -> str:
    arrow = next(cache.glob("train/*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size * 2 // 3])
    return "OSError: Expected to be able to read"  # Arrow finds the last record batch cut short


def _tear(name: str):
    def damage(cache: Path) -> str:
        path = next(cache.glob(f"**/{name}"))
        path.write_text(path.read_text()[: len(path.read_text()) // 2])
        return "JSONDecodeError"

    return damage


DAMAGE = [
    ("truncated-arrow", _truncate_arrow),
    ("torn-dataset-dict", _tear("dataset_dict.json")),
    ("torn-state", _tear("state.json")),
]


@pytest.fixture(scope="module")
def cached_run(tmp_path_factory, tiny_bert, sst2_dir) -> tuple[Path, dict[str, str]]:
    """A finished short run whose OUTPUT_DIR/cache holds the tokenized data."""
    tmp = tmp_path_factory.mktemp("cached")
    env = base_env(
        tmp, MODEL_NAME=tiny_bert, DATASET_PATH=sst2_dir, OUTPUT_DIR=tmp / "out", MAX_STEPS=1, PER_DEVICE_BATCH_SIZE=16
    )
    result = run_main(env, timeout=300)
    assert result.code == 0, result.stderr[-3000:]
    return tmp / "out", env


@pytest.mark.parametrize("damage", [d for _, d in DAMAGE], ids=[name for name, _ in DAMAGE])
def test_damaged_tokenized_cache_is_rebuilt_with_a_warning(cached_run, damage, tmp_path):
    finished, env = cached_run
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(finished / "cache", out / "cache")  # the cache and the run record of that run, nothing trained
    shutil.copy(finished / "run.json", out / "run.json")
    [cache] = list((out / "cache").glob("tokenized-*"))
    kind = damage(cache)

    result = run_main({**env, "OUTPUT_DIR": str(out)}, timeout=300)
    assert result.code == 0, result.stderr[-3000:]
    [warning] = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert f"tokenized cache {cache} is damaged ({kind}" in warning and "tokenizing again" in warning
    assert "Traceback" not in result.stderr and (out / "metrics.json").is_file()
    assert (cache / "dataset_dict.json").is_file()  # rebuilt under the same key: the next run loads it

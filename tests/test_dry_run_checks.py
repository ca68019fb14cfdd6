"""`python main.py --dry-run` checks the local inputs it can reach without torch or the network (a MODEL_NAME folder,
DATASET_PATH, its split files and their columns, OUTPUT_DIR) and refuses each mistake with the line the real run
prints for it, exit 2; and the warning a run gives when the tokenizer does not know the data's words. Each through
the real entry point, in a process."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.support.data import saved_dataset, write_files
from tests.support.env import base_env, tiny_run_env, tiny_run_settings
from tests.support.outcomes import error_lines
from tests.support.processes import run_main
from utils.common.errors import EXIT_BAD_INPUT

MODEL_FIX = (
    "point MODEL_NAME at a folder holding the model's config.json, tokenizer and weights "
    "(e.g. `hf download MODEL --local-dir FOLDER`), or give a Hub id"
)
TEXT_FIX = "set TEXT_COLUMN to the right one (TEXT_COLUMN=first,second names a sentence pair)"


def no_column(name: str, columns: list[str], fix: str = TEXT_FIX) -> str:
    return f"error: the train split has no column '{name}' (columns: {columns}); {fix}"


def missing_dataset(tmp: Path, env: dict) -> tuple[dict, str]:
    path = tmp / "no-such-data"
    return {"DATASET_PATH": str(path)}, (
        f"error: DATASET_PATH={path} does not exist; point it at the data's folder (train and validation files, "
        "or a save_to_disk DatasetDict), or unset it to load DATASET_NAME from the Hub"
    )


def dataset_is_a_file(tmp: Path, env: dict) -> tuple[dict, str]:
    path = Path(env["DATASET_PATH"]) / "train.csv"
    return {"DATASET_PATH": str(path)}, (
        f"error: DATASET_PATH={path} is one file, the training rows; set VALIDATION_FILE to the validation rows' "
        "file, or VALIDATION_SPLIT=0.1 to hold out a tenth of the training rows (or point DATASET_PATH at a folder "
        "of train and validation files)"
    )


def wrong_text_column(tmp: Path, env: dict) -> tuple[dict, str]:
    return {"TEXT_COLUMN": "review"}, no_column("review", ["sentence", "label", "idx"])


def wrong_label_column_in_jsonl(tmp: Path, env: dict) -> tuple[dict, str]:
    rows = "".join(json.dumps({"text": "a fine film", "stars": i % 2}) + "\n" for i in range(4))
    folder = write_files(tmp / "jsonl", {"train.jsonl": rows, "validation.jsonl": rows})
    line = no_column("label", ["text", "stars"], "set LABEL_COLUMN to the right one")
    return {"DATASET_PATH": str(folder), "TEXT_COLUMN": "text"}, line


def wrong_column_in_saved_dataset(tmp: Path, env: dict) -> tuple[dict, str]:
    folder = saved_dataset(tmp / "saved", ["negative", "positive"])
    return {"DATASET_PATH": str(folder), "TEXT_COLUMN": "review"}, no_column("review", ["sentence", "label"])


def wrong_text_column_in_parquet(tmp: Path, env: dict) -> tuple[dict, str]:
    import pyarrow
    import pyarrow.parquet

    folder = tmp / "parquet"
    folder.mkdir()
    table = pyarrow.table({"premise": ["a fine film", "a dull film"], "label": [1, 0]})
    for split in ("train", "validation"):
        pyarrow.parquet.write_table(table, folder / f"{split}.parquet")
    return {"DATASET_PATH": str(folder)}, no_column("sentence", ["premise", "label"])


def missing_model(tmp: Path, env: dict) -> tuple[dict, str]:
    path = tmp / "no-such-model"
    return {
        "MODEL_NAME": str(path)
    }, f"error: MODEL_NAME={path} does not exist (no such folder, and no Hub id); {MODEL_FIX}"


def model_without_config(tmp: Path, env: dict) -> tuple[dict, str]:
    folder = tmp / "model"
    shutil.copytree(env["MODEL_NAME"], folder)
    (folder / "config.json").unlink()
    held = ", ".join(sorted(p.name for p in folder.iterdir()))
    return {"MODEL_NAME": str(folder)}, f"error: MODEL_NAME={folder} has no config.json (it holds {held}); {MODEL_FIX}"


def output_dir_under_a_file(tmp: Path, env: dict) -> tuple[dict, str]:
    (tmp / "a-file").write_text("not a folder")
    path = tmp / "a-file" / "out"
    return {"OUTPUT_DIR": str(path)}, (
        f"error: OUTPUT_DIR={path} is not writable (Not a directory) by uid {os.getuid()}; "
        "mount a writable volume there or set OUTPUT_DIR to a writable folder"
    )


CASES = {
    "dataset-missing": missing_dataset,
    "dataset-a-file": dataset_is_a_file,
    "text-column-wrong": wrong_text_column,
    "label-column-wrong-jsonl": wrong_label_column_in_jsonl,
    "column-wrong-save-to-disk": wrong_column_in_saved_dataset,
    "text-column-wrong-parquet": wrong_text_column_in_parquet,
    "model-missing": missing_model,
    "model-without-config": model_without_config,
    "output-dir-under-a-file": output_dir_under_a_file,
}


def env_for(tmp: Path, tiny_bert: Path, sst2_dir: Path, case: str) -> tuple[dict, str]:
    env = tiny_run_env(tmp, tiny_bert, sst2_dir)
    extra, line = CASES[case](tmp, env)
    return {**env, **extra}, line


@pytest.mark.parametrize("case", list(CASES))
def test_dry_run_refuses_a_local_input_with_one_line(case, tiny_bert, sst2_dir, tmp_path):
    env, line = env_for(tmp_path, tiny_bert, sst2_dir, case)
    result = run_main(env, "--dry-run", timeout=60)
    assert (result.code, result.stdout) == (EXIT_BAD_INPUT, ""), result.stderr
    assert result.stderr.splitlines() == [line]
    assert not (tmp_path / "out").exists()  # --dry-run writes nothing


def test_dry_run_of_good_local_inputs_passes_and_imports_no_torch(tiny_bert, sst2_dir, tmp_path):
    env = tiny_run_env(tmp_path, tiny_bert, sst2_dir, PYTHONVERBOSE="1")
    result = run_main(env, "--dry-run", timeout=60)
    assert result.code == 0, result.stderr[-3000:]
    assert result.json()["config"]["dataset_path"] == str(sst2_dir)
    imported = {line.split()[1] for line in result.stderr.splitlines() if line.startswith("import ")}
    assert not {"torch", "transformers", "datasets", "peft", "pyarrow.parquet"} & imported
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["dataset-missing", "text-column-wrong", "model-without-config"])
def test_the_real_run_refuses_with_the_same_line(case, tiny_bert, sst2_dir, tmp_path):
    """What --dry-run says is what the run says when it meets the same input, from the same function."""
    env, line = env_for(tmp_path, tiny_bert, sst2_dir, case)
    result = run_main(env, timeout=180)
    assert result.code == EXIT_BAD_INPUT, result.stderr[-3000:]
    assert error_lines(result.stderr) == [line] and "Traceback" not in result.stderr


FOREIGN = ["der Film war wunderbar", "ein langweiliger Film", "die Geschichte ist schön", "schlechte Schauspieler"]


def test_a_tokenizer_that_does_not_know_the_data_is_warned_with_the_share(tiny_bert, tmp_path):
    data = tmp_path / "german"
    data.mkdir()
    for split, count in (("train", 32), ("validation", 8)):
        with open(data / f"{split}.csv", "w", newline="") as handle:
            csv.writer(handle).writerows([("sentence", "label"), *((FOREIGN[i % 4], i % 2) for i in range(count))])
    out = tmp_path / "out"
    env = base_env(tmp_path, **tiny_run_settings(tiny_bert, data, out, MAX_STEPS=1, NUM_EPOCHS=1))
    result = run_main(env, timeout=300)
    assert result.code == 0, result.stderr[-3000:]

    # The share counted here from the tokenizer's own file, each row as the run tokenizes it, special tokens aside.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_bert / "tokenizer.json"))
    unk, special = tokenizer.token_to_id("[UNK]"), {tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]")}
    ids = [t for row in range(32) for t in tokenizer.encode(FOREIGN[row % 4]).ids if t not in special]
    unknown = sum(i == unk for i in ids)
    assert unknown / len(ids) > 0.05

    log = (out / "logs" / "rank-0.log").read_text()
    share = f"{unknown / len(ids):.1%}"
    warning = re.search(r" WARNING utils\.training\.data: (.*)", log)
    assert warning, log
    assert warning[1].startswith(
        f"{share} of the training rows' tokens are the unknown token [UNK] ({unknown} of {len(ids)}; above 5%)"
    )
    assert f"MODEL_NAME={tiny_bert}" in warning[1] and "another language" in warning[1]
    assert "train a model whose tokenizer fits the data" in warning[1]

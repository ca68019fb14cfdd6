"""Bad input: every refusal before the first training step, with the fix in its message.

One table, run in this process against the functions a start meets in their order: `main.configure` (settings,
ranks, recipe, strategy: what main() calls before torch), `open_run_dir` (OUTPUT_DIR), `load_tokenizer`,
`load_sst2` and `with_rows` (the data, as the run loads it), `build_model`. Each case must be refused by
the layer it names, not earlier for another reason, with exit code 2 and a message that says what is wrong and
how to fix it. Then one refused start of the real `python main.py` per layer (settings, OUTPUT_DIR, numerics,
model, data, Hub): exit 2, one `error:` line, no traceback, nothing trained or pushed, the token not shown; and
mode-000 weights, refused to a job that cannot read them (as root, started without the capabilities that read
any file).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    BASE_ID,
    FAKE_TOKEN,
    REPO,
    REPO_ID,
    STRAY_QUOTE,
    assert_refused_as_bad_input,
    base_env,
    configured,
    delimited,
    error_lines,
    film_rows,
    push_settings,
    saved_dataset,
    tiny_run_settings,
    write_files,
)
from utils.data import load_sst2
from utils.errors import EXIT_BAD_INPUT, JobError
from utils.model import build_model, load_tokenizer
from utils.outputs import open_run_dir
from utils.plan import build_plan, with_rows
from utils.settings import load_settings

GOOD_ROWS = [("a wonderful film", 1), ("a dull film", 0)] * 4
GOOD_CSV = delimited(film_rows(8))


# ------------------------------------------------------------------------------- what the cases set up
def csv_data(train: list | None, validation: list | None = GOOD_ROWS, header=("sentence", "label")):
    """DATASET_PATH: train.csv and validation.csv of these rows (None: no file for that split)."""

    def setup(tmp: Path, env: dict) -> dict:
        folder = tmp / "bad-data"
        folder.mkdir()
        for split, rows in (("train", train), ("validation", validation)):
            if rows is not None:
                with open(folder / f"{split}.csv", "w", newline="") as handle:
                    csv.writer(handle).writerows([header, *rows])
        return {"DATASET_PATH": str(folder)}

    return setup


def files_data(build: Callable[[Path], Path]):
    """DATASET_PATH: the folder `build(folder)` writes."""
    return lambda tmp, env: {"DATASET_PATH": str(build(tmp / "bad-data"))}


def scores_with_nan(folder: Path) -> Path:
    """STS-B's columns in parquet, one score NaN (a csv's `nan` would be read as text)."""
    import pyarrow
    import pyarrow.parquet

    folder.mkdir()
    for split, scores in (("train", [0.5, float("nan"), 2.0]), ("validation", [0.5, 1.5])):
        table = {"sentence1": ["a film"] * len(scores), "sentence2": ["it is good"] * len(scores), "label": scores}
        pyarrow.parquet.write_table(pyarrow.table(table), folder / f"{split}.parquet")
    return folder


def not_utf8(tmp: Path, env: dict) -> dict:
    folder = write_files(tmp / "bad-data", {"validation.csv": GOOD_CSV})
    (folder / "train.csv").write_bytes(b"sentence,label\na wonderful film,1\na caf\xe9 film,0\n")  # Latin-1, not UTF-8
    return {"DATASET_PATH": str(folder)}


def torn_saved_dataset(tmp: Path, env: dict) -> dict:
    folder = write_files(tmp / "saved", {"dataset_dict.json": '{"splits": ["tra'})  # a save_to_disk copy cut short
    return {"DATASET_PATH": str(folder)}


JSONL_GOOD = "".join(json.dumps({"sentence": text, "label": label}) + "\n" for text, label in film_rows(4))
JSONL_MIX = "".join(
    json.dumps({"sentence": f"film {i}", "label": label}) + "\n" for i, label in enumerate([1, "1", True])
)


def model_copy(change: Callable[[Path], None]):
    """MODEL_NAME: a copy of the tiny BERT, changed by `change(folder)`."""

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


def foreign_run(tmp: Path, env: dict) -> dict:
    """OUTPUT_DIR holds the record of a run with LORA_R=4 (its settings resolved as a one-process job resolves them)."""
    settings = load_settings([], environ=env)[0]
    plan = build_plan(settings, 1)
    settings = settings.model_copy(
        update={"learning_rate": plan.learning_rate, "loraplus_lr_ratio": plan.loraplus_ratio}
    )
    out = Path(env["OUTPUT_DIR"])
    out.mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"training_settings": {**settings.training_settings(), "lora_r": 4}}))
    return {}


def torn_run_record(tmp: Path, env: dict) -> dict:
    out = Path(env["OUTPUT_DIR"])
    out.mkdir(parents=True)
    (out / "run.json").write_text('{"training_settings": {"model_na')  # a write cut short
    return {}


def another_tools_folder(tmp: Path, env: dict) -> dict:
    """OUTPUT_DIR holds no run of the job: a checkpoint and a model/ another tool wrote."""
    out = Path(env["OUTPUT_DIR"])
    write_files(out / "checkpoints" / "checkpoint-500", {"optimizer.pt": "their state"})
    write_files(out / "model", {"model.safetensors": "their weights"})
    return {}


def file_in_the_way(tmp: Path, env: dict) -> dict:
    (tmp / "a-file").write_text("not a folder")
    return {"OUTPUT_DIR": str(tmp / "a-file" / "out")}


# ------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Refusal:
    id: str
    layer: str  # settings, output, model or data: the first check that must refuse it
    says: tuple[str, ...]  # what is wrong, and the fix
    env: dict  # over the tiny run's settings with a push asked for; None removes a variable
    argv: tuple[str, ...] = ()
    setup: Callable[[Path, dict], dict] | None = None  # (tmp, env) -> more environment


def case(id: str, layer: str, says, env=None, argv=(), setup=None, marks=()):
    says = (says,) if isinstance(says, str) else tuple(says)
    return pytest.param(Refusal(id, layer, says, env or {}, tuple(argv), setup), id=id, marks=marks)


LAUNCHER = {"WORLD_SIZE": "2", "MASTER_ADDR": "h"}
NO_TOKEN = {"HF_TOKEN": None}

REFUSALS = [
    # settings: values, each named as it was given (variable or flag) with the fix
    case(
        "batch-size-zero",
        "settings",
        ["PER_DEVICE_BATCH_SIZE=0 is invalid", "greater than or equal to 1", "fix PER_DEVICE_BATCH_SIZE"],
        {"PER_DEVICE_BATCH_SIZE": "0"},
    ),
    case(
        "batch-size-not-a-number",
        "settings",
        ["PER_DEVICE_BATCH_SIZE=sixteen is invalid", "fix PER_DEVICE_BATCH_SIZE or --per-device-batch-size"],
        {"PER_DEVICE_BATCH_SIZE": "sixteen"},
    ),
    case(
        "batch-size-negative-flag",
        "settings",
        ["--per-device-batch-size=-4 is invalid", "fix PER_DEVICE_BATCH_SIZE"],
        argv=["--per-device-batch-size=-4"],
    ),
    case(
        "num-epochs-flag-not-a-number",
        "settings",
        ["--num-epochs=zero is invalid", "fix NUM_EPOCHS or --num-epochs"],
        argv=["--num-epochs", "zero"],
    ),
    case(
        "learning-rate-negative",
        "settings",
        ["LEARNING_RATE=-1 is invalid", "fix LEARNING_RATE"],
        {"LEARNING_RATE": "-1"},
    ),
    case(
        "quantization-unknown", "settings", ["QUANTIZATION=4bit", "'auto', '8bit' or 'none'"], {"QUANTIZATION": "4bit"}
    ),
    case("precision-unknown", "settings", ["PRECISION=fp8", "'auto', 'fp32', 'bf16' or 'fp16'"], {"PRECISION": "fp8"}),
    case(
        "hub-private-not-a-boolean",
        "settings",
        ["HUB_PRIVATE=maybe is invalid", "fix HUB_PRIVATE"],
        {"HUB_PRIVATE": "maybe"},
    ),
    case(
        "max-seq-length-absurd",
        "settings",
        ["MAX_SEQ_LENGTH=100000 is invalid", "fix MAX_SEQ_LENGTH"],
        {"MAX_SEQ_LENGTH": "100000"},
    ),
    case(
        "lora-targets-blank",
        "settings",
        ["LORA_TARGET_MODULES", "fix LORA_TARGET_MODULES"],
        {"LORA_TARGET_MODULES": " , "},
    ),
    case(
        "repo-id-malformed",
        "settings",
        ["RESULT_MODEL_ID=not a/repo id!", "your-name/model-name"],
        {"RESULT_MODEL_ID": "not a/repo id!"},
    ),
    case(
        "num-epochs-inf",
        "settings",
        "NUM_EPOCHS=inf is invalid: Input should be a finite number",
        {"NUM_EPOCHS": "inf"},
    ),
    case("num-epochs-absurd", "settings", ["NUM_EPOCHS=1e9", "less than or equal to 1000"], {"NUM_EPOCHS": "1e9"}),
    case(
        "max-steps-absurd",
        "settings",
        ["MAX_STEPS=1000000000", "less than or equal to 100000000"],
        {"MAX_STEPS": "1000000000"},
    ),
    case(
        "lora-r-absurd",
        "settings",
        "LORA_R=100000 is invalid: Input should be less than or equal to 4096",
        {"LORA_R": "100000"},
    ),
    case(
        "seed-above-32-bits", "settings", ["SEED=4294967296", "less than or equal to 4294967295"], {"SEED": str(2**32)}
    ),
    case(
        "run-name-with-path",
        "settings",
        ["RUN_NAME=../../x is invalid", "(no '/' or '..'); fix RUN_NAME"],
        {"RUN_NAME": "../../x"},
    ),
    case("run-name-too-long", "settings", ["RUN_NAME=rrr", "use 1-100 letters"], {"RUN_NAME": "r" * 101}),
    # settings: a task the job cannot train, or settings that disagree with TASK (tests/test_tasks.py trains the tasks)
    case(
        "task-unknown",
        "settings",
        ["TASK=ax is invalid", "the diagnostic set has a test split only", "leave TASK unset"],
        {"TASK": "ax"},
    ),
    case(
        "task-and-problem-type-disagree",
        "settings",
        ["TASK=mnli is classification and PROBLEM_TYPE=regression disagrees", "unset PROBLEM_TYPE"],
        {"TASK": "mnli", "PROBLEM_TYPE": "regression"},
    ),
    case(
        "three-text-columns",
        "settings",
        ["TEXT_COLUMN=a,b,c is invalid", "two separated by a comma"],
        {"TEXT_COLUMN": "a,b,c"},
    ),
    case("label-names-repeated", "settings", ["labels need two different names"], {"LABEL_NAMES": '["a","a"]'}),
    case(
        "label-names-too-many",
        "settings",
        ["name at most 10000 labels"],
        {"LABEL_NAMES": ",".join(f"c{i}" for i in range(10_001))},
    ),
    case("label-name-too-long", "settings", ["each at most 255 characters"], {"LABEL_NAMES": "a," + "b" * 256}),
    case("task-too-long", "settings", ["TASK=ttt", "at most 255 characters"], {"TASK": "t" * 256}),
    case(
        "text-column-is-label-column",
        "settings",
        ["both name the column 'label'", "must be two different columns: fix TEXT_COLUMN or LABEL_COLUMN"],
        {"TEXT_COLUMN": "label"},
    ),
    case(
        "scaled-learning-rate-out-of-bounds",
        "settings",
        [
            "LEARNING_RATE_SCALING=linear resolves the learning rate to 15.36 at global batch 983040",
            "set LEARNING_RATE to the rate to train at, or another rule",
        ],
        {
            "LEARNING_RATE": None,
            "LEARNING_RATE_SCALING": "linear",
            "PER_DEVICE_BATCH_SIZE": "65536",
            "GRADIENT_ACCUMULATION_STEPS": "15",
        },
    ),
    # settings: the command line
    case(
        "flag-empty",
        "settings",
        ["--result-model-id= is invalid", "fix RESULT_MODEL_ID"],
        argv=["--result-model-id", ""],
    ),
    case(
        "flag-abbreviated",
        "settings",
        ["unrecognized arguments: --learn 1e-3", "python main.py --help"],
        argv=["--learn", "1e-3"],
    ),
    case(
        "flag-abbreviated-unknown",
        "settings",
        ["unrecognized arguments: --hf-tok x", "python main.py --help"],
        argv=["--hf-tok", "x"],
    ),
    case(
        "positional-argument",
        "settings",
        ["unrecognized arguments: extra", "python main.py --help"],
        argv=["--num-epochs", "1", "extra"],
    ),
    case(
        "token-as-a-flag", "settings", ["unrecognized arguments", "python main.py --help"], argv=["--hf-token", "hf_x"]
    ),
    # settings: who this process is (the launcher's variables)
    case(
        "rank-not-a-number",
        "settings",
        ["RANK='x' is not an integer", "set it to a whole number"],
        {"RANK": "x", **LAUNCHER},
    ),
    case(
        "world-size-not-a-number",
        "settings",
        ["WORLD_SIZE='two' is not an integer", "set it to a whole number"],
        {"RANK": "0", "WORLD_SIZE": "two", "MASTER_ADDR": "h"},
    ),
    case(
        "rank-not-below-world-size",
        "settings",
        ["WORLD_SIZE=4 but RANK=4", "RANK must be 0..3"],
        {"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h"},
    ),
    case("rank-negative", "settings", ["WORLD_SIZE=2 but RANK=-1", "RANK must be 0..1"], {"RANK": "-1", **LAUNCHER}),
    case(
        "world-size-zero", "settings", ["world size is 0", "it must be at least 1"], {"RANK": "0", "WORLD_SIZE": "0"}
    ),
    case(
        "worker-without-master-addr",
        "settings",
        ["MASTER_ADDR is not set", "set MASTER_ADDR"],
        {"RANK": "1", "WORLD_SIZE": "2"},
    ),
    case(
        "rank-0-without-master-addr",
        "settings",
        ["MASTER_ADDR is not set", "set MASTER_ADDR"],
        {"RANK": "0", "WORLD_SIZE": "2"},
    ),
    case(
        "master-port-out-of-range",
        "settings",
        ["MASTER_PORT=99999 is not a TCP port", "use 1..65535"],
        {"RANK": "0", **LAUNCHER, "MASTER_PORT": "99999"},
    ),
    case(
        "torchrun-variables-disagree",
        "settings",
        [
            "PET_NPROC_PER_NODE=4 but the pod started main.py without torchrun",
            "start the container with `torchrun main.py`",
        ],
        {"RANK": "0", "WORLD_SIZE": "8", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "4", "MASTER_ADDR": "h"},
    ),
    case("world-size-without-rank", "settings", "WORLD_SIZE=4 is set but RANK is not; set RANK", {"WORLD_SIZE": "4"}),
    case("rank-without-world-size", "settings", "RANK=1 is set but WORLD_SIZE is not; set WORLD_SIZE", {"RANK": "1"}),
    case(
        "rank-0-without-world-size", "settings", "RANK=0 is set but WORLD_SIZE is not; set WORLD_SIZE", {"RANK": "0"}
    ),
    case(
        "node-rank-alone",
        "settings",
        ["NODE_RANK=3 is set but RANK and WORLD_SIZE are not", "set RANK and WORLD_SIZE as well"],
        {"NODE_RANK": "3"},
    ),
    case(
        "local-rank-alone",
        "settings",
        ["LOCAL_RANK=1 is set but RANK and WORLD_SIZE are not", "set RANK and WORLD_SIZE as well"],
        {"LOCAL_RANK": "1"},
    ),
    case(
        "master-addr-and-node-rank-alone",
        "settings",
        ["NODE_RANK=2, MASTER_ADDR=replica-0 are set", "set RANK and WORLD_SIZE as well"],
        {"MASTER_ADDR": "replica-0", "NODE_RANK": "2"},
    ),
    case(
        "master-addr-and-port-alone",
        "settings",
        ["MASTER_ADDR=replica-0, MASTER_PORT=29500 are set", "set RANK and WORLD_SIZE"],
        {"MASTER_ADDR": "replica-0", "MASTER_PORT": "29500"},
    ),
    case(
        "slurm-node-list-unreadable",
        "settings",
        ["SLURM_JOB_NODELIST='node[1-' is not a node list", "set MASTER_ADDR"],
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-"},
    ),
    # settings: the token and the push
    case(
        "token-file-missing",
        "settings",
        ["HF_TOKEN_PATH=/nonexistent/token cannot be read", "mount the token file"],
        {**NO_TOKEN, "HF_TOKEN_PATH": "/nonexistent/token"},
    ),
    case("push-without-token", "settings", ["ask(s) for a push but no token is set", "set HF_TOKEN"], NO_TOKEN),
    case("push-while-offline", "settings", ["HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE"], {"HF_HUB_OFFLINE": "1"}),
    # OUTPUT_DIR
    case(
        "output-dir-unwritable",
        "output",
        ["is not writable", "set OUTPUT_DIR to a writable folder"],
        setup=file_in_the_way,
    ),
    case(
        "output-dir-of-another-run",
        "output",
        ["holds a run with other training settings (lora_r: 4 -> 8)", "use a new OUTPUT_DIR"],
        setup=foreign_run,
    ),
    case("run-json-torn", "output", ["run.json is damaged (not valid JSON", "delete run.json"], setup=torn_run_record),
    case(
        "output-dir-of-another-tool",
        "output",
        [
            "is not empty and is not a run folder of this job (it holds checkpoints, model",
            "use an empty or new folder",
        ],
        setup=another_tools_folder,
    ),
    # the model folder and its config
    case(
        "model-without-tokenizer",
        "model",
        ["has no tokenizer files", "save the base model's tokenizer"],
        setup=model_copy(without_tokenizer),
    ),
    case(
        "max-seq-length-above-positions",
        "model",
        [
            "MAX_SEQ_LENGTH=128 but MODEL_NAME",
            "has position embeddings for 64 tokens",
            "set MAX_SEQ_LENGTH to 64 or less",
        ],
        {"MAX_SEQ_LENGTH": "128"},
        setup=model_copy(short_positions),
    ),
    case(
        "lora-r-above-hidden-size",
        "model",
        ["above the hidden size 64", "set LORA_R to 64 or less"],
        {"LORA_R": "128"},
    ),
    case(
        "lora-target-typo",
        "model",
        ["'vlaue' matches no module (closest: value)", "fix LORA_TARGET_MODULES"],
        {"LORA_TARGET_MODULES": "query,vlaue"},
    ),
    case(
        "lora-target-head-only",
        "model",
        ["'classifier' matches only modules that take no adapter", "fix LORA_TARGET_MODULES"],
        {"LORA_TARGET_MODULES": "query,classifier"},
    ),
    case(
        "lora-targets-not-in-model",
        "model",
        ["'q_proj' matches no module", "linear layers are named", "fix LORA_TARGET_MODULES"],
        {"LORA_TARGET_MODULES": "q_proj,v_proj"},
    ),
    case(
        "weights-truncated",
        "model",
        ["weights file model.safetensors is damaged or truncated", "copy the model's files there again"],
        setup=model_copy(truncated_weights),
    ),
    case(
        "weights-empty",
        "model",
        ["weights file model.safetensors is empty", "copy the model's files there again"],
        setup=model_copy(empty_weights),
    ),
    case(
        "weights-dangling-link",
        "model",
        ["is a link to /nonexistent/blobs/0123abcd, which does not exist", "copy the model's files there again"],
        setup=model_copy(dangling_weights),
    ),
    # the data: folders and splits
    case(
        "dataset-folder-missing",
        "data",
        ["is not a folder", "point it at a folder with train/validation files"],
        {"DATASET_PATH": "/nonexistent/sst2"},
    ),
    case("split-missing", "data", ["no 'validation' split", "add validation.csv"], setup=csv_data(GOOD_ROWS, None)),
    case(
        "split-empty-train",
        "data",
        ["has a header but no rows", "each split needs at least one row"],
        setup=csv_data([], GOOD_ROWS),
    ),
    case(
        "split-empty-validation",
        "data",
        ["validation.csv has a header but no rows", "each split needs at least one row"],
        setup=csv_data(GOOD_ROWS, []),
    ),
    case(
        "split-file-of-0-bytes",
        "data",
        ["train.jsonl is empty (0 bytes)", "each split needs at least one row"],
        setup=files_data(lambda f: write_files(f, {"train.jsonl": "", "validation.jsonl": JSONL_GOOD})),
    ),
    case(
        "split-file-is-a-folder",
        "data",
        ["train.csv is a folder", "write its rows to train.csv as a file, or move it out of DATASET_PATH"],
        setup=files_data(lambda f: (write_files(f, {"validation.csv": GOOD_CSV}) / "train.csv").mkdir() or f),
    ),
    case(
        "split-file-not-parquet",
        "data",
        ["cannot read", "train.parquet as parquet (ArrowInvalid", "write it again as parquet"],
        setup=files_data(lambda f: write_files(f, {"train.parquet": "sentence,label\n", "validation.parquet": "x"})),
    ),
    case(
        "splits-with-other-columns",
        "data",
        ["the train split has no column 'sentence' (columns: ['text', 'label'])", "set TEXT_COLUMN"],
        setup=files_data(lambda f: write_files(f, {"train.csv": "text,label\na,1\n", "validation.csv": GOOD_CSV})),
    ),
    case(
        "two-files-for-one-split",
        "data",
        ["has 2 files for the 'train' split (train.csv, train.jsonl)", "keep one and move the others out"],
        setup=files_data(
            lambda f: write_files(
                f,
                {
                    "train.csv": GOOD_CSV,
                    "train.jsonl": '{"sentence": "a film", "label": 1}\n',
                    "validation.csv": GOOD_CSV,
                },
            )
        ),
    ),
    case(
        "data-not-utf8",
        "data",
        ["train.csv is not valid UTF-8 (byte 0xe9 on line 3)", "save it as UTF-8"],
        setup=not_utf8,
    ),
    case(
        "saved-dataset-torn",
        "data",
        ["holds a damaged save_to_disk DatasetDict (JSONDecodeError", "write it again with DatasetDict.save_to_disk"],
        setup=torn_saved_dataset,
    ),
    # the data: columns
    case(
        "text-column-missing-in-data",
        "data",
        ["no column 'sentence'", "set TEXT_COLUMN"],
        setup=csv_data([("a", 1)], [("b", 0)], header=("text", "label")),
    ),
    case("text-column-setting-not-in-data", "data", ["no column 'text'", "set TEXT_COLUMN"], {"TEXT_COLUMN": "text"}),
    case(
        "text-column-numeric",
        "data",
        ["column 'sentence' holds int64 values, not text", "set TEXT_COLUMN"],
        setup=csv_data([(1, 1), (2, 0)], [(3, 1)]),
    ),
    case(
        "sentence-empty",
        "data",
        ["has 2 row(s) with an empty or missing 'sentence' (the first is row 9)", "fill in or remove those rows"],
        setup=csv_data([*GOOD_ROWS, ("", 1), ("   ", 0)]),
    ),
    case(
        "label-column-twice",
        "data",
        ["train.csv names the column 'label' 2 times in its header", "rename or remove the extra column"],
        setup=files_data(
            lambda f: write_files(f, {"train.csv": "sentence,label,label\na film,1,0\n", "validation.csv": GOOD_CSV})
        ),
    ),
    case(
        "text-column-twice",
        "data",
        ["train.tsv names the column 'sentence' 2 times in its header", "rename or remove the extra column"],
        setup=files_data(
            lambda f: write_files(
                f,
                {"train.tsv": "sentence\tsentence\tlabel\na\tb\t1\n", "validation.tsv": delimited(film_rows(4), "\t")},
            )
        ),
    ),
    case(
        "stray-quote-in-csv",
        "data",
        ["train.csv line 3: a quoted field runs over lines 3-6", 'double a quote inside a quoted field ("")'],
        setup=files_data(lambda f: write_files(f, {"train.csv": delimited(STRAY_QUOTE), "validation.csv": GOOD_CSV})),
    ),
    # the data: labels
    case(
        "labels-outside-0-1",
        "data",
        ["labels [2]", "labels must be ids 0 (negative), 1 (positive)", "name every class in LABEL_NAMES"],
        {"LABEL_NAMES": "negative,positive"},
        setup=csv_data([*GOOD_ROWS, ("so-so", 2)]),
    ),
    case(
        "labels-of-the-test-split",
        "data",
        ["labels [-1]", "cannot be used for training"],
        setup=csv_data(GOOD_ROWS, [("a", -1)]),
    ),
    case(
        "label-fractional",
        "data",
        ["labels [0.5]", "that are fractions, not class ids", "set PROBLEM_TYPE=regression"],
        {"PROBLEM_TYPE": "classification"},
        setup=csv_data([*GOOD_ROWS, ("so-so", 0.5)]),
    ),
    case(
        "label-missing",
        "data",
        ["1 row(s) without a label in 'label'", "give every row a label 0 or 1"],
        setup=csv_data([*GOOD_ROWS, ("a dull film", "")]),
    ),
    case(
        "labels-words-not-label-names",
        "data",
        [
            "text labels ['bad', 'good'] in 'label' that are not LABEL_NAMES ['negative', 'positive']",
            "add them to LABEL_NAMES",
        ],
        {"LABEL_NAMES": "negative,positive"},
        setup=csv_data([("a wonderful film", "good"), ("a dull film", "bad")]),
    ),
    case(
        "classlabel-names-not-label-names",
        "data",
        [
            "a ClassLabel named ['bad', 'good'], and LABEL_NAMES is ['negative', 'positive']",
            "set LABEL_NAMES=bad,good",
        ],
        {"LABEL_NAMES": "negative,positive"},
        setup=files_data(lambda f: saved_dataset(f, ["bad", "good"])),
    ),
    case(
        "jsonl-labels-of-three-types",
        "data",
        [
            "train.jsonl mixes label types in 'label': number (1), string (\"1\"), boolean (true)",
            "write every label the same way",
        ],
        setup=files_data(lambda f: write_files(f, {"train.jsonl": JSONL_MIX, "validation.jsonl": JSONL_MIX})),
    ),
    # the data: labels of other tasks
    case(
        "one-class-only",
        "data",
        [
            "the train split has one class only ('good' in 'label', of ['bad', 'good'])",
            "add rows of the other classes",
        ],
        {"LABEL_NAMES": "bad,good"},
        setup=csv_data([("a film", "good")] * 4, [("a film", "good"), ("a dull film", "bad")]),
    ),
    case(
        "label-neither-name-nor-id",
        "data",
        [
            "validation split has text labels ['meh'] in 'label' that are not LABEL_NAMES ['bad', 'good']",
            "add them to LABEL_NAMES",
        ],
        {"LABEL_NAMES": "bad,good"},
        setup=csv_data([("a", "good"), ("b", "bad")], [("a", "good"), ("b", "meh")]),
    ),
    case(
        "label-id-not-in-the-train-split",
        "data",
        ["the validation split has labels [2] in 'label'", "labels must be ids 0 (negative), 1 (positive)"],
        setup=csv_data(GOOD_ROWS, [("a", 0), ("b", 2)]),
    ),
    case(
        "second-text-column-missing",
        "data",
        [
            "has no column 'hypothesis'",
            "set TEXT_COLUMN to the right one (TEXT_COLUMN=first,second names a sentence pair)",
        ],
        {"TEXT_COLUMN": "sentence,hypothesis"},
        setup=csv_data(GOOD_ROWS),
    ),
    case(
        "float-label-with-task-mnli",
        "data",
        ["labels [0.5] in 'label' that are fractions", "TASK=mnli is a classification task"],
        {"TASK": "mnli"},
        setup=files_data(
            lambda f: write_files(
                f,
                {
                    f"{split}.csv": "premise,hypothesis,label\na film,it is good,0.5\na film,it is bad,2.0\n"
                    for split in ("train", "validation_matched", "validation_mismatched")
                },
            )
        ),
    ),
    case(
        "regression-target-nan",
        "data",
        ["1 regression target(s) in 'label' that are NaN", "fill in or remove those rows"],
        {"TASK": "stsb"},
        setup=files_data(lambda f: scores_with_nan(f)),
    ),
    # the data and the settings together
    case(
        "global-batch-above-train-split",
        "data",
        [
            "the global batch is 65536 rows (PER_DEVICE_BATCH_SIZE=65536 x 1 replica(s) x GRADIENT_ACCUMULATION_STEPS=1) but the training split has only 2000",
            "set PER_DEVICE_BATCH_SIZE to 2000 or less",
        ],
        {"PER_DEVICE_BATCH_SIZE": "65536"},
    ),
]


def first_refusal(monkeypatch, env: dict[str, str], argv: list[str]) -> tuple[str, JobError]:
    """The checks of a start in a process whose environment is `env`, in the order main.py and the run meet them,
    up to the first training step; the layer that refused and its error (the test fails if none does)."""
    layer = "settings"
    try:
        settings, dist, _, plan = configured(monkeypatch, env, argv)
        layer = "output"
        run_dir = open_run_dir(settings)
        layer = "model"
        tokenizer = load_tokenizer(settings)
        layer = "data"
        data = load_sst2(settings, tokenizer, run_dir.cache)
        with_rows(plan, settings, len(data["train"]))
        layer = "model"
        build_model(settings, False, torch.device("cpu"))
    except JobError as exc:
        return layer, exc
    pytest.fail("accepted: every check passed")


def files_under(folder: Path) -> dict[str, int]:
    return {str(path): path.stat().st_size for path in folder.rglob("*") if not path.is_symlink()}


@pytest.fixture
def push_env(tmp_path, tiny_bert, sst2_dir) -> dict[str, str]:
    """A job's environment (no launcher or HF variable of the shell): the tiny run, asking for a push."""
    return base_env(
        tmp_path,
        **tiny_run_settings(tiny_bert, sst2_dir, tmp_path / "out"),
        HF_HUB_OFFLINE="0",
        HF_TOKEN=FAKE_TOKEN,
        RESULT_MODEL_ID=REPO_ID,
        BASE_MODEL_ID=BASE_ID,
    )


@pytest.mark.check
@pytest.mark.parametrize("refusal", REFUSALS)
def test_refused_by_its_layer_with_the_fix(refusal: Refusal, push_env, monkeypatch, tmp_path):
    env = {**push_env, **(refusal.setup(tmp_path, push_env) if refusal.setup else {}), **refusal.env}
    env = {name: value for name, value in env.items() if value is not None}
    before, data = files_under(tmp_path), Path(env["DATASET_PATH"])
    given = files_under(data)
    layer, error = first_refusal(monkeypatch, env, list(refusal.argv))
    assert (layer, error.code) == (refusal.layer, EXIT_BAD_INPUT), error.message
    missing = [fragment for fragment in refusal.says if fragment not in error.message]
    assert not missing, f"{missing} not in: {error.message}"
    assert "\n" not in error.message and FAKE_TOKEN not in error.message
    assert "hf_x" not in error.message.replace("--hf-token hf_x", "")  # a token typed as a flag is not repeated
    if layer == "settings":
        assert files_under(tmp_path) == before  # refused before anything is written: RUN_NAME=../../x included
    assert files_under(data) == given  # nothing written into the user's data folder


# ------------------------------------------------------------------------------- through main.py
# One refused start per layer: the refusal reaches the console as one `error:` line, exit 2, before a step
# is trained or anything pushed, whichever part of the job raised it.
STARTS = [
    pytest.param(
        {},
        ["--bogus-flag", "2"],
        None,
        ["unrecognized arguments: --bogus-flag 2", "python main.py --help"],
        id="settings",
        marks=pytest.mark.check,
    ),
    pytest.param(
        {},
        [],
        foreign_run,
        ["holds a run with other training settings", "use a new OUTPUT_DIR"],
        id="output-dir",
        marks=pytest.mark.check,
    ),
    pytest.param(
        {"PRECISION": "fp16"},
        [],
        None,
        ["PRECISION=fp16 needs a CUDA GPU", "use PRECISION=auto or fp32"],
        id="numerics",
    ),
    pytest.param(
        {"LORA_TARGET_MODULES": "query,vlaue"},
        [],
        None,
        ["'vlaue' matches no module (closest: value)", "fix LORA_TARGET_MODULES"],
        id="model",
    ),
    pytest.param(
        {},
        [],
        files_data(lambda f: write_files(f, {"train.csv": delimited(STRAY_QUOTE), "validation.csv": GOOD_CSV})),
        ["train.csv line 3: a quoted field runs over lines 3-6", 'double a quote inside a quoted field ("")'],
        id="data",
    ),
    pytest.param(
        {"HF_TOKEN": "hf_not_the_right_one"},
        [],
        None,
        ["the Hub refused HF_TOKEN", "create a token with write access"],
        id="hub",
    ),
]


@pytest.mark.parametrize("extra, args, setup, says", STARTS)
def test_refused_start_gives_one_error_line_exit_2_and_pushes_nothing(
    extra, args, setup, says, job_env, hub, tmp_path, request
):
    before_torch = request.node.callspec.id in ("settings", "output-dir")
    env = {**job_env, **push_settings(hub)}
    env.update(setup(tmp_path, env) if setup else {})
    # Event files other tests of the session wrote are theirs: only new ones count.
    before = set(tmp_path.parent.glob("**/*tfevents*"))
    result = assert_refused_as_bad_input({**env, **extra}, args, says[0], hub)
    [error] = error_lines(result.stderr)
    assert all(fragment in error for fragment in says), error
    assert result.stdout == ""
    if before_torch:  # refused before logging is set up: the line is all the console shows (no usage text)
        assert result.stderr.splitlines() == [error]
    assert set(tmp_path.parent.glob("**/*tfevents*")) == before


# Root reads a mode-000 file through two capabilities; a job started without them meets the file's mode as the
# platform's uid-10000 jobs do. Dropped from the bounding set before exec, they are gone from the job's process.
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2
WITHOUT_FILE_CAPABILITIES = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for capability in ({CAP_DAC_OVERRIDE}, {CAP_DAC_READ_SEARCH}):
    if libc.prctl({PR_CAPBSET_DROP}, capability, 0, 0, 0) != 0:
        sys.exit(f"cannot drop capability {{capability}}: {{os.strerror(ctypes.get_errno())}}")
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def test_unreadable_weights_are_refused_naming_the_uid(tiny_bert, sst2_dir, tmp_path):
    """Mode-000 weights, through main.py: one error line naming the file, its mode and the job's uid."""
    shutil.copytree(tiny_bert, tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").chmod(0)
    env = base_env(tmp_path, **tiny_run_settings(tmp_path / "model", sst2_dir, tmp_path / "out"))
    command = [sys.executable, str(REPO / "main.py")]
    if os.geteuid() == 0:
        command = [sys.executable, "-c", WITHOUT_FILE_CAPABILITIES, *command[1:]]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    [error] = error_lines(result.stderr)
    assert f"the weights file model.safetensors is not readable by uid {os.getuid()} (mode ----------)" in error
    assert "make them readable" in error and "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "model").exists()

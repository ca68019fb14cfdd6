"""Bad input: every refusal before the first training step, with the fix in its message.

One table, run in this process through the job's own start-up up to the first training step (`start_in_process`),
so the checks come in the order a start meets them. Each case must be refused by the part of the start-up whose
list holds it, with exit code 2 and one `error:` line naming what is wrong and what fixes it; a case
docs/reliability.md's "Bad input" table shows names its row (`row=`), and the line must be that row's. Then one
refused start of the real `python main.py` per layer (exit 2, one `error:` line, nothing trained or pushed, the
token not shown), and mode-000 weights refused to a job that cannot read them.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.support.data import STRAY_QUOTE, delimited, film_rows, saved_dataset, write_files
from tests.support.docs import assert_documented
from tests.support.env import (
    BASE_ID,
    FAKE_TOKEN,
    REPO,
    REPO_ID,
    base_env,
    free_port,
    push_settings,
    tiny_run_env,
)
from tests.support.harness import start_in_process
from tests.support.hub_stub import HubStub
from tests.support.outcomes import assert_refusal, assert_refused_as_bad_input, error_lines
from tests.support.processes import run_command
from tests.support.weights import pickled_weights
from utils.common.errors import EXIT_BAD_INPUT
from utils.config.plan import build_plan
from utils.config.sources import load_settings
from utils.run_folder.record import RUN_RECORD_FORMAT

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


def data_files(files: dict[str, str]):
    """DATASET_PATH: a folder holding `files` (name: text)."""
    return files_data(lambda folder: write_files(folder, files))


def train_score(score: float):
    """DATASET_PATH: STS-B's columns in parquet (a csv's `nan` would be read as text), the train split's second
    score `score`."""

    def build(folder: Path) -> Path:
        import pyarrow
        import pyarrow.parquet

        folder.mkdir()
        for split, scores in (("train", [0.5, score, 2.0]), ("validation", [0.5, 1.5])):
            table = {"sentence1": ["a film"] * len(scores), "sentence2": ["it is good"] * len(scores), "label": scores}
            pyarrow.parquet.write_table(pyarrow.table(table), folder / f"{split}.parquet")
        return folder

    return files_data(build)


def class_label_pairs(folder: Path) -> Path:
    """STS-B's columns as a save_to_disk copy whose label is CoLA's ClassLabel: classes, not scores."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    label = ClassLabel(names=["unacceptable", "acceptable"])
    features = Features({"sentence1": Value("string"), "sentence2": Value("string"), "label": label})
    rows = {"sentence1": ["a film", "film a"] * 4, "sentence2": ["it is", "is it"] * 4, "label": [1, 0] * 4}
    DatasetDict({s: Dataset.from_dict(rows, features=features) for s in ("train", "validation")}).save_to_disk(folder)
    return folder


def not_utf8(tmp: Path, env: dict) -> dict:
    folder = write_files(tmp / "bad-data", {"validation.csv": GOOD_CSV})
    (folder / "train.csv").write_bytes(b"sentence,label\na wonderful film,1\na caf\xe9 film,0\n")  # Latin-1, not UTF-8
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


def dangling_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("/nonexistent/blobs/0123abcd")  # a Hub cache snapshot without its blob


def recorded_run(change: Callable[[dict], None], finished: bool = False, world: int = 1, **then: str):
    """OUTPUT_DIR holds the job's run.json of a run whose identity is this start's under the settings `then` on
    `world` replicas, as `change` edits it (the data or base it digested, the label names it trained with);
    `finished`: its model/ (its adapter naming bert-base-uncased as its base) and metrics.json beside it."""

    def setup(tmp: Path, env: dict) -> dict:
        settings = load_settings([], environ={**env, **then})[0]
        identity = json.loads(json.dumps(build_plan(settings, world).identity))
        change(identity)
        out = Path(env["OUTPUT_DIR"])
        out.mkdir(parents=True)
        (out / "run.json").write_text(json.dumps({"format": RUN_RECORD_FORMAT, "identity": identity}))
        if finished:
            adapter = {"base_model_name_or_path": "bert-base-uncased"}
            write_files(out / "model", {"adapter_config.json": json.dumps(adapter)})
            (out / "metrics.json").write_text("{}")
        return {}

    return setup


def foreign_run(tmp: Path, env: dict) -> dict:
    """OUTPUT_DIR holds the record of a run with LORA_R=4."""
    return recorded_run(lambda identity: identity.update(lora_r=4))(tmp, env)


def edited(field: str, name: str) -> Callable[[dict], None]:
    """The identity's digest of file `name` of `field` (data, base_model) other than the file's now: it was edited."""
    return lambda identity: identity[field].update({name: "0" * 64})


def run_folder_with(plant: Callable[[Path, Path], None]):
    """OUTPUT_DIR a run folder of the job (its marker) in which `plant(out, tmp)` put what the job did not."""

    def setup(tmp: Path, env: dict) -> dict:
        out = Path(env["OUTPUT_DIR"])
        write_files(out, {".run-folder": "A run folder of the LoRA fine-tuning job (main.py)\n"})
        plant(out, tmp)
        return {}

    return setup


def symlink_in_tensorboard(out: Path, tmp: Path) -> None:
    (out / "tensorboard" / "run").mkdir(parents=True)
    (out / "tensorboard" / "run" / "x").symlink_to(write_files(tmp / "cache" / "huggingface", {"token": "hf_..."}))


def hard_linked_metrics(out: Path, tmp: Path) -> None:
    os.link(write_files(tmp / "elsewhere", {"notes.json": "{}"}) / "notes.json", out / "metrics.json")


def ds_config(config: object):
    """DEEPSPEED_CONFIG: ds.json holding `config` (a JSON value, or text as written)."""

    def setup(tmp: Path, env: dict) -> dict:
        text = config if isinstance(config, str) else json.dumps(config)
        return {"DEEPSPEED_CONFIG": str(write_files(tmp / "ds", {"ds.json": text}) / "ds.json")}

    return setup


def token_fifo(tmp: Path, env: dict) -> dict:
    os.mkfifo(tmp / "token-pipe")  # no writer: a read would wait for one
    return {"HF_TOKEN_PATH": str(tmp / "token-pipe")}


LISTENING: list = []  # sockets holding a port for the rest of the session, as another process would


def port_taken(tmp: Path, env: dict) -> dict:
    """Rank 0 of two, its MASTER_PORT held by a listening socket."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    LISTENING.append(holder)
    return {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(holder.getsockname()[1])}


def custom_code(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom_bert.CustomConfig", "AutoModel": "custom_bert.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom_bert.py").write_text('raise SystemExit("the folder\'s code ran")\n')


def torn_run_record(tmp: Path, env: dict) -> dict:
    out = Path(env["OUTPUT_DIR"])
    out.mkdir(parents=True)
    (out / "run.json").write_text('{"identity": {"model_na')  # a write cut short
    return {}


def another_tools_folder(tmp: Path, env: dict) -> dict:
    """OUTPUT_DIR holds no run of the job: a checkpoint and a model/ another tool wrote."""
    out = Path(env["OUTPUT_DIR"])
    write_files(out / "checkpoints" / "checkpoint-500", {"optimizer.pt": "their state"})
    write_files(out / "model", {"model.safetensors": "their weights"})
    return {}


def recipe_with(text: str):
    """CONFIG_FILE: a recipe holding `text`."""
    return lambda tmp, env: {"CONFIG_FILE": str(write_files(tmp / "recipe", {"r.yaml": text}) / "r.yaml")}


def file_in_the_way(tmp: Path, env: dict) -> dict:
    (tmp / "a-file").write_text("not a folder")
    return {"OUTPUT_DIR": str(tmp / "a-file" / "out")}


# ------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Refusal:
    id: str
    # What the message must name, not how it words it: the setting (its variable or flag), the offending value,
    # the file or column, the bound or the setting that fixes it; {OUTPUT_DIR}, {MODEL_NAME}... stand for the run's.
    names: tuple[str, ...]
    env: dict  # over the tiny run's settings with a push asked for; None removes a variable
    argv: tuple[str, ...] = ()
    setup: Callable[[Path, dict], dict] | None = None  # (tmp, env) -> more environment
    # The row of docs/reliability.md's "Bad input" table that shows this refusal, by its case, and which of its
    # lines the message must be (`assert_documented`); `where`'s values name the run's paths as `names` do.
    row: str | None = None
    line: int = 0
    where: tuple[tuple[str, str], ...] = ()
    layer: str = ""  # settings, output, model, data...: the first check that must refuse it (the list it is in)


def case(id: str, names, env=None, argv=(), setup=None, row=None, line=0, where=None) -> Refusal:
    return Refusal(id, tuple(names), env or {}, tuple(argv), setup, row, line, tuple((where or {}).items()))


def setting(id: str, assignment: str, *names: str, env=None, **given) -> Refusal:
    """A case whose fault is the setting `NAME=value` it is given (over `env`), which the message names first."""
    name, value = assignment.split("=", 1)
    return case(id, [assignment, *names], {**(env or {}), name: value}, **given)


LAUNCHER = {"WORLD_SIZE": "2", "MASTER_ADDR": "h"}
NO_TOKEN = {"HF_TOKEN": None}
DEEPSPEED = {"STRATEGY": "deepspeed"}
IN_DS_JSON = {"DEEPSPEED_CONFIG=ds.json": "DEEPSPEED_CONFIG={DEEPSPEED_CONFIG}"}

# fmt: off
# A case a line or two, read as a table (the formatter would give each argument a line of its own).
SETTINGS = [
    # settings: values, each named as it was given (variable or flag) with the fix
    setting("batch-size-zero", "PER_DEVICE_BATCH_SIZE=0", "65536"),
    setting("batch-size-not-a-number", "PER_DEVICE_BATCH_SIZE=sixteen", "--per-device-batch-size"),
    case("batch-size-negative-flag", ["--per-device-batch-size=-4", "PER_DEVICE_BATCH_SIZE"],
         argv=["--per-device-batch-size=-4"]),
    case("num-epochs-flag-not-a-number", ["--num-epochs=zero", "NUM_EPOCHS", "1000"], argv=["--num-epochs", "zero"]),
    setting("learning-rate-negative", "LEARNING_RATE=-1", "--learning-rate"),
    setting("quantization-unknown", "QUANTIZATION=2bit", "'auto'", "'8bit'", "'4bit'", "'none'"),
    setting("precision-unknown", "PRECISION=fp8", "'auto'", "'fp32'", "'bf16'", "'fp16'"),
    setting("hub-private-not-a-boolean", "HUB_PRIVATE=maybe", "--hub-private"),
    setting("torch-compile-not-a-choice", "TORCH_COMPILE=maybe", "boolean", "'auto'", "--torch-compile"),
    setting("max-seq-length-absurd", "MAX_SEQ_LENGTH=100000", "512"),
    setting("lora-targets-blank", "LORA_TARGET_MODULES= , ", "query,value"),
    setting("repo-id-malformed", "RESULT_MODEL_ID=not a/repo id!", "your-name/model-name", row="malformed repo id"),
    setting("num-epochs-inf", "NUM_EPOCHS=inf", "1000", row="endless or absurd length"),
    setting("num-epochs-absurd", "NUM_EPOCHS=1e9", "1000", row="endless or absurd length", line=1),
    setting("max-steps-absurd", "MAX_STEPS=1000000000", "--max-steps", row="endless or absurd length", line=3),
    setting("lora-r-absurd", "LORA_R=100000", "4096"),
    case("seed-above-32-bits", ["SEED=4294967296", "4294967295"], {"SEED": str(2**32)}),
    setting("run-name-with-path", "RUN_NAME=../../x", "OUTPUT_DIR", "'/'", "'..'",
            row="run name with a path, or too long"),
    case("run-name-too-long", ["RUN_NAME=" + "r" * 101, "1-100"], {"RUN_NAME": "r" * 101}),
    # settings: a task the job cannot train, or settings that disagree with TASK (tests/test_tasks.py trains the tasks)
    setting("task-unknown", "TASK=ax", "cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli", "DATASET_PATH"),
    case("task-and-problem-type-disagree", ["TASK=mnli", "PROBLEM_TYPE=regression"],
         {"TASK": "mnli", "PROBLEM_TYPE": "regression"}),
    setting("three-text-columns", "TEXT_COLUMN=a,b,c", "premise,hypothesis"),
    case("label-names-repeated", ['LABEL_NAMES=["a","a"]', "'a'"], {"LABEL_NAMES": '["a","a"]'}),
    case("label-names-too-many", ["LABEL_NAMES=c0,c1,", "10000"],
         {"LABEL_NAMES": ",".join(f"c{i}" for i in range(10_001))}),
    case("label-name-too-long", ["LABEL_NAMES=a," + "b" * 100, "255"], {"LABEL_NAMES": "a," + "b" * 256}),
    case("task-too-long", ["TASK=" + "t" * 100, "255"], {"TASK": "t" * 256}),
    case("text-column-is-label-column", ["TEXT_COLUMN", "LABEL_COLUMN", "'label'"], {"TEXT_COLUMN": "label"}),
    case("scaled-learning-rate-out-of-bounds",
         ["LEARNING_RATE_SCALING=linear", "15.36", "983040", "GRADIENT_ACCUMULATION_STEPS=15",
          "LEARNING_RATE_SCALING=fourth-root", "0.0111326"],
         {"LEARNING_RATE": None, "LEARNING_RATE_SCALING": "linear", "PER_DEVICE_BATCH_SIZE": "65536",
          "GRADIENT_ACCUMULATION_STEPS": "15"}),
    # settings: the command line
    case("flag-empty", ["--result-model-id=", "RESULT_MODEL_ID", "your-name/model-name"],
         argv=["--result-model-id", ""]),
    case("flag-abbreviated", ["--learn 1e-3", "python main.py --help"], argv=["--learn", "1e-3"]),
    case("flag-abbreviated-unknown", ["--hf-tok x", "python main.py --help"], argv=["--hf-tok", "x"]),
    case("positional-argument", [": extra", "python main.py --help"], argv=["--num-epochs", "1", "extra"]),
    case("recipe-key-twice", ["CONFIG_FILE={CONFIG_FILE}", "lora_r twice", "lines 1 and 3"],
         setup=recipe_with("lora_r: 8\nseed: 1\nlora_r: 16\n"), row="a recipe key given twice",
         where={"CONFIG_FILE=r.yaml": "CONFIG_FILE={CONFIG_FILE}"}),
    case("token-as-a-flag", ["--hf-token", "python main.py --help"], argv=["--hf-token", "hf_x"]),
    # settings: who this process is (the launcher's variables)
    case("rank-not-a-number", ["RANK='x'"], {"RANK": "x", **LAUNCHER}),
    case("world-size-not-a-number", ["WORLD_SIZE='two'"], {"RANK": "0", "WORLD_SIZE": "two", "MASTER_ADDR": "h"}),
    case("rank-not-below-world-size", ["WORLD_SIZE=4", "RANK=4", "0..3"],
         {"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h"}),
    case("rank-negative", ["WORLD_SIZE=2", "RANK=-1", "0..1"], {"RANK": "-1", **LAUNCHER}),
    case("world-size-zero", ["0 (platform)"], {"RANK": "0", "WORLD_SIZE": "0"}),
    case("worker-without-master-addr", ["WORLD_SIZE=2", "MASTER_ADDR", "MASTER_PORT"],
         {"RANK": "1", "WORLD_SIZE": "2"}),
    case("rank-0-without-master-addr", ["WORLD_SIZE=2", "MASTER_ADDR", "MASTER_PORT"],
         {"RANK": "0", "WORLD_SIZE": "2"}, row="no rendezvous address"),
    setting("master-port-out-of-range", "MASTER_PORT=99999", "1..65535", env={"RANK": "0", **LAUNCHER}),
    case("torchrun-variables-disagree", ["PET_NPROC_PER_NODE=4", "torchrun main.py", "nprocPerNode: 1"],
         {"RANK": "0", "WORLD_SIZE": "8", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "4", "MASTER_ADDR": "h"}),
    setting("world-size-without-rank", "WORLD_SIZE=4", "RANK (0..WORLD_SIZE-1)", row="world size without rank"),
    setting("rank-without-world-size", "RANK=1", "WORLD_SIZE", row="rank without world size"),
    setting("rank-0-without-world-size", "RANK=0", "WORLD_SIZE"),
    setting("node-rank-alone", "NODE_RANK=3", "RANK and WORLD_SIZE", "torchrun"),
    setting("local-rank-alone", "LOCAL_RANK=1", "RANK and WORLD_SIZE", "torchrun"),
    case("master-addr-and-node-rank-alone", ["NODE_RANK=2", "MASTER_ADDR=replica-0", "RANK and WORLD_SIZE"],
         {"MASTER_ADDR": "replica-0", "NODE_RANK": "2"}, row="rendezvous or node variables alone"),
    case("master-addr-and-port-alone", ["MASTER_ADDR=replica-0", "MASTER_PORT=29500", "RANK and WORLD_SIZE"],
         {"MASTER_ADDR": "replica-0", "MASTER_PORT": "29500"}),
    case("slurm-node-list-unreadable", ["SLURM_JOB_NODELIST='node[1-'", "MASTER_ADDR"],
         {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-"}),
    # settings: the token and the push
    setting("token-file-missing", "HF_TOKEN_PATH=/nonexistent/token", "No such file or directory", env=NO_TOKEN),
    case("push-without-token", ["RESULT_MODEL_ID=tester/sst2-lora", "HF_TOKEN", "HF_TOKEN_PATH"], NO_TOKEN,
         row="push without a token"),
    case("push-while-offline", ["RESULT_MODEL_ID=tester/sst2-lora", "HF_HUB_OFFLINE", "--push-only"],
         {"HF_HUB_OFFLINE": "1"}, row="push while offline"),
    # cases the tables of docs/reliability.md show (row=): the settings and the command line
    case("flag-unknown", ["--bogus-flag 2"], argv=["--bogus-flag", "2"], row="unknown flag"),
    case("local-rank-flag-not-the-launchers", ["--local_rank=0"], {"LOCAL_RANK": "1"}, argv=["--local_rank=0"],
         row="a `--local_rank` the launcher did not add"),
    setting("rendezvous-timeout-absurd", "RENDEZVOUS_TIMEOUT=100000000000", "86400", row="any setting past its range"),
    case("recipe-key-not-a-setting", ["lora_rank", "lora_r"], setup=recipe_with("lora_rank: 8\n"),
         row="a bad recipe file", where={"CONFIG_FILE=r.yaml": "CONFIG_FILE={CONFIG_FILE}"}),
    case("recipe-with-a-secret", ["hf_token", "HF_TOKEN_PATH"], setup=recipe_with("hf_token: hf_in_a_recipe\n"),
         row="a bad recipe file", line=1),
    setting("recipe-missing", "CONFIG_FILE=/nonexistent/r.yaml", row="a bad recipe file", line=2),
    case("recipe-not-yaml", ["line 2"], setup=recipe_with("lora_r: 8\n  seed: 1\n"), row="a bad recipe file", line=3),
    case("recipe-value-out-of-range", ["lora_r: 100000"], setup=recipe_with("lora_r: 100000\n"),
         row="a bad recipe file", line=4,
         where={"CONFIG_FILE=r.yaml": "CONFIG_FILE={CONFIG_FILE}", "in r.yaml": "in {CONFIG_FILE}"}),
    # settings: the token
    case("token-path-a-fifo", ["HF_TOKEN_PATH={HF_TOKEN_PATH}", "FIFO"], NO_TOKEN, setup=token_fifo,
         row="token path that is no file", where={"/run/token-pipe": "{HF_TOKEN_PATH}"}),
    case("token-with-a-newline", ["HF_TOKEN", "newline"], {"HF_TOKEN": "hf_abcdefgh\nX: y"},
         row="token with a newline or control character"),
    case("setting-holding-the-token", ["RUN_NAME", "HF_TOKEN"], {"RUN_NAME": FAKE_TOKEN},
         row="a setting holding the token"),
    # settings: the strategy and DeepSpeed
    setting("torch-compile-under-deepspeed", "TORCH_COMPILE=true", env=DEEPSPEED,
            row="the fast path under DeepSpeed or FSDP"),
    case("deepspeed-config-under-ddp", ["DEEPSPEED_CONFIG={DEEPSPEED_CONFIG}"], {"STRATEGY": "ddp"},
         setup=ds_config({"zero_optimization": {"stage": 2}}), row="a DeepSpeed config without DeepSpeed",
         where=IN_DS_JSON),
    setting("deepspeed-under-accelerate-fsdp", "ACCELERATE_USE_FSDP=true", env=DEEPSPEED,
            row="DeepSpeed and FSDP at once"),
    setting("accelerate-stage-against-zero-stage", "ZERO_STAGE=2",
            env={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
            row="an accelerate DeepSpeed config against the settings"),
    case("deepspeed-config-not-json", ["DEEPSPEED_CONFIG={DEEPSPEED_CONFIG}"], DEEPSPEED,
         setup=ds_config("{stage: 2"), row="unreadable or non-JSON DeepSpeed config"),
    setting("deepspeed-config-missing", "DEEPSPEED_CONFIG=/nowhere.json", env=DEEPSPEED,
            row="unreadable or non-JSON DeepSpeed config", line=1),
    case("deepspeed-config-pins-the-micro-batch", ["train_micro_batch_size_per_gpu: 32"],
         {**DEEPSPEED, "PER_DEVICE_BATCH_SIZE": "16"},
         setup=ds_config({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 32}),
         row="a DeepSpeed config pinning what the settings own", where=IN_DS_JSON),
    case("deepspeed-config-pins-the-warmup", ["scheduler.params.warmup_num_steps: 100"], DEEPSPEED,
         setup=ds_config({"zero_optimization": {"stage": 2},
                          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}),
         row="a DeepSpeed config pinning what transformers fills in later", where=IN_DS_JSON),
    setting("zero-stage-against-the-deepspeed-config", "ZERO_STAGE=3", env=DEEPSPEED,
            setup=ds_config({"zero_optimization": {"stage": 2}}),
            row="a DeepSpeed setting beside a config that says otherwise", where=IN_DS_JSON),
    case("deepspeed-config-offloads-weights-at-stage-2", ["offload_param"], DEEPSPEED,
         setup=ds_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}),
         row="a DeepSpeed config that cannot apply", where=IN_DS_JSON),
]

OUTPUT = [
    # OUTPUT_DIR
    case("output-dir-unwritable", ["OUTPUT_DIR={OUTPUT_DIR}", "Not a directory", f"uid {os.getuid()}"],
         setup=file_in_the_way, row="unwritable output dir",
         where={"/pvc-home/output": "{OUTPUT_DIR}", "Read-only file system": "Not a directory",
                "uid 10000": f"uid {os.getuid()}"}),
    case("output-dir-of-another-run", ["OUTPUT_DIR={OUTPUT_DIR}", "LORA_R: 4 -> 8"], setup=foreign_run,
         row="output dir of another run"),
    case("run-json-torn", ["{OUTPUT_DIR}/run.json", "OUTPUT_DIR"], setup=torn_run_record, row="torn run record"),
    case("output-dir-of-another-tool", ["OUTPUT_DIR={OUTPUT_DIR}", "checkpoints, model", ".run-folder", "run.json"],
         setup=another_tools_folder, row="output dir that is no run of the job"),
    # OUTPUT_DIR: a run recorded there, links planted in it
    case("label-names-against-the-run", ["LABEL_NAMES"], {"LABEL_NAMES": "positive,negative"},
         setup=recorded_run(lambda identity: None, LABEL_NAMES="negative,positive"),
         row="label names against a finished run"),
    setting("base-against-the-finished-run", "BASE_MODEL_ID=org/other",
            setup=recorded_run(lambda identity: None, finished=True), row="base against a finished run"),
    case("data-edited-since-the-run", ["train.csv"], setup=recorded_run(edited("data", "train.csv")),
         row="data changed since a finished run"),
    case("base-weights-edited-since-the-run", ["model.safetensors"],
         setup=recorded_run(edited("base_model", "model.safetensors")), row="base model replaced since a run"),
    case("replica-count-of-another-run", ["replica count: 2 -> 1", "restart with 2 replica(s)"],
         setup=recorded_run(lambda identity: None, world=2), row="resume of another run shape"),
    case("symbolic-link-in-the-run-folder", ["tensorboard/run/x"], {"RUN_NAME": "run"},
         setup=run_folder_with(symlink_in_tensorboard), row="a link planted in the run folder",
         where={"<run>": "run"}),
    case("hard-link-in-the-run-folder", ["metrics.json"], setup=run_folder_with(hard_linked_metrics),
         row="a hard link planted in the run folder"),
]

MODEL = [
    # the model folder and its config
    case("model-without-tokenizer", ["MODEL_NAME={MODEL_NAME}", "tokenizer.json", "vocab.txt"],
         setup=model_copy(without_tokenizer), row="model folder without a tokenizer"),
    setting("max-seq-length-above-positions", "MAX_SEQ_LENGTH=128", "MODEL_NAME={MODEL_NAME}",
            "max_position_embeddings", "64", setup=model_copy(short_positions),
            row="sequences longer than the model's positions"),
    setting("lora-r-above-hidden-size", "LORA_R=128", "64", "MODEL_NAME={MODEL_NAME}",
            row="LoRA rank above the hidden size",
            where={"1024": "128", "768": "64", "bert-base-uncased": "{MODEL_NAME}"}),
    setting("lora-target-typo", "LORA_TARGET_MODULES=query,vlaue", "'vlaue'", "(closest: value)",
            "MODEL_NAME={MODEL_NAME}", row="LoRA targets not in the model",
            where={"bert-base-uncased": "{MODEL_NAME}"}),
    setting("lora-target-head-only", "LORA_TARGET_MODULES=query,classifier", "'classifier'", "query,value",
            row="a LoRA target that is the head"),
    setting("lora-targets-not-in-model", "LORA_TARGET_MODULES=q_proj,v_proj", "'q_proj'", "'v_proj'",
            "classifier, dense, key, query, value"),
    case("weights-truncated", ["MODEL_NAME={MODEL_NAME}", "model.safetensors", "incomplete metadata"],
         setup=model_copy(truncated_weights), row="damaged weights file"),
    case("weights-empty", ["MODEL_NAME={MODEL_NAME}", "model.safetensors is empty"],
         setup=model_copy(lambda f: (f / "model.safetensors").write_bytes(b"")), row="damaged weights file", line=1),
    case("weights-dangling-link", ["MODEL_NAME={MODEL_NAME}", "model.safetensors", "/nonexistent/blobs/0123abcd"],
         setup=model_copy(dangling_weights), row="damaged weights file", line=2),
    setting("lora-target-not-linear", "LORA_TARGET_MODULES=LayerNorm", row="a LoRA target LoRA cannot adapt"),
    case("model-with-custom-code", ["MODEL_NAME={MODEL_NAME}", "auto_map"], setup=model_copy(custom_code),
         row="model folder with custom code", where={"/models/custom": "{MODEL_NAME}"}),
    case("pickled-weights-that-run-code", ["pytorch_model.bin"],
         setup=model_copy(lambda f: pickled_weights(f, "malicious", f / "payload-ran")),
         row="pickled weights that would run code"),
    case("pickled-weights-damaged", ["pytorch_model.bin"],
         setup=model_copy(lambda f: pickled_weights(f, "truncated", f / "payload-ran")),
         row="damaged pickled weights"),
]

DATA = [
    # the data: folders and splits
    setting("dataset-folder-missing", "DATASET_PATH=/nonexistent/sst2"),
    case("split-missing", ["DATASET_PATH={DATASET_PATH}", "'validation'", "train.csv", "validation.csv"],
         setup=csv_data(GOOD_ROWS, None), row="missing split"),
    case("split-empty-train", ["{DATASET_PATH}/train.csv"], setup=csv_data([], GOOD_ROWS), row="empty data set"),
    case("split-empty-validation", ["{DATASET_PATH}/validation.csv"], setup=csv_data(GOOD_ROWS, [])),
    case("split-file-of-0-bytes", ["{DATASET_PATH}/train.jsonl", "0 bytes"],
         setup=data_files({"train.jsonl": "", "validation.jsonl": JSONL_GOOD}),
         row="empty data file"),
    case("split-file-is-a-folder", ["{DATASET_PATH}/train.csv", "'train'", "DATASET_PATH"],
         setup=files_data(lambda f: (write_files(f, {"validation.csv": GOOD_CSV}) / "train.csv").mkdir() or f),
         row="a split's name on a folder"),
    case("split-file-not-parquet", ["{DATASET_PATH}/train.parquet", "ArrowInvalid"],
         setup=data_files({"train.parquet": "sentence,label\n", "validation.parquet": "x"}),
         row="a file not in its format"),
    case("splits-with-other-columns", ["'sentence'", "['text', 'label']", "TEXT_COLUMN"],
         setup=data_files({"train.csv": "text,label\na,1\n", "validation.csv": GOOD_CSV})),
    case("two-files-for-one-split", ["DATASET_PATH={DATASET_PATH}", "'train'", "train.csv, train.jsonl"],
         setup=data_files({"train.csv": GOOD_CSV, "train.jsonl": '{"sentence": "a film", "label": 1}\n',
                           "validation.csv": GOOD_CSV}),
         row="two files for one split"),
    case("data-not-utf8", ["{DATASET_PATH}/train.csv", "0xe9", "line 3", "iconv"], setup=not_utf8,
         row="data file not UTF-8"),
    case("saved-dataset-torn", ["DATASET_PATH={DATASET_PATH}", "JSONDecodeError", "DatasetDict.save_to_disk"],
         setup=data_files({"dataset_dict.json": '{"splits": ["tra'}),  # a save_to_disk copy cut short
         row="damaged saved data set"),
    # the data: columns
    case("text-column-missing-in-data", ["'sentence'", "['text', 'label']", "TEXT_COLUMN"],
         setup=csv_data([("a", 1)], [("b", 0)], header=("text", "label"))),
    case("text-column-setting-not-in-data", ["'text'", "['sentence', 'label', 'idx']", "TEXT_COLUMN"],
         {"TEXT_COLUMN": "text"}, row="missing column"),
    case("text-column-numeric", ["'sentence'", "int64", "TEXT_COLUMN"], setup=csv_data([(1, 1), (2, 0)], [(3, 1)]),
         row="text column that is not text"),
    case("sentence-empty", ["2 row(s)", "'sentence'", "row 9"], setup=csv_data([*GOOD_ROWS, ("", 1), ("   ", 0)]),
         row="empty or missing sentence"),
    case("label-column-twice", ["{DATASET_PATH}/train.csv", "['sentence', 'label', 'label']"],
         setup=data_files({"train.csv": "sentence,label,label\na film,1,0\n", "validation.csv": GOOD_CSV}),
         row="a column named twice"),
    case("text-column-twice", ["{DATASET_PATH}/train.tsv", "['sentence', 'sentence', 'label']"],
         setup=data_files({"train.tsv": "sentence\tsentence\tlabel\na\tb\t1\n",
                           "validation.tsv": delimited(film_rows(4), "\t")})),
    case("stray-quote-in-csv", ["{DATASET_PATH}/train.csv", "line 3", "lines 3-6", ".tsv"],
         setup=data_files({"train.csv": delimited(STRAY_QUOTE), "validation.csv": GOOD_CSV}),
         row="a quote that merges rows"),
    # the data: labels
    case("labels-outside-0-1", ["train", "'label'", "[2]", "0 (negative), 1 (positive)", "LABEL_NAMES"],
         {"LABEL_NAMES": "negative,positive"}, setup=csv_data([*GOOD_ROWS, ("so-so", 2)]),
         row="a label id out of range"),
    case("labels-of-the-test-split", ["validation", "'label'", "[-1]"], setup=csv_data(GOOD_ROWS, [("a", -1)]),
         row="a label id out of range", line=1),
    case("label-fractional", ["[0.5]", "'label'", "PROBLEM_TYPE=regression"], {"PROBLEM_TYPE": "classification"},
         setup=csv_data([*GOOD_ROWS, ("so-so", 0.5)]), row="fractional label under classification"),
    case("label-fraction-with-label-names",
         ["[0.5]", "'label'", "row 9", "LABEL_NAMES=negative,positive", "PROBLEM_TYPE=regression"],
         {"LABEL_NAMES": "negative,positive"}, setup=csv_data([*GOOD_ROWS, ("so-so", 0.5)]),
         row="fractional label under classification", line=1),
    case("label-names-with-regression",
         ["LABEL_NAMES=negative,positive", "PROBLEM_TYPE=regression", "unset LABEL_NAMES"],
         {"LABEL_NAMES": "negative,positive", "PROBLEM_TYPE": "regression"}),
    case("label-nan-among-ids", ["train", "'label'", "'nan'", "row 9", "LABEL_NAMES"],
         setup=csv_data([*GOOD_ROWS, ("so-so", "nan")]), row="a word among ids"),
    case("label-names-in-train-ids-in-validation",
         ["'label'", "names in the train split", "ids in the validation split", "LABEL_NAMES"],
         setup=csv_data([("a wonderful film", "positive"), ("a dull film", "negative")] * 4),
         row="names in one split, ids in another"),
    case("class-labels-with-task-stsb",
         ["'label'", "ClassLabel", "['unacceptable', 'acceptable']", "TASK=stsb", "PROBLEM_TYPE=regression"],
         {"TASK": "stsb"}, setup=files_data(class_label_pairs), row="class labels under a regression `TASK`"),
    case("label-missing", ["1 row(s)", "'label'"], setup=csv_data([*GOOD_ROWS, ("a dull film", "")]),
         row="missing label"),
    case("labels-words-not-label-names", ["['bad', 'good']", "LABEL_NAMES ['negative', 'positive']"],
         {"LABEL_NAMES": "negative,positive"},
         setup=csv_data([("a wonderful film", "good"), ("a dull film", "bad")]),
         row="labels as words that are not `LABEL_NAMES`"),
    case("classlabel-names-not-label-names",
         ["ClassLabel", "['bad', 'good']", "['negative', 'positive']", "LABEL_NAMES=bad,good"],
         {"LABEL_NAMES": "negative,positive"}, setup=files_data(lambda f: saved_dataset(f, ["bad", "good"])),
         row="label names that are not `LABEL_NAMES`"),
    case("jsonl-labels-of-three-types",
         ["{DATASET_PATH}/train.jsonl", "'label'", "number (1)", 'string ("1")', "boolean (true)"],
         setup=data_files({"train.jsonl": JSONL_MIX, "validation.jsonl": JSONL_MIX}),
         row="labels of mixed JSON types"),
    # the data: labels of other tasks
    case("one-class-only", ["'good'", "'label'", "['bad', 'good']", "LABEL_COLUMN"], {"LABEL_NAMES": "bad,good"},
         setup=csv_data([("a film", "good")] * 4, [("a film", "good"), ("a dull film", "bad")]),
         row="one class only"),
    case("label-neither-name-nor-id", ["validation", "['meh']", "LABEL_NAMES ['bad', 'good']"],
         {"LABEL_NAMES": "bad,good"}, setup=csv_data([("a", "good"), ("b", "bad")], [("a", "good"), ("b", "meh")])),
    case("label-id-not-in-the-train-split", ["validation", "[2]", "0 (negative), 1 (positive)"],
         setup=csv_data(GOOD_ROWS, [("a", 0), ("b", 2)])),
    case("second-text-column-missing", ["'hypothesis'", "['sentence', 'label']", "TEXT_COLUMN"],
         {"TEXT_COLUMN": "sentence,hypothesis"}, setup=csv_data(GOOD_ROWS),
         row="a second text column that does not exist", where={"hypotesis": "hypothesis"}),
    case("float-label-with-task-mnli", ["[0.5]", "TASK=mnli", "DATASET_PATH"], {"TASK": "mnli"},
         setup=data_files({f"{split}.csv": "premise,hypothesis,label\na film,it is good,0.5\na film,it is bad,2.0\n"
                           for split in ("train", "validation_matched", "validation_mismatched")}),
         row="fractional label under classification", line=2),
    case("regression-target-nan", ["1 regression target(s)", "'label'", "NaN", "row 2"], {"TASK": "stsb"},
         setup=train_score(float("nan"))),
    case(
        "regression-target-beyond-float32",
        ["1 regression target(s)", "'label'", "float32", "row 2", "1e+39"],
        {"TASK": "stsb"},
        setup=train_score(1e39),  # finite in float64, infinite in float32, training's dtype
        row="a regression target that is NaN, or beyond float32",
    ),
    # the data and the settings together
    setting("global-batch-above-train-split", "PER_DEVICE_BATCH_SIZE=2001", "GRADIENT_ACCUMULATION_STEPS=1",
            "2001 rows", "2000", row="a global batch larger than the training split"),
]

JOIN = [
    case("token-refused", ["HF_TOKEN", "HTTP 401"], {"HF_TOKEN": "hf_not_the_right_one"}, row="token refused"),
    case(
        "tracker-not-listening",
        ["MLFLOW_TRACKING_URI=", "ConnectionRefusedError"],
        {"REPORT_TO": "mlflow"},
        setup=lambda tmp, env: {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"},  # nothing listens
        row="tracker that refuses its URI",
        where={"http://alice:***@mlflow:5000": "{MLFLOW_TRACKING_URI}"},  # the masking: tests/test_secrets_and_code.py
    ),
    # the rendezvous
    case("master-port-taken", ["MASTER_PORT={MASTER_PORT}", "Address already in use"], setup=port_taken,
         row="rendezvous port taken on rank 0's host", where={"29500": "{MASTER_PORT}", "10.0.0.5": "127.0.0.1"}),
]

DEVICE = [
    # the device
    setting("fp16-on-the-cpu", "PRECISION=fp16", row="fp16 without a GPU"),
]
# fmt: on
LAYERS = {"settings": SETTINGS, "output": OUTPUT, "model": MODEL, "data": DATA, "join": JOIN, "device": DEVICE}


def files_under(folder: Path) -> dict[str, int]:
    return {str(path): path.stat().st_size for path in folder.rglob("*") if not path.is_symlink()}


@pytest.fixture(scope="module")
def token_hub():
    """The Hub stand-in, taking the token the table's job is given: one for the table (stopping one takes 0.5 s)."""
    stub = HubStub(token=FAKE_TOKEN)
    stub.url = stub.start()
    yield stub
    stub.stop()


@pytest.fixture
def push_env(tmp_path, tiny_bert, sst2_dir, token_hub, monkeypatch) -> dict[str, str]:
    """A job's environment (no launcher or HF variable of the shell): the tiny run, asking for a push to the Hub
    stand-in, which takes its token: a case refused for bad input is never refused by the Hub check instead."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", token_hub.url)  # read from HF_ENDPOINT when huggingface_hub is imported
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    push = dict(HF_HUB_OFFLINE="0", HF_TOKEN=FAKE_TOKEN, RESULT_MODEL_ID=REPO_ID, BASE_MODEL_ID=BASE_ID)
    return tiny_run_env(tmp_path, tiny_bert, sst2_dir, **push)


@pytest.mark.check
@pytest.mark.parametrize(
    "refusal", [pytest.param(replace(r, layer=k), id=r.id) for k, rs in LAYERS.items() for r in rs]
)
def test_refused_by_its_layer_with_the_fix(refusal: Refusal, push_env, monkeypatch, tmp_path):
    env = {**push_env, **(refusal.setup(tmp_path, push_env) if refusal.setup else {}), **refusal.env}
    env = {name: value for name, value in env.items() if value is not None}
    before, data = files_under(tmp_path), Path(env["DATASET_PATH"])
    given = files_under(data)
    start = start_in_process(monkeypatch, env, refusal.argv)
    assert start.code is not None, "accepted: the start-up reached the first training step"
    assert (start.layer, start.code) == (refusal.layer, EXIT_BAD_INPUT), start.stderr[-3000:]
    message = start.error
    assert message is not None and len(error_lines(start.stderr)) == 1, start.stderr[-3000:]
    missing = [name for name in (name.format_map(env) for name in refusal.names) if name not in message]
    assert not missing, f"{missing} not named in: {message}"
    if refusal.row is not None:
        where = [(words, here.format_map(env)) for words, here in refusal.where]
        assert_documented(refusal.row, message, refusal.line, where)
    assert FAKE_TOKEN not in start.stderr and "Traceback" not in start.stderr
    assert "hf_x" not in message.replace("--hf-token hf_x", "")  # a token typed as a flag is not repeated
    if start.layer == "settings":
        assert files_under(tmp_path) == before  # refused before anything is written: RUN_NAME=../../x included
    assert files_under(data) == given  # nothing written into the user's data folder


@pytest.mark.check
def test_the_tables_run_without_a_fault_reaches_the_first_training_step(push_env, monkeypatch, token_hub):
    """The table's starting point is accepted by every check of the start-up, the Hub's included: each case is
    refused for the fault it adds."""
    start = start_in_process(monkeypatch, push_env)
    assert (start.code, start.error) == (None, None), start.stderr[-3000:]
    assert (start.ready.train_rows, start.ready.checkpoint) == (2000, None)
    assert ("GET", "/api/whoami-v2") in token_hub.requests


@pytest.mark.check
def test_a_check_test_cannot_start_the_job(tmp_path):
    """The table stays in `make check`'s one process: a test marked `check` that starts main.py (or any Python)
    fails there, in tests/support/processes.py, before the process starts."""
    with pytest.raises(pytest.fail.Exception, match="a test marked `check` started .*python"):
        run_command([sys.executable, str(REPO / "main.py"), "--dry-run"], env=base_env(tmp_path))


# ------------------------------------------------------------------------------- through main.py
# One refused start per layer: the refusal reaches the console as one `error:` line, exit 2, before a step
# is trained or anything pushed, whichever part of the job raised it.
# fmt: off
STARTS = [  # (settings, arguments, setup, what the line names)
    pytest.param({}, ["--bogus-flag", "2"], None, ["--bogus-flag 2", "python main.py --help"], id="settings"),
    pytest.param({}, [], foreign_run, ["OUTPUT_DIR=", "LORA_R: 4 -> 8"], id="output-dir"),
    pytest.param({"PRECISION": "fp16"}, [], None, ["PRECISION=fp16", "CUDA", "PRECISION=auto"], id="numerics"),
    pytest.param({"LORA_TARGET_MODULES": "query,vlaue"}, [], None,
                 ["LORA_TARGET_MODULES=query,vlaue", "'vlaue'", "(closest: value)"], id="model"),
    pytest.param({}, [], data_files({"train.csv": delimited(STRAY_QUOTE), "validation.csv": GOOD_CSV}),
                 ["train.csv line 3", "lines 3-6", ".tsv"], id="data"),
    pytest.param({"HF_TOKEN": "hf_not_the_right_one"}, [], None,
                 ["HF_TOKEN", "HTTP 401", "https://huggingface.co/settings/tokens"], id="hub"),
]
# fmt: on


@pytest.mark.parametrize("extra, args, setup, names", STARTS)
def test_refused_start_gives_one_error_line_exit_2_and_pushes_nothing(
    extra, args, setup, names, job_env, hub, tmp_path, request
):
    before_torch = request.node.callspec.id in ("settings", "output-dir")
    env = {**job_env, **push_settings(hub)}
    env.update(setup(tmp_path, env) if setup else {})
    # Event files other tests of the session wrote are theirs: only new ones count.
    before = set(tmp_path.parent.glob("**/*tfevents*"))
    result = assert_refused_as_bad_input({**env, **extra}, args, names, hub)
    [error] = error_lines(result.stderr)
    assert result.stdout == ""
    if before_torch:  # refused before logging is set up: the line is all the console shows (no usage text)
        assert result.stderr.splitlines() == [error]
    assert set(tmp_path.parent.glob("**/*tfevents*")) == before
    # Refused once the rank log exists (after the rendezvous and the folder's lock): the volume keeps the line too.
    # Before that the folder may be another job's: nothing is written into it.
    rank_log = Path(env["OUTPUT_DIR"]) / "logs" / "rank-0.log"
    if request.node.callspec.id in ("model", "data"):
        assert f"ERROR utils.run: {error} (exit 2)" in rank_log.read_text()
    else:
        assert not rank_log.exists()
        # A folder the refused start made, and left as it made it, is gone: no claimed empty folder behind.
        assert setup is not None or not Path(env["OUTPUT_DIR"]).exists()


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
    env = tiny_run_env(tmp_path, tmp_path / "model", sst2_dir)
    command = [sys.executable, str(REPO / "main.py")]
    if os.geteuid() == 0:
        command = [sys.executable, "-c", WITHOUT_FILE_CAPABILITIES, *command[1:]]
    result = run_command(command, env=env, cwd=REPO, timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert_refusal(
        result.stderr, [f"MODEL_NAME={tmp_path / 'model'}", "model.safetensors", f"uid {os.getuid()}", "----------"]
    )
    assert not (tmp_path / "out" / "model").exists()

"""Every setting of the job in one typed model: default, range and `--help` text per field, and the rules across
fields. Where the values come from is sources.py; checks beyond the settings (a push's token, a tracker) preflight.py.

The Hub token is no setting: it comes only from `HF_TOKEN` or `HF_TOKEN_PATH`'s file, never a flag (flags end up in
`ps`, shell history and job specs). Imports pydantic only: `--help` and `--dry-run` answer before torch loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator, Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSuppress, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from utils.config.tasks import GLUE, GLUE_DATASETS, GLUE_UNTRAINABLE, validation_splits

SHARED_VOLUME = "/pvc-home"  # where the platform, the k8s manifests and the Dockerfile mount the shared volume
# The Hub's repo id grammar: an optional namespace, then a name of letters, digits, -, _, .
REPO_ID_PATTERN = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# RUN_NAME names a folder under OUTPUT_DIR/tensorboard: no separators, no '..', no hidden names, and
# short enough for the event files inside it to stay below the 255-byte file-name limit.
RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]{0,99}$")

# The settings' ranges: generous, but finite, so nothing --dry-run accepts overflows later (a wait, a seed, an allocation).
PATH_MAX = 4096  # Linux's PATH_MAX
NAME_MAX = 255  # a column, module or Hub name
MAX_STEPS = 10**8  # optimizer steps: years of steps
MAX_INTERVAL = 10**9  # steps between checkpoints, evaluations, log records: above MAX_STEPS, so "never" can be said
MAX_DEVICE_BATCH = 65536  # rows per device per step (and micro-batches per step): far above any memory
MAX_GLOBAL_BATCH = 10**6  # rows per optimizer step, however they are made up
MAX_WAIT_SECONDS = 86400  # a day: the longest any wait of the job may be set to
MAX_TARGET_MODULES = 256
MAX_LABELS = 10_000  # classes a classifier head is given; more is a retrieval problem, not this job's
MAX_ROWS = 10**9  # rows of a data set: far above any file this job can tokenize in memory
PathStr = Annotated[str, Field(min_length=1, max_length=PATH_MAX)]
NameStr = Annotated[str, Field(min_length=1, max_length=NAME_MAX)]
# A numeric bound sits on the whole type (`Annotated[float | None, RATE]`): describe_range finds none inside `| None`.
RATE, FRACTION, RATIO = Field(gt=0, lt=1), Field(ge=0, lt=1), Field(gt=0, le=1000)
DEVICE_BATCH, STEPS = Field(ge=1, le=MAX_DEVICE_BATCH), Field(ge=1, le=MAX_INTERVAL)
T = TypeVar("T")

# Rows per optimizer step when no batch setting is given: one GPU's batch, where the recipe was tuned, on every
# replica count (plan.py).
DEFAULT_GLOBAL_BATCH = 64
# Either given (GLOBAL_BATCH_SIZE not): the global batch is their product x the replica count.
BATCH_SHAPE = frozenset({"per_device_batch_size", "gradient_accumulation_steps"})


def split_commas(value: Any) -> Any:
    return tuple(name.strip() for name in value.split(",") if name.strip()) if isinstance(value, str) else value


# Comma-separated in env and flags (`query,value`), not JSON (NoDecode); defaults too, so --help shows the format.
Names = Annotated[tuple[T, ...], NoDecode, BeforeValidator(split_commas)]


# Which STRATEGY runs what, where not every one does: the one table the refusals, the plan's `auto` choices, the
# identity and the FSDP preflight (utils/training/strategy.py) read.
RUNS_UNDER = {
    # bitsandbytes' weights survive neither DeepSpeed's casting nor sharding; FSDP's refusal waits for the device
    "quantized weights": ("ddp",),
    "compiled blocks": ("ddp",),  # the other strategies wrap the model in engines whose compiled graphs are not tested
    "captured step": ("ddp",),  # one rank's whole forward and backward, replayed; the engines keep their own hooks
    "a DeepSpeed config": ("deepspeed",),  # DEEPSPEED_CONFIG, ZERO_STAGE, ZERO_OFFLOAD
    # one global order of the rows that any count continues; DeepSpeed's checkpoints are partitioned by rank
    "another replica count": ("ddp", "fsdp"),
}


def runs_under(strategy: str, what: str) -> bool:
    return strategy in RUNS_UNDER[what]


def default_output_dir() -> str:
    # On the platform the shared volume is the only place every replica (and a restart) can see.
    return f"{SHARED_VOLUME}/output" if os.path.isdir(SHARED_VOLUME) else "./output"


class Settings(BaseSettings):
    """The job's settings. Each field's description is its `--help` text: why the default is what it is."""

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        str_strip_whitespace=True,
        allow_inf_nan=False,  # every float is bounded: nan is refused as what it is, not as "less than 1"
        validate_default=True,  # the comma-separated defaults become tuples as any given value does
        case_sensitive=False,  # MODEL_NAME reaches model_name, with no prefix (config_map uses the bare names)
        # An empty flag (`--result-model-id "$UNSET"`) is refused, not read as unset; a blank variable is unset
        # (_Environment drops it).
        env_ignore_empty=False,
        cli_kebab_case=True,  # for the CliSettingsSource load_settings builds on its own parser
        cli_show_env_vars=True,
        # booleans take a value (`--hub-private false`), as their env variables do
        cli_implicit_flags=False,
    )

    # --- where the settings come from (shown in --help as --config; --config-file works, unlisted)
    config_file: CliSuppress[PathStr | None] = Field(
        None,
        description="a YAML recipe of settings by their --dry-run names; env and flags win over it (also --config)",
    )

    # --- what to train on
    model_name: PathStr = Field(
        "bert-base-uncased",
        description="Hub id or local folder of the base model (a folder on the shared volume for air-gapped clusters)",
    )
    dataset_name: NameStr = Field("nyu-mll/glue", description="Hub dataset id, used when DATASET_PATH is unset")
    dataset_config: NameStr = Field("sst2", description="configuration of the Hub dataset")
    dataset_path: PathStr | None = Field(
        None,
        description="local data that wins over DATASET_NAME: a folder of train/validation files (.csv .tsv .json .jsonl "
        ".parquet) or a save_to_disk DatasetDict, or one such file (the training rows)",
    )
    train_file: PathStr | None = Field(
        None,
        description="the training rows as one file (.csv .tsv .json .jsonl .parquet), instead of DATASET_PATH",
    )
    validation_file: PathStr | None = Field(
        None,
        description="the validation rows as one file, beside TRAIN_FILE (or a DATASET_PATH that is one file)",
    )
    # Not part of the run's identity: answering it after training changes nothing that was trained.
    test_file: PathStr | None = Field(
        None,
        description="rows to answer once trained, as one file (.csv .tsv .json .jsonl .parquet; a test.* file in a "
        "DATASET_PATH folder is read the same way): OUTPUT_DIR/predictions/, with metrics when labelled",
    )
    # At most half: a larger share leaves less to train on than to score, which is no quick check of a model.
    validation_split: Annotated[float | None, Field(gt=0, le=0.5)] = Field(
        None,
        description="a fraction of the training rows held out for validation (with SEED; rows of one text stay on "
        "one side), where the data has no validation rows",
    )
    # The first N rows after a shuffle with SEED: the head of a file sorted by label would be one class.
    max_train_samples: Annotated[int | None, Field(ge=1, le=MAX_ROWS)] = Field(
        None, description="train on N of the training rows, drawn with SEED (a quick run); unset: all"
    )
    max_eval_samples: Annotated[int | None, Field(ge=1, le=MAX_ROWS)] = Field(
        None, description="evaluate on N of each validation split's rows, drawn with SEED; unset: all"
    )
    task: NameStr | None = Field(
        None,
        description=f"a GLUE task ({'|'.join(GLUE)}): sets DATASET_CONFIG, the columns, labels, problem type, metrics and "
        "validation split(s); settings given beside it must agree with it",
    )
    # _check_text_columns bounds each of its one or two names
    text_column: str = Field(
        "sentence",
        description="the text column (SST-2's name), or two, comma-separated, for a sentence pair (premise,hypothesis)",
    )
    label_column: NameStr = Field(
        "label", description="the label column: a class id, a class name, or a float score (regression)"
    )
    label_names: Names[Annotated[str, Field(max_length=NAME_MAX)]] = Field(
        "negative,positive",
        max_length=MAX_LABELS,
        description="the labels' names in id order (id2label), comma-separated or a JSON list; unset: the data's (a "
        "ClassLabel's names, or a text label column's sorted values), and negative,positive for two unnamed ids 0/1",
    )
    problem_type: Literal["auto", "classification", "regression", "multi_label_classification"] = Field(
        "auto",
        description="classification (one label per row, cross-entropy), regression (one float score, MSE) or "
        "multi_label_classification (any number of labels per row, a sigmoid and binary cross-entropy per label: "
        "LABEL_COLUMN holding each row's list of names, `|`-separated in a csv/tsv, or LABEL_COLUMNS); "
        "auto: regression for a float label column with fractions, else classification",
    )
    label_columns: Annotated[Names[NameStr] | None, Field(min_length=1, max_length=MAX_LABELS)] = Field(
        None,
        description="multi_label_classification: several 0/1 columns, one per label (toxic,obscene,insult), whose "
        "names are the label names; unset: LABEL_COLUMN holds each row's label names",
    )
    threshold: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.5,
        description="multi_label_classification: a label is predicted where its sigmoid score is at least this, in "
        "the metrics, LOAD_BEST_MODEL's choice and predict.py's default; 0.5 is a logit of 0, the point the "
        "binary cross-entropy trains each label's decision around",
    )
    class_weights: Literal["none", "balanced"] = Field(
        "none",
        description="classification only: balanced weighs each class's loss by rows / (classes x its rows in the "
        "training split), so a rare class counts as much as a common one; none: every row alike",
    )
    base_model_id: str | None = Field(
        None,
        description="the base model's Hub id in the adapter config and card, so a pushed adapter loads anywhere; "
        "unset: MODEL_NAME when a Hub id, else the one its folder records (a Hub cache snapshot)",
    )

    # --- where results go
    output_dir: PathStr = Field(
        default_factory=default_output_dir,
        description=f"one run per folder; {SHARED_VOLUME}/output when {SHARED_VOLUME} exists, else ./output",
    )
    run_name: str | None = Field(
        None,
        description="run name; unset: derived from the training settings, so every replica and restart agree",
    )

    # --- how long and how big
    num_epochs: Annotated[float, RATIO] = Field(
        1.0, description="passes over the training split; one pass is enough for LoRA on SST-2"
    )
    max_steps: Annotated[int | None, Field(ge=1, le=MAX_STEPS)] = Field(
        None, description="optimizer steps; when set it wins over NUM_EPOCHS"
    )
    per_device_batch_size: Annotated[int, DEVICE_BATCH] = Field(
        64,
        description="unset: the cap on the micro-batch of the default global batch (64 rows a step on any replica "
        "count); set: rows per device per step, and the global batch = this x world size x accumulation",
    )
    per_device_eval_batch_size: Annotated[int, DEVICE_BATCH] = Field(
        256, description="evaluation needs no gradients or optimizer state, so it fits a larger batch"
    )
    gradient_accumulation_steps: Annotated[int, DEVICE_BATCH] = Field(
        1,
        description="micro-batches per optimizer step; set, the global batch = PER_DEVICE_BATCH_SIZE x world size x "
        "this; raise it only to reach a global batch that does not fit",
    )
    global_batch_size: Annotated[int | None, Field(ge=1, le=MAX_GLOBAL_BATCH)] = Field(
        None,
        description="rows per optimizer step on any replica count (micro-batch and accumulation derived, "
        "PER_DEVICE_BATCH_SIZE their cap), so a restart may come back on any count that divides it; unset: 64 (one "
        "GPU's batch) unless PER_DEVICE_BATCH_SIZE or GRADIENT_ACCUMULATION_STEPS is set, then the global batch "
        "follows the replica count",
    )
    learning_rate: Annotated[float | None, RATE] = Field(
        None,
        description="unset: BASE_LEARNING_RATE scaled by LEARNING_RATE_SCALING; set: this on any replica count",
    )
    base_learning_rate: Annotated[float, RATE] = Field(
        1e-3,
        description="the rate at a global batch of 64 (one replica, the defaults), where it was tuned on SST-2 with LoRA+ (docs/quality.md)",
    )
    learning_rate_scaling: Literal["fourth-root", "sqrt", "linear", "none"] = Field(
        "fourth-root",
        description="how the rate follows the global batch: x (global batch / 64) ** 0.25 trained 4 replicas within a point of one; sqrt overshot (docs/quality.md)",
    )
    weight_decay: Annotated[float, FRACTION] = Field(
        0.0, description="AdamW decoupled weight decay; one epoch of LoRA does not overfit SST-2"
    )
    warmup_ratio: Annotated[float, FRACTION] = Field(
        0.06,
        description="fraction of steps with a rising learning rate, as in the RoBERTa/LoRA GLUE recipes; never all "
        "of them (a warm-up step starts at rate 0)",
    )

    # --- LoRA
    lora_r: Annotated[int, Field(ge=1, le=4096)] = Field(
        8, description="adapter rank; 8 is the LoRA paper's GLUE setting (at most the model's width)"
    )
    lora_alpha: Annotated[int, Field(ge=1, le=65536)] = Field(16, description="adapter scale alpha/r = 2")
    lora_dropout: Annotated[float, FRACTION] = Field(0.05, description="light regularisation of the adapter input")
    lora_target_modules: Names[NameStr] = Field(
        "query,value",
        max_length=MAX_TARGET_MODULES,
        description="comma-separated module names to adapt; query,value as in the LoRA paper; a name that adapts no "
        "layer of the model is refused with the closest names",
    )
    train_pooler: bool = Field(
        True,
        description="train BERT's pooler with the classifier (both are the head); sentence-embedding checkpoints never trained theirs (docs/quality.md)",
    )
    head_learning_rate_ratio: Annotated[float, RATIO] = Field(
        1.0, description="the head (classifier, pooler) trains at this x the learning rate"
    )
    loraplus_lr_ratio: Annotated[float | None, RATIO] = Field(
        None,
        description="LoRA+: each adapter's B matrix trains at this x the learning rate; 1 is plain LoRA. Unset: 8 at a global "
        "batch of 64 or less, 8 x (64 / global batch) ** 0.5 above it, never below 1 (4 at 256: 4 replicas level with one, "
        "docs/quality.md)",
    )
    lora_variant: Literal["lora", "rslora", "dora"] = Field(
        "lora", description="rslora: scale alpha/sqrt(r) instead of alpha/r; dora: weight-decomposed LoRA (slower)"
    )
    lora_init: Literal["default", "gaussian", "pissa", "olora"] = Field(
        "default", description="adapter initialisation (peft init_lora_weights); default: B=0, A Kaiming-uniform"
    )
    model_dropout: Annotated[float, FRACTION] | Literal["checkpoint"] = Field(
        0.0,
        description="dropout in the frozen base model (BERT's hidden and attention dropout, which its classifier's "
        "follows); 0 trained better on SST-2 in one epoch (docs/quality.md); checkpoint: the checkpoint's (BERT: 0.1)",
    )

    # --- numerics and speed
    quantization: Literal["auto", "8bit", "4bit", "none"] = Field(
        "auto",
        description="auto: 8bit when the whole job is one CUDA GPU (it halves weight memory) and STRATEGY is not "
        "deepspeed, none otherwise; 4bit: QLoRA's NF4 weights with double quantization (a quarter of the memory)",
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 autocast where the GPU supports it, else fp32"
    )
    strategy: Literal["ddp", "fsdp", "deepspeed"] = Field(
        "ddp",
        description="ddp: a whole model per GPU (BERT-base with LoRA fits one many times over: fastest); fsdp: "
        "weights, gradients and optimizer state sharded per transformer block, for a base model too big for one GPU "
        "(2+ CUDA GPUs); deepspeed: DeepSpeed ZeRO (ZERO_STAGE, ZERO_OFFLOAD or DEEPSPEED_CONFIG), on GPUs or the CPU",
    )
    zero_stage: Annotated[int, Field(ge=1, le=3)] = Field(
        2,
        description="STRATEGY=deepspeed: ZeRO stage; 1 shards optimizer state, 2 also gradients (as fast as DDP, "
        "less memory: the default), 3 also the weights",
    )
    zero_offload: Literal["none", "optimizer", "optimizer+parameters"] = Field(
        "none",
        description="STRATEGY=deepspeed: keep optimizer state (and, at ZERO_STAGE=3 only, the weights) in host memory "
        "and step on the CPU (DeepSpeedCPUAdam): a larger base model on a smaller GPU, slower steps",
    )
    deepspeed_config: PathStr | None = Field(
        None,
        description="STRATEGY=deepspeed: your own ds_config.json; its stage and offload become ZERO_STAGE and "
        "ZERO_OFFLOAD; what the settings own (batch, rate, schedule, clipping, precision) must be 'auto', absent or agree",
    )
    gradient_checkpointing: bool = Field(
        False, description="saves activation memory that BERT-base LoRA does not need, at ~30% more compute"
    )
    max_seq_length: Annotated[int, Field(ge=8, le=512)] = Field(
        128,
        description="truncation length; SST-2 sentences average ~13 tokens and batches are padded only to their longest row",
    )
    dataloader_num_workers: Annotated[int, Field(ge=0, le=256)] = Field(
        2, description="collating runs beside the GPU step instead of before it"
    )
    torch_compile: bool | Literal["auto"] = Field(
        "auto",
        description="compiled transformer blocks, one graph per padded length; auto: on a CUDA GPU under ddp where "
        "the step is not captured (CUDA_GRAPHS replays eager kernels: a cold start without a compile), off on the "
        "CPU (minutes of compiling for no gain there); true: inside the captured step too",
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto",
        description="each length bucket's forward and backward captured once as a CUDA graph and replayed (the "
        "host launches one graph, not ~1,100 kernels a step); auto: on a CUDA GPU under ddp without gradient "
        "checkpointing or fp16; true on the CPU runs the same step on its static buffers, without a graph",
    )
    int8_threshold: Annotated[float, Field(ge=0, le=1000)] = Field(
        0.0,
        description="bitsandbytes' LLM.int8 outlier threshold for 8-bit weights; 0: no outlier columns kept apart, "
        "so no host sync per matmul and a step CUDA graphs can capture (bitsandbytes' own default is 6.0)",
    )
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = Field(
        42, description="seeds data order, LoRA init and dropout: the same seed gives the same run"
    )

    # --- checkpoints, rendezvous, publishing
    save_steps: Annotated[int, STEPS] = Field(
        100,
        description="checkpoint every N optimizer steps: ~10 per epoch of SST-2 at the default global batch (64), "
        "each a few MB",
    )
    save_total_limit: Annotated[int, Field(ge=1, le=1000)] = Field(
        2, description="checkpoints kept; two, so a restart still has one if the newest is incomplete"
    )
    rendezvous_timeout: Annotated[int, Field(ge=10, le=MAX_WAIT_SECONDS)] = Field(
        600,
        description="seconds a rank waits for its peers in any collective before failing; covers rank 0 downloading "
        "and tokenizing while the others wait",
    )
    result_model_id: str | None = Field(
        None, description="Hub repo to push model/ to (needs HF_TOKEN); unset: the model stays on the volume"
    )
    hub_timeout: Annotated[float, Field(gt=0, le=600)] = Field(
        30,
        description="seconds one Hub request may take to connect or to send a byte back; a Hub that accepts and never answers fails here, then is retried",
    )
    push_timeout: Annotated[float, Field(gt=0, le=MAX_WAIT_SECONDS)] = Field(
        600,
        description="seconds the push (retries and uploads in flight included) may take before exit 3; the token check before training gets min(120, this)",
    )
    hub_private: bool = Field(True, description="a new Hub repo is private unless asked otherwise")
    merge_adapter: bool = Field(
        False,
        description="also write OUTPUT_DIR/merged: the base with the adapter merged in, full precision, for servers without peft",
    )
    result_merged_model_id: str | None = Field(
        None, description="Hub repo to push merged/ to (needs MERGE_ADAPTER=true and HF_TOKEN)"
    )

    # --- evaluation and tracking
    eval_steps: Annotated[int | None, Field(ge=0, le=MAX_INTERVAL)] = Field(
        None,
        description="evaluate on the validation split every N optimizer steps; unset: 4 times an epoch (seconds each on a GPU); 0: only at the end",
    )
    load_best_model: bool = Field(
        False,
        description="the saved and pushed model is the checkpoint of the best validation score (the task's metric, "
        "see the card), not the last step; a checkpoint at every evaluation, the best one never pruned",
    )
    early_stopping_patience: Annotated[int | None, Field(ge=1, le=1000)] = Field(
        None,
        description="stop after this many evaluations in a row without a better validation score, and keep the "
        "best checkpoint (LOAD_BEST_MODEL); unset: train every step",
    )
    logging_steps: Annotated[int, STEPS] = Field(
        10, description="optimizer steps between training-loss records (console, TensorBoard, trackers, log_history)"
    )
    report_to: Names[Literal["tensorboard", "mlflow", "wandb", "trackio", "none"]] = Field(
        "tensorboard",
        description="comma-separated trackers rank 0 reports to: tensorboard (under OUTPUT_DIR/tensorboard), mlflow, "
        "wandb, trackio, or none; each reads its own variables (MLFLOW_TRACKING_URI, WANDB_PROJECT, ...)",
    )

    # The Hub token, no setting: read once by load_settings, so the push, its preflight and --dry-run ask the same
    # value. Settings built directly (tests, benchmarks) have none.
    _hub_token: SecretStr | None = PrivateAttr(None)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, **_: Any
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # `Settings(**values)` is those values and the defaults, never the environment a test runs in; load_settings
        # passes the environment and flag sources itself.
        return (init_settings,)

    @field_validator("label_names", mode="before")
    @classmethod
    def _read_label_names(cls, value: Any) -> Any:
        if not (isinstance(value, str) and value.strip().startswith("[")):
            return value
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f'it is not a JSON list ({exc.msg}); write it as ["a","b","c"] or a,b,c') from None
        if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
            raise ValueError('a JSON list of label names holds strings only, e.g. ["a","b","c"]')
        return tuple(name.strip() for name in value)

    @field_validator("lora_target_modules")
    @classmethod
    def _check_modules(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("name at least one module, e.g. query,value")
        return value

    @field_validator("label_names")
    @classmethod
    def _check_label_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(value) < 2:
            raise ValueError("name at least two labels, label 0 first, e.g. negative,positive")
        if repeated := sorted({name for name in value if value.count(name) > 1}):
            raise ValueError(
                f"labels need two different names, e.g. negative,positive ({repeated[0]!r} names more than one)"
            )
        return value

    @field_validator("text_column")
    @classmethod
    def _check_text_columns(cls, value: str) -> str:
        names = [name.strip() for name in value.split(",")]
        if not 1 <= len(names) <= 2 or not all(names):
            raise ValueError("name one text column, or two, comma-separated, for sentence pairs (premise,hypothesis)")
        if any(len(name) > NAME_MAX for name in names):
            raise ValueError(f"a column name has at most {NAME_MAX} characters")
        if len(names) == 2 and names[0] == names[1]:
            raise ValueError(f"a pair needs two different columns ('{names[0]}' is named twice)")
        return ",".join(names)

    @field_validator("task")
    @classmethod
    def _check_task(cls, value: str | None) -> str | None:
        if value is not None and value.lower() not in GLUE:
            why = f" ({GLUE_UNTRAINABLE[value.lower()]})" if value.lower() in GLUE_UNTRAINABLE else ""
            raise ValueError(
                f"the job trains the GLUE tasks {', '.join(GLUE)}{why}; for other data leave TASK unset and set "
                "DATASET_PATH (or DATASET_NAME) with TEXT_COLUMN and LABEL_COLUMN"
            )
        return None if value is None else value.lower()

    @model_validator(mode="after")
    def _apply_task(self) -> Settings:
        """TASK fills what it decides; a value given beside it that disagrees is refused, not silently overruled."""
        if self.task is None:
            config = self.dataset_config
            if not self.local_data and self.dataset_name in GLUE_DATASETS and config in GLUE_UNTRAINABLE:
                raise ValueError(
                    f"DATASET_CONFIG={self.dataset_config} of {self.dataset_name} cannot be trained: "
                    f"{GLUE_UNTRAINABLE[self.dataset_config]}; set TASK to one of {', '.join(GLUE)}"
                )
            return self
        task = GLUE[self.task]
        decided = {
            "dataset_config": task.dataset_config,
            "text_column": ",".join(task.text_columns),
            "label_column": task.label_column,
            "problem_type": task.problem_type,
        }
        if task.label_names:
            decided["label_names"] = task.label_names
        given = self.model_fields_set
        for name, value in decided.items():
            if name not in given:
                object.__setattr__(self, name, value)
            elif name == "problem_type" and getattr(self, name) != value:
                raise ValueError(
                    f"TASK={self.task} is {value} and PROBLEM_TYPE={self.problem_type} disagrees; unset PROBLEM_TYPE, "
                    "or leave TASK unset to train your own columns as you describe them"
                )
            elif name == "dataset_config" and not self.local_data and getattr(self, name) != value:
                raise ValueError(
                    f"TASK={self.task} trains DATASET_CONFIG={value}, not {self.dataset_config}; unset DATASET_CONFIG"
                )
        return self

    @property
    def local_data(self) -> str | None:
        """DATASET_PATH or TRAIN_FILE, None for the Hub's data set."""
        return self.dataset_path or self.train_file

    @model_validator(mode="after")
    def _check_data_files(self) -> Settings:
        """Where the training and validation rows come from is said one way."""
        if self.dataset_path and self.train_file:
            raise ValueError(
                f"DATASET_PATH={self.dataset_path} and TRAIN_FILE={self.train_file} both name the training rows; "
                "unset one: DATASET_PATH for a folder (or one file), TRAIN_FILE (with VALIDATION_FILE) for files"
            )
        if self.validation_file and not self.local_data:
            raise ValueError(
                f"VALIDATION_FILE={self.validation_file} needs the training rows as a file too; set TRAIN_FILE"
            )
        if self.validation_file and self.validation_split is not None:
            raise ValueError(
                f"VALIDATION_SPLIT={self.validation_split} carves validation rows out of the training rows, and "
                f"VALIDATION_FILE={self.validation_file} gives them; unset one of them"
            )
        if self.train_file and not self.validation_file and self.validation_split is None:
            raise ValueError(
                f"TRAIN_FILE={self.train_file} has no validation rows beside it; set VALIDATION_FILE, or "
                "VALIDATION_SPLIT=0.1 to hold out a tenth of the training rows"
            )
        splits = validation_splits(self.task)
        if (self.train_file or self.validation_split is not None) and len(splits) > 1:
            raise ValueError(
                f"TASK={self.task} validates on {len(splits)} splits ({', '.join(splits)}), "
                "which one file or one fraction cannot give; use DATASET_PATH with a file per split"
            )
        return self

    @property
    def text_columns(self) -> tuple[str, ...]:
        return tuple(self.text_column.split(","))

    @property
    def label_source_columns(self) -> tuple[str, ...]:
        """The columns the labels are read from: LABEL_COLUMNS' 0/1 columns, else LABEL_COLUMN."""
        return self.label_columns or (self.label_column,)

    @property
    def batch_follows_replicas(self) -> bool:
        """Whether the global batch is PER_DEVICE_BATCH_SIZE x world size x GRADIENT_ACCUMULATION_STEPS (BATCH_SHAPE
        given, GLOBAL_BATCH_SIZE not); otherwise it is fixed on any replica count (plan.py)."""
        return self.global_batch_size is None and bool(BATCH_SHAPE & self.model_fields_set)

    def _refuse_multi_label_conflicts(self) -> None:
        """What only a multi-label problem reads, given to another, and what a multi-label problem cannot take."""
        multi = self.problem_type == "multi_label_classification"
        given = self.model_fields_set
        if self.label_columns and not multi:
            raise ValueError(
                f"LABEL_COLUMNS={','.join(self.label_columns)} names the 0/1 columns of a multi-label problem, and "
                f"PROBLEM_TYPE={self.problem_type}; set PROBLEM_TYPE=multi_label_classification, or unset LABEL_COLUMNS"
            )
        # Given as its default it changes nothing: accepted, as every default given outright is.
        if self.threshold != FIELDS["threshold"].default and not multi:
            raise ValueError(
                f"THRESHOLD={self.threshold:g} decides which labels a multi-label model predicts, and "
                f"PROBLEM_TYPE={self.problem_type} predicts one class (or a score); unset THRESHOLD, or set "
                "PROBLEM_TYPE=multi_label_classification"
            )
        if not multi:
            return
        if self.class_weights != "none":
            raise ValueError(
                f"CLASS_WEIGHTS={self.class_weights} weighs the classes of a softmax, and PROBLEM_TYPE="
                "multi_label_classification trains a yes/no per label (each its own binary cross-entropy); unset "
                "CLASS_WEIGHTS"
            )
        if not self.label_columns:
            return
        if len(self.label_columns) < 2:
            raise ValueError(
                f"LABEL_COLUMNS={','.join(self.label_columns)} names one column: a multi-label problem has at least "
                "two labels; name every 0/1 column (toxic,obscene,insult), or for one yes/no label set "
                "LABEL_COLUMN to it and leave PROBLEM_TYPE unset"
            )
        if twice := sorted({name for name in self.label_columns if self.label_columns.count(name) > 1}):
            raise ValueError(f"LABEL_COLUMNS names '{twice[0]}' twice; name each 0/1 column once")
        if shared := [name for name in self.label_columns if name in self.text_columns]:
            raise ValueError(
                f"TEXT_COLUMN and LABEL_COLUMNS both name the column '{shared[0]}'; the text and the labels must be "
                "different columns: fix TEXT_COLUMN or LABEL_COLUMNS"
            )
        for name, fix in (
            ("label_column", "the labels are LABEL_COLUMNS' columns"),
            ("label_names", "the label names are LABEL_COLUMNS' column names"),
        ):
            if name in given:
                shown = getattr(self, name) if name == "label_column" else ",".join(self.label_names)
                raise ValueError(
                    f"{name.upper()}={shown} and LABEL_COLUMNS are both set, and {fix}; unset {name.upper()}"
                )

    @field_validator("report_to")
    @classmethod
    def _check_trackers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or ("none" in value and len(value) > 1):
            raise ValueError("name trackers (tensorboard,mlflow,...) or none alone")
        return tuple(dict.fromkeys(value))

    @field_validator("run_name")
    @classmethod
    def _check_run_name(cls, value: str | None) -> str | None:
        if value is not None and (not RUN_NAME_PATTERN.match(value) or ".." in value):
            raise ValueError(
                "it names a folder under OUTPUT_DIR: use 1-100 letters, digits, '-', '_', '.', '+', '=' (no '/' or '..')"
            )
        return value

    @field_validator("result_model_id", "result_merged_model_id", "base_model_id")
    @classmethod
    def _check_repo_id(cls, value: str | None) -> str | None:
        if value is not None and (not REPO_ID_PATTERN.match(value) or "--" in value or ".." in value):
            raise ValueError("must look like 'your-name/model-name' (letters, digits, '-', '_', '.')")
        return value

    @model_validator(mode="after")
    def _refuse_conflicts(self) -> Settings:
        if self.label_column in self.text_columns:
            raise ValueError(
                f"TEXT_COLUMN and LABEL_COLUMN both name the column '{self.label_column}'; the text and the label must be "
                "two different columns: fix TEXT_COLUMN or LABEL_COLUMN"
            )
        if self.global_batch_size is not None and self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"GLOBAL_BATCH_SIZE={self.global_batch_size} derives the accumulation from the replica count, so "
                f"GRADIENT_ACCUMULATION_STEPS={self.gradient_accumulation_steps} cannot also be set: unset one of them"
            )
        self._refuse_strategy_conflicts()
        self._refuse_multi_label_conflicts()
        if self.class_weights != "none" and self.problem_type == "regression":
            raise ValueError(
                f"CLASS_WEIGHTS={self.class_weights} weighs classes, and PROBLEM_TYPE=regression has none; "
                "unset CLASS_WEIGHTS, or set PROBLEM_TYPE=classification"
            )
        if (self.load_best_model or self.early_stopping_patience) and self.eval_steps == 0:
            asked = (
                "LOAD_BEST_MODEL=true"
                if self.load_best_model
                else f"EARLY_STOPPING_PATIENCE={self.early_stopping_patience}"
            )
            raise ValueError(
                f"{asked} chooses among the evaluations during training, and EVAL_STEPS=0 runs none; unset EVAL_STEPS "
                "(4 evaluations an epoch) or set it to the interval to evaluate at"
            )
        if self.result_merged_model_id and not self.merge_adapter:
            raise ValueError(
                f"RESULT_MERGED_MODEL_ID={self.result_merged_model_id} pushes the merged model, which only MERGE_ADAPTER=true writes: "
                "set MERGE_ADAPTER=true, or unset RESULT_MERGED_MODEL_ID"
            )
        return self

    def _refuse_strategy_conflicts(self) -> None:
        """What STRATEGY cannot run (RUNS_UNDER): quantized weights, compiled blocks, the captured step, a config."""
        if self.zero_offload == "optimizer+parameters" and self.zero_stage != 3 and self.deepspeed_config is None:
            raise ValueError(
                f"ZERO_OFFLOAD=optimizer+parameters offloads the weights, which only ZeRO stage 3 shards "
                f"(ZERO_STAGE={self.zero_stage}); set ZERO_STAGE=3, or ZERO_OFFLOAD=optimizer"
            )
        # FSDP's refusal waits for the device (RUNS_UNDER)
        quantized = self.quantization in ("8bit", "4bit")
        if quantized and not runs_under(self.strategy, "quantized weights") and self.strategy != "fsdp":
            raise ValueError(
                f"QUANTIZATION={self.quantization} cannot be combined with STRATEGY=deepspeed: DeepSpeed casts and "
                "shards the weights, which bitsandbytes' quantized weights do not survive; use QUANTIZATION=none (or "
                f"auto: none under deepspeed), or STRATEGY=ddp for {self.quantization}"
            )
        if self.torch_compile is True and not runs_under(self.strategy, "compiled blocks"):
            raise ValueError(
                f"TORCH_COMPILE=true runs under STRATEGY=ddp only: {self.strategy} wraps the model in its own engine, "
                "whose compiled graphs are not tested here; set TORCH_COMPILE=auto (off under "
                f"{self.strategy}) or false, or STRATEGY=ddp"
            )
        if self.cuda_graphs is True and (
            not runs_under(self.strategy, "captured step") or self.gradient_checkpointing
        ):
            raise ValueError(
                "CUDA_GRAPHS=true captures the whole step under STRATEGY=ddp without GRADIENT_CHECKPOINTING "
                f"(STRATEGY={self.strategy}, GRADIENT_CHECKPOINTING={str(self.gradient_checkpointing).lower()}); "
                "set CUDA_GRAPHS=auto (off where it cannot run) or false"
            )
        if self.deepspeed_config is not None and not runs_under(self.strategy, "a DeepSpeed config"):
            raise ValueError(
                f"DEEPSPEED_CONFIG={self.deepspeed_config} is a DeepSpeed config but STRATEGY={self.strategy}; "
                "set STRATEGY=deepspeed, or unset DEEPSPEED_CONFIG"
            )

    # ---------------------------------------------------------------- views
    @property
    def hub_token(self) -> SecretStr | None:
        """HF_TOKEN (or HF_TOKEN_PATH's file) as load_settings read it; None when neither is set."""
        return self._hub_token

    @property
    def given(self) -> frozenset[str]:
        """The settings a recipe, the environment or a flag set: where a default decides less than a value given."""
        return frozenset(self.model_fields_set)

    @property
    def given_label_names(self) -> tuple[str, ...] | None:
        """LABEL_NAMES when the user set it; None when unset (the data's names, or a finished run's, then apply)."""
        return self.label_names if "label_names" in self.model_fields_set else None

    def select(self, concern: type[T]) -> T:
        """The fields one concern reads (a dataclass whose fields are named as the settings are), so the code of
        that concern takes what it reads and never the whole Settings."""
        return concern(**{field.name: getattr(self, field.name) for field in dataclasses.fields(concern)})

    def as_dict(self) -> dict[str, Any]:
        values = self.model_dump(mode="json")
        values["hf_token"] = "***" if self._hub_token else None
        return values


def resolve_base_model_id(base_model_id: str | None, model_name: str) -> str | None:
    """The Hub id the base model goes by, so a pushed adapter loads elsewhere: BASE_MODEL_ID, MODEL_NAME when a Hub
    id, or a local Hub cache snapshot's (`.../models--ORG--NAME/snapshots/REV`); None for a plain folder.
    config.json's `_name_or_path` is not trusted: for a fine-tuned checkpoint it names another model."""
    if base_model_id:
        return base_model_id
    path = Path(model_name).expanduser()
    if not path.exists():
        return model_name if REPO_ID_PATTERN.match(model_name) else None
    # abspath, not resolve: links are not followed, the path is the record
    cached = [part for part in Path(os.path.abspath(path)).parts if part.startswith("models--")]
    return cached[-1].removeprefix("models--").replace("--", "/") if cached else None


FIELDS = Settings.model_fields


def env_name(field: str) -> str:
    return field.upper()  # as the env source matches it (case_sensitive=False, no env_prefix)


def flag_name(name: str) -> str:
    return "--" + name.lstrip("-").replace("_", "-")  # as CliSettingsSource makes it (cli_kebab_case); `--a_b` too

"""Whether two starts are one run: one key (`run_identity`), one comparison (`check_same_run`).

The key holds what decides the trained model and the order its rows are trained in, each as the run uses it, and
nothing else: files by their SHA-256 (another spelling of one folder is one run, weights replaced in place another;
a Hub model by its id: asking its revision would put a network call before the first step), values as the plan
resolves them, `auto` precision and quantization once the device is known (`with_numerics`).
`FIELDS` names each field; docs/reliability.md lists them (tests/test_identity.py holds the two alike).

run.json and every checkpoint record it, the ranks compare theirs at the rendezvous, a restart compares it with the
run folder's and the checkpoint's, and an unset RUN_NAME is its hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from utils.common.delimited import data_files
from utils.common.errors import BadInput
from utils.config.settings import Settings, runs_under
from utils.config.tasks import MULTI_LABEL, REGRESSION, validation_splits

# Bumped when a field's meaning changes: an identity another version recorded is compared on the fields both hold.
IDENTITY_VERSION = 2
# Each field of the identity -> what it holds, in the words its refusal names it by.
FIELDS = {
    "base_model": "base model: the SHA-256 of each weights, config and tokenizer file of a local MODEL_NAME, or its Hub id",
    "dataset": "DATASET_NAME/DATASET_CONFIG: the Hub data set (none when DATASET_PATH or TRAIN_FILE is set)",
    "data": "data files: the SHA-256 of each file of DATASET_PATH the loader reads, or of TRAIN_FILE and VALIDATION_FILE",
    "validation_split": "VALIDATION_SPLIT",
    "max_train_samples": "MAX_TRAIN_SAMPLES",
    "max_eval_samples": "MAX_EVAL_SAMPLES",
    "text_column": "TEXT_COLUMN",
    "label_column": "LABEL_COLUMN",
    "label_names": "LABEL_NAMES: the label mapping given, names in id order (none for a regression or when unset: the "
    "data's own names then, or those the finished run recorded)",
    "label_columns": "LABEL_COLUMNS: a multi-label problem's 0/1 columns (none when unset)",
    "threshold": "THRESHOLD: a multi-label problem's, only where it chooses the saved model (LOAD_BEST_MODEL or "
    "EARLY_STOPPING_PATIENCE)",
    "problem": "PROBLEM_TYPE: regression, multi_label_classification, or auto (classification trains as auto does "
    "wherever both train)",
    "seed": "SEED",
    "max_seq_length": "MAX_SEQ_LENGTH",
    "max_steps": "MAX_STEPS",
    "epochs": "NUM_EPOCHS: none when MAX_STEPS decides",
    "global_batch_size": "GLOBAL_BATCH_SIZE",
    "per_device_batch_size": "PER_DEVICE_BATCH_SIZE: only where the global batch follows it",
    "gradient_accumulation_steps": "GRADIENT_ACCUMULATION_STEPS",
    "global_batch": "global batch: rows per optimizer step, as the plan resolves it",
    "world_size": "replica count: none where the global batch is fixed under DDP",
    "rates": "learning rates: each optimizer group's, as the plan resolves them",
    "warmup_ratio": "WARMUP_RATIO",
    "weight_decay": "WEIGHT_DECAY",
    "lora_r": "LORA_R",
    "lora_alpha": "LORA_ALPHA",
    "lora_dropout": "LORA_DROPOUT",
    "lora_target_modules": "LORA_TARGET_MODULES: as a set",
    "lora_variant": "LORA_VARIANT",
    "lora_init": "LORA_INIT",
    "model_dropout": "MODEL_DROPOUT",
    "train_pooler": "TRAIN_POOLER",
    "strategy": "STRATEGY",
    "zero_stage": "ZERO_STAGE: STRATEGY=deepspeed only",
    "zero_offload": "ZERO_OFFLOAD: STRATEGY=deepspeed only",
    "deepspeed": "DEEPSPEED_CONFIG: the file's content, STRATEGY=deepspeed only",
    "precision": "PRECISION: as resolved on the device",
    "quantization": "QUANTIZATION: as resolved on the device",
    "int8_threshold": "INT8_THRESHOLD: 8-bit weights only",
    "load_best_model": "LOAD_BEST_MODEL",
    "early_stopping_patience": "EARLY_STOPPING_PATIENCE",
    "class_weights": "CLASS_WEIGHTS",
}
# Settings whose value the identity holds as given (the rest of FIELDS is derived below).
AS_GIVEN = (
    *("text_column", "label_column", "seed", "max_seq_length", "max_steps", "global_batch_size"),
    *("gradient_accumulation_steps", "warmup_ratio", "weight_decay", "lora_r", "lora_alpha", "lora_dropout"),
    *("lora_variant", "lora_init", "model_dropout", "train_pooler", "strategy", "precision", "quantization"),
    *("load_best_model", "early_stopping_patience", "class_weights"),
    *("validation_split", "max_train_samples", "max_eval_samples"),
)
DEVICE_RESOLVED = ("precision", "quantization", "int8_threshold")  # `auto` until Job.start knows the device
ZERO = ("strategy", "zero_stage", "zero_offload", "deepspeed")
# The fields that are None where the run does not use them (MAX_STEPS's None, by contrast, says the epochs decide).
UNUSED_AS_NONE = frozenset(
    {"zero_stage", "zero_offload", "deepspeed", "per_device_batch_size", "int8_threshold", "label_names", "epochs"}
    | {"label_columns", "threshold"}
)
# What from_pretrained reads of a local model folder (not a README or notes).
MODEL_FILES = frozenset(
    "config.json tokenizer.json tokenizer_config.json special_tokens_map.json added_tokens.json vocab.txt vocab.json "
    "merges.txt".split()
)
MODEL_SUFFIXES = (".safetensors", ".bin", ".model", ".index.json")  # weights, their shard index, sentencepiece


def run_identity(
    settings: Settings,
    global_batch: int,
    world_size: int,
    elastic: bool,
    rates: dict[str, float],
    deepspeed_file: dict[str, Any] | None,
) -> dict[str, Any]:
    """The key two starts must share to be one run, JSON-ready. Every field is present (None where the run does not
    use it), so two identities of this version differ exactly where their runs do. `deepspeed_file`: DEEPSPEED_CONFIG
    as the settings' load read it (its spacing and key order are not the run); read here when not given."""
    deepspeed = runs_under(settings.strategy, "a DeepSpeed config")
    if deepspeed and deepspeed_file is None:  # settings built without load_settings (tests, a sweep's check)
        deepspeed_file = config_content(settings.deepspeed_config)
    regression = settings.problem_type == REGRESSION
    multi_label = settings.problem_type == MULTI_LABEL
    choosing = settings.load_best_model or settings.early_stopping_patience is not None
    identity = {name: getattr(settings, name) for name in AS_GIVEN}
    identity.update(
        version=IDENTITY_VERSION,
        base_model=model_digest(settings.model_name),
        dataset=None if settings.local_data else f"{settings.dataset_name}/{settings.dataset_config}",
        data=data_digest(settings.local_data, settings.train_file, settings.validation_file, settings.task),
        # Unset, the mapping is the data's or a finished run's record: nothing to compare before the data is read.
        label_names=list(settings.given_label_names) if settings.given_label_names and not regression else None,
        label_columns=list(settings.label_columns) if settings.label_columns else None,
        # Where the scores measured at it choose among checkpoints; otherwise it changes only what is reported.
        threshold=settings.threshold if multi_label and choosing else None,
        problem=settings.problem_type if settings.problem_type in (REGRESSION, MULTI_LABEL) else "auto",
        epochs=None if settings.max_steps else settings.num_epochs,
        per_device_batch_size=settings.per_device_batch_size if settings.batch_follows_replicas else None,
        global_batch=global_batch,
        world_size=None if elastic else world_size,
        rates=rates,
        lora_target_modules=sorted(set(settings.lora_target_modules)),
        zero_stage=settings.zero_stage if deepspeed else None,
        zero_offload=settings.zero_offload if deepspeed else None,
        deepspeed=deepspeed_file if deepspeed else None,
        int8_threshold=None if settings.quantization == "none" or deepspeed else settings.int8_threshold,
    )
    return identity


def default_label_names() -> list[str]:
    return [name.strip() for name in Settings.model_fields["label_names"].default.split(",")]


def with_numerics(identity: dict[str, Any], precision: str, quantization: str) -> dict[str, Any]:
    """The identity with the precision and quantization `auto` resolved to on this device (plan.with_device)."""
    threshold = identity.get("int8_threshold") if quantization == "8bit" else None
    return {**identity, "precision": precision, "quantization": quantization, "int8_threshold": threshold}


def run_name(identity: dict[str, Any], model_name: str, local_data: str | None, dataset_config: str) -> str:
    """The name of a run RUN_NAME leaves unset: the model, the data, the rank and the identity's hash, less what the
    device resolves (DEVICE_RESOLVED), so --dry-run names the run as the training does."""
    # The folders' own names, links followed: another spelling of one folder is one name.
    model = Path(os.path.realpath(model_name)).name or "model"
    data = Path(os.path.realpath(local_data)).stem if local_data else dataset_config
    hashed = {name: value for name, value in identity.items() if name not in DEVICE_RESOLVED}
    if hashed.get("label_names") == default_label_names():  # given as the default: the name of the run left unset
        hashed["label_names"] = None
    return f"{model}-{data}-lora-r{identity['lora_r']}-{short_digest(hashed)[:8]}"


def short_digest(value: Any) -> str:
    """16 hex digits of the SHA-256 of `value` as JSON: the run name's tail, the data's fingerprint on the card."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_digest(model_name: str) -> str | dict[str, str]:
    """A local folder's weights, config and tokenizer files by name -> the SHA-256 of their bytes; a Hub id as is."""
    folder = Path(model_name)
    if not folder.is_dir():  # from_pretrained's own test: an existing folder is loaded, anything else is an id
        return model_name
    files = [p for p in folder.iterdir() if p.name in MODEL_FILES or p.name.endswith(MODEL_SUFFIXES)]
    return {path.name: readable_digest(path) for path in sorted(files) if path.is_file()}


def base_model_changes(recorded: Any, model_name: str) -> str | None:
    """`model.safetensors, config.json`: the files of the local folder `model_name` added, removed or changed since
    `recorded` (model_digest of the base an adapter was trained on); None where they match or nothing can be
    compared (a Hub id on either side, no fingerprint recorded)."""
    if not isinstance(recorded, dict) or not Path(model_name).is_dir():
        return None
    return _first_four(_changed_keys(recorded, model_digest(model_name), values=False)) or None


def readable_digest(path: Path) -> str:
    """sha256_file, or what kept the file from being read (the model's own load refuses it with the fix)."""
    try:
        return sha256_file(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror or type(exc).__name__})"


def config_content(path: str | None) -> dict | str | None:
    """DEEPSPEED_CONFIG parsed; the SHA-256 of its bytes when it is no JSON object (refused before anything runs)."""
    if path is None:
        return None
    file = Path(path).expanduser()
    try:
        content = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return sha256_file(file) if file.is_file() else None
    return content if isinstance(content, dict) else sha256_file(file)


def data_digest(
    local_data: str | None, train_file: str | None, validation_file: str | None, task: str | None
) -> dict[str, str | None] | None:
    """SHA-256 of each file the loader reads: a DATASET_PATH folder's split files (every file of a save_to_disk
    folder) by their path in it, or TRAIN_FILE, VALIDATION_FILE or a DATASET_PATH file by their split; None for a Hub
    data set. Bytes, not dates or paths: a restored or moved volume is the same data."""
    if not local_data:
        return None
    path = Path(local_data)
    if train_file or path.is_file():
        given = {"train": local_data, "validation": validation_file}
        return {split: readable_digest(Path(p)) if Path(p).is_file() else None for split, p in given.items() if p}
    if not path.is_dir():
        return {}
    if (path / "dataset_dict.json").exists():
        paths = [file for file in path.rglob("*") if file.is_file()]
    else:
        splits = ("train", *validation_splits(task))  # MNLI: validation_matched and validation_mismatched
        paths = [file for file in data_files(path, splits) if file.is_file()]
    return {str(file.relative_to(path)): readable_digest(file) for file in sorted(paths)}


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def compared_fields(theirs: dict, ours: dict) -> set[str]:
    """The fields two identities are compared on: all; with another version's, those both hold, so an upgrade does
    not refuse its own runs."""
    if theirs.get("version") == ours.get("version"):
        names = set(theirs) | set(ours)
    else:
        # An older record holds a setting this run does not use (ZERO_STAGE under DDP) as given: no difference.
        unused = {name for name in UNUSED_AS_NONE if ours.get(name) is None}
        names = (set(theirs) & set(ours)) - {"version"} - unused
    # LABEL_NAMES unset against given as the default names: one mapping (ids 0/1 are named so when unset).
    if {str(theirs.get("label_names")), str(ours.get("label_names"))} <= {"None", str(default_label_names())}:
        names.discard("label_names")
    # Before the device is known (--dry-run, the run folder's first check) `auto` may still become either value.
    for setting, fields in (("precision", {"precision"}), ("quantization", {"quantization", "int8_threshold"})):
        if "auto" in (theirs.get(setting), ours.get(setting)):
            names -= fields
    return names


def _changed_keys(was: dict, now: dict, values: bool, prefix: str = "") -> list[str]:
    """The dotted keys that differ between two JSON objects (`model.safetensors`), with both values where `values`
    (`scheduler.type WarmupDecayLR -> WarmupLR`)."""
    keys = []
    for key in sorted(set(was) | set(now), key=str):
        a, b = was.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed_keys(a, b, values, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key} {_shown(a)} -> {_shown(b)}" if values else f"{prefix}{key}")
    return keys


def _first_four(keys: list[str]) -> str:
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _shown(value: Any) -> str:
    shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return shown if len(shown) <= 80 else f"{shown[:77]}..."  # one line, even for a whole block of a config


def _differing(theirs: dict, ours: dict, ignore: frozenset[str]) -> set[str]:
    """The fields that differ; the rates follow the global batch, so where it changed they are not named again."""
    differing = {name for name in compared_fields(theirs, ours) - ignore if theirs.get(name) != ours.get(name)}
    return differing - {"rates"} if "global_batch" in differing else differing


def identity_changes(theirs: dict, ours: dict, ignore: frozenset[str] = frozenset()) -> list[str]:
    """`LORA_R: 8 -> 16`, `replica count: 2 -> 4`, `data files: train.csv changed` for each field that differs."""
    changes = []
    for name in sorted(_differing(theirs, ours, ignore)):
        was, now = theirs.get(name), ours.get(name)
        label = FIELDS.get(name, name.upper()).split(":")[0]
        if isinstance(was, dict) and isinstance(now, dict):
            files = name in ("data", "base_model")  # by name: a digest says nothing to a reader
            shown = _first_four(_changed_keys(was, now, values=not files))
            changes.append(f"{label}: {shown} added, removed or edited" if files else f"{label}: {shown}")
        else:
            if name == "label_names":  # unset: the default names, or the data's own
                was, now = (default_label_names() if value is None else value for value in (was, now))
            changes.append(f"{label}: {_shown(was)} -> {_shown(now)}")
    return changes


def check_same_run(theirs: dict, ours: dict, where: str, ignore: frozenset[str] = frozenset()) -> None:
    """Refuse (exit 2) a start whose identity differs from the one `where` recorded, naming each difference and
    the fix: for another replica count, the count to restart with."""
    changed = _differing(theirs, ours, ignore)
    if not changed:
        return
    count = theirs.get("world_size")
    if "world_size" in changed and count is not None and not changed & {"global_batch_size", *ZERO}:
        if ours.get("strategy") == "deepspeed":
            fix = (
                f"restart with {count} replica(s): DeepSpeed partitions the optimizer state by rank, and this job does "
                "not convert a checkpoint to another count (for elastic runs use STRATEGY=ddp with GLOBAL_BATCH_SIZE)"
            )
        else:
            fix = (
                f"restart with {count} replica(s) to resume (the learning rate follows the global batch), or for a "
                "new run set GLOBAL_BATCH_SIZE in a new OUTPUT_DIR: then the replica count may change between restarts"
            )
    elif changed & set(ZERO):
        fix = "restore that run's DeepSpeed config (DEEPSPEED_CONFIG's file, ZERO_STAGE, ZERO_OFFLOAD) to resume"
    elif changed == {"data"}:
        fix = "restore the data it was trained on to resume"
    elif "base_model" in changed:
        fix = "restore the base model it was trained on (MODEL_NAME's weights, config and tokenizer files) to resume"
    else:
        fix = "restore the old settings to resume"
    raise BadInput(
        f"{where} holds another run ({'; '.join(identity_changes(theirs, ours, ignore))}); {fix}, or use a new OUTPUT_DIR to start over",
    )


def agreement_refusal(rank0: dict, others: dict[int, dict]) -> str | None:
    """The ranks' agreement (utils/run.agreement) compared with rank 0's: None, or the refusal naming each difference."""
    differ = [
        f"rank {rank}: {', '.join(changes)}"
        for rank, theirs in sorted(others.items())
        if (changes := identity_changes(rank0, theirs))
    ]
    if not differ:
        return None
    return (
        f"the replicas were started with other settings than rank 0 ({'; '.join(differ)}); give every replica the "
        "same settings (one config_map / ConfigMap for all) and start them again"
    )


def identity_table() -> str:
    """FIELDS as docs/reliability.md lists them (tests/test_identity.py holds the page to it)."""
    return "\n".join(f"  - `{name}`: {what}" for name, what in FIELDS.items())

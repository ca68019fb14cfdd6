"""Whether two starts are one run: one key (`run_identity`), one comparison (`check_same_run`).

The key holds what decides the trained model and the order its rows are trained in: the training settings
(settings.TRAINING_SETTINGS, as given), the global batch, the replica count unless GLOBAL_BATCH_SIZE under DDP
gives one global order of the rows (then any count continues where the last one stopped), and a digest of the
data files. run.json and every checkpoint's completion marker record it, the ranks compare theirs at the
rendezvous, a restart compares it with the run folder's and with the checkpoint it would resume, and RUN_NAME,
unless set, is its hash. The learning rate and the step counts are left out: the plan derives them from the key.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from utils.errors import EXIT_BAD_INPUT, JobError
from utils.settings import Settings
from utils.tasks import validation_splits

DERIVED = {"global_batch": "global batch", "world_size": "replica count", "data": "data files"}
ZERO = ("strategy", "zero_stage", "zero_offload", "deepspeed_config")


def run_identity(settings: Settings, global_batch: int, world_size: int, elastic: bool) -> dict[str, Any]:
    """The key two starts must share to be one run (JSON-ready: run.json and the checkpoints hold it as is)."""
    return {
        **settings.training_settings(),
        "global_batch": global_batch,
        "world_size": None if elastic else world_size,
        "data": data_digest(settings),
    }


def run_name(settings: Settings, identity: dict[str, Any]) -> str:
    """RUN_NAME when set, else the model, the data, the rank and the identity's hash: the same on every replica
    and after every restart of one run, another for another run."""
    if settings.run_name:
        return settings.run_name
    model = Path(settings.model_name.rstrip("/")).name or "model"
    data = Path(settings.dataset_path.rstrip("/")).name if settings.dataset_path else settings.dataset_config
    return f"{model}-{data}-lora-r{settings.lora_r}-{short_digest(identity)[:8]}"


def short_digest(value: Any) -> str:
    """16 hex digits of the SHA-256 of `value` as JSON: the run name's tail, the data's fingerprint on the card."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def data_digest(settings: Settings) -> dict[str, str] | None:
    """SHA-256 of each file a local DATASET_PATH is read from (the split files, or every file of a save_to_disk
    folder), by its path in the folder: the files' bytes, not their dates, so a restored volume is the same data.
    None for a Hub data set, which DATASET_NAME and DATASET_CONFIG name."""
    if not settings.dataset_path:
        return None
    folder = Path(settings.dataset_path)
    if not folder.is_dir():
        return {}
    if (folder / "dataset_dict.json").exists():
        paths = [path for path in folder.rglob("*") if path.is_file()]
    else:
        splits = ("train", *validation_splits(settings))  # MNLI: validation_matched and validation_mismatched
        paths = [path for path in folder.iterdir() if path.is_file() and path.stem in splits]
    return {str(path.relative_to(folder)): sha256_file(path) for path in sorted(paths)}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def identity_changes(theirs: dict, ours: dict, ignore: frozenset[str] = frozenset()) -> list[str]:
    """`LORA_R: 8 -> 16`, `replica count: 2 -> 4`, `data files: train.csv changed` for each field that differs."""
    changes = []
    for name in sorted((set(theirs) | set(ours)) - ignore):
        was, now = theirs.get(name), ours.get(name)
        if was == now:
            continue
        if name == "data" and isinstance(was, dict) and isinstance(now, dict):
            files = sorted(f for f in set(was) | set(now) if was.get(f) != now.get(f))
            where = f" in DATASET_PATH={ours.get('dataset_path')}" if ours.get("dataset_path") else ""
            changes.append(f"data files: {', '.join(files[:4])}{where} added, removed or edited")
        else:
            changes.append(f"{DERIVED.get(name, name.upper())}: {was} -> {now}")
    return changes


def check_same_run(theirs: dict, ours: dict, where: str, ignore: frozenset[str] = frozenset()) -> None:
    """Refuse (exit 2) a start whose identity differs from the one `where` recorded, naming each difference and
    the fix: for another replica count, the count to restart with."""
    changes = identity_changes(theirs, ours, ignore)
    if not changes:
        return
    changed = {name for name in set(theirs) | set(ours) if theirs.get(name) != ours.get(name)} - ignore
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
    else:
        fix = "restore the old settings to resume"
    raise JobError(
        EXIT_BAD_INPUT,
        f"{where} holds another run ({'; '.join(changes)}); {fix}, or use a new OUTPUT_DIR to start over",
    )


def agreement_refusal(rank0: dict, others: dict[int, dict]) -> str | None:
    """The ranks' agreement (utils/run.agreement: the identity, the replica count, the run name and folder)
    compared with rank 0's at the rendezvous: None, or the refusal naming each difference and the fix."""
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

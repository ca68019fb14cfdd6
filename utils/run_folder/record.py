"""The run record (OUTPUT_DIR/run.json) and the claim on the folder: OUTPUT_DIR is the job's, and holds this run or
a finished run these settings agree with."""

from __future__ import annotations

import json
import os
import stat
from contextlib import suppress
from importlib import metadata
from pathlib import Path

from utils.common.errors import BadInput
from utils.config.identity import check_same_run
from utils.config.plan import Plan
from utils.config.settings import REPO_ID_PATTERN
from utils.run_folder.layout import LOCK_NAME, RunDir, not_writable
from utils.run_folder.model_files import LABELS_NAME

PACKAGES = ("torch", "transformers", "datasets", "accelerate", "peft", "bitsandbytes", "evaluate", "huggingface-hub")
# Written first into a folder the job claims: it deletes and replaces files there, so it works only in a folder it
# created or found empty.
RUN_MARKER = ".run-folder"
# What the job makes before its first record, all empty: the skeleton of a run killed that early before RUN_MARKER.
SKELETON = frozenset({"logs", "checkpoints", "cache", LOCK_NAME})
# A fresh file system's own folder at the root of a volume mounted as OUTPUT_DIR.
NOT_CONTENT = frozenset({"lost+found"})
# run.json's layout, in every run.json the job writes; older records are told by the keys every version wrote.
RUN_RECORD_FORMAT = 2
RECORD_KEYS = {"run_name": str, "settings": dict, "versions": dict}


def check_run_dir(
    output_dir: str,
    plan: Plan,
    label_names: tuple[str, ...] | None,
    base_model_id: str | None,
    push_only: bool = False,
) -> RunDir:
    """Refuse an OUTPUT_DIR that is not a run folder of this job, holds a planted link or another run, or a finished
    run with other label names or base model. Writes nothing."""
    run = RunDir(Path(output_dir).resolve())
    # First: a link in someone else's folder is theirs, not a link planted in ours.
    refuse_foreign(run, output_dir)
    run.check_planted()
    record = run.read_json(run.run_record) if run.root.is_dir() else None
    if record is not None:
        if record.get("format", RUN_RECORD_FORMAT) > RUN_RECORD_FORMAT:
            raise BadInput(
                f"{run.run_record} was written by a newer version of the job (format {record['format']}; this version "
                f"reads up to {RUN_RECORD_FORMAT}); run that version on this folder, or set OUTPUT_DIR to a new folder",
            )
        theirs, unrecorded = recorded_identity(record, plan.identity)
        # --push-only publishes what the volume holds: the replica count, global batch and data are not its to check.
        ignore = frozenset({"world_size", "global_batch", "data"}) if push_only else frozenset()
        if run.is_finished() and plan.identity.get("label_names") is None:
            # A finished run restarted without LABEL_NAMES publishes the names it recorded (check_finished_run).
            ignore |= {"label_names"}
        check_same_run(theirs, plan.identity, f"OUTPUT_DIR={output_dir}", ignore | unrecorded)
    if run.is_finished():
        check_finished_run(run, output_dir, label_names, base_model_id)
    elif push_only:  # before open_run_dir claims (or creates) the folder: a refused start leaves nothing behind
        raise BadInput(f"{run.model} holds no finished model; run the training first (without --push-only)")
    return run


def is_run_folder(run: RunDir) -> bool:
    """Whether OUTPUT_DIR is new, empty, or the job's: its RUN_MARKER or run.json, or the empty SKELETON. A run.json
    not the job's makes the folder someone else's, marker or not."""
    try:
        names = {entry.name for entry in os.scandir(run.root)} - NOT_CONTENT
    except (FileNotFoundError, NotADirectoryError):  # open_run_dir creates it, or says why it cannot
        return True
    if not names:
        return True
    marked = _is_regular(run.root / RUN_MARKER)
    if _is_regular(run.run_record):
        return _record_problem(run, marked) is None
    if marked:
        return True
    return names <= SKELETON and all(_is_empty_folder(run.root / name) for name in names - {LOCK_NAME})


def _record_problem(run: RunDir, marked: bool) -> str | None:
    """Why run.json is not this job's (None: it is): its `format`, or the keys every version wrote. Unmarked, one with
    other hard links is someone else's (marked, RunDir.open refuses it as a planted link)."""
    if not marked and os.lstat(run.run_record).st_nlink > 1:
        return "it is a file with other hard links"
    record = run.read_json(run.run_record)
    if "format" in record:
        fmt = record["format"]
        good = isinstance(fmt, int) and not isinstance(fmt, bool) and fmt >= RUN_RECORD_FORMAT
        return None if good else f"its format is {json.dumps(fmt)}, where the job writes {RUN_RECORD_FORMAT}"
    missing = [key for key, kind in RECORD_KEYS.items() if not isinstance(record.get(key), kind)]
    return f"it has no {', '.join(missing)}" if missing else None


def recorded_identity(record: dict, identity: dict) -> tuple[dict, frozenset[str]]:
    """run.json's identity (an older run's: its recorded settings), and the fields of `identity` it does not record."""
    if isinstance(record.get("identity"), dict):
        return record["identity"], frozenset()
    recorded = record.get("training_settings")
    recorded = recorded if isinstance(recorded, dict) else record.get("settings")
    theirs = {name: recorded[name] for name in identity if name in recorded} if isinstance(recorded, dict) else {}
    return theirs, frozenset(identity) - set(theirs)


def _is_regular(path: Path) -> bool:
    with suppress(OSError):
        return stat.S_ISREG(os.lstat(path).st_mode)
    return False


def _is_empty_folder(path: Path) -> bool:
    with suppress(OSError):
        return stat.S_ISDIR(os.lstat(path).st_mode) and not os.listdir(path)
    return False


def refuse_foreign(run: RunDir, output_dir: str | Path) -> None:
    if is_run_folder(run):
        return
    names = sorted(set(os.listdir(run.root)) - NOT_CONTENT)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    if _is_regular(run.run_record):
        why = f"its run.json is not one the job writes: {_record_problem(run, _is_regular(run.root / RUN_MARKER))}"
    else:
        why = f"no {RUN_MARKER} or run.json of the job's"
    raise BadInput(
        f"OUTPUT_DIR={output_dir} is not empty and is not a run folder of this job (it holds {shown}, and "
        f"{why}); the job deletes and replaces files in its run folder, so it leaves this one untouched: use an "
        "empty or new folder",
    )


def claim_run_dir(run: RunDir) -> None:
    """Mark OUTPUT_DIR as this job's before anything else is written (another rank sees it empty or marked)."""
    with suppress(FileExistsError), run.open(run.root / RUN_MARKER, "x") as handle:
        handle.write("A run folder of the LoRA fine-tuning job (main.py): it deletes and replaces files here.\n")


def discard_unused_claim(run: RunDir) -> None:
    """Remove OUTPUT_DIR after a refused start when it holds only what `open_run_dir` made; the folders first and only
    while empty: never a folder left unmarked with content."""
    with suppress(OSError):
        names = set(os.listdir(run.root))
        if not names <= {RUN_MARKER, *(SKELETON - {LOCK_NAME})}:
            return
        for name in sorted(names - {RUN_MARKER}):
            os.rmdir(run.root / name)  # OSError when not empty: kept from here on
        (run.root / RUN_MARKER).unlink(missing_ok=True)
        run.root.rmdir()


def check_finished_run(
    run: RunDir, output_dir: str, label_names: tuple[str, ...] | None, base_model_id: str | None
) -> None:
    """A finished run publishes what it recorded: a setting given now that contradicts it is refused."""
    names = run.read_json(run.model / LABELS_NAME)
    recorded = tuple(name for _, name in sorted((int(i), name) for i, name in names.items())) if names else None
    if recorded and label_names is not None and tuple(label_names) != recorded:
        raise BadInput(
            f"LABEL_NAMES={','.join(label_names)} contradicts the finished run in OUTPUT_DIR={output_dir}: "
            f"its model was trained with {','.join(recorded)} (label 0 first, {run.model / LABELS_NAME}); unset LABEL_NAMES (or "
            "label_names in the --config file) to publish the names it was trained with, or use a new OUTPUT_DIR to train with these",
        )
    trained_base = (run.read_json(run.model / "adapter_config.json") or {}).get("base_model_name_or_path")
    if not trained_base or not REPO_ID_PATTERN.match(trained_base) or Path(trained_base).expanduser().exists():
        return  # no base recorded, or a local folder: no Hub id to contradict
    if base_model_id and base_model_id != trained_base:
        raise BadInput(
            f"BASE_MODEL_ID={base_model_id} contradicts the finished run in OUTPUT_DIR={output_dir}: its "
            f"adapter names {trained_base} as its base ({run.model / 'adapter_config.json'}); unset BASE_MODEL_ID, or "
            "use a new OUTPUT_DIR to train on that base",
        )


def open_run_dir(
    output_dir: str,
    plan: Plan,
    label_names: tuple[str, ...] | None,
    base_model_id: str | None,
    push_only: bool = False,
) -> RunDir:
    """Create OUTPUT_DIR's folders, claimed as this job's, after refusing one `check_run_dir` refuses."""
    run = check_run_dir(output_dir, plan, label_names, base_model_id, push_only)
    try:
        run.root.mkdir(parents=True, exist_ok=True)  # OUTPUT_DIR itself, and the folders above it, are the user's
        claim_run_dir(run)
        for folder in (run.logs, run.checkpoints, run.cache):
            run.make_dir(folder)
        probe = run.logs / f".write-test-{os.getpid()}"
        run.open(probe, "x").close()
        probe.unlink()
    except OSError as exc:
        raise not_writable(output_dir, exc.strerror) from None
    return run


def write_run_record(run: RunDir, as_given: dict, plan: Plan, **extra) -> None:
    """run.json: the settings as given, the completed plan, its identity, the package versions."""
    versions = dict.fromkeys(PACKAGES)  # None: not installed
    for name in PACKAGES:
        with suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    plan_fields = dict(plan=plan.as_dict(), identity=plan.identity)
    update_run_record(run, run_name=plan.run_name, settings=as_given, **plan_fields, versions=versions, **extra)


def update_run_record(run: RunDir, **fields) -> None:
    run.write_json(run.run_record, {**(run.read_json(run.run_record) or {}), **fields, "format": RUN_RECORD_FORMAT})


def record_written(run: RunDir, what: str, paths: list[str], replace: bool = False) -> None:
    """Add files the job wrote (relative to the root) to what a push may send (run.json `written`)."""
    written = (run.read_json(run.run_record) or {}).get("written", {})
    update_run_record(
        run, written={**written, what: sorted(set(paths) | set([] if replace else written.get(what, [])))}
    )


def written_files(run: RunDir, what: str) -> list[Path] | None:
    names = ((run.read_json(run.run_record) or {}).get("written") or {}).get(what)
    return None if names is None else [run.root / name for name in names]

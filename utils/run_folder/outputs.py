"""The run folder (OUTPUT_DIR): its layout, atomic writes, and whether it is the job's and belongs to these settings.

    OUTPUT_DIR/
      .run-folder       the job's mark on a folder it claimed: it works only in its own (RUN_MARKER)
      model/            adapter + config, tokenizer, id2label.json, inputs.json, base_model.json, training_curves.png,
                        README.md card (rank 0)
      merged/           with MERGE_ADAPTER: the base with the adapter merged in, full precision         (rank 0)
      metrics.json      eval_accuracy/f1/precision/recall, eval_samples, world_size, train_*, what ran (rank 0)
      predictions/      the test split answered: predictions.jsonl, metrics.json when it is labelled    (rank 0)
      run.json          its format, the settings (secrets masked), the plan, the identity, versions, pushes (rank 0)
      checkpoints/      Trainer checkpoints; a COMPLETE manifest (file sizes and hashes, the identity) once one is whole
      logs/rank-R.log   one per rank
      tensorboard/      training curves
      cache/            tokenized data, keyed by tokenizer, max length and data fingerprint

Files other ranks or a restart read appear whole or not at all: written beside their final name on
the same volume, then renamed.

The job writes only regular files it created, inside OUTPUT_DIR, and publishes only those. The folder is on
a shared volume and RUN_NAME is predictable (--dry-run prints it), so a neighbour could plant a symbolic
link (logs/ -> elsewhere, tensorboard/RUN/x -> a folder holding a token) or a hard link to a file outside
(metrics.json): followed, the job would append its log to that file, overwrite it, or push it to the Hub.
So every file the job opens here is reached from OUTPUT_DIR one folder at a time without following a
link, and must be a regular file with no other hard link; what is planted is refused (exit 2) with the
path and the fix. `check_planted` refuses what is there before the run; the write itself refuses what is
planted during it. What a push sends is the list of files the job recorded as it wrote them
(`record_written`), never a walk of the folders.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import re
import shlex
import shutil
import stat
from contextlib import suppress
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO

from utils.common.errors import EXIT_BAD_INPUT, JobError, volume_error, volume_state
from utils.config.identity import check_same_run, sha256_file
from utils.config.plan import Plan
from utils.config.settings import REPO_ID_PATTERN, Settings
from utils.run_folder.model_files import LABELS_NAME

log = logging.getLogger(__name__)

PACKAGES = ("torch", "transformers", "datasets", "accelerate", "peft", "bitsandbytes", "evaluate", "huggingface-hub")
COMPLETE_MARKER = "COMPLETE"
# Written first into a folder the job claims: the job deletes and replaces files in its run folder (unfinished
# checkpoints, model/), so it works only in a folder it created or found empty.
RUN_MARKER = ".run-folder"
# What the job makes before its first record, all empty: the skeleton of a run killed that early before RUN_MARKER.
LOCK_NAME = ".job.lock"  # utils/cluster/run_lock.py's lock file
SKELETON = frozenset({"logs", "checkpoints", "cache", LOCK_NAME})
# A fresh file system's own folder at the root of a volume mounted as OUTPUT_DIR.
NOT_CONTENT = frozenset({"lost+found"})
# run.json's layout, written into every run.json the job writes: a file of that name is this job's record only when
# it says so (another tool's run.json marks no run folder of this job's). The records from before the key (1) are
# told by the keys every version of the job wrote (RECORD_KEYS); a newer layout is refused, not guessed at.
RUN_RECORD_FORMAT = 2
RECORD_KEYS = {"run_name": str, "settings": dict, "versions": dict}
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class RunDir:
    root: Path

    model = property(lambda self: self.root / "model")
    merged = property(lambda self: self.root / "merged")
    metrics = property(lambda self: self.root / "metrics.json")
    run_record = property(lambda self: self.root / "run.json")
    checkpoints = property(lambda self: self.root / "checkpoints")
    logs = property(lambda self: self.root / "logs")
    tensorboard = property(lambda self: self.root / "tensorboard")
    cache = property(lambda self: self.root / "cache")
    predictions = property(lambda self: self.root / "predictions")

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def rank_record(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.json"

    def is_finished(self) -> bool:
        return self.metrics.is_file() and (self.model / "adapter_config.json").is_file()

    def open(self, path: Path, mode: str = "r") -> IO:
        """`path` (under the root) opened for reading ("r", "rb"), appending ("a"), writing ("w", "wb") or
        creating ("x"), its folders created as needed; a link on the way or a file with other hard links is
        refused (JobError, exit 2) before a byte is read or written."""
        flags = {"r": os.O_RDONLY, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "w": os.O_WRONLY | os.O_CREAT}
        flags["x"] = flags["w"] | os.O_EXCL
        # O_NONBLOCK: a FIFO planted under the name must not block the open; regular files ignore it.
        base = flags[mode.rstrip("b")] | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        folder = self._open_folder(path.parent, create=mode.rstrip("b") != "r")
        try:
            fd = os.open(path.name, base, FILE_MODE, dir_fd=folder)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise planted(path) from None
            raise
        finally:
            os.close(folder)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
            os.close(fd)
            raise planted(path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if mode.rstrip("b") == "w":
            os.ftruncate(fd, 0)  # only now: truncating first would have emptied another link's file
        text = {} if "b" in mode else {"encoding": "utf-8"}
        return os.fdopen(fd, mode.replace("x", "w"), **text)

    def write_text(self, path: Path, text: str) -> None:
        """Write `path` whole or not at all: beside its final name, then renamed over it."""
        folder = self._open_folder(path.parent, create=True)
        partial = f".{path.name}.partial-{os.getpid()}"
        try:
            with suppress(FileNotFoundError):
                os.unlink(partial, dir_fd=folder)
            fd = os.open(
                partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=folder
            )
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            present = None
            with suppress(FileNotFoundError):
                present = os.stat(path.name, dir_fd=folder, follow_symlinks=False)
            if present is not None and (not stat.S_ISREG(present.st_mode) or present.st_nlink > 1):
                os.unlink(partial, dir_fd=folder)
                raise planted(path)
            os.replace(partial, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        finally:
            os.close(folder)

    def write_json(self, path: Path, payload: dict) -> None:
        """`payload` as JSON, a NaN or infinite number as null: Python writes them as NaN and Infinity, which no JSON
        reader takes (an evaluation's Pearson correlation of constant predictions is NaN)."""
        replaced: list[str] = []
        text = json.dumps(_finite(payload, "", replaced), indent=2, sort_keys=True, allow_nan=False)
        if replaced:
            log.warning("%s: %s not a finite number, written as null", path.name, ", ".join(replaced[:5]))
        self.write_text(path, text + "\n")

    def read_json(self, path: Path) -> dict | None:
        """The JSON object in `path`, None when there is no file; a torn or foreign file is bad input with the fix."""
        try:
            with self.open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return None
        try:
            payload = json.loads(data)
            what = None if isinstance(payload, dict) else f"a JSON {type(payload).__name__}, not an object"
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            what = f"not valid JSON: {str(exc).splitlines()[0][:80]}"
        if what is None:
            return payload
        # run.json is what tells this run from another one's folder: guessing would risk resuming foreign checkpoints.
        raise JobError(
            EXIT_BAD_INPUT,
            f"{path} is damaged ({what}); if this folder holds only this run, delete {path.name} and start again "
            "(checkpoints and the tokenized cache are kept and reused), otherwise set OUTPUT_DIR to a new folder",
        )

    def make_dir(self, path: Path, fresh: bool = False) -> Path:
        """`path` as a real folder of the job's (with `fresh`, emptied first); a link at its name or on the way
        is refused, except at a `fresh` folder's own name, which is set aside: the job discards that folder anyway."""
        if fresh:
            with suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    shutil.rmtree(path)  # removes links inside it, never what they point to
                else:
                    path.unlink()
        os.close(self._open_folder(path, create=True))
        return path

    def files_in(self, folder: Path) -> list[str]:
        """The files in a folder the job just filled, relative to it, for `record_written`."""
        return sorted(str(path.relative_to(folder)) for path in _unplanted_files(folder))

    def record_written(self, what: str, paths: list[str], replace: bool = False) -> None:
        """Add files the job wrote (relative to the root) to what a push may send (run.json `written`)."""
        record = self.read_json(self.run_record) or {}
        written = record.setdefault("written", {})
        written[what] = sorted(set(paths) | (set() if replace else set(written.get(what, []))))
        self.write_json(self.run_record, {**record, "format": RUN_RECORD_FORMAT})

    def written(self, what: str) -> list[Path] | None:
        names = ((self.read_json(self.run_record) or {}).get("written") or {}).get(what)
        return None if names is None else [self.root / name for name in names]

    def check_owned(self, path: Path) -> None:
        self.open(path).close()  # refuses a link on the way, a file with other hard links, a FIFO

    def check_planted(self) -> None:
        """Before the run: nothing is read or written through a link planted under the root."""
        if self.root.is_dir():
            _unplanted_files(self.root)

    def _open_folder(self, folder: Path, create: bool) -> int:
        """A descriptor of `folder` (the root or below it), reached one name at a time without following a link."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            reached = self.root
            for name in folder.relative_to(self.root).parts:
                reached = reached / name
                if create:
                    with suppress(FileExistsError):
                        os.mkdir(name, DIR_MODE, dir_fd=fd)
                try:
                    child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise planted(reached) from None
                    raise
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise


def _finite(value, where: str, replaced: list[str]):
    """`value` with each NaN or infinite float replaced by None, their places added to `replaced`."""
    if isinstance(value, float) and not math.isfinite(value):
        replaced.append(where or "the value")
        return None
    if isinstance(value, dict):
        return {key: _finite(item, f"{where}.{key}" if where else str(key), replaced) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item, f"{where}[{i}]", replaced) for i, item in enumerate(value)]
    return value


def _unplanted_files(folder: Path) -> list[Path]:
    """The regular files under `folder`; a symbolic link or a file with other hard links anywhere in it is refused.
    os.walk never descends into a linked folder."""
    files = []
    for current, folders, names in os.walk(folder):
        for name in sorted([*folders, *names]):
            path = Path(current) / name
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue  # gone since the listing: another rank's write probe in logs/; nothing to refuse
            if stat.S_ISLNK(info.st_mode) or (not stat.S_ISDIR(info.st_mode) and info.st_nlink > 1):
                raise planted(path)
            if stat.S_ISREG(info.st_mode):
                files.append(path)
    return files


def planted(path: Path) -> JobError:
    """Bad input naming what was found at `path` and the fix: the job neither follows nor removes it."""
    info = None
    with suppress(OSError):
        info = os.lstat(path)
    kept = "what it points to is kept"
    if info is None:
        what = "was replaced while the job used it"
    elif stat.S_ISLNK(info.st_mode):
        what = f"is a symbolic link (to {os.readlink(path)})"
    elif stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        what = f"is a file with {info.st_nlink - 1} other hard link(s)"
        kept = "the other names keep the content"
    elif stat.S_ISDIR(info.st_mode):
        what = "is a folder where the job writes a file"
        kept = "it holds no file of this job's"
    elif stat.S_ISREG(info.st_mode):
        what = "is a file where the job keeps a folder"
    else:
        what = "is not a regular file"
    return JobError(
        EXIT_BAD_INPUT,
        f"{path} {what}; the job writes and publishes only files it created itself, never through a link: "
        f"remove it (rm {'-r ' if info and stat.S_ISDIR(info.st_mode) else ''}{shlex.quote(str(path))}; {kept}) "
        "and start again",
    )


# What the job creates, before the umask takes its bits away, as open() and mkdir() do by default: the volume is
# shared, and the umask of whoever started the job says who else reads (and writes) what it leaves there.
FILE_MODE, DIR_MODE = 0o666, 0o777


def process_umask() -> int:
    """The umask, read without setting it (os.umask sets one to read it: another thread could create a file then)."""
    with suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_tree(folder: Path) -> None:
    """Flush a folder's files to the volume before a rename or a marker declares them whole, each with the mode
    the umask gives a new file.

    A killed process loses nothing the kernel already has; a node that goes down (a preempted VM) loses
    what is not yet on disk, and the marker must not outlive the files it vouches for. Links are not
    followed (a planted one is refused where it would be read or published). The mode: safetensors writes
    its files 0600 whatever the umask, so the model and checkpoints on a shared volume were unreadable to
    the rest of the group (a teammate, predict.py run by another user); every folder the job saves passes here.
    """
    file_mode = FILE_MODE & ~process_umask()
    for current, _, files in os.walk(folder):
        for path in [*(Path(current) / name for name in sorted(files)), Path(current)]:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENXIO):
                    continue
                raise
            try:
                info = os.fstat(fd)
                # Only a file of the job's own with no other name: a hard link planted in a checkpoint folder
                # must not have its mode opened up.
                ours = stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and info.st_uid == os.geteuid()
                if ours and stat.S_IMODE(info.st_mode) != file_mode:
                    os.fchmod(fd, file_mode)
                if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
                    os.fsync(fd)
            finally:
                os.close(fd)


def replace_dir(staged: Path, final: Path) -> None:
    """Swap a fully written folder into place; a reader sees the old one or the new one, never half."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    fsync_tree(staged)
    if final.exists():
        final.rename(old)
    staged.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def check_run_dir(settings: Settings, plan: Plan, push_only: bool = False) -> RunDir:
    """Refuse an OUTPUT_DIR that is not a run folder of this job, holds a planted link, or holds another run (its
    run.json's identity, utils/config/identity.py); a finished run also with other label names or base model
    (`check_finished_run`). `push_only` publishes what the volume holds: the replica count, the global batch and
    the data are not its to check, and a folder without a finished run is refused. Reads, writes nothing."""
    run = RunDir(Path(settings.output_dir).resolve())
    refuse_foreign(run, settings)  # first: a link in someone else's folder is theirs, not a link planted in ours
    run.check_planted()
    record = run.read_json(run.run_record) if run.root.is_dir() else None
    if record is not None:
        check_record_format(run, record)
        theirs, unrecorded = recorded_identity(record, plan.identity)
        ignore = frozenset({"world_size", "global_batch", "data"}) if push_only else frozenset()
        if run.is_finished() and plan.identity.get("label_names") is None:
            # A finished run restarted without LABEL_NAMES publishes the names it recorded (check_finished_run).
            ignore |= {"label_names"}
        check_same_run(theirs, plan.identity, f"OUTPUT_DIR={settings.output_dir}", ignore | unrecorded)
    if run.is_finished():
        check_finished_run(run, settings)
    elif push_only:  # before open_run_dir claims (or creates) the folder: a refused start leaves nothing behind
        raise JobError(
            EXIT_BAD_INPUT, f"{run.model} holds no finished model; run the training first (without --push-only)"
        )
    return run


def is_run_folder(run: RunDir) -> bool:
    """Whether OUTPUT_DIR is new, empty, or a run folder of this job: its RUN_MARKER or a run.json of this job's
    (runs from before the marker), or the empty skeleton a start killed before either leaves. A run.json that is not
    the job's (`foreign_record`) makes the folder someone else's, marker or not: the job would resume, rewrite and
    publish what it holds as its own. Links are not followed."""
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
    """Why the file run.json is not this job's record (None: it is). Unmarked, one with other hard links is someone
    else's file (the job's has one name); in a folder the job marked, that is a planted link, refused with its fix by
    RunDir.open, as a damaged one is."""
    if not marked and os.lstat(run.run_record).st_nlink > 1:
        return "it is a file with other hard links"
    return foreign_record(run.read_json(run.run_record))


def foreign_record(record: dict) -> str | None:
    """Why `record`, a run.json, is not one this job wrote (None: it is). Its layout's `format`, or, for the records
    written before that key, the keys every version of the job wrote: another tool's run.json
    (`{"tool": "another-trainer"}`) holds neither."""
    if "format" in record:
        fmt = record["format"]
        good = isinstance(fmt, int) and not isinstance(fmt, bool) and fmt >= RUN_RECORD_FORMAT
        return None if good else f"its format is {json.dumps(fmt)}, where the job writes {RUN_RECORD_FORMAT}"
    missing = [key for key, kind in RECORD_KEYS.items() if not isinstance(record.get(key), kind)]
    return f"it has no {', '.join(missing)}" if missing else None


def check_record_format(run: RunDir, record: dict) -> None:
    """A run.json of a newer version of the job is refused: what it records is not this version's to read."""
    if record.get("format", RUN_RECORD_FORMAT) > RUN_RECORD_FORMAT:
        raise JobError(
            EXIT_BAD_INPUT,
            f"{run.run_record} was written by a newer version of the job (format {record['format']}; this version "
            f"reads up to {RUN_RECORD_FORMAT}); run that version on this folder, or set OUTPUT_DIR to a new folder",
        )


def recorded_identity(record: dict, identity: dict) -> tuple[dict, frozenset[str]]:
    """What run.json says its run was, and the fields of `identity` it does not record (left out of the comparison).
    Its identity; for a run from before the identity existed, the training settings it recorded (`training_settings`,
    or those among its `settings`): such a run is refused on what it recorded, before anything in its folder is
    touched, instead of resumed on a model of another shape with run.json rewritten to the new settings."""
    if isinstance(record.get("identity"), dict):
        return record["identity"], frozenset()
    recorded = record.get("training_settings")
    recorded = recorded if isinstance(recorded, dict) else record.get("settings")
    theirs = {name: recorded[name] for name in identity if name in recorded} if isinstance(recorded, dict) else {}
    return theirs, frozenset(identity) - set(theirs)


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_empty_folder(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and not os.listdir(path)
    except OSError:
        return False


def refuse_foreign(run: RunDir, settings: Settings) -> None:
    """A non-empty OUTPUT_DIR that is not a run of this job is refused, untouched: resuming, the job would delete
    a checkpoint it did not write as one cut short, and replace a model/ folder it did not save."""
    if is_run_folder(run):
        return
    names = sorted(set(os.listdir(run.root)) - NOT_CONTENT)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    if _is_regular(run.run_record):
        why = f"its run.json is not one the job writes: {_record_problem(run, _is_regular(run.root / RUN_MARKER))}"
    else:
        why = f"no {RUN_MARKER} or run.json of the job's"
    raise JobError(
        EXIT_BAD_INPUT,
        f"OUTPUT_DIR={settings.output_dir} is not empty and is not a run folder of this job (it holds {shown}, and "
        f"{why}); the job deletes and replaces files in its run folder, so it leaves this one untouched: use an "
        "empty or new folder",
    )


def claim_run_dir(run: RunDir) -> None:
    """Mark OUTPUT_DIR as this job's, before anything else is written into it (another rank checking the folder
    meanwhile sees it empty or marked, never half-made)."""
    with suppress(FileExistsError), run.open(run.root / RUN_MARKER, "x") as handle:
        handle.write("A run folder of the LoRA fine-tuning job (main.py): it deletes and replaces files here.\n")


def discard_unused_claim(run: RunDir) -> None:
    """Remove OUTPUT_DIR when it holds only what `open_run_dir` made (the marker, empty logs/, checkpoints/, cache/):
    called for a folder this start created, when the start is refused, so that it leaves nothing behind. The folders
    go first and only while empty (another rank's file in one keeps it, and with it the marker): never a folder left
    unmarked with content, which the next start would refuse as someone else's."""
    with suppress(OSError):
        names = set(os.listdir(run.root))
        if not names <= {RUN_MARKER, *(SKELETON - {LOCK_NAME})}:
            return
        for name in sorted(names - {RUN_MARKER}):
            os.rmdir(run.root / name)  # OSError when not empty: kept from here on
        (run.root / RUN_MARKER).unlink(missing_ok=True)
        run.root.rmdir()


def check_finished_run(run: RunDir, settings: Settings) -> None:
    """What a finished run publishes comes from its own records (model/id2label.json, adapter_config.json): a
    setting given now that contradicts them is refused with the recorded value and the fix."""
    names = run.read_json(run.model / LABELS_NAME)
    recorded = tuple(name for _, name in sorted((int(i), name) for i, name in names.items())) if names else None
    if recorded and "label_names" in settings.model_fields_set and tuple(settings.label_names) != recorded:
        raise JobError(
            EXIT_BAD_INPUT,
            f"LABEL_NAMES={','.join(settings.label_names)} contradicts the finished run in OUTPUT_DIR={settings.output_dir}: "
            f"its model was trained with {','.join(recorded)} (label 0 first, {run.model / LABELS_NAME}); unset LABEL_NAMES (or "
            "label_names in the --config file) to publish the names it was trained with, or use a new OUTPUT_DIR to train with these",
        )
    trained_base = (run.read_json(run.model / "adapter_config.json") or {}).get("base_model_name_or_path")
    if not trained_base or not REPO_ID_PATTERN.match(trained_base) or Path(trained_base).expanduser().exists():
        return  # no base recorded, or a local folder: no Hub id to contradict
    if settings.base_model_id and settings.base_model_id != trained_base:
        raise JobError(
            EXIT_BAD_INPUT,
            f"BASE_MODEL_ID={settings.base_model_id} contradicts the finished run in OUTPUT_DIR={settings.output_dir}: its "
            f"adapter names {trained_base} as its base ({run.model / 'adapter_config.json'}); unset BASE_MODEL_ID, or "
            "use a new OUTPUT_DIR to train on that base",
        )


def open_run_dir(settings: Settings, plan: Plan, push_only: bool = False) -> RunDir:
    """Create OUTPUT_DIR's folders, claimed as this job's, after refusing one `check_run_dir` refuses."""
    run = check_run_dir(settings, plan, push_only=push_only)
    try:
        run.root.mkdir(parents=True, exist_ok=True)  # OUTPUT_DIR itself, and the folders above it, are the user's
        claim_run_dir(run)
        for folder in (run.logs, run.checkpoints, run.cache):
            run.make_dir(folder)
        probe = run.logs / f".write-test-{os.getpid()}"
        run.open(probe, "x").close()
        probe.unlink()
    except OSError as exc:
        raise not_writable(settings.output_dir, exc.strerror) from None
    return run


def not_writable(output_dir: str, strerror: str | None) -> JobError:
    return JobError(
        EXIT_BAD_INPUT,
        f"OUTPUT_DIR={output_dir} is not writable ({strerror}) by uid {os.getuid()}; "
        "mount a writable volume there or set OUTPUT_DIR to a writable folder",
    )


def check_output_writable(output_dir: str) -> None:
    """What `open_run_dir` would meet creating OUTPUT_DIR's folders, found without writing (for --dry-run): the
    nearest existing folder on the path must be a folder this uid may write into, on a writable volume."""
    path = Path(output_dir).absolute()
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        # mkdir's own errors: OUTPUT_DIR itself a file, or a file where a folder above it should be
        raise not_writable(output_dir, os.strerror(errno.EEXIST if existing == path else errno.ENOTDIR))
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        raise not_writable(output_dir, os.strerror(errno.EROFS if read_only else errno.EACCES))


def write_run_record(run: RunDir, settings: Settings, plan: Plan, **extra) -> None:
    """run.json: the settings as given, the plan (completed), the run's identity, the package versions."""
    versions = dict.fromkeys(PACKAGES)  # None: not installed
    for name in PACKAGES:
        with suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    settings_and_plan = dict(settings=settings.as_dict(), plan=plan.as_dict(), identity=plan.identity)
    update_run_record(run, run_name=plan.run_name, **settings_and_plan, versions=versions, **extra)


def update_run_record(run: RunDir, **fields) -> None:
    run.write_json(run.run_record, {**(run.read_json(run.run_record) or {}), **fields, "format": RUN_RECORD_FORMAT})


def mark_checkpoint_complete(run: RunDir, checkpoint: Path, resume_key: dict) -> None:
    """Declare a checkpoint whole; call it once every rank has written its part (its RNG state).

    The marker is a manifest: every file's size and SHA-256, so a resume can tell a checkpoint damaged
    after it was marked (a truncated optimizer state, a deleted file), and `resume_key`: the run's identity
    (utils/config/identity.py), so a restart that would continue another run is refused instead of silently skipping
    or repeating rows, and the stretches of the run so far.
    """
    fsync_tree(checkpoint)
    files = {
        str(path.relative_to(checkpoint)): {"size": path.stat().st_size, "sha256": sha256_file(path)}
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file() and path.name != COMPLETE_MARKER
    }
    run.write_json(checkpoint / COMPLETE_MARKER, {"resume": resume_key, "files": files})


def checkpoint_damage(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint marked complete (None: every file is as it was when marked)."""
    try:
        manifest = json.loads((checkpoint / COMPLETE_MARKER).read_text())
        files, _ = manifest["files"], manifest["resume"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its COMPLETE manifest is unreadable"
    for name, expected in sorted(files.items()):
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{name} has {path.stat().st_size} bytes, {expected['size']} when it was written"
        if sha256_file(path) != expected["sha256"]:
            return f"{name} changed since it was written (checksum)"
    return None


def checkpoint_resume_key(checkpoint: Path) -> dict:
    return json.loads((checkpoint / COMPLETE_MARKER).read_text())["resume"]


def _checkpoints(run: RunDir, complete: bool = True) -> list[Path]:
    """The checkpoint folders marked complete (or, `complete=False`, those a kill cut short), oldest first."""
    found = sorted(
        (int(match.group(1)), path)
        for path in run.checkpoints.glob("checkpoint-*")
        if (match := CHECKPOINT_RE.match(path.name)) and path.is_dir()
    )
    return [path for _, path in found if (path / COMPLETE_MARKER).is_file() == complete]


def latest_complete_checkpoint(run: RunDir) -> Path | None:
    return next(reversed(_checkpoints(run)), None)


def usable_checkpoints(run: RunDir) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint whose files are intact, and the damaged ones found newer than it
    (removed: a later save of the same step must not mix with their files)."""
    damaged = []
    for path in reversed(_checkpoints(run)):
        problem = checkpoint_damage(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
        shutil.rmtree(path, ignore_errors=True)
    return None, damaged


def discard_incomplete_checkpoints(run: RunDir) -> list[Path]:
    """Remove checkpoints a kill cut short, so neither resume nor the next save ever mixes in their files."""
    removed = _checkpoints(run, complete=False)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def prune_checkpoints(run: RunDir, keep: int, best: str | None = None) -> None:
    """Keep the newest `keep` complete checkpoints, and `best` (LOAD_BEST_MODEL's, the model the run ends with)
    beside them. Runs after a new one is marked complete, so the newest complete checkpoint is never deleted before
    a newer one is whole (the Trainer's own rotation deletes before the new one is finished, and by mtime)."""
    complete = [path for path in _checkpoints(run) if best is None or path.name != Path(best).name]
    for path in complete[: max(0, len(complete) - keep)]:
        # The marker goes first: a kill in the middle of the deletion leaves an unmarked checkpoint, which
        # the next start discards quietly, never a marked one with files missing.
        (path / COMPLETE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)


def volume_fault(run: RunDir, exc: BaseException, doing: str) -> JobError | None:
    """The one-line error (exit 2) when `exc` means OUTPUT_DIR's volume is full or turned read-only, naming the
    checkpoint a restart resumes from once the volume is fixed; None for any other failure."""
    state = volume_state(exc, run.root)
    if state is None:
        return None
    latest = None
    with suppress(OSError):
        latest = latest_complete_checkpoint(run)
    resume = (
        f"it resumes from {latest.name}, the last complete checkpoint (kept intact; one cut short is discarded)"
        if latest
        else "no checkpoint is complete yet, so the run starts over"
    )
    return volume_error(state, run.root, doing, resume)

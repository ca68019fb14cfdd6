"""The run folder (OUTPUT_DIR): its layout and its writes, atomic and through no planted link.

    OUTPUT_DIR/
      .run-folder       the job's mark on a folder it claimed: it works only in its own (record.py RUN_MARKER)
      .job.lock         one job at a time (utils/cluster/run_lock.py)
      model/            adapter, tokenizer, id2label.json, inputs.json, base_model.json, curves, README.md card
      merged/           with MERGE_ADAPTER: the base with the adapter merged in, full precision
      metrics.json      eval_accuracy/f1/precision/recall, eval_samples, world_size, train_*, what ran
      predictions/      the test split answered: predictions.jsonl, metrics.json when it is labelled
      run.json          the settings (secrets masked), the plan, the identity, versions, pushes (record.py)
      checkpoints/      Trainer checkpoints, each with a COMPLETE manifest once whole (checkpoints.py)
      logs/rank-R.log   one per rank
      tensorboard/      training curves
      cache/            tokenized data, keyed by tokenizer, max length and data fingerprint

Rank 0 writes model/, merged/, metrics.json, predictions/ and run.json. Files other ranks or a restart read are
written beside their final name, then renamed: whole or not at all.

The folder is on a shared volume, so a neighbour could plant a symbolic link (logs/ -> elsewhere) or a hard
link to a file outside (metrics.json): followed, the job would append to, overwrite or push that file. So every
file is reached from OUTPUT_DIR one folder at a time without following a link, and must be a regular file with
no other hard link; what is planted is refused (exit 2) with the fix. A push sends the files the job recorded as
it wrote them (record.py `record_written`), never a walk of the folders.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import shlex
import shutil
import stat
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from utils.common.errors import BadInput, JobError

log = logging.getLogger(__name__)

LOCK_NAME = ".job.lock"  # utils/cluster/run_lock.py's lock file


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
        """`path` (under the root) opened ("r", "rb", "a", "w", "wb", "x"), its folders created as needed; a link
        on the way or a file with other hard links is refused before a byte is read or written."""
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
        """`payload` as JSON, a NaN or infinite number as null: no JSON reader takes Python's NaN (an evaluation's
        Pearson correlation of constant predictions)."""
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
        raise BadInput(
            f"{path} is damaged ({what}); if this folder holds only this run, delete {path.name} and start again "
            "(checkpoints and the tokenized cache are kept and reused), otherwise set OUTPUT_DIR to a new folder",
        )

    def make_dir(self, path: Path, fresh: bool = False) -> Path:
        """`path` as a real folder of the job's (with `fresh`, emptied first: a link at its own name is removed)."""
        if fresh:
            with suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    shutil.rmtree(path)  # removes links inside it, never what they point to
                else:
                    path.unlink()
        os.close(self._open_folder(path, create=True))
        return path

    def files_in(self, folder: Path) -> list[str]:
        """The files in a folder the job just filled, relative to it, for record.py `record_written`."""
        return sorted(str(path.relative_to(folder)) for path in _unplanted_files(folder))

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
    if isinstance(value, float) and not math.isfinite(value):
        replaced.append(where or "the value")
        return None
    if isinstance(value, dict):
        return {key: _finite(item, f"{where}.{key}" if where else str(key), replaced) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item, f"{where}[{i}]", replaced) for i, item in enumerate(value)]
    return value


def _unplanted_files(folder: Path) -> list[Path]:
    """The regular files under `folder`; a link anywhere in it is refused."""
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
    return BadInput(
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
    """Flush a folder's files to disk before a rename or a marker declares them whole (a node that goes down loses
    what is not on disk), each with the mode the umask gives a new file: safetensors writes 0600 whatever the umask,
    which would hide the model from the rest of the group on a shared volume."""
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
                # Only the job's own files: a planted hard link must not have its mode opened up.
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


def not_writable(output_dir: str, strerror: str | None) -> JobError:
    return BadInput(
        f"OUTPUT_DIR={output_dir} is not writable ({strerror}) by uid {os.getuid()}; "
        "mount a writable volume there or set OUTPUT_DIR to a writable folder",
    )


def check_output_writable(output_dir: str) -> None:
    """What `open_run_dir` would meet creating OUTPUT_DIR, found without writing (for --dry-run)."""
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

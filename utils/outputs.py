"""The run folder (OUTPUT_DIR): its layout, atomic writes, and whether it belongs to these settings.

    OUTPUT_DIR/
      model/            adapter + config, tokenizer, id2label.json, training_curves.png, README.md model card   (rank 0)
      merged/           with MERGE_ADAPTER: the base with the adapter merged in, full precision         (rank 0)
      metrics.json      eval_accuracy/f1/precision/recall, eval_samples, world_size, train_*, what ran (rank 0)
      run.json          resolved settings (secrets masked), package versions, push record (rank 0)
      checkpoints/      Trainer checkpoints; a COMPLETE manifest (file sizes and hashes, what a resume must keep) once one is whole
      logs/rank-R.log   one per rank
      tensorboard/      training curves
      cache/            tokenized data, keyed by tokenizer, max length and data fingerprint

Files other ranks or a restart read appear whole or not at all: written beside their final name on
the same volume, then renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from utils.errors import EXIT_BAD_INPUT, JobError
from utils.settings import Settings

PACKAGES = ("torch", "transformers", "datasets", "accelerate", "peft", "bitsandbytes", "evaluate", "huggingface-hub")
COMPLETE_MARKER = "COMPLETE"
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

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def rank_record(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.json"

    def is_finished(self) -> bool:
        return self.metrics.is_file() and (self.model / "adapter_config.json").is_file()


def write_json(path: Path, payload: dict) -> None:
    _write_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with open(partial, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def fsync_tree(folder: Path) -> None:
    """Flush a folder's files to the volume before a rename or a marker declares them whole.

    A killed process loses nothing the kernel already has; a node that goes down (a preempted VM) loses
    what is not yet on disk, and the marker must not outlive the files it vouches for.
    """
    for path in [*sorted(p for p in folder.rglob("*") if p.is_file()), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, None when there is no file; a torn or foreign file is bad input with the fix."""
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise _damaged(path, f"not valid JSON: {str(exc).splitlines()[0][:80]}") from None
    if not isinstance(payload, dict):
        raise _damaged(path, f"a JSON {type(payload).__name__}, not an object")
    return payload


def _damaged(path: Path, what: str) -> JobError:
    # run.json is what tells this run from another one's folder: guessing would risk resuming foreign checkpoints.
    return JobError(
        EXIT_BAD_INPUT,
        f"{path} is damaged ({what}); if this folder holds only this run, delete {path.name} and start again "
        "(checkpoints and the tokenized cache are kept and reused), otherwise set OUTPUT_DIR to a new folder",
    )


def replace_dir(staged: Path, final: Path) -> None:
    """Swap a fully written folder into place; a reader sees the old one or the new one, never half."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    fsync_tree(staged)
    if final.exists():
        final.rename(old)
    staged.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def check_run_dir(settings: Settings) -> RunDir:
    """Refuse an OUTPUT_DIR whose run.json holds a run with other training settings (reads, writes nothing)."""
    run = RunDir(Path(settings.output_dir).resolve())
    record = read_json(run.run_record) if run.root.is_dir() else None
    if record is not None:
        theirs, ours = record.get("training_settings", {}), settings.training_settings()
        changed = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        if changed:
            detail = ", ".join(f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in changed[:4])
            raise JobError(
                EXIT_BAD_INPUT,
                f"OUTPUT_DIR={settings.output_dir} holds a run with other training settings ({detail}); "
                "use a new OUTPUT_DIR for new settings, or restore the old ones to resume",
            )
    return run


def open_run_dir(settings: Settings) -> RunDir:
    """Create OUTPUT_DIR's folders and refuse a folder that holds a run with other training settings."""
    run = check_run_dir(settings)
    try:
        for folder in (run.root, run.logs, run.checkpoints, run.cache):
            folder.mkdir(parents=True, exist_ok=True)
        probe = run.logs / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise JobError(
            EXIT_BAD_INPUT,
            f"OUTPUT_DIR={settings.output_dir} is not writable ({exc.strerror}) by uid {os.getuid()}; "
            "mount a writable volume there or set OUTPUT_DIR to a writable folder",
        ) from None
    return run


def write_run_record(run: RunDir, settings: Settings, **extra) -> None:
    record = read_json(run.run_record) or {}
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    record.update(
        run_name=settings.run_name,
        settings=settings.as_dict(),
        training_settings=settings.training_settings(),
        versions=versions,
    )
    record.update(extra)
    write_json(run.run_record, record)


def mark_checkpoint_complete(checkpoint: Path, resume_key: dict) -> None:
    """Declare a checkpoint whole; call it once every rank has written its part (its RNG state).

    The marker is a manifest: every file's size and SHA-256, so a resume can tell a checkpoint damaged
    after it was marked (a truncated optimizer state, a deleted file), and `resume_key`, what a resume
    must not change (world size, global batch, the data), so a restart that would continue another run
    is refused instead of silently skipping or repeating rows.
    """
    fsync_tree(checkpoint)
    files = {
        str(path.relative_to(checkpoint)): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file() and path.name != COMPLETE_MARKER
    }
    _write_atomic(
        checkpoint / COMPLETE_MARKER,
        json.dumps({"resume": resume_key, "files": files}, indent=2, sort_keys=True) + "\n",
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
        if _sha256(path) != expected["sha256"]:
            return f"{name} changed since it was written (checksum)"
    return None


def checkpoint_resume_key(checkpoint: Path) -> dict:
    return json.loads((checkpoint / COMPLETE_MARKER).read_text())["resume"]


def _checkpoints(run: RunDir) -> list[tuple[int, Path, bool]]:
    """(step, path, complete) for every checkpoint folder, oldest first."""
    found = []
    for path in run.checkpoints.glob("checkpoint-*"):
        match = CHECKPOINT_RE.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path, (path / COMPLETE_MARKER).is_file()))
    return sorted(found)


def latest_complete_checkpoint(run: RunDir) -> Path | None:
    """The newest checkpoint whose save finished; one cut short by a kill has no marker and is skipped."""
    complete = [path for _, path, done in _checkpoints(run) if done]
    return complete[-1] if complete else None


def usable_checkpoints(run: RunDir) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint whose files are intact, and the damaged ones found newer than it
    (removed: a later save of the same step must not mix with their files)."""
    damaged = []
    for _, path, done in reversed(_checkpoints(run)):
        if not done:
            continue
        problem = checkpoint_damage(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
        shutil.rmtree(path, ignore_errors=True)
    return None, damaged


def discard_incomplete_checkpoints(run: RunDir) -> list[Path]:
    """Remove checkpoints a kill cut short, so neither resume nor the next save ever mixes in their files."""
    removed = [path for _, path, done in _checkpoints(run) if not done]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def prune_checkpoints(run: RunDir, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints. Runs after a new one is marked complete, so the
    newest complete checkpoint is never deleted before a newer one is whole (the Trainer's own rotation
    deletes before the new one is finished, and by mtime)."""
    complete = [path for _, path, done in _checkpoints(run) if done]
    for path in complete[: max(0, len(complete) - keep)]:
        # The marker goes first: a kill in the middle of the deletion leaves an unmarked checkpoint, which
        # the next start discards quietly, never a marked one with files missing.
        (path / COMPLETE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)

"""The Trainer's checkpoints in OUTPUT_DIR/checkpoints: one is resumed from only once marked whole (its COMPLETE
manifest), a damaged or unfinished one is discarded, and the newest whole one is never deleted first."""

from __future__ import annotations

import json
import re
import shutil
from contextlib import suppress
from pathlib import Path

from utils.common.errors import JobError, volume_error, volume_state
from utils.config.identity import sha256_file
from utils.run_folder.layout import RunDir, fsync_tree

COMPLETE_MARKER = "COMPLETE"
# Not transformers' get_last_checkpoint: it takes a checkpoint a kill cut short (no COMPLETE), and imports torch.
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


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

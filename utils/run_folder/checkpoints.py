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
    """Declare a checkpoint whole, once every rank has written its part. The manifest holds every file's size and
    SHA-256 (a resume tells one damaged since) and `resume_key`, so a restart of another run is refused."""
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
    """The newest intact complete checkpoint, and the damaged ones newer than it (removed)."""
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
    """Keep the newest `keep` complete checkpoints, and `best` (LOAD_BEST_MODEL's). Unlike the Trainer's rotation,
    it runs after a new one is whole, so the newest complete one is never deleted first."""
    complete = [path for path in _checkpoints(run) if best is None or path.name != Path(best).name]
    for path in complete[: max(0, len(complete) - keep)]:
        # The marker first: a kill mid-deletion leaves an unmarked checkpoint, never a marked one with files missing.
        (path / COMPLETE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)


def volume_fault(run: RunDir, exc: BaseException, doing: str) -> JobError | None:
    """The error (exit 2) when `exc` means OUTPUT_DIR's volume is full or read-only, naming the checkpoint a
    restart resumes from; None for any other failure."""
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

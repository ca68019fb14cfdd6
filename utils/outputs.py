"""The run folder (OUTPUT_DIR): its layout, atomic writes, and whether it belongs to these settings.

    OUTPUT_DIR/
      model/            adapter + config, tokenizer, README.md model card   (rank 0)
      metrics.json      eval_accuracy, eval_samples, world_size, train_*     (rank 0)
      run.json          resolved settings (secrets masked), package versions, push record (rank 0)
      checkpoints/      Trainer checkpoints; a COMPLETE marker is written once one is whole
      logs/rank-R.log   one per rank
      tensorboard/      training curves
      cache/            tokenized data, keyed by tokenizer, max length and data fingerprint

Files other ranks or a restart read appear whole or not at all: written beside their final name on
the same volume, then renamed.
"""

from __future__ import annotations

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
    metrics = property(lambda self: self.root / "metrics.json")
    run_record = property(lambda self: self.root / "run.json")
    checkpoints = property(lambda self: self.root / "checkpoints")
    logs = property(lambda self: self.root / "logs")
    tensorboard = property(lambda self: self.root / "tensorboard")
    cache = property(lambda self: self.root / "cache")

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def is_finished(self) -> bool:
        return self.metrics.is_file() and (self.model / "adapter_config.json").is_file()


def write_json(path: Path, payload: dict) -> None:
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(partial, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def replace_dir(staged: Path, final: Path) -> None:
    """Swap a fully written folder into place; a reader sees the old one or the new one, never half."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staged.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def open_run_dir(settings: Settings) -> RunDir:
    """Create OUTPUT_DIR's folders and refuse a folder that holds a run with other training settings."""
    run = RunDir(Path(settings.output_dir).resolve())
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
    record = read_json(run.run_record)
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


def write_run_record(run: RunDir, settings: Settings, **extra) -> None:
    record = read_json(run.run_record) or {}
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    record.update(run_name=settings.run_name, settings=settings.as_dict(), training_settings=settings.training_settings(), versions=versions)
    record.update(extra)
    write_json(run.run_record, record)


def mark_checkpoint_complete(checkpoint: Path) -> None:
    (checkpoint / COMPLETE_MARKER).write_text("ok\n")


def latest_complete_checkpoint(run: RunDir) -> Path | None:
    """The newest checkpoint whose save finished; one cut short by a kill has no marker and is skipped."""
    found = []
    for path in run.checkpoints.glob("checkpoint-*"):
        match = CHECKPOINT_RE.match(path.name)
        if match and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None

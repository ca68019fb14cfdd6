"""The files the job keeps beside a saved model (the label names, what one input is, the adapter's base), and the
one place that reads them back, from a folder or a Hub repo alike."""

from __future__ import annotations

import json
from pathlib import Path

LABELS_NAME = "id2label.json"  # the label names beside an adapter (its config.json would be the base model's)
# The text column(s) (one sentence, or a pair) and label column trained on, predict.py's defaults, and for a
# multi-label model its problem type and THRESHOLD, which the base's config beside an adapter does not know.
INPUTS_NAME = "inputs.json"
# The base the adapter was trained on, as the run's identity fingerprints it (utils/config/identity.model_digest):
# predict.py and the merge refuse a local base whose files differ from it.
BASE_NAME = "base_model.json"
REGRESSION_LABEL = "score"  # the one output of a regression model (utils/training/model.label_config)


def model_file(model: str | Path, name: str) -> str | None:
    """`name` in the model folder, or in its Hub repo (downloaded once into the cache); None where it has none."""
    if Path(model).is_dir():
        return str(Path(model, name)) if Path(model, name).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(str(model), name)
    except EntryNotFoundError:
        return None


def read_model_json(model: str | Path, name: str) -> dict | None:
    """The JSON object `name` beside the model; None where there is none (an older or another tool's model, or a
    repo out of reach: the model's own load reports that)."""
    try:
        path = model_file(model, name)
        record = json.loads(Path(path).read_text()) if path else None
    except Exception:
        return None
    return record if isinstance(record, dict) else None


def recorded_input(model: str | Path, key: str):
    """What inputs.json beside the model records under `key` (`text_columns`, `label_column`, `threshold`)."""
    return (read_model_json(model, INPUTS_NAME) or {}).get(key)


def read_label_names(model: str | Path) -> dict[int, str] | None:
    """id2label.json beside the model, ids as integers; None where there is none."""
    names = read_model_json(model, LABELS_NAME)
    return {int(index): name for index, name in names.items()} if names is not None else None


def write_base_fingerprint(folder: Path, fingerprint: dict[str, str] | str) -> None:
    """base_model.json beside an adapter: `{"sha256": {file: digest}}` (a local base) or `{"hub_id": id}`."""
    key = "sha256" if isinstance(fingerprint, dict) else "hub_id"
    (folder / BASE_NAME).write_text(json.dumps({key: fingerprint}, indent=2, sort_keys=True) + "\n")


def read_base_fingerprint(model: str | Path) -> dict[str, str] | str | None:
    """The fingerprint base_model.json beside the model records (write_base_fingerprint); None where there is none."""
    record = read_model_json(model, BASE_NAME) or {}
    fingerprint = record.get("sha256", record.get("hub_id"))
    return fingerprint if isinstance(fingerprint, dict | str) else None

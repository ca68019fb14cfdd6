"""Classify sentences with a model this job trained, without writing code.

    python predict.py OUTPUT_DIR/model sentences.txt            # the adapter folder on the volume
    python predict.py OUTPUT_DIR/merged reviews.csv --text-column review
    python predict.py your-name/bert-sst2-lora < sentences.txt  # a pushed adapter (or merged model) on the Hub
    python predict.py OUTPUT_DIR/model --base-model bert-base-uncased sentences.jsonl

MODEL is an adapter folder (adapter_config.json), a merged folder (config.json and weights) or a Hub repo
id of either. Sentences come one per line from FILE or standard input, or from a column of a .csv, .tsv
or .jsonl file. Each prints as one JSON line: {"text": ..., "label": "positive", "score": 0.97}. Batches
run on the GPU when there is one. Bad input (no such model or file, a missing column) is one `error:`
line and exit 2, as in main.py.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from utils.errors import EXIT_BAD_INPUT, JobError
from utils.model_card import LABELS_NAME, read_label_names


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `error:` line and exit 2, as in main.py
        print(f"error: {message}; see `python predict.py --help`", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="predict.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("model", help="adapter folder, merged folder, or Hub repo id of either")
    parser.add_argument(
        "file",
        nargs="?",
        type=Path,
        help="sentences: one per line, or a .csv/.tsv/.jsonl column; default: standard input",
    )
    parser.add_argument(
        "--base-model",
        help="base model (Hub id or folder) for an adapter; default: the one its adapter_config.json names",
    )
    parser.add_argument(
        "--text-column",
        default="sentence",
        help="the column holding the text in a .csv/.tsv/.jsonl file (default: sentence)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per forward pass (default: 64)")
    return parser.parse_args(argv)


def read_sentences(file: Path | None, column: str) -> list[str]:
    if file is None:
        return [line.rstrip("\n") for line in sys.stdin if line.strip()]
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(
            EXIT_BAD_INPUT,
            f"cannot read {file} ({getattr(exc, 'strerror', None) or exc}); give a UTF-8 text, .csv, .tsv or .jsonl file",
        ) from None
    if file.suffix in (".csv", ".tsv"):
        rows = list(csv.DictReader(text.splitlines(), delimiter="\t" if file.suffix == ".tsv" else ","))
    elif file.suffix == ".jsonl":
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise JobError(
                EXIT_BAD_INPUT,
                f"{file} is not JSON lines ({exc.msg} on line {exc.lineno}); give one JSON object per line",
            ) from None
    else:
        return [line for line in text.splitlines() if line.strip()]
    if rows and not all(isinstance(row, dict) and isinstance(row.get(column), str) for row in rows):
        raise JobError(
            EXIT_BAD_INPUT, f"{file} has rows without a text column '{column}'; name the column with --text-column"
        )
    return [row[column] for row in rows]


def adapter_files(model: str) -> tuple[dict | None, dict[int, str] | None]:
    """(adapter_config.json, id2label.json) of an adapter folder or Hub repo; (None, None) for a full model."""
    from transformers.utils import find_adapter_config_file

    folder = Path(model)
    config_path = find_adapter_config_file(model)
    if config_path is None:
        return None, None
    if folder.is_dir():
        return json.loads(Path(config_path).read_text()), read_label_names(folder)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        labels = read_label_names(Path(hf_hub_download(model, LABELS_NAME)).parent)
    except EntryNotFoundError:
        labels = None
    return json.loads(Path(config_path).read_text()), labels


def load_classifier(model: str, base_model: str | None):
    """A text-classification pipeline over the adapter (on its base) or the merged model."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    device = 0 if torch.cuda.is_available() else -1
    try:
        adapter, id2label = adapter_files(model)
        if adapter is None:  # a merged model: its config.json names the labels
            return pipeline("text-classification", model=model, device=device)
        from peft import PeftModel

        labels = (
            {"id2label": id2label, "label2id": {name: index for index, name in id2label.items()}} if id2label else {}
        )
        base_id = base_model or adapter["base_model_name_or_path"]
        try:
            base = AutoModelForSequenceClassification.from_pretrained(base_id, **labels)
        except OSError as exc:
            raise JobError(
                EXIT_BAD_INPUT,
                f"cannot load {base_id}, the base model of the adapter {model} ({_first_line(exc)}); "
                "pass --base-model with its Hub id or a local copy of it",
            ) from None
        return pipeline(
            "text-classification",
            model=PeftModel.from_pretrained(base, model),
            tokenizer=AutoTokenizer.from_pretrained(model),
            device=device,
        )
    except (OSError, ValueError) as exc:
        raise JobError(
            EXIT_BAD_INPUT,
            f"cannot load {model} ({_first_line(exc)}); give an adapter folder, a merged folder or a Hub repo id (with --base-model if the adapter's base is elsewhere)",
        ) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sentences = read_sentences(args.file, args.text_column)
        classifier = load_classifier(args.model, args.base_model)
    except JobError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.code
    for text, prediction in zip(
        sentences, classifier(sentences, batch_size=args.batch_size, truncation=True), strict=True
    ):
        print(
            json.dumps({"text": text, "label": prediction["label"], "score": round(float(prediction["score"]), 4)}),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

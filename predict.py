"""Classify sentences with a model this job trained, without writing code.

    python predict.py OUTPUT_DIR/model sentences.txt            # the adapter folder on the volume
    python predict.py OUTPUT_DIR/merged reviews.csv --text-column review
    python predict.py your-name/bert-sst2-lora < sentences.txt  # a pushed adapter (or merged model) on the Hub
    python predict.py OUTPUT_DIR/model --base-model bert-base-uncased sentences.jsonl

MODEL is an adapter folder (adapter_config.json), a merged folder (config.json and weights) or a Hub repo
id of either. Sentences come one per line from FILE or standard input, or from a column of a .csv, .tsv
or .jsonl file, in UTF-8. Each prints as one JSON line: {"text": ..., "label": "positive", "score": 0.97};
no sentences, no lines. A sentence longer than the model takes is cut to the length recorded with the
model (MAX_SEQ_LENGTH of the run that trained it), else to the model's position embeddings. Options may
come before or after MODEL and FILE. Batches run on the GPU when there is one. Bad input (no such model
or file, a missing column, bytes that are not text) is one `error:` line and exit 2, as in main.py.
"""

from __future__ import annotations

import argparse
import csv
import gc
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
    # Intermixed: `predict.py MODEL --base-model X FILE` (the README's order) reads FILE as FILE.
    return parser.parse_intermixed_args(argv)


def read_sentences(file: Path | None, column: str) -> list[str]:
    if file is None:
        if sys.stdin is None:  # started with standard input closed: nothing to classify
            return []
        if sys.stdin.isatty():
            print("reading sentences from standard input, one per line (Ctrl-D ends)", file=sys.stderr)
        text = decode_text(sys.stdin.buffer.read(), "standard input")
        return [line for line in text.splitlines() if line.strip()]
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise JobError(
            EXIT_BAD_INPUT,
            f"cannot read {file} ({exc.strerror or exc}); give a UTF-8 text, .csv, .tsv or .jsonl file",
        ) from None
    text = decode_text(data, str(file))
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


def decode_text(data: bytes, source: str) -> str:
    """`data` as UTF-8 text (a byte-order mark dropped). Bytes that are not text would reach the tokenizer
    as replacement characters, or crash it (a TypeError on lone surrogates): refused, naming `source`."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise JobError(
            EXIT_BAD_INPUT,
            f"{source} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "give sentences as UTF-8 text, one per line, or a UTF-8 .csv, .tsv or .jsonl file",
        ) from None
    if "\x00" in text:  # UTF-16 text, or binary data that happens to decode
        raise JobError(
            EXIT_BAD_INPUT,
            f"{source} holds NUL bytes (offset {text.index(chr(0))}): binary data or UTF-16, not UTF-8 text; "
            "give sentences as UTF-8 text, one per line (re-save a UTF-16 file as UTF-8)",
        )
    return text


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
    from utils.job import leave_out

    # The adapter goes on a full-precision base and a merged model holds no quantizer: neither DeepSpeed nor
    # bitsandbytes has a part in serving, and left out they cost nothing at start (a third of its CPU).
    leave_out("deepspeed", "bitsandbytes")
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    # What the imports built lives as long as the process: frozen, it is out of the garbage collector's sight, and
    # the collections loading the model sets off walk the model's own objects (a fifth of a short call's CPU).
    gc.freeze()

    device = 0 if torch.cuda.is_available() else -1
    # No code from a model folder or repo runs, and transformers never asks on stdin, which holds the sentences.
    safe = {"trust_remote_code": False}
    try:
        adapter, id2label = adapter_files(model)
        if adapter is None:  # a merged model: its config.json names the labels
            classifier = pipeline("text-classification", model=model, device=device, **safe)
        else:
            from peft import PeftModel

            labels = (
                {"id2label": id2label, "label2id": {name: index for index, name in id2label.items()}}
                if id2label
                else {}
            )
            base_id = base_model or adapter["base_model_name_or_path"]
            try:
                base = AutoModelForSequenceClassification.from_pretrained(base_id, **labels, **safe)
            except OSError as exc:
                raise JobError(
                    EXIT_BAD_INPUT,
                    f"cannot load {base_id}, the base model of the adapter {model} ({_first_line(exc)}); "
                    "pass --base-model with its Hub id or a local copy of it",
                ) from None
            classifier = pipeline(
                "text-classification",
                model=PeftModel.from_pretrained(base, model),
                tokenizer=AutoTokenizer.from_pretrained(model, **safe),
                device=device,
            )
    except (OSError, ValueError) as exc:
        raise JobError(
            EXIT_BAD_INPUT,
            f"cannot load {model} ({_first_line(exc)}); give an adapter folder, a merged folder or a Hub repo id (with --base-model if the adapter's base is elsewhere)",
        ) from None
    cap_length(classifier.tokenizer, classifier.model.config)
    return classifier


def cap_length(tokenizer, config) -> None:
    """Truncate no further than the model has positions. The job records MAX_SEQ_LENGTH with the model
    (tokenizer_config.json); a folder without it says 1e30, and a longer sentence fails inside the model."""
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and tokenizer.model_max_length > positions:
        tokenizer.model_max_length = positions


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
    if not sentences:  # the pipeline fails on an empty batch; no sentences, no lines
        return 0
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

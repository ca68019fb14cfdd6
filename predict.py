"""Classify sentences with a model this job trained, without writing code.

    python predict.py OUTPUT_DIR/model sentences.txt            # the adapter folder on the volume
    python predict.py OUTPUT_DIR/merged reviews.csv --text-column review
    python predict.py your-name/bert-sst2-lora < sentences.txt  # a pushed adapter (or merged model) on the Hub
    python predict.py OUTPUT_DIR/model --base-model bert-base-uncased sentences.jsonl

MODEL is an adapter folder (adapter_config.json), a merged folder (config.json and weights) or a Hub repo
id of either. Sentences come from FILE or standard input, in UTF-8: one per line (split on newlines only;
blank lines skipped), or the --text-column of each record of a .csv, .tsv (unquoted, as training reads it),
.json or .jsonl file (a JSON array or one object per line), the suffix in any case; a sentence pair model
takes two columns, `--text-column premise,hypothesis`. Each prints as one JSON line, in input order:
{"text": ..., "label": "positive", "score": 0.97} (a pair adds "text_pair"; a regression model prints its
score and no label; a multi-label model prints every label whose sigmoid score is at least --threshold, default
the THRESHOLD it was trained with, and every label's score: {"text": ..., "labels": ["toxic"], "scores":
{"toxic": 0.91, "insult": 0.12}}); no sentences, no lines. A sentence longer than the model takes is cut to the length
recorded with the model (MAX_SEQ_LENGTH of the run that trained it), else to the model's position embeddings. Options may come before or after MODEL and FILE.
Batches run on the GPU when there is one. FILE is a regular file; a stream (a pipe, a device) comes on standard
input; either is read up to MAX_INPUT_BYTES (256 MiB). Bad input (no such model or file, a FILE that is a device,
a FIFO or a folder, more than 256 MiB of input, a missing column, bytes that are not text, a base model of another size than the adapter's, one text a row for a pair model, and what
training refuses in a file: an empty text in a column, a column named twice) is one `error:` line and
exit 2, as in main.py.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import stat
import sys
from pathlib import Path

from utils.delimited import DIALECTS, read_records
from utils.errors import EXIT_BAD_INPUT, JobError
from utils.model_card import INPUTS_NAME, LABELS_NAME, read_label_names
from utils.settings import Parser
from utils.tasks import MULTI_LABEL

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a tool the signal ended
DEFAULT_THRESHOLD = 0.5  # a logit of 0: for a multi-label model that records no THRESHOLD

# A batch pads to its longest sentence: 1,024 sentences of 512 tokens already hold gigabytes of attention scores.
MAX_BATCH_SIZE = 1024
# The input is read whole, then held as sentences and their answers: 256 MiB is millions of sentences, and `/dev/zero`
# or a runaway pipe on standard input stops there instead of at a MemoryError gigabytes later.
MAX_INPUT_BYTES = 256 * 2**20


def batch_size(value: str) -> int:
    """--batch-size as argparse checks it: a whole number from 1 to MAX_BATCH_SIZE, else one `error:` line."""
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a whole number; give 1 to {MAX_BATCH_SIZE}") from None
    if not 1 <= size <= MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(f"{size} is out of range; give 1 to {MAX_BATCH_SIZE}")
    return size


def threshold(value: str) -> float:
    """--threshold as argparse checks it: a number above 0 and below 1 (THRESHOLD's range), else one `error:` line."""
    try:
        score = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number; give a score above 0 and below 1") from None
    if not 0 < score < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; give a score above 0 and below 1")
    return score


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="predict.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("model", help="adapter folder, merged folder, or Hub repo id of either")
    parser.add_argument(
        "file", nargs="?", type=Path, help="stdin if none; one sentence a line, or a .csv/.tsv/.json/.jsonl column"
    )
    parser.add_argument("--base-model", help="base model (Hub id or folder) of an adapter; default: the one it names")
    parser.add_argument(
        "--text-column",
        help="the column holding the text in a .csv/.tsv/.json/.jsonl file (default: sentence), or two separated by "
        "a comma for a sentence-pair model (premise,hypothesis)",
    )
    parser.add_argument(
        "--batch-size",
        type=batch_size,
        default=64,
        help=f"sentences per forward pass, 1 to {MAX_BATCH_SIZE} (default: 64)",
    )
    parser.add_argument(
        "--threshold",
        type=threshold,
        help="multi-label models: print each label whose sigmoid score is at least this (default: the THRESHOLD the "
        f"model was trained with, else {DEFAULT_THRESHOLD})",
    )
    # Intermixed: `predict.py MODEL --base-model X FILE` (the README's order) reads FILE as FILE.
    return parser.parse_intermixed_args(argv)


# Formats by suffix, whatever its case, read as training reads DATASET_PATH (.csv and .tsv: utils/delimited.py;
# tests/test_predict.py checks both read a file alike). Any other suffix is one sentence a line.
JSON_SUFFIXES = (".json", ".jsonl")


def read_inputs(model: str, file: Path | None, column: str | None) -> list[str] | list[dict[str, str]]:
    """The sentences, or with two columns (`premise,hypothesis`) the pairs as the pipeline takes them
    (`{"text": ..., "text_pair": ...}`), in the shape the model was trained on."""
    columns = [name.strip() for name in column.split(",")] if column else []
    check_input_shape(model, column, len(columns) == 2)
    if len(columns) != 2:
        return read_sentences(file, column)
    if not all(columns) or columns[0] == columns[1]:
        raise JobError(
            EXIT_BAD_INPUT,
            f"--text-column {column} names no pair; give two different columns, e.g. premise,hypothesis",
        )
    first, second = (read_sentences(file, name) for name in columns)
    return [{"text": a, "text_pair": b} for a, b in zip(first, second, strict=True)]


def check_input_shape(model: str, column: str | None, pairs: bool) -> None:
    """One sentence a row for a single-sentence model, two columns for a pair model, as training took them
    (inputs.json beside the model): a pair model given one text answers about half an input, without a word."""
    try:
        path = model_file(model, INPUTS_NAME)
        trained = json.loads(Path(path).read_text())["text_columns"] if path else None
    except Exception:  # no such repo, offline, a foreign file: the model's own load reports it
        return
    if trained is None or pairs == (len(trained) == 2):  # None: a model saved before it recorded it, or another tool's
        return
    if pairs:
        raise JobError(
            EXIT_BAD_INPUT,
            f"{model} takes one sentence a row (trained on {trained[0]}), and --text-column {column} names a pair; "
            "name one column",
        )
    raise JobError(
        EXIT_BAD_INPUT,
        f"{model} takes sentence pairs (trained on {','.join(trained)}), and "
        + (f"--text-column {column} names one column" if column else "one text a row was given")
        + f"; give a .csv, .tsv, .json or .jsonl file with --text-column {','.join(trained)} (or your two columns)",
    )


def empty_text(file: Path, place: str, column: str) -> JobError:
    """A row without text in a column: training refuses it (it would answer about [CLS] [SEP])."""
    return JobError(
        EXIT_BAD_INPUT,
        f"{file} {place} has an empty '{column}'; training refuses a row without text, and so does this: "
        "fill it in or remove the row",
    )


def read_sentences(file: Path | None, column: str | None) -> list[str]:
    """The sentences of `file` (standard input when None), in order: one per non-blank line of text, or the
    `column` (default: sentence) of each record of a .csv, .tsv, .json (a JSON array or JSON lines, as training
    takes) or .jsonl file."""
    suffix = file.suffix.lower() if file else ""
    if column is not None and suffix not in (*DIALECTS, *JSON_SUFFIXES):
        # A column of a file read one sentence a line: a .csv saved as .txt, whose header would be answered too.
        raise JobError(
            EXIT_BAD_INPUT,
            f"--text-column {column} names a column, and {file or 'standard input'} is read one sentence a line; "
            "give a .csv, .tsv, .json or .jsonl file as FILE (its suffix says its format), or drop --text-column",
        )
    column = column or "sentence"
    if file is None:
        if sys.stdin is None:  # started with standard input closed: nothing to classify
            return []
        if sys.stdin.isatty():
            print("reading sentences from standard input, one per line (Ctrl-D ends)", file=sys.stderr)
        return split_lines(decode_text(read_bounded(sys.stdin.buffer, "standard input"), "standard input"))
    text = decode_text(read_file(file), str(file))
    if suffix in DIALECTS:
        return read_delimited(text, file, column, suffix)
    if suffix in JSON_SUFFIXES:
        return read_json_records(text, file, column)
    return split_lines(text)


def read_file(file: Path) -> bytes:
    """The bytes of `file`, a regular file within MAX_INPUT_BYTES. Anything else is refused before a byte is read:
    a device (`/dev/zero` read 5.4 GB before a MemoryError) or a FIFO (no writer: the open blocked for ever; it is
    opened without waiting for one), a folder; a pipe belongs on standard input, where the bound applies as read."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise JobError(
            EXIT_BAD_INPUT,
            f"cannot read {file} ({exc.strerror or exc}); give a UTF-8 text file (one sentence a line), .csv, .tsv, .json or .jsonl file",
        ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = next((name for test, name in NOT_FILES if test(info.st_mode)), "not a regular file")
        raise JobError(
            EXIT_BAD_INPUT,
            f"{file} is {kind}, not a file of sentences; give a regular file, or send a stream on standard input "
            f"(python predict.py MODEL < {file} reads at most {MAX_INPUT_BYTES // 2**20} MiB)",
        )
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as handle:
        return read_bounded(handle, str(file), info.st_size)


# What a FILE that is not a regular file is, for its refusal.
NOT_FILES = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (a named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_bounded(handle, source: str, size: int = 0) -> bytes:
    """At most MAX_INPUT_BYTES from `handle` (`size`: what the file says it holds, refused before reading); more is
    refused naming `source` and the fix: split the input."""
    data = b"" if size > MAX_INPUT_BYTES else handle.read(MAX_INPUT_BYTES + 1)
    if size > MAX_INPUT_BYTES or len(data) > MAX_INPUT_BYTES:
        held = f"holds {size / 2**20:.0f} MiB" if size > MAX_INPUT_BYTES else "goes on past that"
        raise JobError(
            EXIT_BAD_INPUT,
            f"{source} {held}; predict.py reads at most {MAX_INPUT_BYTES // 2**20} MiB of sentences at a time: split "
            "the input (split -l 1000000 FILE part-) and run it once for each part",
        )
    return data


def split_lines(text: str) -> list[str]:
    """The non-blank lines, split on `\n` and `\r\n` only: `str.splitlines` also splits on form feed, NEL,
    U+2028 and other characters a sentence may hold, and would answer one line several times."""
    lines = (line.removesuffix("\r") for line in text.split("\n"))
    return [line for line in lines if line.strip()]


def read_delimited(text: str, file: Path, column: str, suffix: str) -> list[str]:
    """`column` of each record, one record a line, read and refused as training reads the file (utils/delimited.py:
    a column named twice in the header, a quoted field running over lines, which would merge the rows up to the
    next quote into one answer)."""
    header, records = read_records(io.StringIO(text, newline=""), file, suffix)
    if header is None:
        return []
    if column not in header:
        raise JobError(
            EXIT_BAD_INPUT,
            f"{file} has no column '{column}' (its header: {header}); name the text column with --text-column",
        )
    index, sentences = header.index(column), []
    for start, record in records:
        if index >= len(record):
            raise JobError(
                EXIT_BAD_INPUT,
                f"{file} line {start} has {len(record)} field(s) and no '{column}' (column {index + 1}); "
                "give every line a value in each column of the header",
            )
        if not record[index].strip():
            raise empty_text(file, f"line {start}", column)
        sentences.append(record[index])
    return sentences


def read_json_records(text: str, file: Path, column: str) -> list[str]:
    """`column` of each object of a JSON array, or of each line of JSON lines: training's loader takes either
    under both suffixes. A string in an array is itself a sentence (training reads it as the column `text`)."""
    array = text.lstrip().startswith("[")

    def parse(chunk: str, where: str):
        try:
            return json.loads(chunk)
        except json.JSONDecodeError as exc:
            detail = f"{exc.msg} on line {exc.lineno}" if array else exc.msg
            fix = "give a JSON array of objects, or one JSON object per line"
            raise JobError(EXIT_BAD_INPUT, f"{file} {where} ({detail}); {fix}") from None

    if array:
        records = [(f"item {n}", record) for n, record in enumerate(parse(text, "is not a JSON array"), start=1)]
    else:
        lines = enumerate(text.split("\n"), start=1)
        records = [(f"line {n}", parse(line, f"line {n} is not JSON")) for n, line in lines if line.strip()]
    sentences = []
    for place, record in records:
        text_value = record.get(column) if isinstance(record, dict) else record
        if not isinstance(text_value, str):
            found = f"'{column}' is {json.dumps(text_value)[:60]}" if isinstance(record, dict) else "it is no object"
            raise JobError(
                EXIT_BAD_INPUT,
                f"{file} {place} has no text in '{column}' ({found}); give each object a '{column}' string, "
                "or name the text column with --text-column",
            )
        if not text_value.strip():
            raise empty_text(file, place, column)
        sentences.append(text_value)
    return sentences


def decode_text(data: bytes, source: str) -> str:
    """`data` as UTF-8 text (a byte-order mark dropped). Bytes that are not text would reach the tokenizer
    as replacement characters, or crash it (a TypeError on lone surrogates): refused, naming `source`."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise JobError(
            EXIT_BAD_INPUT,
            f"{source} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "give sentences as UTF-8 text, one per line, or a UTF-8 .csv, .tsv, .json or .jsonl file",
        ) from None
    if "\x00" in text:  # UTF-16 text, or binary data that happens to decode
        raise JobError(
            EXIT_BAD_INPUT,
            f"{source} holds NUL bytes (offset {text.index(chr(0))}): binary data or UTF-16, not UTF-8 text; "
            "give sentences as UTF-8 text, one per line (re-save a UTF-16 file as UTF-8)",
        )
    return text


def model_file(model: str, name: str) -> str | None:
    """`name` in the model folder, or in its Hub repo (downloaded once into the cache); None where it has none."""
    if Path(model).is_dir():
        return str(Path(model, name)) if Path(model, name).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(model, name)
    except EntryNotFoundError:
        return None


def load_classifier(model: str, base_model: str | None):
    """A text-classification pipeline over the adapter (on its base) or the merged model."""
    from utils.job import leave_out

    # The adapter goes on a full-precision base and a merged model holds no quantizer: neither DeepSpeed nor
    # bitsandbytes has a part in serving, and left out they cost nothing at start (a third of its CPU).
    leave_out("deepspeed", "bitsandbytes")
    import torch
    from transformers import AutoTokenizer, pipeline
    from transformers.utils import find_adapter_config_file

    from utils.model import NO_REMOTE_CODE, first_line

    # What the imports built lives as long as the process: frozen, it is out of the garbage collector's sight, and
    # the collections loading the model sets off walk the model's own objects (a fifth of a short call's CPU).
    gc.freeze()
    device = 0 if torch.cuda.is_available() else -1
    try:
        config = find_adapter_config_file(model)
        if config is None and base_model:
            raise JobError(
                EXIT_BAD_INPUT,
                f"--base-model is for an adapter, and {model} is a merged model, which holds its base; drop --base-model",
            )
        if config is None:  # a merged model: its config.json names the labels
            classifier = pipeline("text-classification", model=model, device=device, **NO_REMOTE_CODE)
            warn_if_untrained(model, classifier.model.config.id2label)
        else:
            adapted = load_adapter(model, json.loads(Path(config).read_text()), base_model)
            tokenizer = AutoTokenizer.from_pretrained(model, **NO_REMOTE_CODE)
            classifier = pipeline("text-classification", model=adapted, tokenizer=tokenizer, device=device)
    except (OSError, ValueError) as exc:
        raise JobError(
            EXIT_BAD_INPUT,
            f"cannot load {model} ({first_line(exc, 300)}); give an adapter folder, a merged folder or a Hub repo id (with --base-model if the adapter's base is elsewhere)",
        ) from None
    # Truncate no further than the model has positions: the job records MAX_SEQ_LENGTH with the model
    # (tokenizer_config.json); a folder without it says 1e30, and a longer sentence fails inside the model.
    positions = getattr(classifier.model.config, "max_position_embeddings", None)
    if isinstance(positions, int):
        classifier.tokenizer.model_max_length = min(classifier.tokenizer.model_max_length, positions)
    return classifier


def warn_if_untrained(model: str, id2label: dict) -> None:
    """A warning on stderr for a full model whose labels are transformers' defaults (LABEL_0, LABEL_1, ...) and that
    holds no record of a run of this job: most likely a base model, whose head is untrained, so that every answer is
    chance (seen: LABEL_0 at 0.50 for everything, without a word). A fine-tuned model from elsewhere that never named
    its labels is warned about too; its answers still come."""
    if all(name == f"LABEL_{i}" for i, name in id2label.items()) and model_file(model, INPUTS_NAME) is None:
        print(
            f"warning: {model} names its labels {', '.join(id2label.values())} (transformers' defaults) and holds no "
            "record of a training run of this job: if it is a base model, its classification head is untrained and "
            "its answers are chance; give the trained adapter (OUTPUT_DIR/model) or merged model (OUTPUT_DIR/merged)",
            file=sys.stderr,
        )


def load_adapter(model: str, adapter: dict, base_model: str | None):
    """The adapter `model` (its adapter_config.json: `adapter`) on its base, the head sized and named by the labels
    saved beside it; a base it does not fit is refused (check_adapter_fits)."""
    from peft import PeftModel

    from utils.model import first_line, load_base

    base_id = base_model or adapter["base_model_name_or_path"]
    # A multi-label head (sigmoid scores) as inputs.json records it: the base's config does not know it.
    multi_label = trained_record(model).get("problem_type") == MULTI_LABEL
    labels = model_file(model, LABELS_NAME)
    id2label = read_label_names(Path(labels).parent) if labels else None  # None: the base's own head
    # The head the adapter restores as peft loads it (modules_to_save): a base's head of another size is
    # no news to whoever runs this.
    restored = ["classifier", "score", *(adapter.get("modules_to_save") or [])]
    try:
        base = load_base(base_id, [id2label[i] for i in sorted(id2label)] if id2label else None, restored, multi_label)
    except OSError as exc:
        raise JobError(
            EXIT_BAD_INPUT,
            f"cannot load {base_id}, the base model of the adapter {model} ({first_line(exc, 300)}); "
            "pass --base-model with its Hub id or a local copy of it",
        ) from None
    check_adapter_fits(model, adapter, base, base_id)
    try:
        return PeftModel.from_pretrained(base, model)
    except RuntimeError as exc:  # a shape the check above cannot see (a .bin adapter, a new layer kind)
        raise misfit(model, adapter, f"does not fit the base {base_id} ({first_line(exc, 300)})") from None


def trained_record(model: str) -> dict:
    """inputs.json beside the model (what training took and, for a multi-label model, its threshold); {} where
    there is none or it cannot be read (a model saved before it was written, or another tool's)."""
    try:
        path = model_file(model, INPUTS_NAME)
        return json.loads(Path(path).read_text()) if path else {}
    except Exception:  # no such repo, offline, a foreign file: the model's own load reports it
        return {}


def misfit(model: str, adapter: dict, what: str) -> JobError:
    fix = f"pass --base-model with {adapter['base_model_name_or_path']}, or a local copy of it"
    return JobError(EXIT_BAD_INPUT, f"the adapter {model} {what}; {fix}")


def check_adapter_fits(model: str, adapter: dict, base, base_id: str) -> None:
    """Refuse a base the adapter was not trained on, before peft loads it: each tensor of
    adapter_model.safetensors is checked against the base's weight it adapts or replaces (another width is a
    traceback listing every tensor), and each module of the base the adapter's target_modules name must hold
    its weights (a deeper base loads with a warning and answers with layers the training never adapted)."""
    weights = None if adapter.get("fan_in_fan_out") else model_file(model, "adapter_model.safetensors")
    if weights is None:  # no safetensors file, or (out, in) stored transposed: peft's own load checks it
        return
    from safetensors import safe_open

    from utils.model import matches_target

    trained_on = adapter["base_model_name_or_path"]
    shapes = {name: tuple(param.shape) for name, param in base.named_parameters()}
    hidden = base.config.hidden_size
    adapted = set()
    with safe_open(weights, framework="pt") as tensors:
        for key in tensors.keys():
            name = key.removeprefix("base_model.model.")
            module, _, kind = name.rpartition(".")[0].rpartition(".")
            lora = kind in ("lora_A", "lora_B")
            if "lora_" in name and not lora:
                continue  # a variant's extra (DoRA's magnitude): its layer's A and B are checked
            target = shapes.get(f"{module}.weight" if lora else name)
            if target is None:
                lacking = f"holds weights for {module if lora else name}, which the base {base_id} lacks"
                raise misfit(model, adapter, f"{lacking}: it was trained on {trained_on}")
            adapted |= {module} if lora else set()
            shape = tuple(tensors.get_slice(key).get_shape())
            # lora_A is (r, in) and lora_B (out, r) of the base's (out, in) weight; a module trained in full (the
            # head, the pooler) has the base's own shape.
            if lora:
                pairs = [(shape[1], target[1])] if kind == "lora_A" else [(shape[0], target[0])]
            else:
                pairs = list(zip(shape, target, strict=False)) if len(shape) == len(target) else []
            if any(ours != theirs for ours, theirs in pairs):
                widths = [ours for ours, theirs in pairs if ours != theirs and theirs == hidden]
                size = (
                    f"of hidden size {widths[0]}, and the base {base_id} has hidden size {hidden}"
                    if widths
                    else f"({key} is {list(shape)}), and {base_id} does not match it"
                )
                raise misfit(model, adapter, f"was trained on the base {trained_on} {size}")
    targets = adapter.get("target_modules")
    if not isinstance(targets, list) or adapter.get("layers_to_transform") or adapter.get("exclude_modules"):
        return
    targeted = [name for name, _ in base.named_modules() if any(matches_target(t, [name]) for t in targets)]
    unadapted = [name for name in targeted if name not in adapted]
    if adapted and unadapted:
        raise misfit(
            model,
            adapter,
            f"holds no weights for {unadapted[0]} of the base {base_id} ({len(unadapted)} of the {len(targeted)} "
            f"modules its target_modules name there): it was trained on {trained_on}, a smaller base",
        )


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        sentences = read_inputs(args.model, args.file, args.text_column)
        classifier = load_classifier(args.model, args.base_model)
        if args.threshold is not None and classifier.model.config.problem_type != MULTI_LABEL:
            raise JobError(
                EXIT_BAD_INPUT,
                f"--threshold {args.threshold:g} picks the labels of a multi-label model, and {args.model} predicts "
                "one label (or a score) a row; drop --threshold",
            )
    except JobError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.code
    if not sentences:  # the pipeline fails on an empty batch; no sentences, no lines
        return 0
    config = classifier.model.config
    scores_only, multi_label = config.problem_type == "regression", config.problem_type == MULTI_LABEL
    # Multi-label: every label's sigmoid score (top_k=None), the labels at or above the threshold printed.
    every = {"top_k": None} if multi_label else {}
    predictions = classifier(sentences, batch_size=args.batch_size, truncation=True, **every)
    cut = args.threshold or trained_record(args.model).get("threshold", DEFAULT_THRESHOLD)
    try:
        for text, prediction in zip(sentences, predictions, strict=True):
            shown = text if isinstance(text, dict) else {"text": text}
            if multi_label:
                scores = {entry["label"]: float(entry["score"]) for entry in prediction}
                scores = {name: scores[name] for name in config.id2label.values()}  # in id order
                chosen = [name for name, score in scores.items() if score >= cut]  # before rounding
                answer = {"labels": chosen, "scores": {name: round(score, 4) for name, score in scores.items()}}
            else:
                label = {} if scores_only else {"label": prediction["label"]}
                answer = {**label, "score": round(float(prediction["score"]), 4)}
            print(json.dumps({**shown, **answer}), flush=True)
    except BrokenPipeError:
        # The reader stopped reading (`| head`): end as a Unix tool does on SIGPIPE, without a traceback, and
        # with stdout on /dev/null so that the interpreter's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return 0


if __name__ == "__main__":
    sys.exit(main())

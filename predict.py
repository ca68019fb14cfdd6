"""Classify sentences with a model this job trained, without writing code.

    python predict.py OUTPUT_DIR/model sentences.txt            # the adapter folder on the volume
    python predict.py OUTPUT_DIR/merged reviews.csv --text-column review
    python predict.py your-name/bert-sst2-lora < sentences.txt  # a pushed adapter (or merged model) on the Hub
    python predict.py OUTPUT_DIR/model --base-model bert-base-uncased sentences.jsonl
    python predict.py OUTPUT_DIR/model sentences.jsonl --metrics metrics.json   # labelled rows: their metrics too

MODEL is an adapter folder (adapter_config.json), a merged folder or a Hub repo id of either. Input (FILE or
standard input, UTF-8) is one sentence a line, or the rows of a .csv/.tsv/.json/.jsonl/.parquet file, read by the
text column(s) the model was trained on (inputs.json beside it) unless --text-column names others. Each row prints
as one JSON line in input order, a file's other columns carried through (a clashing name as input_<name>); a file
with the label column prints its labelled rows' metrics on stderr (--metrics FILE writes them as JSON), as a run
writes its test split (utils/training/predictions.py). README.md "Using the model" shows every output shape. Bad
input is one `error:` line and exit 2, as in main.py: an adapter answers only on the base it was trained on.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

from utils.common.errors import BadInput, JobError, first_line
from utils.config.sources import Parser
from utils.config.tasks import MULTI_LABEL
from utils.run_folder.model_files import (
    BASE_NAME,
    INPUTS_NAME,
    model_file,
    read_base_fingerprint,
    read_label_names,
    recorded_input,
)
from utils.training.predictions import (
    DEFAULT_THRESHOLD,
    FORMATS,
    answer_rows,
    classify,
    has_labels,
    is_table,
    metrics_line,
    model_labels,
    read_inputs,
    references,
    score_answers,
)

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a tool the signal ended
# A batch pads to its longest sentence: 1,024 sentences of 512 tokens already hold gigabytes of attention scores.
MAX_BATCH_SIZE = 1024


def batch_size(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a whole number; give 1 to {MAX_BATCH_SIZE}") from None
    if not 1 <= size <= MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(f"{size} is out of range; give 1 to {MAX_BATCH_SIZE}")
    return size


def threshold(value: str) -> float:
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
        "file",
        nargs="?",
        type=Path,
        help="stdin if none; one sentence a line, or a .csv/.tsv/.json/.jsonl/.parquet file of rows",
    )
    parser.add_argument("--base-model", help="base model (Hub id or folder) of an adapter; default: the one it names")
    parser.add_argument(
        "--text-column",
        help="the column holding the text in a table file (default: the column(s) the model was trained on, as its "
        "inputs.json records them, else sentence), or two separated by a comma for a sentence-pair model "
        "(premise,hypothesis)",
    )
    parser.add_argument(
        "--label-column",
        help="the column holding the true labels, for metrics (default: the one the model was trained on, else label)",
    )
    parser.add_argument(
        "--metrics",
        type=Path,
        metavar="FILE",
        help="also write the metrics of a labelled file to FILE as JSON (they print on stderr either way)",
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


def input_columns(model: str, file: Path | None, column: str | None) -> list[str] | None:
    """The text column(s) of a table FILE: --text-column, else those the model was trained on, else `sentence`;
    None for one sentence a line."""
    columns = [name.strip() for name in column.split(",")] if column else None
    if column is not None and not is_table(file):
        # A column of a file read one sentence a line: a .csv saved as .txt, whose header would be answered too.
        raise BadInput(
            f"--text-column {column} names a column, and {file or 'standard input'} is read one sentence a line; "
            f"give {FORMATS} as FILE (its suffix says its format), or drop --text-column",
        )
    if columns is None and is_table(file):
        return recorded_input(model, "text_columns") or ["sentence"]  # None: a model saved before it was recorded
    pair = columns is not None and len(columns) == 2
    check_input_shape(model, column, pair)
    if pair and (not all(columns) or columns[0] == columns[1]):
        raise BadInput(f"--text-column {column} names no pair; give two different columns, e.g. premise,hypothesis")
    return columns


def check_input_shape(model: str, column: str | None, pairs: bool) -> None:
    """Inputs shaped as training took them: a pair model given one text answers about half an input, without a word."""
    trained = recorded_input(model, "text_columns")
    if trained is None or pairs == (len(trained) == 2):  # None: a model saved before it recorded it, or another tool's
        return
    if pairs:
        raise BadInput(
            f"{model} takes one sentence a row (trained on {trained[0]}), and --text-column {column} names a pair; "
            "name one column",
        )
    raise BadInput(
        f"{model} takes sentence pairs (trained on {','.join(trained)}), and "
        + (f"--text-column {column} names one column" if column else "one text a row was given")
        + f"; give {FORMATS} (it reads the columns {','.join(trained)}, or name yours with --text-column)",
    )


def load_classifier(model: str, base_model: str | None):
    """A text-classification pipeline over the adapter (on its base) or the merged model."""
    from utils.cluster.job import leave_out

    # Serving needs neither DeepSpeed nor bitsandbytes; left out, they cost nothing at start (a third of its CPU).
    leave_out("deepspeed", "bitsandbytes")
    import torch
    from transformers import AutoTokenizer, pipeline
    from transformers.utils import find_adapter_config_file

    from utils.training.model import NO_REMOTE_CODE

    # Frozen, the imports' objects are out of the collector's sight (a fifth of a short call's CPU), as in main.py.
    gc.freeze()
    device = 0 if torch.cuda.is_available() else -1
    try:
        config = find_adapter_config_file(model)
        if config is None and base_model:
            raise BadInput(
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
        raise BadInput(
            f"cannot load {model} ({first_line(exc, 300)}); give an adapter folder, a merged folder or a Hub repo id (with --base-model if the adapter's base is elsewhere)",
        ) from None
    # A folder without a recorded MAX_SEQ_LENGTH says 1e30: cut to the model's positions, or a long sentence fails.
    positions = getattr(classifier.model.config, "max_position_embeddings", None)
    if isinstance(positions, int):
        classifier.tokenizer.model_max_length = min(classifier.tokenizer.model_max_length, positions)
    return classifier


def warn_if_untrained(model: str, id2label: dict) -> None:
    """Warn about a full model with transformers' default label names and no record of a run of this job: most
    likely a base model, whose untrained head answers by chance (seen: LABEL_0 at 0.50 for everything)."""
    if all(name == f"LABEL_{i}" for i, name in id2label.items()) and model_file(model, INPUTS_NAME) is None:
        print(
            f"warning: {model} names its labels {', '.join(id2label.values())} (transformers' defaults) and holds no "
            "record of a training run of this job: if it is a base model, its classification head is untrained and "
            "its answers are chance; give the trained adapter (OUTPUT_DIR/model) or merged model (OUTPUT_DIR/merged)",
            file=sys.stderr,
        )


def load_adapter(model: str, adapter: dict, base_model: str | None):
    """The adapter `model` (its adapter_config.json: `adapter`) on its base, the head sized and named by the labels
    saved beside it."""
    from peft import PeftModel

    from utils.training.model import load_base

    base_id = base_model or adapter["base_model_name_or_path"]
    # A multi-label head (sigmoid scores) as inputs.json records it: the base's config does not know it.
    multi_label = recorded_input(model, "problem_type") == MULTI_LABEL
    id2label = read_label_names(model)  # None: the base's own head
    # The head peft restores (modules_to_save): a base's head of another size is no news to whoever runs this.
    restored = ["classifier", "score", *(adapter.get("modules_to_save") or [])]
    try:
        base = load_base(base_id, [id2label[i] for i in sorted(id2label)] if id2label else None, restored, multi_label)
    except OSError as exc:
        raise BadInput(
            f"cannot load {base_id}, the base model of the adapter {model} ({first_line(exc, 300)}); "
            "pass --base-model with its Hub id or a local copy of it",
        ) from None
    check_adapter_fits(model, adapter, base, base_id)
    check_base_unchanged(model, base_id)
    try:
        return PeftModel.from_pretrained(base, model)
    except RuntimeError as exc:  # a shape the check above cannot see (a .bin adapter, a new layer kind)
        raise misfit(model, adapter, f"does not fit the base {base_id} ({first_line(exc, 300)})") from None


def check_base_unchanged(model: str, base_id: str) -> None:
    """Refuse a local base folder whose files differ from the fingerprint base_model.json records: a base of the
    same shapes with other weights loads without a word and answers wrongly. A Hub base records its id alone."""
    from utils.config.identity import base_model_changes

    if not Path(base_id).is_dir():
        return
    recorded = read_base_fingerprint(model)  # None too for a Hub repo that cannot be reached now
    if recorded is None:
        print(
            f"note: {model} holds no {BASE_NAME} (saved before the job recorded its base's fingerprint), so the base "
            f"{base_id} is not checked against the one it was trained on",
            file=sys.stderr,
        )
        return
    if changed := base_model_changes(recorded, base_id):
        raise BadInput(
            f"the base model {base_id} is not the one the adapter {model} was trained on: its {changed} changed since "
            f"(added, removed or edited; the adapter's {BASE_NAME} records the SHA-256 of each weights, config and "
            "tokenizer file of its base); point --base-model at the base it was trained on (an unchanged copy of it), "
            "or train the adapter again on this base",
        )


def misfit(model: str, adapter: dict, what: str) -> JobError:
    fix = f"pass --base-model with {adapter['base_model_name_or_path']}, or a local copy of it"
    return BadInput(f"the adapter {model} {what}; {fix}")


def check_adapter_fits(model: str, adapter: dict, base, base_id: str) -> None:
    """Refuse a base the adapter was not trained on, before peft loads it: another width is a traceback listing
    every tensor, and a deeper base loads with a warning and answers with layers the training never adapted."""
    weights = None if adapter.get("fan_in_fan_out") else model_file(model, "adapter_model.safetensors")
    if weights is None:  # no safetensors file, or (out, in) stored transposed: peft's own load checks it
        return
    from safetensors import safe_open

    from utils.training.model import matches_target

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
        columns = input_columns(args.model, args.file, args.text_column)
        label_column = args.label_column or recorded_input(args.model, "label_column") or "label"
        inputs = read_inputs(args.file, columns, label_column)
        if args.metrics and not has_labels(inputs):
            raise BadInput(
                f"--metrics {args.metrics} asks for metrics, and {inputs.source} has no labelled row in "
                f"'{label_column}'; give a file with the labels, name their column with --label-column, or drop --metrics",
            )
        classifier = load_classifier(args.model, args.base_model)
        labels = model_labels(classifier)
        multi_label = classifier.model.config.problem_type == MULTI_LABEL
        if args.threshold is not None and not multi_label:
            raise BadInput(
                f"--threshold {args.threshold:g} picks the labels of a multi-label model, and {args.model} predicts "
                "one label (or a score) a row; drop --threshold",
            )
        if args.metrics and multi_label:
            raise BadInput(
                f"--metrics {args.metrics}: predict.py scores single-label and regression models; a multi-label "
                "model's scores are its run's metrics.json (eval_f1_micro, eval_f1_macro, eval_subset_accuracy); "
                "drop --metrics",
            )
        labelled = [] if multi_label else references(inputs, labels, label_column)
    except JobError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.code
    cut = args.threshold if args.threshold is not None else recorded_input(args.model, "threshold")
    answers = classify(classifier, inputs.texts, args.batch_size, cut)
    try:
        for row in answer_rows(inputs, answers):
            print(json.dumps(row, default=str), flush=True)
    except BrokenPipeError:
        # `| head` stopped reading: end as a Unix tool does, stdout on /dev/null so the flush at exit cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    if (metrics := score_answers(answers, labelled, labels)) is not None:
        # On stderr: standard output stays one JSON line per input row, for the next tool in a pipe.
        print(metrics_line(metrics, inputs.source), file=sys.stderr)
        if args.metrics:
            args.metrics.write_text(json.dumps(metrics, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The model card (README.md), its training-curve plot and the label names, written at save and again at push (with
the repo id) from metrics.json and the settings, so a `--push-only` after a restart writes the same card."""

from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from utils.config.plan import Plan
from utils.config.recipe import RecipeOptions, recipe_summary
from utils.config.tasks import MULTI_LABEL
from utils.run_folder.model_files import INPUTS_NAME, LABELS_NAME, REGRESSION_LABEL

PLOT_NAME = "training_curves.png"
CARD_METRICS = ("accuracy", "f1", "precision", "recall", "matthews_correlation", "pearson", "spearman", "mse")
CARD_METRICS += ("f1_micro", "f1_macro")  # multi-label (subset_accuracy is an accuracy)
# The validation curve: the first of these logged is drawn.
CURVE_METRICS = ("eval_accuracy", "eval_matched_accuracy", "eval_pearson", "eval_f1_micro")

CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

{{ what }} fine-tuned for {{ task }} on {{ data_source }}.

| metric (validation {{ splits }}, {{ eval_samples }} rows) | value |
| --- | --- |
{{ metrics_rows }}
{% if plot %}
![Training loss and validation accuracy]({{ plot }})
{% endif %}
## Use

```python
{{ usage }}
```

Or without code: `{{ predict_command }}` (from the training job's repository)
prints one JSON line per {{ row }}.

## Training

| setting | value |
| --- | --- |
{{ training_rows }}
"""


@dataclass(frozen=True)
class CardFacts(RecipeOptions):
    """The card's and label files' settings, and the recipe's (Settings.select builds it)."""

    model_name: str
    output_dir: str
    local_data: str | None
    dataset_name: str
    dataset_config: str
    task: str | None
    text_column: str
    text_columns: tuple[str, ...]
    label_column: str
    label_names: tuple[str, ...]
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    lora_target_modules: tuple[str, ...]
    max_seq_length: int
    seed: int
    early_stopping_patience: int | None


def published_base(metrics: dict, plan: Plan) -> str | None:
    """The base's Hub id: the one the run trained from (metrics.json), else the plan's (a run trained from a plain
    folder is published once BASE_MODEL_ID is given)."""
    return metrics.get("base_model_id") or plan.base_model_id


def run_labels(metrics: dict, label_names: tuple[str, ...]) -> list[str]:
    """The class names in id order (`[]` for regression); LABEL_NAMES for a run recorded before the labels were."""
    return list(metrics.get("labels", label_names))


def write_label_names(
    folder: Path, metrics: dict, label_names: tuple[str, ...], text_columns: tuple[str, ...], label_column: str
) -> None:
    """id2label.json (`score` for a regression) and inputs.json beside an adapter: predict.py reads what training
    read."""
    names = run_labels(metrics, label_names) or [REGRESSION_LABEL]
    (folder / LABELS_NAME).write_text(json.dumps(dict(enumerate(names)), indent=2) + "\n")
    inputs = {"text_columns": list(text_columns), "label_column": label_column}
    if metrics.get("problem_type") == MULTI_LABEL:
        inputs |= {"problem_type": MULTI_LABEL, "threshold": metrics["threshold"]}
    (folder / INPUTS_NAME).write_text(json.dumps(inputs, indent=2) + "\n")


def plot_training_curves(log_history: list[dict], path: Path) -> bool:
    """Training loss and the validation curve against the optimizer step, as a PNG; False when nothing was logged."""
    losses = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry]
    logged = {key for entry in log_history for key in entry}
    curve = next((key for key in CURVE_METRICS if key in logged), "eval_accuracy")
    what = "validation " + curve.removeprefix("eval_").replace("_", " ")
    accuracies = [(entry["step"], entry[curve]) for entry in log_history if curve in entry]
    if not losses and not accuracies:
        return False
    import matplotlib

    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt

    fig, loss_axis = plt.subplots(figsize=(7, 3.5), dpi=100)
    if losses:
        loss_axis.plot(*zip(*losses, strict=True), color="tab:blue", label="training loss")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("training loss", color="tab:blue")
    if accuracies:
        accuracy_axis = loss_axis.twinx()
        accuracy_axis.plot(*zip(*accuracies, strict=True), color="tab:orange", marker="o", label=what)
        accuracy_axis.set_ylabel(what, color="tab:orange")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def data_source(metrics: dict, hub_dataset: str | None, dataset_config: str) -> str:
    data = metrics.get("data", {})
    if hub_dataset is None:
        return f"local data ({data.get('train_rows', '?')} training and {data.get('validation_rows', '?')} validation rows, fingerprint {data.get('fingerprint', '?')})"
    return f"[{hub_dataset}](https://huggingface.co/datasets/{hub_dataset}) ({dataset_config})"


def task_summary(metrics: dict, labels: list[str], pair: bool, task_name: str | None, label_column: str) -> str:
    pairs = "sentence-pair " if pair else ""
    task = f"GLUE {task_name.upper()}: " if task_name else ""
    if not labels:
        return f"{task}{pairs}regression (one score, {label_column})"
    if metrics.get("problem_type") == MULTI_LABEL:
        return (
            f"{pairs}multi-label classification into any of {len(labels)} labels ({' / '.join(labels)}), each "
            f"predicted where its sigmoid score is at least {metrics['threshold']:g}"
        )
    if not task_name and not pairs and len(labels) == 2:
        return f"binary sentiment classification ({' / '.join(labels)})"
    return f"{task}{pairs}classification into {len(labels)} classes ({' / '.join(labels)})"


def card_metrics(metrics: dict) -> list[str]:
    """`accuracy`, or `matched_accuracy` per MNLI split: metrics.json's evaluation metrics less `eval_`."""
    return [
        key.removeprefix("eval_")
        for key in metrics
        if key.startswith("eval_") and any(key.endswith(name) for name in CARD_METRICS)
    ]


def usage_snippet(repo_or_path: str, labels: list[str], pair: bool, merged: bool, metrics: dict) -> str:
    """The card's Python; an adapter's passes the label names and a regression's `problem_type` (else the pipeline
    answers with a sigmoid of the score)."""
    example = (
        '{"text": "A man is playing a guitar.", "text_pair": "A person plays music."}'
        if pair
        else '"a gripping, beautifully acted film"'
    )
    answer = '[{"label": "score", "score": <the predicted score>}]' if not labels else '[{"label": ..., "score": ...}]'
    multi = metrics.get("problem_type") == MULTI_LABEL
    every = ", top_k=None" if multi else ""  # every label's sigmoid score
    if multi:
        answer = f"every label with its sigmoid score; the text has those at or above {metrics['threshold']:g}"
    if merged:
        return (
            f'from transformers import pipeline\n\nclassifier = pipeline("text-classification", model="{repo_or_path}"{every})\n'
            f"classifier({example})  # {answer}"
        )
    id2label = dict(enumerate(labels or [REGRESSION_LABEL]))
    label2id = {name: index for index, name in id2label.items()}
    problem = ', "problem_type": "regression"' if not labels else f', "problem_type": "{MULTI_LABEL}"' if multi else ""
    # A base checkpoint with a head of two outputs (most have none) would refuse a head of another size.
    resized = ', "ignore_mismatched_sizes": True' if len(id2label) != 2 else ""
    what = "label names and that it is a regression" if not labels else "label names"
    what = f"label names and that it is {MULTI_LABEL}" if multi else what
    head = " (its head, of another size, comes with the adapter)" if resized else ""
    return (
        "from transformers import pipeline\n\n"
        f"# The base model's config knows no {what}: pass them (also in {LABELS_NAME} beside the adapter){head}.\n"
        f'config = {{"id2label": {id2label}, "label2id": {label2id}{problem}{resized}}}\n'
        f'classifier = pipeline("text-classification", model="{repo_or_path}", model_kwargs=config{every})\n'
        f"classifier({example})  # {answer}\n\n"
        "# or, as a PEFT model:\n"
        "from peft import AutoPeftModelForSequenceClassification\n"
        f'model = AutoPeftModelForSequenceClassification.from_pretrained("{repo_or_path}", **config)'
    )


def adapter_config(folder: Path) -> dict:
    """adapter_config.json as peft saved it (a merged folder's: model/'s beside it); {} if none."""
    for config in (folder / "adapter_config.json", folder.parent / "model" / "adapter_config.json"):
        with suppress(OSError, ValueError):
            return json.loads(config.read_text())
    return {}


def write_model_card(
    folder: Path, card: CardFacts, plan: Plan, metrics: dict, repo_id: str | None, merged=False
) -> ModelCard:
    """README.md in `folder`, model/ or, `merged`, merged/; `repo_id` None: the card names the folder."""
    base_id = published_base(metrics, plan)
    link = f"[{base_id}](https://huggingface.co/{base_id})" if base_id else f"`{card.model_name}`"
    what = f"{link} with a LoRA adapter merged into its weights," if merged else f"A LoRA adapter for {link},"
    repo_or_path = repo_id or f"{card.output_dir}/{'merged' if merged else 'model'}"
    pair = len(card.text_columns) == 2
    labels = run_labels(metrics, card.label_names)
    hub_dataset = None if card.local_data else card.dataset_name
    adapter = adapter_config(folder)
    # The layers as the adapter records them: LORA_TARGET_MODULES may be unset.
    targets = adapter.get("target_modules")
    targets = sorted(targets) if isinstance(targets, list) else list(card.lora_target_modules)
    rows, source = metrics.get("global_batch", "?"), metrics.get("global_batch_source")
    # The Training table: what the run trained with, as it resolved it (metrics.json) where it recorded it.
    training = {
        "base model": base_id or card.model_name,
        "adapter": f"LoRA r={card.lora_r}, alpha={card.lora_alpha}, dropout {card.lora_dropout:g}, on {', '.join(targets)}",
        "recipe": recipe_summary(
            card, metrics.get("loraplus_ratio"), "pooler" in (adapter.get("modules_to_save") or [])
        ),
        "epochs": f"{plan.num_epochs:g}" if plan.max_steps is None else f"{plan.max_steps} steps",
        "learning rate": f"{metrics.get('learning_rate', plan.learning_rate):g}",
        "global batch": f"{rows} rows a step ({source})" if source else str(rows),
        "world size (replicas)": replica_counts(metrics),
        "precision": metrics.get("precision", "?"),
        "quantization": metrics.get("quantization", "?"),
        "max sequence length": card.max_seq_length,
        **({"threshold": f"{metrics['threshold']:g} (sigmoid score)"} if "threshold" in metrics else {}),
        "seed": card.seed,
        "train runtime": f"{metrics['train_runtime']:.0f} s" if "train_runtime" in metrics else "?",
        "run name": metrics.get("run_name"),
    }
    if selected := metrics.get("selected_checkpoint"):
        training["model selection"] = model_selection(selected, card.early_stopping_patience)
    written = ModelCard.from_template(
        card_metadata(metrics, base_id, merged, hub_dataset, card.dataset_config, card.task),
        template_str=CARD_TEMPLATE,
        model_name=metrics.get("run_name"),
        what=what,
        task=task_summary(metrics, labels, pair, card.task, card.label_column),
        data_source=data_source(metrics, hub_dataset, card.dataset_config),
        splits="splits" if "eval_samples" not in metrics and "data" in metrics else "split",
        eval_samples=metrics.get("eval_samples", metrics.get("data", {}).get("validation_rows", "?")),
        # Rows joined here, not by a template loop: a blank line inside a table ends it on the Hub.
        metrics_rows="\n".join(f"| {name} | {metrics[f'eval_{name}']:.4f} |" for name in card_metrics(metrics)),
        plot=PLOT_NAME if (folder / PLOT_NAME).exists() else None,
        usage=usage_snippet(repo_or_path, labels, pair, merged, metrics),
        predict_command=f"python predict.py {repo_or_path} "
        + (f"pairs.jsonl --text-column {card.text_column}" if pair else "sentences.txt"),
        row="pair" if pair else "sentence",
        training_rows="\n".join(f"| {key} | {value} |" for key, value in training.items()),
    )
    written.save(folder / "README.md")
    return written


def card_metadata(
    metrics: dict, base_id: str | None, merged: bool, hub_dataset: str | None, dataset_config: str, task: str | None
) -> ModelCardData:
    """The card's YAML header: the base model, the tags, the validation metrics the Hub shows (model-index)."""
    hub_data = hub_dataset is not None
    sentiment = ["sentiment-analysis"] if dataset_config == "sst2" and not task else []
    return ModelCardData(
        base_model=base_id,  # None when unknown: the Hub rejects a path here
        library_name="transformers" if merged else "peft",
        pipeline_tag="text-classification",
        tags=["lora", "text-classification", *sentiment, *([] if merged else ["peft"])],
        datasets=[hub_dataset] if hub_data else None,
        model_name=metrics.get("run_name"),
        eval_results=[
            EvalResult(
                task_type="text-classification",
                dataset_type=hub_dataset if hub_data else "local",
                dataset_name=f"GLUE {dataset_config.upper()}" if hub_data else "local data",
                dataset_config=dataset_config if hub_data else None,
                dataset_split="validation",
                metric_type=name,
                metric_value=round(metrics[f"eval_{name}"], 4),
            )
            for name in card_metrics(metrics)
        ],
    )


def model_selection(selected: dict, early_stopping_patience: int | None) -> str:
    """Chosen on the split the card's metrics are measured on: they flatter it a little."""
    stopping = f", early stopping after {early_stopping_patience} evaluations without a better score"
    return (
        f"the checkpoint of step {selected['step']} of {selected['steps_trained']}, the best "
        f"{selected['metric']} ({selected['score']:.4f}) on the validation split (LOAD_BEST_MODEL"
        f"{stopping if early_stopping_patience else ''}); the metrics above are on the same split"
    )


def replica_counts(metrics: dict) -> str:
    """The replica count, or for a run resumed on another count: "steps 1-120 on 4, ..."."""
    segments = metrics.get("segments") or []
    if len({segment["world_size"] for segment in segments}) < 2:
        return str(metrics.get("world_size", "?"))
    return "steps " + ", ".join(
        f"{segment['steps'][0]}-{segment['steps'][1]} on {segment['world_size']}" for segment in segments
    )

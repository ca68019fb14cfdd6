"""The GLUE tasks by name (TASK=mnli): each one's data, columns, labels, problem type, metrics and validation
splits, in one table. A run without TASK is the same with the columns, labels and problem type it was given (or
found in the data). Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CLASSIFICATION, REGRESSION = "classification", "regression"
MULTI_LABEL = "multi_label_classification"  # transformers' own name, which selects its sigmoid and BCE loss
# What each problem reports, first the metric tracked as best when no task names one. F1, precision and recall are
# the positive class's for two labels, macro averages for more. Multi-label: micro F1 (tracked: it moves with every
# decision), macro F1 (a rare label counts as much as a common one), and the share of rows wholly right.
METRICS = {
    CLASSIFICATION: ("accuracy", "f1", "precision", "recall", "matthews_correlation"),
    REGRESSION: ("pearson", "spearman", "mse"),
    MULTI_LABEL: ("f1_micro", "f1_macro", "subset_accuracy"),
}
LOWER_IS_BETTER = frozenset({"mse"})
# The `evaluate` script computing each problem's METRICS, loaded by path (by name it would come from the Hub).
TRAINING = Path(__file__).resolve().parents[1] / "training"
METRIC_MODULES = {
    CLASSIFICATION: str(TRAINING / "classification_metrics.py"),
    REGRESSION: str(TRAINING / "regression_metrics.py"),
    MULTI_LABEL: str(TRAINING / "multi_label_metrics.py"),
}


@dataclass(frozen=True)
class Task:
    dataset_config: str  # the nyu-mll/glue configuration
    text_columns: tuple[str, ...]  # one column, or a pair tokenized as `[CLS] a [SEP] b [SEP]`
    label_names: tuple[str, ...]  # id order; empty for regression
    problem_type: str
    metrics: tuple[str, ...]  # GLUE's metric(s) for the task, first the one tracked as best
    validation_splits: tuple[str, ...] = ("validation",)  # each evaluated; several: metrics prefixed by split
    label_column: str = "label"


# GLUE's own column names, label names (the ClassLabel names of nyu-mll/glue) and metrics.
GLUE = {
    "cola": Task(
        "cola", ("sentence",), ("unacceptable", "acceptable"), CLASSIFICATION, ("matthews_correlation", "accuracy")
    ),
    "sst2": Task("sst2", ("sentence",), ("negative", "positive"), CLASSIFICATION, ("accuracy", "f1")),
    "mrpc": Task(
        "mrpc", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), CLASSIFICATION, ("f1", "accuracy")
    ),
    "qqp": Task("qqp", ("question1", "question2"), ("not_duplicate", "duplicate"), CLASSIFICATION, ("f1", "accuracy")),
    "stsb": Task("stsb", ("sentence1", "sentence2"), (), REGRESSION, ("pearson", "spearman", "mse")),
    "mnli": Task(
        "mnli",
        ("premise", "hypothesis"),
        ("entailment", "neutral", "contradiction"),
        CLASSIFICATION,
        ("accuracy",),
        ("validation_matched", "validation_mismatched"),
    ),
    "qnli": Task("qnli", ("question", "sentence"), ("entailment", "not_entailment"), CLASSIFICATION, ("accuracy",)),
    "rte": Task("rte", ("sentence1", "sentence2"), ("entailment", "not_entailment"), CLASSIFICATION, ("accuracy",)),
    "wnli": Task("wnli", ("sentence1", "sentence2"), ("not_entailment", "entailment"), CLASSIFICATION, ("accuracy",)),
}
GLUE_DATASETS = ("nyu-mll/glue", "glue")
# nyu-mll/glue configurations without a labelled train split: nothing to fine-tune on.
GLUE_UNTRAINABLE = {"ax": "the diagnostic set has a test split only"} | dict.fromkeys(
    ("mnli_matched", "mnli_mismatched"),
    "it holds MNLI's validation and test splits only (TASK=mnli trains on MNLI and evaluates both)",
)


def validation_splits(task: str | None) -> tuple[str, ...]:
    """The splits evaluated at the end: TASK's, else `validation`."""
    return GLUE[task].validation_splits if task else ("validation",)


def eval_prefix(split: str) -> str:
    """`validation_matched` is reported as `eval_matched_accuracy`; a lone `validation` as `eval_accuracy`."""
    return split.removeprefix("validation").strip("_")


def reported_metrics(task: str | None, problem_type: str) -> tuple[str, ...]:
    """The metrics a run reports, as metrics.json names them less `eval_`, the task's first."""
    names = GLUE[task].metrics if task else ()
    names = tuple(dict.fromkeys((*names, *METRICS[problem_type])))
    prefixes = [eval_prefix(split) for split in validation_splits(task)]
    return tuple(f"{prefix}_{name}" if prefix else name for prefix in prefixes for name in names)


def best_metric(task: str | None, problem_type: str) -> str:
    """The metric trainer_state.json tracks as best (`metric_for_best_model`): the task's first, on its first split."""
    name = GLUE[task].metrics[0] if task else METRICS[problem_type][0]
    prefix = eval_prefix(validation_splits(task)[0])
    return f"{prefix}_{name}" if prefix else name


def describe_task(settings) -> dict:
    """What `--dry-run` shows: the task as the settings resolve it (labels: from the data when not named)."""
    problem, named = settings.problem_type, settings.given_label_names is not None
    kind = problem if problem in (REGRESSION, MULTI_LABEL) else CLASSIFICATION
    labels = f"from the data (two unnamed ids: {','.join(settings.label_names)})"
    if kind == MULTI_LABEL:
        labels = "from the data (the names its rows list, sorted)"
    if named or settings.task:
        labels = list(settings.label_names)
    if settings.label_columns:
        labels = list(settings.label_columns)
    if problem == "auto":
        problem = "classification" + (
            " (LABEL_NAMES names the classes)" if named else ", or regression for a float label column"
        )
    return {
        "task": settings.task,
        "text_columns": list(settings.text_columns),
        "label_column": settings.label_column,
        "label_columns": list(settings.label_columns or ()),
        "label_names": [] if kind == REGRESSION else labels,
        "problem_type": problem,
        # Multi-label: the sigmoid score at which a label is predicted (metrics, best model, predict.py).
        "threshold": settings.threshold if kind == MULTI_LABEL else None,
        "validation_splits": list(validation_splits(settings.task)),
        "metrics": list(reported_metrics(settings.task, kind)),
        "metric_for_best_model": best_metric(settings.task, kind),
    }


def headline(metrics: dict) -> str:
    """The evaluation in one line, `eval_accuracy=0.9125` (and every split's for MNLI), as the job prints it."""
    shown = [
        key
        for name in ("accuracy", "pearson", "f1_micro")
        for key in metrics
        if key.startswith("eval_") and key.endswith(name)
    ]
    return " ".join(f"{key}={metrics[key]:.4f}" for key in shown)

"""Accuracy, F1, precision, recall and Matthews correlation of a classifier, as an `evaluate` metric module kept
in the repo: `evaluate.load("accuracy")` downloads its script from the Hub, which an offline cluster cannot do."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = (
    "Accuracy and Matthews correlation of class-id predictions; F1, precision and recall of the positive class "
    "(label 1) for two labels, their macro averages over the classes for more."
)
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted class ids.
    references (list of int): true class ids.
    num_labels (int): how many classes the model has (2: binary scores of label 1; more: macro averages).
Returns:
    accuracy (float): correct / total, in [0, 1].
    precision (float): true positives / predicted positives; 0 when nothing is predicted positive.
    recall (float): true positives / actual positives; 0 when nothing is labelled positive.
    f1 (float): the harmonic mean of precision and recall; 0 when both are 0.
    matthews_correlation (float): in [-1, 1], GLUE's CoLA metric; 0 when either side holds one class only.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ClassificationMetrics(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
        )

    def _compute(self, predictions, references, num_labels=2):
        if len(predictions) == 0:
            raise ValueError("no predictions to score")
        predicted, actual = np.asarray(predictions, dtype=np.int64), np.asarray(references, dtype=np.int64)
        classes = max(num_labels, int(predicted.max()) + 1, int(actual.max()) + 1)
        # confusion[true, predicted]
        confusion = np.bincount(actual * classes + predicted, minlength=classes * classes).reshape(classes, classes)
        true_pos = np.diag(confusion).astype(np.float64)
        per_predicted, per_actual = confusion.sum(axis=0).astype(np.float64), confusion.sum(axis=1).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            precision = np.where(per_predicted > 0, true_pos / per_predicted, 0.0)
            recall = np.where(per_actual > 0, true_pos / per_actual, 0.0)
            f1 = np.where(per_predicted + per_actual > 0, 2 * true_pos / (per_predicted + per_actual), 0.0)
        # Two labels: the positive class's scores, as before; more: each class counts the same (macro).
        pick = (lambda scores: float(scores[1])) if num_labels == 2 else (lambda scores: float(scores.mean()))
        total, correct = float(len(actual)), float(true_pos.sum())
        # The multi-class Matthews correlation (Gorodkin's R_K); for two classes the usual MCC.
        covariance = correct * total - float(per_predicted @ per_actual)
        spread = (total**2 - float(per_predicted @ per_predicted)) * (total**2 - float(per_actual @ per_actual))
        return {
            "accuracy": correct / total,
            "precision": pick(precision),
            "recall": pick(recall),
            "f1": pick(f1),
            "matthews_correlation": covariance / spread**0.5 if spread > 0 else 0.0,
        }

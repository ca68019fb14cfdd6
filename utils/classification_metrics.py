"""Accuracy, F1, precision and recall of a binary classifier, as an `evaluate` metric module kept in the
repo: `evaluate.load("accuracy")` downloads its script from the Hub, which an offline cluster cannot do."""

import datasets
import evaluate

_DESCRIPTION = "Accuracy, and F1, precision and recall of the positive class (label 1), of 0/1 predictions."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels, 0 or 1.
    references (list of int): true labels, 0 or 1.
Returns:
    accuracy (float): correct / total, in [0, 1].
    precision (float): true positives / predicted positives; 0 when nothing is predicted positive.
    recall (float): true positives / actual positives; 0 when nothing is labelled positive.
    f1 (float): the harmonic mean of precision and recall; 0 when both are 0.
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

    def _compute(self, predictions, references):
        if len(predictions) == 0:
            raise ValueError("no predictions to score")
        pairs = list(zip(predictions, references, strict=True))
        correct = sum(int(p == r) for p, r in pairs)
        true_pos = sum(int(p == 1 and r == 1) for p, r in pairs)
        predicted, actual = sum(int(p == 1) for p, _ in pairs), sum(int(r == 1) for _, r in pairs)
        return {
            "accuracy": correct / len(pairs),
            "precision": true_pos / predicted if predicted else 0.0,
            "recall": true_pos / actual if actual else 0.0,
            "f1": 2 * true_pos / (predicted + actual) if predicted + actual else 0.0,
        }

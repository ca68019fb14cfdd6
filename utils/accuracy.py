"""Accuracy as an `evaluate` metric module kept in the repo: `evaluate.load("accuracy")` downloads
its script from the Hub, which an offline cluster cannot do."""

import datasets
import evaluate

_DESCRIPTION = "Accuracy: the fraction of predictions equal to the reference labels."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): true labels.
Returns:
    accuracy (float): correct / total, in [0, 1].
    f1 (float): F1 of the positive class (label 1), in [0, 1]; 0 when nothing is predicted or labelled positive.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references):
        if len(predictions) == 0:
            raise ValueError("no predictions to score")
        correct = sum(int(p == r) for p, r in zip(predictions, references))
        true_pos = sum(int(p == 1 and r == 1) for p, r in zip(predictions, references))
        predicted, actual = sum(int(p == 1) for p in predictions), sum(int(r == 1) for r in references)
        f1 = 2 * true_pos / (predicted + actual) if predicted + actual else 0.0
        return {"accuracy": correct / len(predictions), "f1": f1}

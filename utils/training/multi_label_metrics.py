"""Micro and macro F1 and subset accuracy of a multi-label classifier, as an `evaluate` metric module kept in the
repo (scikit-learn's definitions, in numpy: the job's image has no scikit-learn, and `evaluate.load` downloads
scripts from the Hub, which an offline cluster cannot do)."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = (
    "F1 of multi-label predictions (each row's labels as 0/1 per label): over every (row, label) decision (micro) "
    "and the mean of each label's F1 (macro); subset accuracy, the share of rows whose labels are all right."
)
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of list of int): per row, 1 for each label predicted (its score at or above the threshold), else 0.
    references (list of list of int): per row, 1 for each label the row has, else 0.
Returns:
    f1_micro (float): 2 x true positives / (2 x true positives + false positives + false negatives), counted over
        every label of every row; 0 when nothing is labelled or predicted.
    f1_macro (float): the mean over the labels of each label's F1; a label neither labelled nor predicted in any
        row scores 0 (scikit-learn's zero_division=0).
    subset_accuracy (float): rows whose predicted labels are exactly their labels / rows, in [0, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MultiLabelMetrics(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int32")),
                    "references": datasets.Sequence(datasets.Value("int32")),
                }
            ),
        )

    def _compute(self, predictions, references):
        if len(predictions) == 0:
            raise ValueError("no predictions to score")
        predicted, actual = np.asarray(predictions, dtype=bool), np.asarray(references, dtype=bool)
        true_pos = (predicted & actual).sum(axis=0).astype(np.float64)
        # Per label: predicted + labelled = 2 TP + FP + FN, the F1's denominator.
        spread = predicted.sum(axis=0).astype(np.float64) + actual.sum(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            per_label = np.where(spread > 0, 2 * true_pos / spread, 0.0)
        return {
            "f1_micro": float(2 * true_pos.sum() / spread.sum()) if spread.sum() > 0 else 0.0,
            "f1_macro": float(per_label.mean()),
            "subset_accuracy": float((predicted == actual).all(axis=1).mean()),
        }

"""Pearson and Spearman correlation and the mean squared error of predicted scores, as an `evaluate` metric module
kept in the repo (GLUE's STS-B metrics). In numpy: the job's image has no scipy, and `evaluate.load("glue", "stsb")`
downloads its script from the Hub."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Pearson and Spearman correlation, and mean squared error, of predicted scores against the targets."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of float): predicted scores.
    references (list of float): target scores.
Returns:
    pearson (float): the linear correlation, in [-1, 1]; 0 when either side is constant.
    spearman (float): the Pearson correlation of the ranks (ties share their mean rank), in [-1, 1].
    mse (float): the mean of the squared differences.
"""


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    spread = float(np.sqrt((a @ a) * (b @ b)))
    return float(a @ b) / spread if spread > 0 else 0.0


def ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values given the mean of the ranks they span (what scipy.stats.rankdata does)."""
    order = np.argsort(values, kind="mergesort")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(values)]
    mean_rank = (starts + ends + 1) / 2.0  # ranks start..end-1, 1-based
    result = np.empty(len(values), dtype=np.float64)
    result[order] = np.repeat(mean_rank, ends - starts)
    return result


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RegressionMetrics(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}
            ),
        )

    def _compute(self, predictions, references):
        if len(predictions) == 0:
            raise ValueError("no predictions to score")
        predicted, actual = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
        return {
            "pearson": pearson(predicted, actual),
            "spearman": pearson(ranks(predicted), ranks(actual)),
            "mse": float(np.mean((predicted - actual) ** 2)),
        }

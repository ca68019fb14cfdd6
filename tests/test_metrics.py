"""The metrics a run reports, on cases worked by hand (on paper, from the confusion matrix or the ranks shown beside
each), through the compute_metrics the Trainer is given (utils/training/trainer.py), logits and all: argmax, the label
count and the offline metric modules are checked together."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import EvalPrediction

from utils.training.trainer import classification_metrics, regression_metrics

pytestmark = pytest.mark.check


def scored(compute, predicted: list[int], actual: list[int], classes: int) -> dict:
    # The predicted class's logit 2, the others -1: a row's cross-entropy is log(1 + (classes - 1) e^-3) when
    # right, 3 more when wrong (the loss is the mean over the rows).
    logits = np.eye(classes, dtype=np.float32)[predicted] * 3.0 - 1.0
    return compute(EvalPrediction(predictions=logits, label_ids=np.asarray(actual)))


def test_binary_scores_are_those_of_the_positive_class():
    # TP 3, FN 1, FP 2, TN 4.
    actual = [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    predicted = [1, 1, 1, 0, 1, 1, 0, 0, 0, 0]
    scores = scored(classification_metrics(2), predicted, actual, 2)
    assert scores == pytest.approx(
        {
            "accuracy": 0.7,  # 7 / 10
            "precision": 0.6,  # 3 / (3 + 2)
            "recall": 0.75,  # 3 / (3 + 1)
            "f1": 2 / 3,  # 2*3 / (2*3 + 2 + 1)
            "matthews_correlation": 0.408248290463863,  # (3*4 - 2*1) / sqrt(5*4*6*5) = 1/sqrt(6)
            "samples": 10,
            "loss": 0.9485873515737421,  # log(1 + e^-3) + 3 * 3/10
        },
        rel=1e-12,
    )


def test_three_classes_one_never_predicted_are_macro_averaged():
    # confusion[true][predicted]:  class 0: [3, 1, 0]   class 1: [1, 2, 0]   class 2: [1, 2, 0]
    # predicted per class 5, 5, 0; true per class 4, 3, 3; correct 5 of 10.
    actual = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    predicted = [0, 0, 0, 1, 1, 1, 0, 1, 0, 1]
    scores = scored(classification_metrics(3), predicted, actual, 3)
    assert scores == pytest.approx(
        {
            "accuracy": 0.5,
            "precision": 1 / 3,  # (3/5 + 2/5 + 0) / 3: class 2, never predicted, counts 0
            "recall": 17 / 36,  # (3/4 + 2/3 + 0/3) / 3
            "f1": 7 / 18,  # (6/9 + 4/8 + 0) / 3
            # Gorodkin: (5*10 - (5*4 + 5*3 + 0*3)) / sqrt((100 - 50) * (100 - 34)) = 15 / sqrt(3300)
            "matthews_correlation": 0.26111648393354675,
            "samples": 10,
            "loss": 1.5949229564209609,  # log(1 + 2e^-3) + 3 * 5/10
        },
        rel=1e-12,
    )


def test_a_classifier_predicting_one_class_scores_zero_not_nan():
    scores = scored(classification_metrics(2), [0, 0, 0, 0], [1, 0, 1, 0], 2)
    zero = dict.fromkeys(["precision", "recall", "f1", "matthews_correlation"], 0.0)
    loss = pytest.approx(1.548587351573742, rel=1e-6)  # log(1 + e^-3) + 3 * 2/4
    assert scores == {"accuracy": 0.5, **zero, "samples": 4, "loss": loss}


def test_regression_pearson_spearman_with_ties_and_mse():
    predicted = [1.0, 2.0, 3.0, 4.0, 5.0]
    actual = [2.0, 4.0, 5.0, 4.0, 5.0]  # ties: the two 4s share rank 2.5, the two 5s rank 4.5
    compute = regression_metrics()
    scores = compute(EvalPrediction(predictions=np.asarray(predicted).reshape(-1, 1), label_ids=np.asarray(actual)))
    assert scores == pytest.approx(
        {
            # deviations (-2, -1, 0, 1, 2) and (-2, 0, 1, 0, 1): 6 / sqrt(10 * 6) = 3 / sqrt(15)
            "pearson": 0.7745966692414834,
            # ranks (1, 2, 3, 4, 5) and (1, 2.5, 4.5, 2.5, 4.5): 7 / sqrt(10 * 9); without tie-averaged ranks 0.9,
            # with the no-ties shortcut 1 - 6*5/120 = 0.75
            "spearman": 0.7378647873726218,
            "mse": 1.8,  # (1 + 4 + 4 + 0 + 0) / 5
            "samples": 5,
            "loss": 1.8,  # the model's loss for a regression is the MSE
        },
        rel=1e-12,
    )

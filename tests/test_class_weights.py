"""CLASS_WEIGHTS=balanced through the real entry point on skewed data: each class's weight is rows / (classes x its
rows), logged, recorded in metrics.json and named in the card, and the loss the Trainer trains on is the weighted
cross-entropy of the model's logits."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from scripts.make_demo_assets import NEGATIVE, NOUNS, POSITIVE, VERBS
from tests.support.env import base_env, tiny_run_settings
from tests.support.processes import run_code, run_main

pytestmark = pytest.mark.slow
TRAIN_POSITIVE, TRAIN_NEGATIVE = 270, 30  # 9 to 1


def skewed_data(folder: Path) -> Path:
    rng = random.Random(3)
    folder.mkdir(parents=True)
    for split, (positive, negative) in {"train": (TRAIN_POSITIVE, TRAIN_NEGATIVE), "validation": (40, 40)}.items():
        rows = [1] * positive + [0] * negative
        rng.shuffle(rows)
        with open(folder / f"{split}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["sentence", "label"])
            for label in rows:
                words = ["the", rng.choice(NOUNS), rng.choice(VERBS), rng.choice(POSITIVE if label else NEGATIVE)]
                writer.writerow([" ".join(words), label])
    return folder


EXPECTED = [300 / (2 * TRAIN_NEGATIVE), 300 / (2 * TRAIN_POSITIVE)]  # negative 5.0, positive 0.556


def test_balanced_class_weights_are_logged_recorded_and_carded(tmp_path, tiny_bert):
    data = skewed_data(tmp_path / "data")
    settings = tiny_run_settings(tiny_bert, data, tmp_path / "out", CLASS_WEIGHTS="balanced", MAX_STEPS=10)
    settings.pop("NUM_EPOCHS")
    result = run_main(base_env(tmp_path, **settings))
    assert result.code == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert json.loads((out / "metrics.json").read_text())["class_weights"] == pytest.approx(EXPECTED, rel=1e-6)
    log = (out / "logs/rank-0.log").read_text()
    assert "class weights (balanced) in the loss: negative 5.000, positive 0.556" in log
    assert "balanced class weights in the loss" in (out / "model" / "README.md").read_text()


SCRIPT = """
import json, sys
import torch
from benchmarks.arms import build_job_arm
from utils.config.settings import Settings

model_dir, data_dir, out = sys.argv[1:]
settings = Settings(model_name=model_dir, dataset_path=data_dir, output_dir=out, report_to=("none",), max_steps=2,
                    class_weights="balanced", per_device_batch_size=16)
trainer, *_ = build_job_arm(settings, cuda=False)  # as utils/run.py builds it
model, data = trainer.model, {"train": trainer.train_dataset}
model.eval()  # no dropout: the two losses below see the same logits
batch = trainer.data_collator([data["train"][i] for i in range(32)])
with torch.no_grad():
    trained = trainer.compute_loss(model, dict(batch)).item()
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    weighted = torch.nn.functional.cross_entropy(logits, batch["labels"], weight=trainer.class_weights).item()
    plain = torch.nn.functional.cross_entropy(logits, batch["labels"]).item()
print(json.dumps({"trained": trained, "weighted": weighted, "plain": plain, "weights": trainer.class_weights.tolist()}))
"""


def test_the_loss_trained_on_is_the_weighted_cross_entropy(tmp_path, tiny_bert):
    data = skewed_data(tmp_path / "data")
    proc = run_code(SCRIPT, base_env(tmp_path), tiny_bert, data, tmp_path / "out", timeout=300)
    assert proc.code == 0, proc.stderr[-3000:]
    losses = json.loads(proc.stdout.splitlines()[-1])
    assert losses["weights"] == pytest.approx(EXPECTED, rel=1e-6)
    assert losses["trained"] == pytest.approx(losses["weighted"], rel=1e-6)
    assert losses["trained"] != pytest.approx(losses["plain"], rel=1e-3)  # the weights change what is trained on

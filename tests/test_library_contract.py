"""What the job relies on inside transformers' Trainer, beyond its public API, checked on the installed version.

JobTrainer (utils/trainer.py) overrides three private methods. `_get_train_sampler` and `_get_eval_sampler`:
the public route (`train_sampling_strategy="group_by_length"` with a `length` column) measures every row
again, draws each epoch's order from the global RNG (a resume in epoch 2 or later trains other batches)
and reorders evaluation. `_save_checkpoint`: a save a full volume cut short must end every rank alike.
A library upgrade can rename those methods, stop calling them, or change what the loaders do around them;
the job would then train other batches, evaluate reordered rows or fail as a traceback without a
word. These tests fail first and say which.
"""

from __future__ import annotations

import inspect

import datasets
import pytest
import torch
from torch.utils.data import SequentialSampler
from transformers import Trainer
from transformers.trainer_pt_utils import get_length_grouped_indices

from tests.conftest import job_trainer
from utils.trainer import EpochSeededLengthGroupedSampler, epoch_sampler

SEED = 42
BATCH = 8
ROWS = 96  # 12 batches an epoch
FIRST_ID = 5  # after BERT's special tokens


def row_ids(index: int, length: int) -> list[int]:
    """Token ids that name their row: its index in the first two tokens (the tiny vocabulary has > 16 words)."""
    return [FIRST_ID + index // 16, FIRST_ID + index % 16, *[FIRST_ID] * (length - 2)]


def row_index(ids: list[int]) -> int:
    return (ids[0] - FIRST_ID) * 16 + (ids[1] - FIRST_ID)


def sampler_of(loader):
    """The sampler inside a prepared loader, through accelerate's wrappers."""
    batches = loader.batch_sampler
    while hasattr(batches, "batch_sampler"):
        batches = batches.batch_sampler
    return batches.sampler


def lengths() -> list[int]:
    return [2 + (index * 7) % 19 for index in range(ROWS)]


def dataset() -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [
            {"input_ids": row_ids(index, length), "attention_mask": [1] * length, "label": index % 2}
            for index, length in enumerate(lengths())
        ]
    )


@pytest.fixture
def trainer(tmp_path, tiny_bert):
    """The job's own Trainer (build_trainer) on the tiny model, two epochs, nothing saved or evaluated on the way."""
    data = {"train": dataset(), "validation": dataset()}
    return job_trainer(
        tmp_path / "out",
        tiny_bert,
        data,
        per_device_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        num_epochs=2,
        seed=SEED,
    )


def test_the_overridden_private_methods_keep_their_names_and_signatures():
    for name, parameters in (
        ("_get_train_sampler", ["self", "train_dataset"]),
        ("_get_eval_sampler", ["self", "eval_dataset"]),
        ("_save_checkpoint", ["self", "model", "trial"]),
    ):
        method = getattr(Trainer, name, None)
        assert method is not None, f"Trainer.{name} is gone: JobTrainer's override is never called (utils/trainer.py)"
        assert list(inspect.signature(method).parameters) == parameters, (
            f"Trainer.{name} now takes {inspect.signature(method)}: check JobTrainer's override against it"
        )


def test_the_training_loader_still_asks_the_override_for_its_sampler(trainer):
    loader = trainer.get_train_dataloader()
    sampler = sampler_of(loader)
    assert isinstance(sampler, EpochSeededLengthGroupedSampler) and epoch_sampler(loader) is sampler, (
        "get_train_dataloader no longer builds its sampler with _get_train_sampler (or accelerate wraps it "
        "differently): batches are no longer length-grouped in a resumable order"
    )
    assert sampler.lengths == lengths()  # Arrow's lengths, the ones the library would measure


def test_the_evaluation_loader_still_asks_the_override_and_keeps_dataset_order(trainer):
    loader = trainer.get_eval_dataloader()
    assert isinstance(sampler_of(loader), SequentialSampler), (
        "get_eval_dataloader no longer builds its sampler with _get_eval_sampler: evaluation is reordered"
    )
    seen = [row_index(ids.tolist()) for batch in loader for ids in batch["input_ids"]]
    assert seen == list(range(ROWS))
    predictions = trainer.predict(trainer.eval_dataset)
    assert predictions.label_ids.tolist() == [index % 2 for index in range(ROWS)]


def test_each_epoch_trains_the_batches_drawn_from_seed_plus_epoch(trainer):
    """SamplerEpoch must run before each epoch's order is drawn, and the loader must follow the sampler:
    what a resume in any epoch reproduces."""
    steps: list[list[int]] = []
    training_step = trainer.training_step

    def recording_step(model, inputs, num_items_in_batch=None):
        steps.append([row_index(ids.tolist()) for ids in inputs["input_ids"]])
        return training_step(model, inputs, num_items_in_batch)

    trainer.training_step = recording_step
    trainer.train()

    expected = [
        get_length_grouped_indices(lengths(), BATCH, generator=torch.Generator().manual_seed(SEED + epoch))
        for epoch in (0, 1)
    ]
    trained = [index for step in steps for index in step]
    assert trained[:ROWS] == expected[0], "epoch 1 did not train the order drawn from SEED"
    assert trained[ROWS:] == expected[1], "epoch 2 did not train the order drawn from SEED + 1"
    assert expected[0] != expected[1]
    assert trainer.samples_seen == 2 * ROWS

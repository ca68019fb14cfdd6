"""One run identity, five places that ask "is this the same run?": the ranks at the rendezvous, run.json at a
restart, the checkpoint a restart would resume, a finished run found again, and the derived RUN_NAME. Each field of
the identity is changed once; every place must refuse it (or accept it) alike, with the same words."""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.errors import JobError
from utils.identity import agreement_refusal
from utils.outputs import RunDir, check_run_dir, mark_checkpoint_complete, write_run_record
from utils.plan import build_plan
from utils.settings import Settings

pytestmark = pytest.mark.check


def data_folder(root: Path, train: str = "sentence,label\ngood,1\nbad,0\n") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.csv").write_text(train)
    (root / "validation.csv").write_text("sentence,label\nfine,1\n")
    return root


def refusal(call) -> str | None:
    try:
        call()
    except JobError as exc:
        assert exc.code == 2, exc.message
        return exc.message
    return None


def places(tmp: Path, first: tuple[Settings, int], second: tuple[Settings, int], edit=None) -> dict[str, str | None]:
    """What each place says when a start with `second` (settings, replica count) finds the run `first` made
    (`edit`: what changed on the volume between the two)."""
    from utils.run import agreement_of, resume_checkpoint

    (settings_a, world_a), (settings_b, world_b) = first, second
    plan_a = build_plan(settings_a, world_a)
    if edit:
        edit()
    plan_b = build_plan(settings_b, world_b)
    out = tmp / "out"
    out.mkdir()
    run = RunDir(out)
    write_run_record(run, settings_a, plan_a, segments=[])
    checkpoint = out / "checkpoints" / "checkpoint-10"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    mark_checkpoint_complete(run, checkpoint, {"identity": plan_a.identity, "segments": []})
    said = {
        "rendezvous": agreement_refusal(
            agreement_of(settings_a, plan_a, world_a), {1: agreement_of(settings_b, plan_b, world_b)}
        ),
        "run.json": refusal(lambda: check_run_dir(settings_b, plan_b)),
        "checkpoint": refusal(lambda: resume_checkpoint(run, plan_b.identity)),
    }
    (out / "model").mkdir()
    (out / "model" / "adapter_config.json").write_text("{}")
    (out / "metrics.json").write_text("{}")
    said["finished run"] = refusal(lambda: check_run_dir(settings_b, plan_b))
    said["run name"] = None if plan_a.run_name == plan_b.run_name else f"{plan_a.run_name} -> {plan_b.run_name}"
    return said


CHANGES = {  # id -> (settings of the first start, of the second: {**base, **these}; replica counts; what is named)
    "a training setting": ({}, {"lora_r": 16}, (1, 1), "LORA_R: 8 -> 16"),
    # The per-device rule (PER_DEVICE_BATCH_SIZE given): the global batch, and so the run, follows the count.
    "the replica count": ({"per_device_batch_size": 64}, {}, (1, 2), "replica count: 1 -> 2"),
    "the global batch": (
        {"per_device_batch_size": 64},
        {"per_device_batch_size": 32},
        (1, 1),
        "PER_DEVICE_BATCH_SIZE: 64 -> 32",
    ),
    "the default global batch, rounded for another count": ({}, {}, (2, 3), "global batch: 64 -> 63"),
    "the ZeRO stage": (
        {"strategy": "deepspeed", "zero_stage": 2},
        {"strategy": "deepspeed", "zero_stage": 3},
        (2, 2),
        "ZERO_STAGE: 2 -> 3",
    ),
    "the data": ({}, {}, (1, 1), "data files: train.csv in DATASET_PATH="),  # edited in place (test below)
}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_each_change_of_the_identity_is_refused_alike_in_every_place(tmp_path, change):
    first, second, (world_a, world_b), named = CHANGES[change]
    base = {"dataset_path": str(data_folder(tmp_path / "data")), "output_dir": str(tmp_path / "out")}

    def edit():  # the same file name, one row changed
        if change == "the data":
            data_folder(tmp_path / "data", train="sentence,label\ngood,1\nawful,0\n")

    first_start, second_start = (
        (Settings(**base, **first), world_a),
        (Settings(**{**base, **first, **second}), world_b),
    )
    said = places(tmp_path, first_start, second_start, edit)
    assert said.pop("run name"), "another run must get another RUN_NAME"
    for place, message in said.items():
        assert message is not None and named in message, (place, message)
    fixes = {message.split("; ")[-1] for place, message in said.items() if place != "rendezvous"}
    assert len(fixes) == 1, fixes  # one comparison: the same fix wherever a restart meets it


ACCEPTED = {  # id -> (first, second, replica counts): one run, whatever changed
    "where it writes and pushes": ({}, {"logging_steps": 1, "hub_private": False, "save_steps": 7}, (1, 1)),
    "the replica count under GLOBAL_BATCH_SIZE": ({"global_batch_size": 64}, {}, (2, 4)),
    "the replica count under the default global batch": ({}, {}, (2, 4)),
    "the micro-batch cap under GLOBAL_BATCH_SIZE": ({"global_batch_size": 64}, {"per_device_batch_size": 16}, (2, 2)),
}


@pytest.mark.parametrize("change", ACCEPTED, ids=list(ACCEPTED))
def test_what_leaves_the_run_alone_is_accepted_alike_in_every_place(tmp_path, change):
    first, second, (world_a, world_b) = ACCEPTED[change]
    base = {"dataset_path": str(data_folder(tmp_path / "data")), "output_dir": str(tmp_path / "out")}
    said = places(tmp_path, (Settings(**base, **first), world_a), (Settings(**{**base, **first, **second}), world_b))
    if world_a != world_b:
        # The ranks of one start still agree on their count: a rendezvous of 2 and 4 would never complete.
        assert "replica count: 2 -> 4" in said.pop("rendezvous")
    assert said == dict.fromkeys(said), said

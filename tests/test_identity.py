"""One run identity, five places that ask "is this the same run?": the ranks at the rendezvous, run.json at a
restart, the checkpoint a restart would resume, a finished run found again, and the derived RUN_NAME. Each field of
the identity is changed once; every place must refuse it (or accept it) alike, with the same words."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.support.docs import RELIABILITY_DOC
from utils.common.errors import JobError
from utils.config.identity import FIELDS, agreement_refusal, identity_table
from utils.config.plan import build_plan, with_device
from utils.config.settings import Settings
from utils.run_folder.checkpoints import mark_checkpoint_complete
from utils.run_folder.layout import RunDir
from utils.run_folder.record import check_run_dir, write_run_record

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


def model_folder(root: Path, weights: bytes = b"\x00" * 64) -> Path:
    """What from_pretrained reads of a local base model (a config, a tokenizer, weights), and a README it does not."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"model_type": "bert", "hidden_size": 64}')
    (root / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\ngood\nbad\n")
    (root / "model.safetensors").write_bytes(weights)
    (root / "README.md").write_text("a tiny model\n")
    return root


def deepspeed_file(path: Path, scheduler: str = "WarmupDecayLR") -> Path:
    config = {"zero_optimization": {"stage": 2}, "scheduler": {"type": scheduler, "params": {}}}
    path.write_text(json.dumps(config))
    return path


def on_device(settings: Settings, plan):
    """The plan as Job.start completes it on this machine's CPU: what run.json and the checkpoints record."""
    return with_device(plan, cuda=False, bf16_supported=False, gradient_checkpointing=settings.gradient_checkpointing)


def places(tmp: Path, first: tuple[Settings, int], second: tuple[Settings, int], edit=None) -> dict[str, str | None]:
    """What each place says when a start with `second` (settings, replica count) finds the run `first` made
    (`edit`: what changed on the volume between the two). As in a real start, the run folder is checked before the
    device is known (`auto` unresolved), the rendezvous and the checkpoint after (utils/cluster/job.Job.start)."""
    from utils.run import agreement_of, resume_checkpoint

    (settings_a, world_a), (settings_b, world_b) = first, second
    plan_a = on_device(settings_a, build_plan(settings_a, world_a))
    if edit:
        edit()
    before_device = build_plan(settings_b, world_b)
    given_b = settings_b.given_label_names
    plan_b = on_device(settings_b, before_device)
    out = tmp / "out"
    out.mkdir()
    run = RunDir(out)
    write_run_record(run, settings_a.as_dict(), plan_a, segments=[])
    checkpoint = out / "checkpoints" / "checkpoint-10"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    mark_checkpoint_complete(run, checkpoint, {"identity": plan_a.identity, "segments": []})
    said = {
        "rendezvous": agreement_refusal(
            agreement_of(plan_a, world_a, settings_a.output_dir),
            {1: agreement_of(plan_b, world_b, settings_b.output_dir)},
        ),
        "run.json": refusal(
            lambda: check_run_dir(settings_b.output_dir, before_device, given_b, settings_b.base_model_id)
        ),
        "checkpoint": refusal(lambda: resume_checkpoint(run, plan_b.identity)),
    }
    (out / "model").mkdir()
    (out / "model" / "adapter_config.json").write_text("{}")
    (out / "metrics.json").write_text("{}")
    said["finished run"] = refusal(
        lambda: check_run_dir(settings_b.output_dir, before_device, given_b, settings_b.base_model_id)
    )
    said["run name"] = None if plan_a.run_name == plan_b.run_name else f"{plan_a.run_name} -> {plan_b.run_name}"
    return said


# fmt: off
CHANGES = {  # id -> (settings of the first start, of the second: {**base, **these}; replica counts; what is named)
    "a training setting": ({}, {"lora_r": 16}, (1, 1), "LORA_R: 8 -> 16"),
    # The per-device rule (PER_DEVICE_BATCH_SIZE given): the global batch, and so the run, follows the count.
    "the replica count": ({"per_device_batch_size": 64}, {}, (1, 2), "replica count: 1 -> 2"),
    "the global batch": ({"per_device_batch_size": 64}, {"per_device_batch_size": 32}, (1, 1),
                         "PER_DEVICE_BATCH_SIZE: 64 -> 32"),
    "the default global batch, rounded for another count": ({}, {}, (2, 3), "global batch: 64 -> 63"),
    "the ZeRO stage": ({"strategy": "deepspeed", "zero_stage": 2}, {"strategy": "deepspeed", "zero_stage": 3}, (2, 2),
                       "ZERO_STAGE: 2 -> 3"),
    "the data": ({}, {}, (1, 1), "data files: train.csv added, removed or edited"),  # edited in place (EDITS)
    # The same folder, the same shapes, other weights (EDITS): another base, whatever MODEL_NAME says.
    "the base model's weights, replaced in place": ({"model_name": "{tmp}/model"}, {}, (1, 1),
                                                    "base model: model.safetensors added, removed or edited"),
    "the label mapping": ({"label_names": "negative,positive"}, {"label_names": "positive,negative"}, (1, 1),
                          "LABEL_NAMES: negative,positive -> positive,negative"),
    # WarmupDecayLR -> WarmupLR in the file (EDITS): another schedule
    "the DeepSpeed config, edited": ({"strategy": "deepspeed", "deepspeed_config": "{tmp}/ds_config.json"}, {}, (2, 2),
                                     "DEEPSPEED_CONFIG: scheduler.type WarmupDecayLR -> WarmupLR"),
    "the epochs, where they decide": ({"num_epochs": 1}, {"num_epochs": 2}, (1, 1), "NUM_EPOCHS: 1.0 -> 2.0"),
    "the learning rate": ({}, {"learning_rate": 0.002}, (1, 1), "learning rates: base 0.001 -> 0.002"),
}
# fmt: on
EDITS = {  # id -> what changes on the volume between the two starts
    "the data": lambda tmp: data_folder(tmp / "data", train="sentence,label\ngood,1\nawful,0\n"),  # one row
    "the base model's weights, replaced in place": lambda tmp: model_folder(tmp / "model", weights=b"\x01" * 64),
    "the DeepSpeed config, edited": lambda tmp: deepspeed_file(tmp / "ds_config.json", scheduler="WarmupLR"),
    "a notes file beside the data": lambda tmp: (tmp / "data" / "train.txt").write_text("rows from the 2024 export\n"),
}


def volume(tmp: Path) -> dict[str, str]:
    """The data, a local base model and a DeepSpeed config on the volume; the settings every start shares."""
    model_folder(tmp / "model")
    deepspeed_file(tmp / "ds_config.json")
    return {"dataset_path": str(data_folder(tmp / "data")), "output_dir": str(tmp / "out")}


def compared(tmp: Path, first: dict, second: dict, worlds=(1, 1), change: str = "") -> dict[str, str | None]:
    """`places` for a start of {**`volume`, **first, **second} on worlds[1] replicas finding the run of {**`volume`,
    **first} on worlds[0], EDITS[change] made between the two; `{tmp}` in a value stands for `tmp`."""

    def given(values: dict) -> dict:
        return {name: v.replace("{tmp}", str(tmp)) if isinstance(v, str) else v for name, v in values.items()}

    base, first, second = volume(tmp), given(first), given(second)
    edit = EDITS.get(change, lambda tmp: None)
    starts = (Settings(**base, **first), worlds[0]), (Settings(**{**base, **first, **second}), worlds[1])
    return places(tmp, *starts, lambda: edit(tmp))


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_each_change_of_the_identity_is_refused_alike_in_every_place(tmp_path, change):
    first, second, worlds, named = CHANGES[change]
    said = compared(tmp_path, first, second, worlds, change)
    assert said.pop("run name"), "another run must get another RUN_NAME"
    for place, message in said.items():
        assert message is not None and named in message, (place, message)
    fixes = {message.split("; ")[-1] for place, message in said.items() if place != "rendezvous"}
    assert len(fixes) == 1, fixes  # one comparison: the same fix wherever a restart meets it


# fmt: off
ACCEPTED = {  # id -> (first, second, replica counts): one run, whatever changed
    "where it writes and pushes": ({}, {"logging_steps": 1, "hub_private": False, "save_steps": 7}, (1, 1)),
    "the replica count under GLOBAL_BATCH_SIZE": ({"global_batch_size": 64}, {}, (2, 4)),
    "the replica count under the default global batch": ({}, {}, (2, 4)),
    "the micro-batch cap under GLOBAL_BATCH_SIZE": ({"global_batch_size": 64}, {"per_device_batch_size": 16}, (2, 2)),
    # Settings the run ignores, or gives the value it resolves to anyway.
    "NUM_EPOCHS while MAX_STEPS decides": ({"max_steps": 5}, {"num_epochs": 3}, (1, 1)),
    "LEARNING_RATE set to the rate it resolves to": ({}, {"learning_rate": 0.001}, (1, 1)),
    "BASE_LEARNING_RATE beside LEARNING_RATE": ({"learning_rate": 0.002}, {"base_learning_rate": 0.0005}, (1, 1)),
    "PRECISION and QUANTIZATION auto for what auto resolves to": (
        {"precision": "fp32", "quantization": "none"}, {"precision": "auto", "quantization": "auto"}, (1, 1)),
    "LORA_TARGET_MODULES in another order": ({"lora_target_modules": "query,value"},
                                             {"lora_target_modules": "value,query"}, (1, 1)),
    "TASK=sst2 on the same data": ({}, {"task": "sst2"}, (1, 1)),
    "LABEL_NAMES given as the default": ({}, {"label_names": "negative,positive"}, (1, 1)),
    "INT8_THRESHOLD without 8-bit weights": ({"quantization": "none"}, {"int8_threshold": 6.0}, (1, 1)),
    "a notes file beside the data": ({}, {}, (1, 1)),  # train.txt, which the loader does not read (EDITS)
    "the DeepSpeed config's file by another path": (
        {"strategy": "deepspeed", "deepspeed_config": "{tmp}/ds_config.json"},
        {"deepspeed_config": "{tmp}/copy/../ds_config.json"}, (2, 2)),
}
# fmt: on


@pytest.mark.parametrize("change", ACCEPTED, ids=list(ACCEPTED))
def test_what_leaves_the_run_alone_is_accepted_alike_in_every_place(tmp_path, change):
    first, second, worlds = ACCEPTED[change]
    (tmp_path / "copy").mkdir()
    said = compared(tmp_path, first, second, worlds, change)
    if worlds[0] != worlds[1]:
        # The ranks of one start still agree on their count: a rendezvous of 2 and 4 would never complete.
        assert "replica count: 2 -> 4" in said.pop("rendezvous")
    assert said == dict.fromkeys(said), said


def spelled(tmp: Path, spelling: str, folder: Path) -> str:
    """`folder` (a folder under `tmp`) as a user may give it the second time."""
    if spelling == "a relative path":
        return os.path.relpath(folder)
    if spelling == "a trailing slash":
        return f"{folder}/"
    if spelling == "a link":
        link = tmp / "links" / folder.name
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(folder, target_is_directory=True)
        return str(link)
    moved = tmp / "restored" / folder.name  # another mount of the same bytes
    shutil.copytree(folder, moved)
    return str(moved)


@pytest.mark.parametrize("spelling", ["a relative path", "a trailing slash", "a link", "another copy of the bytes"])
def test_the_base_model_and_the_data_by_another_path_are_the_same_run(tmp_path, spelling):
    base = volume(tmp_path)
    model, data = tmp_path / "model", tmp_path / "data"
    first = Settings(**base, model_name=str(model))
    second = Settings(
        **{**base, "dataset_path": spelled(tmp_path, spelling, data)}, model_name=spelled(tmp_path, spelling, model)
    )
    said = places(tmp_path, (first, 1), (second, 1))
    assert said == dict.fromkeys(said), said


def test_auto_numerics_are_compared_once_the_device_resolves_them(tmp_path):
    """PRECISION=auto is fp32 on this CPU: against a run trained in bf16, refused wherever the device is known (the
    rendezvous, the checkpoint it would resume); before that (--dry-run, the run folder's first check) `auto` may
    still be bf16 on a GPU, so it is not refused there. The run name, derived before the device is known, stays."""
    base = volume(tmp_path)
    said = places(tmp_path, (Settings(**base, precision="bf16"), 1), (Settings(**base), 1))
    for place in ("rendezvous", "checkpoint"):
        assert said[place] is not None and "PRECISION: bf16 -> fp32" in said[place], (place, said[place])
    assert said["run.json"] is None and said["finished run"] is None and said["run name"] is None, said


def test_the_identity_holds_what_its_table_and_the_docs_say(tmp_path):
    """Each field of the identity is in FIELDS (what the refusals call it, what it holds), and docs/reliability.md
    lists the table as it is: neither can drift from the key."""
    settings = Settings(**volume(tmp_path))
    assert set(build_plan(settings, 1).identity) - {"version"} == set(FIELDS)
    assert identity_table() in RELIABILITY_DOC.read_text(), (
        "docs/reliability.md's identity table is stale: paste utils/config/identity.identity_table()"
    )


DOCUMENTED = {  # docs/reliability.md's table of refusals: id -> (first start, second start), EDITS as above
    "output dir of another run": ({"lora_r": 4}, {"lora_r": 8}),
    "label names against a finished run": ({"label_names": "negative,positive"}, {"label_names": "positive,negative"}),
    "the data": ({}, {}),
    "the base model's weights, replaced in place": ({"model_name": "{tmp}/model"}, {}),
}


@pytest.mark.parametrize("case", DOCUMENTED, ids=list(DOCUMENTED))
def test_the_documented_refusals_are_the_ones_the_job_prints(tmp_path, case):
    said = compared(tmp_path, *DOCUMENTED[case], change=case)
    printed = said["finished run"].replace(f"OUTPUT_DIR={tmp_path / 'out'}", "OUTPUT_DIR=...")
    assert f"`{printed}`" in RELIABILITY_DOC.read_text(), printed

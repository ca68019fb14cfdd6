"""The fast path (TORCH_COMPILE, docs/performance.md): the same model as the eager path, in a few static graphs.

One compiled `main.py` run of the tiny model is shared by the checks on one process: its every logged loss
against an eager run with the same length rule (TORCHDYNAMO_DISABLE=1, torch's own switch, turns the compile
off and leaves the buckets and the whole-batch order), its eval accuracy, and the compiler's counters the run
recorded in logs/rank-0.json. Dropout is on in both (MODEL_DROPOUT and LORA_DROPOUT), so the masks the compiled
graphs draw are checked too. The DDP check runs apart, dropout off as in tests/test_ddp_numerics.py.
Inductor compiles for tens of seconds a graph on 2 cores: the runs are few and short, the file `integration`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Replicas, base_env, rank_record, run_main, start_main, tiny_run_settings, wait_all
from utils.trainer import length_buckets

pytestmark = pytest.mark.integration

STEPS = 60  # the issue asks for 50 or more; the first epoch of 2000 rows at batch 16 is 125 steps
MAX_SEQ_LENGTH = 48  # buckets 32 and 48: the data's longest rows (42 tokens) come first, the rest fit 32
# Measured on 2 CPU cores: the compiled losses within 1.7e-7 (relative) of eager's over the 60 steps, the eval loss equal.
LOSS_RTOL = 1e-3
COMPILE_TIMEOUT = 1500  # seconds a compiling run may take on 2 busy cores


def losses(out: Path) -> dict[int, float]:
    """Every step's training loss (LOGGING_STEPS=1) from the last checkpoint's trainer_state.json."""
    last = max((out / "checkpoints").glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    history = json.loads((last / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


@pytest.fixture(scope="module")
def compiled_and_eager(tmp_path_factory, tiny_bert, sst2_dir) -> dict[str, Path]:
    """The same run compiled and eager, side by side; their OUTPUT_DIRs."""
    tmp = tmp_path_factory.mktemp("compile")
    settings = tiny_run_settings(
        tiny_bert,
        sst2_dir,
        tmp / "out",
        MAX_STEPS=STEPS,
        LOGGING_STEPS=1,
        SAVE_STEPS=STEPS,
        MAX_SEQ_LENGTH=MAX_SEQ_LENGTH,
        MODEL_DROPOUT="0.1",
        LORA_DROPOUT="0.1",
        TORCH_COMPILE="true",
    )
    outs = {"compiled": tmp / "compiled", "eager": tmp / "eager"}
    switches = {"compiled": {}, "eager": {"TORCHDYNAMO_DISABLE": "1"}}
    procs = [
        start_main(base_env(tmp, **{**settings, "OUTPUT_DIR": outs[arm], **switches[arm]}), log=tmp / f"{arm}.txt")
        for arm in outs
    ]
    codes = wait_all(procs, timeout=COMPILE_TIMEOUT)
    assert codes == [0, 0], [(tmp / f"{arm}.txt").read_text()[-3000:] for arm in outs]
    return outs


def test_compiled_losses_and_accuracy_are_eager_ones(compiled_and_eager):
    compiled, eager = (losses(compiled_and_eager[arm]) for arm in ("compiled", "eager"))
    assert sorted(compiled) == sorted(eager) == list(range(1, STEPS + 1))
    assert compiled == pytest.approx(eager, rel=LOSS_RTOL)
    # Not a run that stood still: the losses move over the steps.
    assert compiled[1] != compiled[STEPS]
    metrics = {arm: json.loads((out / "metrics.json").read_text()) for arm, out in compiled_and_eager.items()}
    assert metrics["compiled"]["eval_accuracy"] == metrics["eager"]["eval_accuracy"]
    # The accuracy of a model this small moves little; the loss shows any difference in the weights.
    assert metrics["compiled"]["eval_loss"] == pytest.approx(metrics["eager"]["eval_loss"], rel=LOSS_RTOL)


def test_compiled_run_has_one_graph_per_bucket_and_no_break(compiled_and_eager):
    record = rank_record(compiled_and_eager["compiled"], 0)["compile"]
    buckets = length_buckets(MAX_SEQ_LENGTH)
    assert buckets == [32, 48]
    # Both buckets were trained (the longest rows come first), each in one graph, the forward and backward whole.
    assert record["graphs"] == len(buckets), record
    assert record["recompiles"] == len(buckets) - 1, record
    assert record["graph_breaks"] == 0, record
    assert record["compile_s"] > 0, record
    # The compiled code is kept on the run's volume, for a restart or another replica.
    assert any((compiled_and_eager["compiled"] / "cache" / "inductor").rglob("*.py"))
    # The eager side really ran eager.
    assert rank_record(compiled_and_eager["eager"], 0)["compile"]["graphs"] == 0
    # The time to the first step, phase by phase, the compile inside the first step.
    startup = rank_record(compiled_and_eager["compiled"], 0)["startup"]
    phases = ["imports_and_rendezvous", "data", "model", "trainer", "first_step"]
    assert sorted(startup) == sorted(phases)
    assert 0 < startup[phases[0]] and [startup[phase] for phase in phases] == sorted(startup.values()), startup
    log = (compiled_and_eager["compiled"] / "logs" / "rank-0.log").read_text()
    assert f"torch.compile: {len(buckets)} graphs for length buckets {buckets}" in log


def test_two_compiled_replicas_train_as_one_process(tmp_path, tiny_bert, sst2_dir):
    """DDP on the fast path: one process at batch 16 and two replicas at 8, the same losses and adapter. Whole
    global batches in one global order (the fast path's sampler) give every step the same rows in both runs;
    dropout is off, so nothing random differs between one process and two."""
    settings = tiny_run_settings(
        tiny_bert,
        sst2_dir,
        tmp_path / "unused",
        MAX_STEPS=8,
        LOGGING_STEPS=1,
        SAVE_STEPS=8,
        MAX_SEQ_LENGTH=32,  # one bucket: one graph per process
        MODEL_DROPOUT="0",
        LORA_DROPOUT="0",
        TORCH_COMPILE="true",
        TORCHINDUCTOR_CACHE_DIR=tmp_path / "inductor",  # the replicas' graphs are compiled once
    )
    settings.pop("NUM_EPOCHS")
    one, two = tmp_path / "one", tmp_path / "two"
    group = Replicas(tmp_path)
    try:  # conftest's train_one_and_two, with time for the compiles on a loaded machine
        procs = group.start("ddp", {**settings, "OUTPUT_DIR": str(two), "PER_DEVICE_BATCH_SIZE": "8"})
        single = run_main(
            base_env(tmp_path, **{**settings, "OUTPUT_DIR": one, "PER_DEVICE_BATCH_SIZE": 16}), timeout=COMPILE_TIMEOUT
        )
        codes = wait_all(procs, timeout=COMPILE_TIMEOUT)
    finally:
        group.cleanup()
    assert single.code == 0, single.stderr[-3000:]
    assert codes == [0, 0], [(tmp_path / f"ddp-rank{r}.txt").read_text()[-3000:] for r in (0, 1)]
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    records = [rank_record(one, 0), rank_record(two, 0), rank_record(two, 1)]
    assert [r["compile"]["graphs"] for r in records] == [1, 1, 1]
    assert len({r["trainable_checksum"] for r in records[1:]}) == 1


def test_frozen_linears_stored_in_bf16_compute_what_autocast_computed(tiny_bert):
    """PRECISION=bf16: the frozen base's linear layers are stored in bf16 once instead of cast at every forward;
    the same numbers come out, to the last bit, the trained weights, LayerNorms and embeddings still fp32."""
    import copy

    import torch

    from utils.model import build_model
    from utils.settings import Settings
    from utils.trainer import store_frozen_linears_in_bf16

    settings = Settings(model_name=str(tiny_bert), lora_dropout=0, model_dropout=0)
    cast_each_step = build_model(settings, False, torch.device("cpu"))
    with torch.no_grad():  # adapters that are not zero, so their gradients flow through the frozen layers
        for name, weight in cast_each_step.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.1)
    stored = copy.deepcopy(cast_each_step)
    store_frozen_linears_in_bf16(stored)
    dtypes = {name: weight.dtype for name, weight in stored.named_parameters()}
    trained = {name for name, weight in stored.named_parameters() if weight.requires_grad}
    assert {dtypes[name] for name in trained} == {torch.float32}
    assert {dtype for name, dtype in dtypes.items() if "LayerNorm" in name or "embeddings" in name} == {torch.float32}
    assert dtypes["base_model.model.bert.encoder.layer.0.attention.self.query.base_layer.weight"] == torch.bfloat16
    ids = torch.randint(5, 60, (4, 12))
    outputs = {}
    for label, model in (("cast", cast_each_step), ("stored", stored)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 1, 1, 0]))
        out.loss.backward()
        grads = {name: weight.grad for name, weight in model.named_parameters() if weight.requires_grad}
        outputs[label] = (out.logits.detach(), grads)
    assert torch.equal(outputs["cast"][0], outputs["stored"][0])
    assert all(torch.equal(grad, outputs["stored"][1][name]) for name, grad in outputs["cast"][1].items())

"""The fast path (TORCH_COMPILE, docs/performance.md): a speed switch only, the same model as the eager path. A run
with TORCH_COMPILE=true and one with false, the defaults otherwise (length buckets, LoRA dropout on), see the same
padded rows at every step: every loss and the eval accuracy agree, and the compiled run builds one graph per bucket
before its first step. Inductor takes tens of seconds a graph on 2 cores: the runs are few and short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.data import write_fixed_length_data
from tests.support.env import base_env, tiny_run_settings
from tests.support.numerics import step_losses
from tests.support.outcomes import rank_record
from tests.support.processes import run_main, start_main, train_one_and_two, wait_all

pytestmark = pytest.mark.integration

STEPS = 60  # 50 or more; the first epoch of 2000 rows at batch 16 is 125 steps
# The bucket padding of every batch (16, 32, then the data's longest row, 42 tokens, rounded up to 48).
BUCKETS = [16, 32, 48]
# Measured on 2 CPU cores: the compiled losses within 9e-8 (relative) of eager's over 50 steps.
LOSS_RTOL = 1e-5
COMPILE_TIMEOUT = 1500  # seconds a compiling run may take on 2 busy cores


@pytest.fixture(scope="module")
def compiled_and_eager(tmp_path_factory, tiny_bert, sst2_dir) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("compile")
    settings = tiny_run_settings(tiny_bert, sst2_dir, tmp / "out", MAX_STEPS=STEPS, LOGGING_STEPS=1, SAVE_STEPS=STEPS)
    outs = {arm: tmp / arm for arm in ("compiled", "eager")}
    env = {
        arm: base_env(tmp, **{**settings, "OUTPUT_DIR": out, "TORCH_COMPILE": str(arm == "compiled").lower()})
        for arm, out in outs.items()
    }
    logs = [tmp / f"{arm}.txt" for arm in outs]
    wait_all([start_main(env[arm], log=log) for arm, log in zip(outs, logs, strict=True)], logs, COMPILE_TIMEOUT)
    return outs


def test_compiled_and_eager_train_the_same_model(compiled_and_eager):
    compiled, eager = (step_losses(compiled_and_eager[arm]) for arm in ("compiled", "eager"))
    assert sorted(compiled) == sorted(eager) == list(range(1, STEPS + 1))
    assert compiled == pytest.approx(eager, rel=LOSS_RTOL)
    # Not a run that stood still: the losses move over the steps.
    assert compiled[1] != compiled[STEPS]
    metrics = {arm: json.loads((out / "metrics.json").read_text()) for arm, out in compiled_and_eager.items()}
    assert metrics["compiled"]["eval_accuracy"] == metrics["eager"]["eval_accuracy"]
    # The accuracy of a model this small moves little; the loss shows any difference in the weights.
    assert metrics["compiled"]["eval_loss"] == pytest.approx(metrics["eager"]["eval_loss"], rel=LOSS_RTOL)
    records = {arm: rank_record(out, 0) for arm, out in compiled_and_eager.items()}
    assert records["compiled"]["samples_trained"] == records["eager"]["samples_trained"] == STEPS * 16


def test_compiled_run_builds_one_graph_per_bucket_before_its_first_step(compiled_and_eager):
    record = rank_record(compiled_and_eager["compiled"], 0)
    compiled = record["compile"]
    # Every bucket compiled once, the blocks sharing one graph, the forward and backward whole.
    assert (compiled["graphs"], compiled["recompiles"], compiled["graph_breaks"]) == (len(BUCKETS), 2, 0), compiled
    assert compiled["compile_s"] > 0 and compiled["cudagraphs"] is False, compiled
    # The compiled code is kept on the run's volume, for a restart or another replica.
    assert any((compiled_and_eager["compiled"] / "cache" / "inductor").rglob("*.py"))
    # The eager side really ran eager, and neither loaded bitsandbytes (full-precision weights).
    eager = rank_record(compiled_and_eager["eager"], 0)
    assert eager["compile"] is None and not eager["bitsandbytes_loaded"] and not record["bitsandbytes_loaded"]
    # The time to the first step, phase by phase; the graphs built inside the first step, so it ends after them.
    startup = record["startup"]
    phases = ["imports_and_rendezvous", "data", "model", "trainer", "first_step"]
    assert sorted(startup) == sorted(phases)
    assert 0 < startup[phases[0]] and [startup[phase] for phase in phases] == sorted(startup.values()), startup
    timing = record["timing"]
    assert timing["first_step_done_s"] > timing["first_step_began_s"] + timing["compile_s"], timing
    assert eager["timing"]["compile_s"] is None
    for arm in (record, eager):  # the steady steps: every step after the first, none of them compiling
        assert arm["timing"]["steady_steps"] == STEPS - 1, arm["timing"]
        assert arm["timing"]["steady_epoch_s"] == pytest.approx(
            arm["timing"]["steady_step_ms"] * arm["timing"]["steps_per_epoch"] / 1000, rel=1e-3
        )
        assert arm["timing"]["steps_per_epoch"] == 2000 // 16
        assert arm["timing"]["model_saved_s"] > arm["timing"]["first_step_done_s"]
    log = (compiled_and_eager["compiled"] / "logs" / "rank-0.log").read_text()
    assert f"torch.compile: graphs for length buckets {BUCKETS} built in" in log
    assert f"torch.compile: {len(BUCKETS)} graphs for length buckets {BUCKETS}" in log


def test_two_compiled_replicas_train_as_one_process(tmp_path, tiny_bert, sst2_dir):
    """DDP on the fast path: one process at batch 16 and two replicas at 8 see the same rows at every step (whole
    global batches in one order), dropout off: the same losses and adapter."""
    settings = tiny_run_settings(
        *(tiny_bert, sst2_dir, tmp_path / "unused"),
        **dict(MAX_STEPS=8, LOGGING_STEPS=1, SAVE_STEPS=8, MODEL_DROPOUT="0", LORA_DROPOUT="0", TORCH_COMPILE="true"),
        MAX_SEQ_LENGTH=32,  # two buckets, 16 and 32: two graphs per process
        TORCHINDUCTOR_CACHE_DIR=tmp_path / "inductor",  # the replicas' graphs are compiled once
    )
    settings.pop("NUM_EPOCHS")
    one, two = train_one_and_two(tmp_path, settings, 8, timeout=COMPILE_TIMEOUT)
    assert step_losses(two) == pytest.approx(step_losses(one), rel=1e-5)
    records = [rank_record(one, 0), rank_record(two, 0), rank_record(two, 1)]
    assert [r["compile"]["graphs"] for r in records] == [2, 2, 2]
    assert len({r["trainable_checksum"] for r in records[1:]}) == 1


def test_frozen_linears_stored_in_bf16_compute_what_autocast_computed(tiny_bert):
    """PRECISION=bf16: the frozen base's linear layers are stored in bf16 once instead of cast at every forward;
    the same numbers come out, to the last bit, the trained weights, LayerNorms and embeddings still fp32."""
    import copy

    import torch

    from utils.config.settings import Settings
    from utils.training.model import ModelChoices, build_model
    from utils.training.trainer import store_frozen_linears_in_bf16

    settings = Settings(model_name=str(tiny_bert), lora_dropout=0, model_dropout=0)
    cast_each_step = build_model(settings.select(ModelChoices), "none", torch.device("cpu"))
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


def test_batches_without_padding_run_the_bucket_s_graph_and_compile_nothing_more(tmp_path, tiny_bert):
    """MAX_SEQ_LENGTH at the smallest bucket and every row longer: every batch is cut to 16 tokens, none padded.
    With a 2D mask, transformers drops the mask of a batch without padding (SDPA then takes None): a graph the
    warm-up had not built, compiled again inside the epoch. The job's 4D mask keeps one graph for the one bucket."""
    data = write_fixed_length_data(tmp_path / "data", counts=(256, 32), extra_words=lambda rng: rng.randint(14, 20))
    settings = tiny_run_settings(
        tiny_bert, data, tmp_path / "out", MAX_STEPS=10, MAX_SEQ_LENGTH=16, TORCH_COMPILE="true", SAVE_STEPS=10
    )
    settings.pop("NUM_EPOCHS")
    result = run_main(base_env(tmp_path, **settings), timeout=COMPILE_TIMEOUT)
    assert result.code == 0, result.stderr[-3000:]
    compiled = rank_record(tmp_path / "out", 0)["compile"]
    assert (compiled["graphs"], compiled["recompiles"], compiled["graph_breaks"]) == (1, 0, 0), compiled

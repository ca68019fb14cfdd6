"""The captured step (CUDA_GRAPHS, utils/training/step_capture.py) held to the eager step on the CPU, where it runs
on its static buffers without a graph. One process builds the job's Trainer for each arm (LoRA dropout on, an
evaluation every 20 steps): eager and captured, with and without accumulation, and captured resumed from step 30;
it reports each step's losses, checksum, buffer addresses, padded lengths, the RNG around the warm-up, and every
host read (a device sync on a GPU) inside a step."""

from __future__ import annotations

import json

import pytest

from tests.support.env import base_env, tiny_run_settings
from tests.support.numerics import step_losses
from tests.support.outcomes import assert_refusal, rank_record
from tests.support.processes import run_code, run_main, wait_all

STEPS = 60
BUCKETS = [16, 32, 48]  # the tiny data's padded lengths (tests/test_compile.py)

SCRIPT = """
import json, random, sys
from pathlib import Path
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback
from benchmarks.arms import build_job_arm
from utils.training.model import trainable_checksum
from utils.config.settings import Settings
from utils.training.step_capture import CapturedStep

model_dir, data_dir, out, steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
# The reads a GPU answers only by waiting for the device: a tensor's value on the host, a count of its nonzeros.
HOST_READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "item", "allclose"}


class Spy(TorchDispatchMode):
    reads = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_READS:
            self.reads += (func.overloadpacket.__name__,)
        return func(*args, **(kwargs or {}))


class Watch(TrainerCallback):
    # What each step saw, from its begin to its end (the optimizer step included, the logging after it not).
    def __init__(self, trainer):
        self.trainer, self.spy, self.reads = trainer, None, []
        self.grad_ptrs, self.buffer_ptrs = set(), {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.spy = Spy()
        self.spy.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self.spy.__exit__(None, None, None)
        self.reads += [(state.global_step, name) for name in self.spy.reads]
        captured = self.trainer.captured
        if captured is not None:
            self.grad_ptrs.add(tuple(p.grad.data_ptr() for p in captured.trainable))
            for key, bucket in captured.buckets.items():
                ptrs = tuple(t.data_ptr() for t in bucket.inputs.values())
                self.buffer_ptrs.setdefault(str(key), set()).add(ptrs)


warmups, prepare = [], CapturedStep.prepare
rng = lambda: (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())


def watched_prepare(self, batches):
    before = rng()
    prepare(self, batches)
    warmups.append((before, rng()))


def kept(before, after):  # compared after training: a comparison inside a step would be a host read of its own
    return torch.equal(before[0], after[0]) and before[1] == after[1] and bool((before[2] == after[2]).all())


CapturedStep.prepare = watched_prepare


def train(name, resume_from=None, **extra):
    values = dict(
        model_name=model_dir, dataset_path=data_dir, output_dir=str(out / name), report_to=("none",),
        max_steps=steps, eval_steps=20, logging_steps=1, save_steps=30, per_device_batch_size=16,
        learning_rate=1e-3,
    )
    trainer, *_ = build_job_arm(Settings(**{**values, **extra}), cuda=False)  # as utils/run.py builds it
    lengths = set()
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.add(kwargs["input_ids"].shape[-1]) if module.training else None,
        with_kwargs=True,
    )
    watch = Watch(trainer)
    trainer.add_callback(watch)
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    history = trainer.state.log_history
    return {
        "losses": {entry["step"]: entry["loss"] for entry in history if "loss" in entry},
        "checksum": trainable_checksum(trainer.model),
        "evaluations": sum(1 for entry in history if "eval_loss" in entry),
        "captured": trainer.captured is not None,
        "graphs": bool(trainer.captured and trainer.captured.graphs),
        "shapes": sorted(dict((n, s) for n, s, _ in key)["input_ids"][-1] for key in trainer.captured.buckets)
        if trainer.captured else [],
        "lengths": sorted(lengths),
        "grad_ptrs": len(watch.grad_ptrs),
        "buffer_ptrs": {key: len(ptrs) for key, ptrs in watch.buffer_ptrs.items()},
        "host_reads": watch.reads,
    }


accumulation = dict(per_device_batch_size=8, gradient_accumulation_steps=2)
result = {f"{arm}{tag}": train(f"{arm}{tag}", cuda_graphs=arm == "captured", **extra)
          for tag, extra in (("", {}), ("-accumulation", accumulation)) for arm in ("eager", "captured")}
result["captured-resumed"] = train("captured-resumed", resume_from=out / "captured" / "checkpoints" / "checkpoint-30", cuda_graphs=True)
result["warmups_kept_rng"] = [kept(*states) for states in warmups]
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def arms(tmp_path_factory, tiny_bert, sst2_dir) -> dict:
    tmp = tmp_path_factory.mktemp("captured")
    proc = run_code(SCRIPT, base_env(tmp), tiny_bert, sst2_dir, tmp / "out", STEPS, timeout=900)
    assert proc.code == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    for arm in result.values():
        if isinstance(arm, dict):
            arm["losses"] = {int(step): loss for step, loss in arm["losses"].items()}
    return result


@pytest.mark.parametrize("tag, rel", [("", 0), ("-accumulation", 1e-6)], ids=["whole-batches", "accumulation"])
def test_the_captured_step_trains_the_eager_step_s_model(arms, tag, rel):
    eager, captured = arms[f"eager{tag}"], arms[f"captured{tag}"]
    assert captured["captured"] and not captured["graphs"] and not eager["captured"]
    # Every step's loss (LoRA dropout on: the same masks drawn; accumulated, to 1e-6) and the weights, to the bit.
    assert sorted(captured["losses"]) == list(range(1, STEPS + 1))
    assert captured["losses"] == pytest.approx(eager["losses"], rel=rel, abs=0)
    assert captured["checksum"] == eager["checksum"]
    assert captured["losses"][1] != captured["losses"][STEPS]  # not a run that stood still
    assert captured["evaluations"] == eager["evaluations"] >= 2  # evaluations between the steps changed nothing


def test_the_captured_step_keeps_its_buffers_and_its_shapes(arms):
    captured = arms["captured"]
    # Every .grad the same view of the flat buffer at every step (what a replay writes into).
    assert captured["grad_ptrs"] == 1, captured["grad_ptrs"]
    # One set of input buffers per bucket, at the same addresses at every step.
    assert len(captured["buffer_ptrs"]) == len(BUCKETS) and set(captured["buffer_ptrs"].values()) == {1}
    assert captured["shapes"] == BUCKETS
    # Every batch trained came in a bucket's shape: no shape a graph was not captured for.
    assert set(captured["lengths"]) <= set(BUCKETS) and captured["lengths"], captured["lengths"]
    # The warm-up before each capture left torch's, Python's and numpy's random state as it found it.
    assert arms["warmups_kept_rng"] and all(arms["warmups_kept_rng"]), arms["warmups_kept_rng"]


def test_a_resumed_captured_run_ends_where_the_uninterrupted_one_did(arms):
    whole, resumed = arms["captured"], arms["captured-resumed"]
    after = {step: loss for step, loss in resumed["losses"].items() if step > 30}  # the history holds steps 1-30 too
    assert sorted(after) == list(range(31, STEPS + 1)) and resumed["captured"]
    assert after == {step: loss for step, loss in whole["losses"].items() if step > 30}
    assert resumed["checksum"] == whole["checksum"]


@pytest.mark.parametrize("arm", ["eager", "captured", "captured-accumulation"])
def test_no_training_step_reads_a_device_value_on_the_host(arms, arm):
    """Between a step's begin and its end (forward, backward, clipping, AdamW, the scheduler, the callbacks) nothing
    reads a tensor's value on the host; on a GPU each such read waits for the device. The Trainer's logging reads
    the loss after the step's end, at LOGGING_STEPS. transformers' check of a 2D mask (`padding_mask.all()`) was
    one at every forward: the job passes a 4D mask of its own."""
    assert arms[arm]["host_reads"] == [], arms[arm]["host_reads"][:10]


@pytest.mark.slow
def test_two_captured_replicas_exchange_the_gradients_ddp_does(tmp_path, tiny_bert, sst2_dir, replicas):
    """Two replicas with the step captured (the gradients all-reduced by the job, one flat buffer) against two
    replicas of the eager step (DDP's hooks): the same losses at every step and the same weights on every rank."""
    settings = tiny_run_settings(tiny_bert, sst2_dir, tmp_path / "unused", MAX_STEPS=8, LOGGING_STEPS=1, SAVE_STEPS=8)
    settings.pop("NUM_EPOCHS")
    outs = {arm: tmp_path / arm for arm in ("eager", "captured")}
    for arm, out in outs.items():
        given = {"OUTPUT_DIR": str(out), "CUDA_GRAPHS": str(arm == "captured").lower(), "PER_DEVICE_BATCH_SIZE": "8"}
        wait_all(replicas.start(arm, {**settings, **given}), replicas.streams)
    assert step_losses(outs["captured"]) == pytest.approx(step_losses(outs["eager"]), rel=1e-6)
    records = {arm: [rank_record(out, rank) for rank in (0, 1)] for arm, out in outs.items()}
    assert [r["capture"] is not None for r in records["captured"]] == [True, True]
    assert [r["capture"] for r in records["eager"]] == [None, None]
    checksums = {r["trainable_checksum"] for arm in records.values() for r in arm}
    assert len(checksums) == 1, records


@pytest.mark.check
@pytest.mark.parametrize(
    "given, cuda, captured, compiled",
    [
        ({}, True, True, False),  # the default on one GPU (8-bit weights): eager kernels captured, no compile
        ({"torch_compile": "true", "quantization": "none"}, True, True, True),  # compiled blocks inside the capture
        # Not captured: TORCH_COMPILE=auto compiles full-precision weights, as before the capture.
        ({"cuda_graphs": "false", "quantization": "none"}, True, False, True),
        ({"gradient_checkpointing": "true", "quantization": "none"}, True, False, True),  # recomputed forwards
        ({"precision": "fp16", "quantization": "none"}, True, False, True),  # fp16's scaler skips on the host's word
        ({"strategy": "deepspeed"}, True, False, False),  # DeepSpeed's engine steps on its own
        ({"quantization": "none"}, True, True, False),  # full-precision weights: captured, not compiled
        ({}, False, False, False),  # the CPU: nothing to gain
        ({"cuda_graphs": "true"}, False, True, False),  # the CPU on request: the static buffers, no graph
    ],
    ids=["gpu", "compiled", "off", "checkpointing", "fp16", "deepspeed", "8bit", "cpu", "cpu-true"],
)
def test_cuda_graphs_auto_captures_the_step_where_it_can_run(given, cuda, captured, compiled):
    from utils.config.plan import build_plan, with_device
    from utils.config.settings import Settings

    settings = Settings(**given)
    plan = with_device(
        build_plan(settings, 1), cuda, bf16_supported=True, gradient_checkpointing=settings.gradient_checkpointing
    )
    assert (plan.capture, plan.compile) == (captured, compiled), plan


@pytest.mark.parametrize("given", [{"STRATEGY": "deepspeed"}, {"GRADIENT_CHECKPOINTING": "true"}])
def test_cuda_graphs_true_where_it_cannot_run_is_refused_with_the_fix(tmp_path, given):
    result = run_main(base_env(tmp_path, CUDA_GRAPHS="true", **given), "--dry-run")
    line = assert_refusal(result, ["CUDA_GRAPHS"])
    assert "set CUDA_GRAPHS=auto (off where it cannot run) or false" in line, line

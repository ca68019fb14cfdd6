"""The Trainer's per-step host work done once or over the trainable weights (JobTrainer.host_levers): the same
model as the library's own calls, step for step, with dropout on and evaluations between the steps, and every
training forward in training mode (an evaluation's eval() must not leave the model in it)."""

from __future__ import annotations

import json

from tests.support.env import base_env
from tests.support.processes import run_code

SCRIPT = """
import json, sys
import torch
from benchmarks.arms import build_job_arm
from utils.config.settings import Settings
from utils.training.model import trainable_checksum
from utils.training.trainer import JobTrainer

model_dir, data_dir, out = sys.argv[1:]
result = {}
for levers in (False, True):
    JobTrainer.host_levers = levers
    settings = Settings(
        model_name=model_dir, dataset_path=data_dir, output_dir=f"{out}/{levers}", report_to=("none",), max_steps=8,
        eval_steps=2, logging_steps=1, save_steps=1000, per_device_batch_size=16, learning_rate=1e-3,
    )
    trainer, *_ = build_job_arm(settings, cuda=False)  # as utils/run.py builds it
    model = trainer.model
    modes = []  # (gradients on: a training forward, the LoRA dropout's mode)
    dropout = next(m for name, m in model.named_modules() if name.endswith("lora_dropout.default"))
    dropout.register_forward_pre_hook(lambda module, args: modes.append((torch.is_grad_enabled(), module.training)))
    # A base module too (from_pretrained hands them over in eval mode): its dropout's mode in the training forwards.
    base_modes = set()
    base = model.get_base_model().bert.encoder.layer[0].output.dropout
    base.register_forward_pre_hook(lambda module, args: base_modes.add(module.training) if torch.is_grad_enabled() else None)
    trainer.train()
    history = trainer.state.log_history
    result[str(levers)] = {
        "losses": [entry["loss"] for entry in history if "loss" in entry],
        "grad_norms": [entry["grad_norm"] for entry in history if "grad_norm" in entry],
        "flos": trainer.state.total_flos, "checksum": trainable_checksum(trainer.model), "modes": sorted(set(modes)),
        "evaluations": sum(1 for entry in history if "eval_loss" in entry),
        "patched": "zero_grad" in vars(trainer.model_wrapped), "base_modes": sorted(base_modes),
    }
print(json.dumps(result))
"""


def test_the_host_levers_train_the_library_s_model_in_training_mode(tmp_path, tiny_bert, sst2_dir):
    proc = run_code(SCRIPT, base_env(tmp_path), tiny_bert, sst2_dir, tmp_path / "out", timeout=600)
    assert proc.code == 0, proc.stderr[-3000:]
    library, job = json.loads(proc.stdout.splitlines()[-1]).values()
    assert job["patched"], job  # the job's train() and zero_grad() are the ones the Trainer calls
    assert len(job["losses"]) == 8 and job["evaluations"] >= 3, job  # at steps 2, 4, 6 (8: the final one)
    # The same model, step for step: the losses, the clipped gradients' norms, the FLOPs counted, the weights.
    for name in ("losses", "grad_norms", "flos", "checksum"):
        assert job[name] == library[name], (name, library[name], job[name])
    # Every training forward with dropout in training mode, every evaluation forward without: after each
    # evaluation's eval(), the next step's train() reached the modules inside.
    assert job["modes"] == [[False, False], [True, True]], job["modes"]
    # The base's modules trained in training mode as well (their dropout, bitsandbytes' training path).
    assert job["base_modes"] == library["base_modes"] == [True], (job["base_modes"], library["base_modes"])

"""The Trainer's host work per step that does not depend on the batch: the library's calls against the job's.

    python benchmarks/host_levers.py                                  # bert-base dimensions, random weights
    python benchmarks/host_levers.py --json benchmarks/results/host_levers.json

A compiled GPU step waits on the host (docs/performance.md: 7.3 ms of kernels in a 44.7 ms step on an H200), and
four calls the HF Trainer makes at every step walk every module or parameter of the model, LoRA's frozen base
included:

  model.train()           training_step, every micro-batch: sets the mode of every module
  floating_point_ops      the FLOPs count, every micro-batch: counts every parameter
  _clip_grad_norm         every optimizer step: every parameter, most with no gradient
  model.zero_grad()       every optimizer step: every parameter

utils/training/trainer.JobTrainer does each once or over the trainable parameters only (`host_levers`). This measures, on
the job's own Trainer (the speed benchmark's `defaults` arm) after a few steps: each call, the library's way
against the job's (median over --calls calls, on the wrapped model the Trainer steps), and the steady step time
with the levers off and on, in alternating blocks of --steps steps on the same Trainer (first step excluded).
Both on the device this runs on; on the CPU the step's arithmetic is large and the host saving a small part of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.arms import arm_settings, build_job_arm  # noqa: E402
from scripts.make_demo_assets import write_dataset, write_tiny_bert  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (default: bert-base dimensions, random weights)")
    parser.add_argument("--batch-size", type=int, default=8, help="small: the step's arithmetic is then small too")
    parser.add_argument("--calls", type=int, default=200, help="timed calls of each operation")
    parser.add_argument("--steps", type=int, default=10, help="steps per block of the step-time comparison")
    parser.add_argument("--blocks", type=int, default=3, help="blocks with the levers off, and as many on")
    parser.add_argument("--work-dir", type=Path, default=REPO / "output" / "benchmark")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def median_ms(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 4)


def main() -> None:
    args = parse_args()
    work = args.work_dir.resolve()
    data = work / "data-sst2-2048-64"
    if not (data / "validation.csv").exists():
        write_dataset(data, train_rows=2048, validation_rows=64, profile="sst2")
    model_dir = Path(args.model) if args.model else work / "bert-base-random-12l"
    if not args.model and not (model_dir / "config.json").exists():
        write_tiny_bert(model_dir, data, layers=12, base=True)

    import torch
    from transformers import ProgressCallback, Trainer, TrainerCallback

    steps = 1 + 2 * args.blocks * args.steps
    cfg = {"model": str(model_dir), "data": str(data), "output_dir": str(work / "host-levers" / "run")}
    cfg |= {"batch_size": args.batch_size, "warmup": 0, "steps": steps, "epoch": False}
    cuda = torch.cuda.is_available()
    trainer, _, precision, compiled = build_job_arm(arm_settings("defaults", cfg), cuda)
    trainer.remove_callback(ProgressCallback)
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)

    class Blocks(TrainerCallback):
        """After the first step, alternating blocks of `--steps` steps with the levers off, then on."""

        def __init__(self):
            self.times: dict[bool, list[float]] = {False: [], True: []}
            self.began = 0.0

        def on_step_begin(self, args_, state, control, **kwargs):
            if state.global_step >= 1:
                trainer.host_levers = ((state.global_step - 1) // args.steps) % 2 == 1
                synchronize()
                self.began = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            if state.global_step >= 2:
                synchronize()
                self.times[trainer.host_levers].append(time.perf_counter() - self.began)

    blocks = Blocks()
    trainer.add_callback(blocks)
    trainer.train()

    # Each call on the Trainer as it stands after training: the wrapped model, its gradients from a last step.
    wrapped = trainer.model_wrapped
    inputs = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._prepare_inputs(inputs)
    trainer.compute_loss(wrapped, inputs).backward()
    library = {
        "model.train()": lambda: torch.nn.Module.train(wrapped),
        "floating_point_ops": lambda: Trainer.floating_point_ops(trainer, inputs),
        "_clip_grad_norm": lambda: Trainer._clip_grad_norm(trainer, wrapped),
        "model.zero_grad()": lambda: torch.nn.Module.zero_grad(wrapped),
    }
    trainer.host_levers = True
    job = {
        "model.train()": lambda: wrapped.train(),
        "floating_point_ops": lambda: trainer.floating_point_ops(inputs),
        "_clip_grad_norm": lambda: trainer._clip_grad_norm(wrapped),
        "model.zero_grad()": lambda: wrapped.zero_grad(),
    }
    calls = {}
    for name in library:
        if name == "model.zero_grad()":  # a gradient to clear at every call, as after a step
            trainer.compute_loss(wrapped, inputs).backward()
        calls[name] = {"library_ms": median_ms(library[name], args.calls), "job_ms": median_ms(job[name], args.calls)}
    off, on = (statistics.median(blocks.times[lever]) * 1e3 for lever in (False, True))
    figures = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch_threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "precision": precision,
        "torch_compile": compiled,
        "calls": calls,
        "host_ms_saved_per_step": round(sum(c["library_ms"] - c["job_ms"] for c in calls.values()), 3),
        "steady_step_ms": {"levers_off": round(off, 2), "levers_on": round(on, 2)},
        "steps_timed_each": len(blocks.times[True]),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()

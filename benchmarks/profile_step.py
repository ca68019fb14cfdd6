"""Where a training step's time goes: torch.profiler over a few steps of the job's own Trainer (the speed
benchmark's `defaults` arm, built the same way), after a warm-up.

    # bert-base dimensions with random weights on SST-2-like rows (the speed benchmark's inputs, reused):
    python benchmarks/profile_step.py
    python benchmarks/profile_step.py --batch-size 256            # the same launches for 4x the rows
    python benchmarks/profile_step.py --set torch_compile=true    # any setting, by its field name

Prints the wall time per step, the time the GPU spent in kernels per step (on CUDA), and the operators that
took the most host (CPU) time and the most device time. A step whose kernels fill a small part of its wall
time is bound by the host: Python, dispatch and kernel launches, not arithmetic.
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--data", help="a DATASET_PATH folder (default: SST-2-like synthetic rows)")
    parser.add_argument("--rows", type=int, default=8192, help="training rows of the synthetic data")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the profiler starts")
    parser.add_argument("--steps", type=int, default=20, help="profiled steps")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a setting by its field name (torch_compile=true)",
    )
    parser.add_argument("--rows-shown", type=int, default=20)
    parser.add_argument("--work-dir", type=Path, default=REPO / "output" / "benchmark")
    parser.add_argument("--json", type=Path, help="also write the per-step figures here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    work = args.work_dir.resolve()
    data = Path(args.data) if args.data else work / f"data-sst2-{args.rows}-872"
    if not args.data and not (data / "validation.csv").exists():
        write_dataset(data, train_rows=args.rows, validation_rows=872, profile="sst2")
    model = Path(args.model) if args.model else work / "bert-base-random-12l"
    if not args.model and not (model / "config.json").exists():
        write_tiny_bert(model, data, layers=12, base=True)

    import torch
    from transformers import ProgressCallback, TrainerCallback

    cfg = {
        "model": str(model),
        "data": str(data),
        "output_dir": str(work / "profile" / "run"),
        "batch_size": args.batch_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "epoch": False,
    }
    from utils.config.settings import Settings

    fields = dict(item.split("=", 1) for item in args.set)
    settings = Settings(**{**arm_settings("defaults", cfg).model_dump(), **fields})  # validated as any setting
    cuda = torch.cuda.is_available()
    trainer, quantize, precision, compiled = build_job_arm(settings, cuda)
    trainer.remove_callback(ProgressCallback)

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    profiler = torch.profiler.profile(activities=activities)

    class Window(TrainerCallback):
        """The profiler runs from the end of the warm-up to the end of the last step."""

        def __init__(self):
            self.wall: float | None = None

        def on_step_end(self, args_, state, control, **kwargs):
            if state.global_step == args.warmup:
                if cuda:
                    torch.cuda.synchronize()
                profiler.start()
                self.wall = time.perf_counter()
            elif state.global_step == args.warmup + args.steps:
                if cuda:
                    torch.cuda.synchronize()
                self.wall = time.perf_counter() - self.wall
                profiler.stop()

    window = Window()
    trainer.add_callback(window)
    trainer.train()

    events = profiler.key_averages()
    step_ms = window.wall / args.steps * 1e3
    device_us = sum(e.self_device_time_total for e in events) if cuda else 0
    figures = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "batch_size": args.batch_size,
        "settings": fields,
        "torch_compile": compiled,
        "quantization": "8bit" if quantize else "none",
        "precision": precision,
        "steps": args.steps,
        "step_ms": round(step_ms, 2),
        "kernel_ms_per_step": round(device_us / 1e3 / args.steps, 2) if cuda else None,
        "kernels_per_step": round(sum(e.count for e in events if e.device_type.name == "CUDA") / args.steps)
        if cuda
        else None,
    }
    print(json.dumps(figures, indent=2))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows_shown))
    if cuda:
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows_shown))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

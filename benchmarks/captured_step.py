"""Eager against captured training steps (CUDA_GRAPHS) of the job's own Trainer, on the same card and the same
batches, in one process: the headline of scripts/gpu_checks.sh. Also the captured step's numerics against eager's.

    python benchmarks/captured_step.py --model DIR --data DIR --json OUT [--arms eager-bf16,captured-bf16]
    python benchmarks/captured_step.py --model DIR --data DIR --json OUT --equivalence

Each arm is the job's Trainer (benchmarks/arms.build_job_arm, as utils/run.py builds it) with the defaults and a
few settings changed (ARMS), trained WARMUP + STEPS + SYNC_STEPS + PROFILED steps of the same seed, so every arm
sees the same batches in the same order (the batch-size arms aside). Its figures, each saying where it starts and
where it ends:

  step_ms           wall time per step from the end of step WARMUP to the end of step WARMUP + STEPS, the GPU
                    waited for at both ends: steady steps (every bucket captured or compiled before step 1)
  steady_epoch_s    step_ms x the optimizer steps of one epoch of the data at this arm's batch
  gpu_busy_ms       the GPU's time in kernels and copies per step, torch.profiler over PROFILED steps after that
  kernels_per_step  the device activities per step in the same window
  syncs_per_step    host waits on the GPU per step (torch.cuda.set_sync_debug_mode) over SYNC_STEPS steps that do
                    not log
  capture_s         the captured arm's warm-up and capture of every length bucket, before its first step
                    (compile_s: TORCH_COMPILE's graphs, built in that warm-up)
  peak_memory_mib   torch.cuda.max_memory_allocated over the arm (reset before it)

`--equivalence`: 60 steps of eager and captured from the same seed with LORA_DROPOUT=0 and with the default
dropout, the loss at every step; the largest relative difference and both final weight checksums.
`--arms host-around-replay` (alone, on the CPU): the Trainer's host time per step around a replayed step (the batch
copied into static buffers, clipping, fused AdamW, the scheduler, callbacks), to set beside the GPU step it hosts.
On the CPU (`--smoke` sizes) the captured arms run the captured function without a graph and nothing is timed
against the GPU: the same code paths, so the call on a GPU runs a script that has run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.arms import build_job_arm  # noqa: E402
from utils.config.settings import Settings  # noqa: E402

EAGER = {"quantization": "none", "cuda_graphs": False, "torch_compile": False}
CAPTURED = {"quantization": "none", "cuda_graphs": True, "torch_compile": False}
ARMS = {
    "eager-bf16": EAGER,
    "captured-bf16": CAPTURED,
    # The per-device batch: 16 rows a replica is what 4 replicas of a global batch of 64 train (issue: the
    # replica count a matter of speed); 256 what a larger batch would buy.
    "eager-bf16-b16": {**EAGER, "per_device_batch_size": 16},
    "captured-bf16-b16": {**CAPTURED, "per_device_batch_size": 16},
    "captured-bf16-b256": {**CAPTURED, "per_device_batch_size": 256},
    # The single-GPU default (8-bit base weights): the job's threshold (0: no outlier columns, no host sync per
    # matmul), captured and eager, and bitsandbytes' own default threshold eager (the step before this job's).
    "eager-8bit": {"quantization": "8bit", "cuda_graphs": False, "torch_compile": False},
    "captured-8bit": {"quantization": "8bit", "cuda_graphs": True, "torch_compile": False},
    "eager-8bit-threshold-6": {
        "quantization": "8bit",
        "cuda_graphs": False,
        "torch_compile": False,
        "int8_threshold": 6.0,
    },
    # Compiled blocks inside the captured step (TORCH_COMPILE=true): fewer kernels, a compile before the first step.
    "captured-compiled-bf16": {"quantization": "none", "cuda_graphs": True, "torch_compile": True},
    # The Trainer's host work around a replay, on the CPU: the captured step with a stand-in for the replay (the
    # batch copied into the bucket's static buffers, no forward or backward), then the real clipping, AdamW,
    # scheduler, callbacks: what the host spends on a step whose arithmetic the GPU does from one launch.
    "host-around-replay": {**CAPTURED, "cuda_graphs": True},
}
STAND_IN = "host-around-replay"
EQUIVALENCE_STEPS = 60
EQUIVALENCE_TOLERANCE = 1e-5  # relative, every step's loss, LORA_DROPOUT=0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--json", type=Path, required=True, help="the figures, rewritten after each arm")
    parser.add_argument("--arms", type=lambda text: text.split(","), default=["eager-bf16", "captured-bf16"])
    parser.add_argument("--equivalence", action="store_true", help="the numerics instead of the speed")
    parser.add_argument("--work-dir", type=Path, default=REPO / "output" / "captured-step")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--sync-steps", type=int, default=5)
    parser.add_argument("--profiled", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU sizes: MAX_SEQ_LENGTH 32, batch 16")
    return parser.parse_args()


def settings_for(args: argparse.Namespace, name: str, overrides: dict, **more) -> Settings:
    values = {
        "model_name": args.model,
        "dataset_path": args.data,
        "output_dir": str(args.work_dir / name),
        "report_to": ("none",),
        "eval_steps": 0,
        "save_steps": 10**9,
        "logging_steps": 10**6,  # no logging step inside the windows: the Trainer reads the loss on the host there
        "dataloader_num_workers": 2,
        "per_device_batch_size": 16 if args.smoke else 64,
        **({"max_seq_length": 32} if args.smoke else {}),
    }
    return Settings(**{**values, **overrides, **more})


def fresh_memory() -> None:
    """The previous arm's model, graphs and optimizer released (the Trainer holds reference cycles) and the peak
    reset, so an arm's peak memory is its own."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_speed_arm(args: argparse.Namespace, name: str) -> dict:
    import torch
    from transformers import ProgressCallback, TrainerCallback

    cuda = torch.cuda.is_available()
    fresh_memory()
    windows = (args.warmup, args.steps, args.sync_steps, args.profiled)
    total = sum(windows)
    settings = settings_for(args, name, ARMS[name], max_steps=total)
    trainer, quantize, precision, compiled = build_job_arm(settings, cuda)
    trainer.remove_callback(ProgressCallback)
    if name == STAND_IN:
        from utils.training.step_capture import CapturedStep

        # The replay's place: its loss, a scalar the graph would have written; the copy-in stays (CapturedStep.run).
        CapturedStep._forward_backward = lambda self, inputs: self.divisor.clone()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    profiler = torch.profiler.profile(activities=activities)
    ends = [sum(windows[: i + 1]) for i in range(4)]
    figures: dict = {}

    def wait() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Windows(TrainerCallback):
        """Steady steps timed, then syncs counted, then profiled; each window ends at a step's end."""

        def __init__(self):
            self.began = 0.0
            self.caught = None
            self.records: list = []

        def on_step_end(self, args_, state, control, **kwargs):
            step = state.global_step
            if step == ends[0]:
                wait()
                self.began = time.perf_counter()
            elif step == ends[1]:
                wait()
                figures["step_ms"] = round(1000 * (time.perf_counter() - self.began) / args.steps, 3)
                if cuda:
                    self.caught = warnings.catch_warnings(record=True)
                    self.records = self.caught.__enter__()
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
            elif step == ends[2]:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
                    self.caught.__exit__(None, None, None)
                    syncs = [r for r in self.records if "synchroniz" in str(r.message)]
                    figures["syncs_per_step"] = round(len(syncs) / args.sync_steps, 2)
                    figures["sync_sites"] = sorted({f"{Path(r.filename).name}:{r.lineno}" for r in syncs})[:10]
                wait()
                profiler.start()
            elif step == ends[3]:
                wait()
                profiler.stop()

    trainer.add_callback(Windows())
    started = time.perf_counter()
    trainer.train()
    figures["arm_s"] = round(time.perf_counter() - started, 1)
    events = profiler.key_averages()
    device_events = [e for e in events if e.device_type.name == "CUDA"]
    batch = settings.per_device_batch_size
    steps_per_epoch = len(trainer.train_dataset) // batch
    figures.update(
        settings={k: v for k, v in ARMS[name].items()},
        device=torch.cuda.get_device_name(0) if cuda else "cpu",
        batch=batch,
        precision=precision,
        quantization="8bit" if quantize else "none",
        compiled=compiled,
        captured=trainer.captured is not None,
        cuda_graphs=bool(trainer.captured and trainer.captured.graphs),
        steps_per_epoch=steps_per_epoch,
        steady_epoch_s=round(figures["step_ms"] * steps_per_epoch / 1000, 2),
        samples_per_s=round(batch * 1000 / figures["step_ms"], 1),
        gpu_busy_ms=round(sum(e.self_device_time_total for e in events) / 1e3 / args.profiled, 3) if cuda else None,
        kernels_per_step=round(sum(e.count for e in device_events) / args.profiled, 1) if cuda else None,
        capture_s=round(trainer.captured.capture_s, 2) if trainer.captured is not None else None,
        compile_s=trainer.startup.compile_s if compiled and trainer.captured is None else None,
        peak_memory_mib=round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None,
        shapes=len(trainer.captured.buckets) if trainer.captured is not None else None,
        # Where the host's time went in the profiled steps: the operators of most CPU time, ms a step.
        host_top_ops={
            e.key: round(e.self_cpu_time_total / 1e3 / args.profiled, 3)
            for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        },
        host_ms=round(sum(e.self_cpu_time_total for e in events) / 1e3 / args.profiled, 3),
        # Of which waiting for the loader's workers (on a 2-core CPU they compete with the main process).
        loader_wait_ms=round(
            sum(e.self_cpu_time_total for e in events if e.key.startswith("enumerate(DataLoader)"))
            / 1e3
            / args.profiled,
            3,
        ),
    )
    figures.setdefault("syncs_per_step", None)
    if cuda and figures["gpu_busy_ms"]:
        figures["gpu_busy_share"] = round(figures["gpu_busy_ms"] / figures["step_ms"], 3)
    return figures


def run_equivalence(args: argparse.Namespace) -> dict:
    import torch

    from utils.training.model import trainable_checksum

    cuda = torch.cuda.is_available()
    report: dict = {}
    for dropout in (0.0, None):
        label = "dropout-0" if dropout == 0.0 else "dropout-default"
        curves, checksums = {}, {}
        for name, overrides in (("eager", EAGER), ("captured", CAPTURED)):
            extra = {"lora_dropout": dropout} if dropout is not None else {}
            settings = settings_for(
                args, f"equivalence-{label}-{name}", overrides, max_steps=EQUIVALENCE_STEPS, logging_steps=1, **extra
            )
            trainer, *_ = build_job_arm(settings, cuda)
            trainer.train()
            curves[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            checksums[name] = trainable_checksum(trainer.model)
            del trainer
            fresh_memory()
        eager, captured = curves["eager"], curves["captured"]
        worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager, captured, strict=True))
        report[label] = {
            "steps": len(eager),
            "max_relative_difference": worst,
            "within_1e-5": worst <= EQUIVALENCE_TOLERANCE,
            "final_loss": {"eager": eager[-1], "captured": captured[-1]},
            "checksums": checksums,
            "same_weights": checksums["eager"] == checksums["captured"],
            "losses": curves,
        }
        print(f"[captured-step] equivalence {label}: max relative difference {worst:.3g}", file=sys.stderr, flush=True)
    return report


def main() -> int:
    args = parse_args()
    if args.smoke:
        args.warmup, args.steps, args.sync_steps, args.profiled = 2, 4, 2, 2
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"arms": {}, "failed": []}

    def save() -> None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")

    if args.equivalence:
        results["equivalence"] = run_equivalence(args)
        save()
        return 0
    for name in args.arms:
        print(f"[captured-step] {name} ...", file=sys.stderr, flush=True)
        try:
            results["arms"][name] = run_speed_arm(args, name)
        except Exception as exc:  # one arm's failure (a capture the GPU refuses, say) is its own figure
            import traceback

            traceback.print_exc()
            results["arms"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            results["failed"].append(name)
        print(f"[captured-step] {name}: {json.dumps(results['arms'][name])}", file=sys.stderr, flush=True)
        save()
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Training speed: the configuration this job replaces against the job's defaults, same model, same data.

    # bert-base dimensions with random weights (BertConfig(): the FLOPs of bert-base-uncased) on
    # SST-2-like sentences, on whatever this machine has (CUDA if present, else the CPU):
    python benchmarks/train_speed.py
    # the CPU figures in docs/performance.md: a 6-layer BERT, 50 timed steps of the defaults, 3 of the original
    python benchmarks/train_speed.py --layers 6 --steps 50 --original-steps 3
    # a GPU: one whole epoch (67,349 rows) of the defaults, the original and 8-bit timed beside it
    python benchmarks/train_speed.py --epoch
    # a real model folder and a DATASET_PATH-style data folder (train/validation files)
    python benchmarks/train_speed.py --model /pvc-home/bert-base-uncased --data /pvc-home/sst2

Arms, each in its own child process (benchmarks/arms.py), one after the other:

  original       what the replaced pipeline ran: the plain HF Trainer, LoRA r8/alpha16 on query,value,
                 gradient checkpointing on, fp32, batch 64, every sentence padded to 128 tokens; everything
                 it did not set is the library's default (random order, no loader workers, no TF32)
  defaults       the job's defaults with QUANTIZATION=none: dynamic padding, length-grouped batches, no
                 gradient checkpointing, bf16 autocast where the GPU has it, fused AdamW, SDPA attention,
                 TF32 on Ampere+, loader workers, pinned memory
  defaults-8bit  the single-GPU default (8-bit base weights); on a GPU it runs beside bf16 to show what
                 the memory saving costs in speed (QUANTIZATION=none is the setting that buys it back)
  compiled       the defaults with TORCH_COMPILE=true (not run unless asked: minutes of compiling)

The job's arms are the job's own code (utils.training.model.build_model, utils.training.data.load_sst2, utils.training.trainer.build_trainer)
given settings only; the original is a plain `transformers.Trainer` on the same model and data builders, with a
collator that pads to MAX_SEQ_LENGTH. Each arm trains `--warmup` steps, then `--steps` timed steps (the
original's batches all have one shape, so `--original-steps` can be smaller on a slow machine without changing
its figure).

Per arm: samples/s, real (non-pad) tokens/s, the padding fraction of what the model computed on,
peak memory (RSS on the CPU, torch.cuda.max_memory_allocated on CUDA), the time from process start
to the first training step, and on CUDA the model FLOPs utilisation against the GPU's peak bf16
FLOP/s. Also: `main.py --help` / `--dry-run` wall time; the real job (`main.py`, benchmarks/job_runs.py)
on one replica and on two CPU replicas for one epoch of a small data set (time to first step, optimizer
steps and rows per replica, read from the job's logs/rank-<R>.json); the gradient bytes DDP all-reduces
per step, the all-reduce time on gloo here for 2 and 4 processes (benchmarks/allreduce.py), and the
projected 4-replica DDP efficiency.

Writes JSON (--json, default WORK_DIR/results.json) and prints a table (benchmarks/report.py): figures and
ratios against the original measured in the same run, no verdicts. Nothing is downloaded: the random model
and the SST-2-like data (scripts/make_demo_assets.py, profile "sst2") are built locally under --work-dir
and reused by later runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# None of these imports torch: the parent only starts processes and reads their JSON.
from benchmarks.allreduce import lora_grad_bytes_bert_base, run_allreduce  # noqa: E402
from benchmarks.arms import ARMS, run_arms  # noqa: E402
from benchmarks.job_runs import run_jobs, time_startup  # noqa: E402
from benchmarks.processes import cpu_name  # noqa: E402
from benchmarks.report import SST2_TRAIN_ROWS, print_table, summarise  # noqa: E402
from scripts.make_demo_assets import write_dataset, write_tiny_bert  # noqa: E402

SST2_VALIDATION_ROWS = 872


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="random", help="'random' (BertConfig() dimensions, random weights) or a local model folder"
    )
    parser.add_argument("--layers", type=int, default=12, help="layers of the random model (12 = bert-base)")
    parser.add_argument(
        "--data", default="sst2-like", help="'sst2-like' (synthetic, SST-2's length profile) or a DATASET_PATH folder"
    )
    parser.add_argument("--rows", type=int, default=SST2_TRAIN_ROWS, help="training rows of the sst2-like data")
    parser.add_argument("--validation-rows", type=int, default=SST2_VALIDATION_ROWS)
    parser.add_argument(
        "--batch-size", type=int, default=64, help="per-device batch of every arm (the original's and the job's 64)"
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first (allocator, kernels, loader workers)"
    )
    parser.add_argument(
        "--steps", type=int, default=50, help="timed steps per arm; 50 covers a whole length-grouped megabatch"
    )
    parser.add_argument(
        "--original-steps",
        type=int,
        help="timed steps of the original (default --steps); its batches all have one shape",
    )
    parser.add_argument(
        "--epoch", action="store_true", help="time one whole epoch of the non-original arms instead of --steps"
    )
    parser.add_argument(
        "--epoch-rows", type=int, default=SST2_TRAIN_ROWS, help="rows of the epoch the projection is for"
    )
    parser.add_argument(
        "--arms",
        help=f"comma-separated, of {', '.join(ARMS)} (default: original,defaults, plus defaults-8bit on CUDA)",
    )
    parser.add_argument(
        "--skip-job", action="store_true", help="skip the runs of main.py (one replica, two CPU replicas)"
    )
    parser.add_argument("--job-rows", type=int, default=1024, help="training rows for the main.py runs")
    parser.add_argument("--job-timeout", type=int, default=1800)
    parser.add_argument("--skip-allreduce", action="store_true")
    parser.add_argument("--startup-repeats", type=int, default=5)
    parser.add_argument(
        "--peak-tflops", type=float, help="peak bf16 TFLOP/s of this GPU when it is not in the built-in table"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=REPO / "output" / "benchmark", help="models, data and runs (reused)"
    )
    parser.add_argument("--json", type=Path, help="where to write the results (default WORK_DIR/results.json)")
    args = parser.parse_args(argv)
    args.work_dir = args.work_dir.resolve()
    args.original_steps = args.original_steps or args.steps
    args.arms = (
        args.arms.split(",")
        if args.arms
        else ["original", "defaults", *(["defaults-8bit"] if cuda_available() else [])]
    )
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    return args


def cuda_available() -> bool:
    """Whether the arms will see a GPU, without importing torch here (nvidia-smi, or CUDA_VISIBLE_DEVICES="")."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return (
        shutil.which("nvidia-smi") is not None
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    )


def prepare_inputs(args) -> tuple[Path, Path, Path | None, str, str]:
    """(model folder, data folder, small data folder for the job runs, model label, data label)."""
    work = args.work_dir
    if args.data == "sst2-like":
        data = work / f"data-sst2-{args.rows}-{args.validation_rows}"
        if not (data / "validation.csv").exists():
            write_dataset(data, train_rows=args.rows, validation_rows=args.validation_rows, profile="sst2")
        data_label = f"SST-2-like synthetic, {args.rows} train rows (profile 'sst2' in scripts/make_demo_assets.py)"
    else:
        data, data_label = Path(args.data).resolve(), str(args.data)
    job_data = None
    if not args.skip_job:
        if args.data == "sst2-like" and args.rows > args.job_rows:
            job_data = work / f"data-sst2-{args.job_rows}-{args.validation_rows}"
            if not (job_data / "validation.csv").exists():
                write_dataset(job_data, train_rows=args.job_rows, validation_rows=args.validation_rows, profile="sst2")
        else:
            job_data = data
    if args.model == "random":
        model = work / f"bert-base-random-{args.layers}l"
        if not (model / "config.json").exists():
            words = data if args.data == "sst2-like" else None
            shutil.rmtree(model, ignore_errors=True)
            write_tiny_bert(model, words, layers=args.layers, base=True)
        model_label = f"BertConfig() with {args.layers} layers, random weights" + (
            " (bert-base)" if args.layers == 12 else ""
        )
    else:
        model, model_label = Path(args.model).resolve(), str(args.model)
    return model, data, job_data, model_label, data_label


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    model, data, job_data, model_label, data_label = prepare_inputs(args)

    startup = time_startup(args.startup_repeats)
    arms = run_arms(args, model, data)
    reference = arms.get("defaults") or next(iter(arms.values()))
    sizes = {"model": reference["trainable_grad_bytes"] // 4, "bert-base": lora_grad_bytes_bert_base() // 4}
    allreduce = None if args.skip_allreduce else run_allreduce(args.work_dir, sizes)
    jobs = None if args.skip_job else run_jobs(args, model, job_data)
    machine = {
        "device": reference["device"],
        "cpu": cpu_name(),
        "torch": reference["versions"]["torch"],
        "transformers": reference["versions"]["transformers"],
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "model": model_label,
        "data": data_label,
        "data_tokens_per_row": reference["train_tokens_per_row"],
        "command": " ".join(["python", "benchmarks/train_speed.py", *sys.argv[1:]]),
    }
    results = summarise(args, arms, startup, jobs, allreduce, sizes, machine)
    target = args.json or args.work_dir / "results.json"
    target.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"\nJSON: {target}")


if __name__ == "__main__":
    main()

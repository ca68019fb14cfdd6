"""The gradient all-reduce DDP runs each step, timed on gloo here with 2 and 4 processes.

python -m benchmarks.allreduce RANK WORLD PORT SIZES_JSON OUT_JSON    # one rank; run_allreduce starts them
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.processes import REPO, clean_env, free_port
from utils.config.settings import Settings

WARMUP_CALLS, TIMED_CALLS = 10, 50


def lora_grad_bytes(settings: Settings, layers: int = 12, hidden: int = 768) -> int:
    """fp32 gradient bytes of the job's LoRA on a BERT of `layers` x `hidden` (bert-base by default), counted without
    loading it (this process imports no torch): per targeted attention projection (hidden -> hidden) per layer, A
    (r x hidden) and B (hidden x r), and DoRA's magnitude (hidden); the 2-label classifier (hidden x 2 + 2); and
    the pooler (hidden x hidden + hidden) where TRAIN_POOLER trains it."""
    per_module = settings.lora_r * (hidden + hidden) + (hidden if settings.lora_variant == "dora" else 0)
    adapters = layers * len(settings.lora_target_modules) * per_module
    head = hidden * 2 + 2 + (hidden * hidden + hidden if settings.train_pooler else 0)
    return 4 * (adapters + head)


def lora_grad_bytes_bert_base() -> int:
    return lora_grad_bytes(Settings())


def time_allreduce(rank: int, world: int, port: int, sizes: dict[str, int], out: Path) -> None:
    """One rank: time one all-reduce of each size (fp32 elements) on gloo; rank 0 writes the medians to `out`."""
    from datetime import timedelta

    import torch
    import torch.distributed as td

    torch.set_num_threads(1)
    td.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    timings = {}
    for name, numel in sizes.items():
        buffer = torch.ones(numel)
        for _ in range(WARMUP_CALLS):
            td.all_reduce(buffer)
        times = []
        for _ in range(TIMED_CALLS):
            td.barrier()
            start = time.perf_counter()
            td.all_reduce(buffer)
            times.append(time.perf_counter() - start)
        timings[name] = {
            "ms_median": round(1000 * statistics.median(times), 3),
            "ms_p90": round(1000 * sorted(times)[int(0.9 * TIMED_CALLS) - 1], 3),
        }
    td.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps(timings))


def run_allreduce(work_dir: Path, sizes: dict[str, int]) -> dict:
    """{"2": ..., "4": ...}: gloo all-reduce times of each size with that many processes on this machine."""
    results = {}
    for world in (2, 4):
        port, out = free_port(), work_dir / f"allreduce-{world}.json"
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.allreduce", str(rank), str(world), str(port), json.dumps(sizes)]
                + [str(out)],
                cwd=REPO,
                env=clean_env(OMP_NUM_THREADS=1),
            )
            for rank in range(world)
        ]
        if [p.wait(timeout=300) for p in procs] != [0] * world:
            raise SystemExit(f"gloo all-reduce with {world} processes failed")
        results[str(world)] = json.loads(out.read_text())
    return results


if __name__ == "__main__":
    rank, world, port, sizes, out = sys.argv[1:]
    time_allreduce(int(rank), int(world), int(port), json.loads(sizes), Path(out))

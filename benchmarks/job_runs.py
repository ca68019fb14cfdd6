"""The real entry point, main.py, as the speed benchmark runs it: start-up time, one epoch on 1 and 2 replicas.

What each rank did is read from the files the job writes: `logs/rank-<R>.json` (rows trained, the checksum of
its trainable weights, time to its first step), the Trainer's `trainer_state.json` in the last checkpoint
(optimizer steps) and `metrics.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.processes import REPO, clean_env, free_port, time_command


def time_startup(repeats: int) -> dict:
    """`main.py --help` and `--dry-run` wall time, median of `repeats`."""
    return {
        "help_s": time_command([sys.executable, "main.py", "--help"], repeats),
        "dry_run_s": time_command([sys.executable, "main.py", "--dry-run"], repeats),
        "repeats": repeats,
    }


def wait_measured(proc: subprocess.Popen, timeout: float) -> tuple[int, int]:
    """Wait for `proc` and return (exit code, its peak resident memory in bytes: ru_maxrss from wait4)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss * 1024  # Linux reports KiB
        if time.monotonic() > deadline:
            proc.kill()
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(0.2)


def run_job(
    work_dir: Path,
    model: Path,
    data: Path,
    world: int,
    batch_size: int,
    timeout: int,
    name: str | None = None,
    **extra,
) -> dict:
    """One epoch of main.py: one process on this machine's device, or `world` CPU replicas; `extra` settings
    (a strategy, MAX_STEPS) on top, the run kept under job/`name`."""
    out = work_dir / "job" / (name or f"world-{world}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # Cold, as a fresh replica: its own datasets cache.
    settings = dict(
        MODEL_NAME=model,
        DATASET_PATH=data,
        OUTPUT_DIR=out / "run",
        NUM_EPOCHS=1,
        PER_DEVICE_BATCH_SIZE=batch_size,
        HF_DATASETS_CACHE=out / "datasets-cache",
        **extra,
    )
    port = free_port()
    procs = []
    for rank in range(world):
        if world == 1:
            env = clean_env(**settings)
        else:  # as the platform starts replicas; one thread each so two ranks on two cores do not fight
            env = clean_env(
                **settings,
                RANK=rank,
                WORLD_SIZE=world,
                NODE_RANK=rank,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS=1,
                CUDA_VISIBLE_DEVICES="",
            )
        log = open(out / f"stdout-{rank}.txt", "w")
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "main.py")], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
        procs.append((proc, log))
    codes, peaks = [], []
    for proc, log in procs:
        code, peak = wait_measured(proc, timeout)
        codes.append(code)
        peaks.append(peak)
        log.close()
    if codes != [0] * world:
        tails = [(out / f"stdout-{r}.txt").read_text()[-2000:] for r in range(world)]
        raise SystemExit(f"main.py with {world} replica(s) failed: exit codes {codes}\n" + "\n---\n".join(tails))
    job = read_job(out / "run", world)
    for rank, peak in zip(job["ranks"], peaks, strict=True):
        rank["peak_rss_bytes"] = peak  # the whole process: model, optimizer state, DeepSpeed's buffers
    return job


def read_job(run: Path, world: int) -> dict:
    """A finished run's figures from its OUTPUT_DIR."""
    ranks = []
    for rank in range(world):
        record = json.loads((run / "logs" / f"rank-{rank}.json").read_text())
        ranks.append(
            {
                "rank": record["rank"],
                "first_step": record["first_step"],
                "time_to_first_step_s": record["seconds_to_first_step"],
                "samples": record["samples_trained"],
                "checksum": record["trainable_checksum"],
            }
        )
    last = max((run / "checkpoints").glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    state = json.loads((last / "trainer_state.json").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    return {
        "world_size": world,
        "device": "cpu" if world > 1 else "default",
        "optimizer_steps_per_replica": state["global_step"],
        "ranks": ranks,
        # A fact, not a verdict: DDP keeps the replicas' trainable weights identical.
        "same_weights_on_all_ranks": len({r["checksum"] for r in ranks}) == 1,
        "train_runtime_s": metrics["train_runtime"],
        "train_samples_per_second": metrics.get("train_samples_per_second"),
        "eval_accuracy": metrics["eval_accuracy"],
    }


def run_jobs(args, model: Path, data: Path) -> dict:
    """main.py on one replica (this machine's device) and on two CPU replicas: {"1": ..., "2": ...}."""
    print("[bench] main.py: one replica, then two CPU replicas ...", file=sys.stderr, flush=True)
    return {
        str(world): run_job(args.work_dir, model, data, world, args.batch_size, args.job_timeout) for world in (1, 2)
    }

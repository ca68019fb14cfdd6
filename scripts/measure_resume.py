"""What a killed replica costs: the work lost since the last checkpoint, and the restart's overhead.

    python scripts/measure_resume.py                       # tiny BERT, two CPU replicas, SAVE_STEPS=20
    python scripts/measure_resume.py --save-steps 50 --fractions 0.5

It runs an uninterrupted two-replica job, then for each kill point starts the same job, SIGKILLs rank 1
a fraction of a checkpoint interval after a checkpoint is complete (the platform killing a replica),
restarts both replicas, and reads what the job writes: `logs/rank-0.json` (the step training began at, seconds
from process start to it), the Trainer's `trainer_state.json` (the run's total steps), the rank-0 log (when
the model was built) and rank 0's progress bar (the step reached when the peer was killed: no file has it):

- lost work: optimizer steps trained after the last complete checkpoint, which the restart trains again
  (at most SAVE_STEPS - 1, SAVE_STEPS / 2 on average for a kill at a random moment), and their time;
- detection: how long the surviving replica took to notice and exit;
- resume overhead: the restart's time from process start to its first training step, minus a fresh
  start's (what resuming adds: loading model, optimizer, scheduler and RNG states and fast-forwarding
  the data loader), and the restart's whole time to first step (imports, data cache, model: paid on
  every restart, resumed or not).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402  (an Accelerate dependency: when a process started)

from scripts.make_demo_assets import write_dataset, write_tiny_bert  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(out: Path, tag: str, settings: dict[str, str]) -> tuple[list[subprocess.Popen], float]:
    """Both replicas of the job on `out`, and when rank 0's process started (epoch seconds)."""
    port, procs = free_port(), []
    for rank in (0, 1):
        env = {
            **os.environ,
            **settings,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "NODE_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OUTPUT_DIR": str(out),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }
        stream = open(out.parent / f"{out.name}-{tag}-rank{rank}.txt", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(REPO / "main.py")], env=env, cwd=REPO, stdout=stream, stderr=subprocess.STDOUT
            )
        )
    return procs, psutil.Process(procs[0].pid).create_time()


def rank_record(out: Path) -> dict:
    """Rank 0's record of the last run of this folder: first_step, seconds_to_first_step, samples, checksum."""
    return json.loads((out / "logs" / "rank-0.json").read_text())


def total_steps(out: Path) -> int:
    """The run's optimizer steps, from the Trainer's state in its newest checkpoint."""
    newest = max((out / "checkpoints").glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    return json.loads((newest / "trainer_state.json").read_text())["max_steps"]


def stamp(line: str) -> float:
    return time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000


def model_to_first_step(out: Path, started: float) -> float:
    """Seconds from the model being built to the first training step in the last run of this folder, whose
    rank 0 started at `started`: the Trainer's set-up, plus, on a resume, loading the checkpoint and
    fast-forwarding the data. Only the rank-0 log says when the model was built."""
    lines = (out / "logs" / "rank-0.log").read_text().splitlines()
    built = stamp([line for line in lines if "trainable parameters:" in line][-1])
    return started + rank_record(out)["seconds_to_first_step"] - built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: a tiny BERT built here)")
    parser.add_argument("--data", type=Path, help="data folder (default: 2000 synthetic SST-2-shaped rows)")
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument(
        "--fractions", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="kill this far into a checkpoint interval"
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="measure-resume-"))
    data = args.data or write_dataset(work / "sst2", train_rows=2000, validation_rows=101)
    model = args.model or write_tiny_bert(work / "tiny-bert", data)
    settings = {
        "MODEL_NAME": str(model),
        "DATASET_PATH": str(data),
        "NUM_EPOCHS": "2",
        "PER_DEVICE_BATCH_SIZE": "16",
        "LEARNING_RATE": "3e-3",
        "SAVE_STEPS": str(args.save_steps),
        "DATALOADER_NUM_WORKERS": "0",
        "HF_HOME": str(work / "hf"),
    }

    began = time.monotonic()
    reference = work / "reference"
    procs, started = start(reference, "run", settings)
    assert [p.wait() for p in procs] == [0, 0], f"the uninterrupted run failed; see {work}"
    fresh_wall = time.monotonic() - began
    metrics = json.loads((reference / "metrics.json").read_text())
    step_seconds = 1 / metrics["train_steps_per_second"]
    fresh_first_step = rank_record(reference)["seconds_to_first_step"]
    fresh_setup = model_to_first_step(reference, started)
    steps = total_steps(reference)
    progress = re.compile(rf"(\d+)/{steps} \[")  # the Trainer's progress bar on rank 0's stream
    print(
        f"uninterrupted: {fresh_wall:.1f} s wall, first step {fresh_first_step:.1f} s after start ({fresh_setup:.2f} s after the model "
        f"was built), {steps} steps of {step_seconds * 1000:.0f} ms, accuracy {metrics['eval_accuracy']:.4f}"
    )

    for n, fraction in enumerate(args.fractions, start=1):
        out, checkpoint = work / f"killed-{n}", args.save_steps * n
        began = time.monotonic()
        procs, _ = start(out, "killed", settings)
        marker = out / "checkpoints" / f"checkpoint-{checkpoint}" / "COMPLETE"
        while not marker.exists():
            assert all(p.poll() is None for p in procs), f"a replica ended before checkpoint-{checkpoint}; see {work}"
            time.sleep(0.01)
        time.sleep(fraction * args.save_steps * step_seconds)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = procs[0].wait()
        detection = time.monotonic() - killed
        reached = max(
            int(done) for done in progress.findall((out.parent / f"{out.name}-killed-rank0.txt").read_text())
        )
        restart, started = start(out, "restart", settings)
        assert [p.wait() for p in restart] == [0, 0], f"the restart failed; see {work}"
        wall = time.monotonic() - began
        resumed = rank_record(out)
        resumed_first_step, resumed_setup = resumed["seconds_to_first_step"], model_to_first_step(out, started)
        lost = reached - checkpoint
        accuracy = json.loads((out / "metrics.json").read_text())["eval_accuracy"]
        print(
            f"kill {n}: rank 1 killed at step ~{reached}, {fraction:.0%} into the interval after checkpoint-{checkpoint}; "
            f"survivor exit {survivor} after {detection:.1f} s; lost {lost} steps = {lost * step_seconds:.1f} s of training; "
            f"restart's first step (step {resumed['first_step']}) {resumed_first_step:.1f} s after start, "
            f"{resumed_setup:.2f} s after the model was built "
            f"(resume overhead {resumed_setup - fresh_setup:+.2f} s); job wall {wall:.1f} s vs {fresh_wall:.1f} s uninterrupted; "
            f"accuracy {accuracy:.4f}"
        )
    print(f"outputs in {work}")


if __name__ == "__main__":
    main()

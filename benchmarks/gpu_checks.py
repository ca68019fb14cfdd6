"""The GPU figures of docs/performance.md in one call: the job itself (`main.py`, one process per part) on a
bert-base-sized model and 67,349 SST-2-like rows, eager and fast, bf16 and 8-bit, then the fast path's step profile.

    python benchmarks/gpu_checks.py RESULTS_DIR [--smoke] [--deadline SECONDS]    # what scripts/gpu_checks.sh runs

Each arm is a user's job with the defaults and one or two settings changed (ARMS below). Its figures are the job's
own (logs/rank-0.json, metrics.json), each saying where it starts and ends:

  compile_s               the fast path's graphs, one per length bucket, built before the first step (dynamo's
                          total: forward and backward)
  steady_epoch_s          the training steps' own time after the first step (evaluations and checkpoints set
                          aside, every bucket already compiled) per step, x the steps of an epoch
  job_cold_s              process start to model/ saved: imports, tokenizing, compiling, one epoch, evaluations,
                          checkpoints, the final evaluation, the save; a fresh OUTPUT_DIR, no compile cache
  job_warm_s              the same job again in a run folder holding the cold run's cache/ (tokenized rows,
                          compiled graphs) and nothing else: what a second start finds on the shared volume
  first_step_done_*_s     process start to the end of the first optimizer step (the GPU waited for), cold and warm

The headline parts run first and RESULTS_DIR/gpu.json is written after every part, so a part that fails or runs
out of time loses only itself; a part with no time left is recorded as skipped. `--smoke`: a tiny model and 512
rows on the CPU, the same parts but the CUDA-graphs arm, so CI knows the script runs to its end. No network: the
model is `BertConfig()` with random weights (scripts/make_demo_assets.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.processes import clean_env  # noqa: E402
from benchmarks.report import SST2_TRAIN_ROWS  # noqa: E402
from scripts.make_demo_assets import write_dataset, write_tiny_bert  # noqa: E402
from utils.run_folder.record import RUN_MARKER  # noqa: E402

SHORT_STEPS = 100  # an arm that projects its epoch (1,052 steps) from the 99 steady steps after its first
# Each arm: (settings beside the defaults, a whole epoch?, seconds it may take on an H100 at most, the lever
# benchmarks/job_variant.py pulls, if any).
ARMS = {
    # The job's defaults on one GPU with bf16 weights: the captured step (CUDA_GRAPHS=auto), eager kernels.
    "job-bf16": ({"QUANTIZATION": "none"}, True, 150, []),
    # The single-GPU default: 8-bit weights (INT8_THRESHOLD 0), captured.
    "job-8bit": ({}, True, 120, []),
    "eager-bf16": ({"QUANTIZATION": "none", "TORCH_COMPILE": "false"}, False, 60, []),
    "fast-bf16": ({"QUANTIZATION": "none", "TORCH_COMPILE": "true"}, True, 150, []),
    # Inductor's own switch (not TORCHINDUCTOR_TRITON_CUDAGRAPHS, which it does not read), on the fast arm's graphs.
    "fast-bf16-cudagraphs": (
        {"QUANTIZATION": "none", "TORCH_COMPILE": "true", "TORCHINDUCTOR_CUDAGRAPHS": "1"},
        False,
        60,
        [],
    ),
    # The levers: one graph per bucket for the whole stack of blocks (what CUDA graphs capture whole), with and
    # without CUDA graphs; SDPA without cuDNN's attention.
    "fast-bf16-encoder": (
        {"QUANTIZATION": "none", "TORCH_COMPILE": "true"},
        False,
        120,
        ["--compile-region", "encoder"],
    ),
    "fast-bf16-encoder-cudagraphs": (
        {"QUANTIZATION": "none", "TORCH_COMPILE": "true", "TORCHINDUCTOR_CUDAGRAPHS": "1"},
        False,
        60,
        ["--compile-region", "encoder"],
    ),
    "fast-bf16-no-cudnn-attention": (
        {"QUANTIZATION": "none", "TORCH_COMPILE": "true"},
        False,
        60,
        ["--no-cudnn-attention"],
    ),
    # The Trainer's own per-step walks of the whole model, against eager-bf16's (the job's calls) in the same call.
    "eager-bf16-host-levers-off": (
        {"QUANTIZATION": "none", "TORCH_COMPILE": "false"},
        False,
        60,
        ["--no-host-levers"],
    ),
    "eager-8bit": ({"QUANTIZATION": "8bit", "TORCH_COMPILE": "false"}, False, 60, []),
    "fast-8bit": ({"QUANTIZATION": "8bit", "TORCH_COMPILE": "true"}, False, 90, []),
}
# An arm that reuses another's compiled graphs (CUDA graphs wrap the same graphs after they are built).
GRAPHS_FROM = {"fast-bf16-cudagraphs": "fast-bf16", "fast-bf16-encoder-cudagraphs": "fast-bf16-encoder"}
# The step arms of benchmarks/captured_step.py, one process a part: (its arms, seconds it may take on an H100).
STEP_PARTS = {
    "steps": (("eager-bf16", "captured-bf16"), 100),
    "steps-8bit": (("eager-8bit", "captured-8bit", "eager-8bit-threshold-6"), 100),
    "steps-batch": (("captured-bf16-b16", "eager-bf16-b16", "captured-bf16-b256"), 90),
    "steps-compiled": (("captured-compiled-bf16",), 100),
}
EQUIVALENCE_BUDGET_S = 90
# The parts a call runs by default, most telling first, should the call's clock run out: eager against captured
# steps on the same batches (the headline), the whole job captured (cold, then warm), the captured step's numerics
# against eager's, the 8-bit steps, the per-device batch, compiled blocks inside the capture, the 8-bit job.
DEFAULT_PARTS = ("steps", "job-bf16", "equivalence", "steps-8bit", "steps-batch", "steps-compiled", "job-8bit")
# Every part there is; those not in DEFAULT_PARTS measure the earlier fast path (regional compile, no capture).
PARTS = (
    *DEFAULT_PARTS,
    "eager-bf16",
    "fast-bf16",
    "profile",
    "eager-8bit",
    "fast-bf16-encoder",
    "fast-bf16-encoder-cudagraphs",
    "fast-8bit",
    "fast-bf16-cudagraphs",
    "fast-bf16-no-cudnn-attention",
    "eager-bf16-host-levers-off",
    "profile-eager",
)
GPU_ONLY = ("fast-bf16-cudagraphs", "fast-bf16-encoder-cudagraphs")  # CUDA graphs: nothing to run on the CPU
WARM_ARMS = ("job-bf16", "fast-bf16")  # whole jobs run again on what their cold run left on the volume
PROFILE_BUDGET_S = 45
TOTAL_S = 300  # the call is 6 minutes with the wheels' install and the archive; GPU tests take what is left
SMOKE_SLOWER = 4  # the smoke run compiles on 2 busy CPU cores: a minute a graph
# The fields every arm of gpu.json carries (None where the arm does not measure it, e.g. eager's compile).
ARM_FIELDS = (
    "compile_s",
    "steady_epoch_s",
    "steady_step_ms",
    "samples_per_s",
    "job_cold_s",
    "job_warm_s",
    "first_step_done_cold_s",
    "first_step_done_warm_s",
    "epoch_measured",
    "steps",
    "steps_per_epoch",
    "eval_accuracy",
    "final_loss",
    "loss_curve",
    "graphs",
    "recompiles",
    "graph_breaks",
    "cudagraphs",
    "cudagraph_skips",
    "precision",
    "quantization",
    "bitsandbytes_loaded",
    "peak_memory_mib",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and 512 rows (the script's own test)")
    parser.add_argument("--deadline", type=float, help="seconds all parts may take (default: TOTAL_S)")
    parser.add_argument(
        "--parts",
        type=lambda text: text.split(","),
        default=list(DEFAULT_PARTS),
        help="a comma-separated subset of " + ",".join(PARTS) + ", in that order (a second call's rerun)",
    )
    parser.add_argument("--merge", type=Path, help="an earlier gpu.json: its parts kept unless run again here")
    # Not under ./output, main.py's default OUTPUT_DIR, which refuses a folder holding anything else.
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "gpu-checks-work")
    return parser.parse_args()


def prepare(work: Path, smoke: bool) -> tuple[Path, Path]:
    """The model folder and the SST-2-like data (67,349 rows; --smoke: 512)."""
    rows = 512 if smoke else SST2_TRAIN_ROWS
    data = work / f"data-sst2-{rows}"
    if not (data / "validation.csv").exists():
        write_dataset(data, train_rows=rows, validation_rows=128 if smoke else 872, profile="sst2")
    model = work / ("tiny-bert" if smoke else "bert-base-random-12l")
    if not (model / "config.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        write_tiny_bert(model, data, layers=2 if smoke else 12, base=not smoke)
    return model, data


class Clock:
    """The time left to the whole call; a part gets its budget or what is left, whichever is less."""

    def __init__(self, total: float, scale: float):
        self.deadline, self.scale = time.monotonic() + total, scale

    def budget(self, seconds: float) -> int:
        return int(min(seconds * self.scale, self.deadline - time.monotonic()))


def run_job(env: dict, out: Path, log: Path, timeout: int, shim: list[str] | None = None) -> dict:
    """main.py in its own process, as a user starts it; what it recorded, or {"error": ...}."""
    if timeout < 10:
        return {"error": "skipped: no time left in the call's budget"}
    command = [sys.executable, *(shim or ["main.py"])]
    started = time.monotonic()
    try:
        with open(log, "w") as handle:
            code = subprocess.call(
                command,
                env=clean_env(OUTPUT_DIR=out, **env),
                cwd=REPO,
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
    except subprocess.TimeoutExpired:
        return {"error": f"past its {timeout} s budget (log: {log.name})"}
    if code != 0:
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        return {"error": f"exit {code}: {tail[0][-300:]} (log: {log.name})"}
    record = json.loads((out / "logs" / "rank-0.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    return {"record": record, "metrics": metrics, "wall_s": round(time.monotonic() - started, 1), "out": out}


def loss_curve(out: Path) -> list[list[float]]:
    """[step, loss] of every logged training loss, from the last checkpoint's trainer_state.json."""
    states = sorted(out.glob("checkpoints/checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name[11:]))
    if not states:
        return []
    history = json.loads(states[-1].read_text())["log_history"]
    return [[entry["step"], entry["loss"]] for entry in history if "loss" in entry]


def summarise(cold: dict, warm: dict, whole_epoch: bool) -> dict:
    """The fields gpu.json promises for an arm, from its cold run and (fast-bf16) its warm one."""
    if "error" in cold:
        return {**dict.fromkeys(ARM_FIELDS), "error": cold["error"]}
    record, metrics = cold["record"], cold["metrics"]
    timing, compiled = record["timing"], record["compile"] or {}
    curve = loss_curve(cold["out"])
    global_batch = metrics["global_batch"]
    summary = {
        "compile_s": compiled.get("compile_s"),
        "steady_epoch_s": timing["steady_epoch_s"],
        "steady_step_ms": timing["steady_step_ms"],
        "samples_per_s": round(global_batch * 1000 / timing["steady_step_ms"], 1)
        if timing["steady_step_ms"]
        else None,
        # A short arm's user time is not a whole job's.
        "job_cold_s": timing["model_saved_s"] if whole_epoch else None,
        "job_warm_s": warm.get("record", {}).get("timing", {}).get("model_saved_s"),
        "first_step_done_cold_s": timing["first_step_done_s"],
        "first_step_done_warm_s": warm.get("record", {}).get("timing", {}).get("first_step_done_s"),
        "epoch_measured": whole_epoch,  # False: steady_epoch_s projected from `steps`
        "steps": record["trained_with"]["steps"],
        "steps_per_epoch": timing["steps_per_epoch"],
        "eval_accuracy": metrics.get("eval_accuracy"),
        "final_loss": curve[-1][1] if curve else None,
        "loss_curve": curve,
        "graphs": compiled.get("graphs", 0),
        "recompiles": compiled.get("recompiles", 0),
        "graph_breaks": compiled.get("graph_breaks", 0),
        "cudagraphs": compiled.get("cudagraphs", False),
        "cudagraph_skips": compiled.get("cudagraph_skips", 0),
        "precision": metrics["precision"],
        "quantization": metrics["quantization"],
        "bitsandbytes_loaded": record["bitsandbytes_loaded"],
        "peak_memory_mib": record["peak_memory_mib"],
        "compile_warmup_s": timing["compile_s"],  # the first step's own compile, wall time (dynamo's is compile_s)
    }
    if "error" in warm:
        summary["warm_error"] = warm["error"]
    return summary


def main() -> int:
    args = parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model, data = prepare(work, args.smoke)
    import torch

    cuda = torch.cuda.is_available()
    clock = Clock(args.deadline or TOTAL_S * (SMOKE_SLOWER if args.smoke else 1), SMOKE_SLOWER if args.smoke else 1)
    results: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "smoke": args.smoke,
        "model": "tiny BERT (2 layers, 64 wide)" if args.smoke else "BertConfig() with 12 layers, random weights",
        "rows": SST2_TRAIN_ROWS if not args.smoke else 512,
        "prepare_s": round(time.monotonic() - started, 1),
        "arms": {},
        "profile": {},
        "steps": {},
        "failed": [],
    }
    target = args.results / "gpu.json"

    def save() -> None:
        target.write_text(json.dumps(results, indent=2) + "\n")

    base = {
        "MODEL_NAME": str(model),
        "DATASET_PATH": str(data),
        "REPORT_TO": "none",
        **({"MAX_SEQ_LENGTH": "32", "PER_DEVICE_BATCH_SIZE": "16"} if args.smoke else {}),
    }
    arms_dir = work / "arms"
    shutil.rmtree(arms_dir, ignore_errors=True)
    arms_dir.mkdir(parents=True)
    if unknown := set(args.parts) - set(PARTS):
        raise SystemExit(f"error: unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    if args.merge:  # a rerun: the earlier call's parts, each marked with the call it came from
        earlier = json.loads(args.merge.read_text())
        for key in ("arms", "profile", "steps"):
            results[key] = {name: {**part, "call": part.get("call", 1)} for name, part in earlier.get(key, {}).items()}
        if "equivalence" in earlier:
            results["equivalence"] = earlier["equivalence"]
        results["earlier_calls"] = [{key: earlier[key] for key in ("device", "torch", "prepare_s")}]
    call = 1 + len(results.get("earlier_calls", []))
    for part in (part for part in PARTS if part in args.parts):
        if part in STEP_PARTS or part == "equivalence":
            outcome = run_steps(part, model, data, work, clock, args.smoke)
            if part == "equivalence":
                results["equivalence"] = {**outcome, "call": call}
            else:
                for arm, figures in outcome.get("arms", {}).items():
                    results["steps"][arm] = {**figures, "call": call}
        elif part.startswith("profile"):
            label = "eager" if part == "profile-eager" else "fast"
            results["profile"][label] = {**profile(label, model, data, work, clock, args.smoke), "call": call}
            outcome = results["profile"][label]
        elif cuda or part not in GPU_ONLY:
            results["arms"][part] = {**run_arm(part, base, arms_dir, clock, args.smoke), "call": call}
            outcome = results["arms"][part]
        else:
            continue
        if outcome.get("error") or outcome.get("failed"):
            results["failed"].append({"part": part, "error": outcome.get("error") or f"arms {outcome['failed']}"})
        print(f"[gpu-checks] {part} done, {time.monotonic() - started:.0f} s in", file=sys.stderr, flush=True)
        save()

    summary = {arm: {k: v for k, v in a.items() if k != "loss_curve"} for arm, a in results["arms"].items()}
    print(json.dumps({"steps": results["steps"], "arms": summary}, indent=2))
    print(f"gpu.json: {target}; failed parts: {[f['part'] for f in results['failed']] or 'none'}")
    return 1 if results["failed"] else 0


def run_arm(arm: str, base: dict, arms_dir: Path, clock: Clock, smoke: bool) -> dict:
    """One arm: its job cold and, for fast-bf16, warm; its figures."""
    settings, whole_epoch, budget, lever = ARMS[arm]
    env = {**base, **settings}
    if not whole_epoch:
        env["MAX_STEPS"] = str(20 if smoke else SHORT_STEPS)
    if arm in GRAPHS_FROM and (arms_dir / GRAPHS_FROM[arm] / "cold").is_dir():
        env["TORCHINDUCTOR_CACHE_DIR"] = str(arms_dir / GRAPHS_FROM[arm] / "cold" / "cache" / "inductor")
    shim = ["benchmarks/job_variant.py", *lever, "main.py"] if lever else None
    print(f"[gpu-checks] {arm}: {'one epoch' if whole_epoch else env['MAX_STEPS'] + ' steps'} ...", file=sys.stderr)
    folder = arms_dir / arm
    folder.mkdir(parents=True, exist_ok=True)
    cold = run_job(env, folder / "cold", folder / "cold.log", clock.budget(budget), shim)
    warm: dict = {}
    if arm in WARM_ARMS and "error" not in cold:
        # The same job again with what the cold run left on the volume, its tokenized rows and compiled graphs:
        # the run folder holds the cold run's cache/ and the job's mark, nothing else.
        shutil.copytree(folder / "cold" / "cache", folder / "warm" / "cache")
        shutil.copy2(folder / "cold" / RUN_MARKER, folder / "warm" / RUN_MARKER)
        print(f"[gpu-checks] {arm}: warm ...", file=sys.stderr)
        warm = run_job(env, folder / "warm", folder / "warm.log", clock.budget(budget))
    return summarise(cold, warm, whole_epoch)


def run_steps(part: str, model: Path, data: Path, work: Path, clock: Clock, smoke: bool) -> dict:
    """benchmarks/captured_step.py in its own process: a part's step arms, or the equivalence; what it wrote (each
    arm is written as it ends, so an arm past the budget loses only itself and those after it)."""
    report = work / f"{part}.json"
    report.unlink(missing_ok=True)
    command = [sys.executable, "benchmarks/captured_step.py", "--model", str(model), "--data", str(data)]
    command += ["--json", str(report), "--work-dir", str(work / part)]
    if part == "equivalence":
        command.append("--equivalence")
        budget = EQUIVALENCE_BUDGET_S
    else:
        arms, budget = STEP_PARTS[part]
        command += ["--arms", ",".join(arms)]
    command += ["--smoke"] if smoke else []
    timeout = clock.budget(budget)
    if timeout < 10:
        return {"error": "skipped: no time left in the call's budget"}
    print(f"[gpu-checks] {part} ...", file=sys.stderr, flush=True)
    error = None
    try:
        with open(work / f"{part}.log", "w") as handle:
            code = subprocess.call(
                command, cwd=REPO, env=clean_env(), stdout=handle, stderr=subprocess.STDOUT, timeout=timeout
            )
        if code != 0:
            error = f"exit {code} (log: {part}.log)"
    except subprocess.TimeoutExpired:
        error = f"past its {timeout} s budget (log: {part}.log)"
    outcome = json.loads(report.read_text()) if report.exists() else {}
    return {**outcome, **({"error": error} if error else {})}


def profile(label: str, model: Path, data: Path, work: Path, clock: Clock, smoke: bool) -> dict:
    """benchmarks/profile_step.py on the fast path (the fast arm's compiled graphs reused) or the eager one:
    kernels and GPU-busy ms per step."""
    folder = work / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / f"profile-{label}.json"
    command = [sys.executable, "benchmarks/profile_step.py", "--set", f"torch_compile={label == 'fast'}"]
    command += ["--set", "quantization=none", "--json", str(report), "--work-dir", str(folder / label)]
    command += ["--model", str(model), "--data", str(data), "--warmup", "3" if smoke else "10"]
    command += ["--steps", "3" if smoke else "20", "--batch-size", "16" if smoke else "64"]
    if smoke:
        command += ["--set", "max_seq_length=32"]
    cache = work / "arms" / "fast-bf16" / "cold" / "cache" / "inductor"
    timeout = clock.budget(PROFILE_BUDGET_S)
    if timeout < 10:
        return {"error": "skipped: no time left in the call's budget"}
    print(f"[gpu-checks] step profile, {label} ...", file=sys.stderr, flush=True)
    try:
        with open(folder / f"profile-{label}.log", "w") as handle:
            code = subprocess.call(
                command,
                cwd=REPO,
                env=clean_env(TORCHINDUCTOR_CACHE_DIR=cache),
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
    except subprocess.TimeoutExpired:
        return {"error": f"past its {timeout} s budget"}
    return json.loads(report.read_text()) if code == 0 else {"error": f"exit {code} (log: profile-{label}.log)"}


if __name__ == "__main__":
    sys.exit(main())

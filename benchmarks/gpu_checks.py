"""The GPU figures of issue #29 in one call: eager and fast (TORCH_COMPILE) arms in bf16 and 8-bit, each in its
own process, with their start-up cold and warm, the step profile before and after, and bitsandbytes' options.

    python benchmarks/gpu_checks.py RESULTS_DIR [--smoke]     # what scripts/gpu_checks.sh runs

Writes RESULTS_DIR/gpu.json after every part, so a part that fails or runs out of time loses only itself:
`device`, `torch`, and per arm (`eager-bf16`, `fast-bf16`, `eager-8bit`, `fast-8bit`) `epoch_s`,
`samples_per_s`, `first_step_cold_s`, `first_step_warm_s`, `final_loss`, `graphs`, `recompiles`,
`eval_accuracy` and `loss_curve`. The fast arms train one whole epoch (compiling included); the eager arms,
whose epoch was measured before (docs/performance.md), a fixed number of steps, their epoch projected
(`epoch_measured` says which). `cold`: a fresh OUTPUT_DIR (nothing tokenized, nothing compiled); `warm`: the
same folder again, a few steps. `--smoke`: a tiny model and a few rows, so that the whole script is known to
run to its end on the CPU; there the GPU-only parts (8-bit kernels, CUDA graphs) may fail and are recorded as
such, on a GPU every failure fails the script. No network: the model is `BertConfig()` with random weights.
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
from benchmarks.train_speed import cuda_available  # noqa: E402
from scripts.make_demo_assets import write_dataset, write_tiny_bert  # noqa: E402

ARMS = ("eager-bf16", "fast-bf16", "eager-8bit", "fast-8bit")
EAGER_STEPS = 100  # an eager arm's timed steps (the epoch is 1,053): 6-12 s of steady steps, its epoch measured before
INT8_STEPS = 100  # each bitsandbytes option's timed steps
# Seconds each part may take on an H100, and all of them together (the whole call: under 8 minutes, the GPU
# tests after). A part past its budget is killed and recorded; a part with no time left is skipped and recorded.
BUDGET = {"cold": 200, "warm": 45, "profile": 90, "int8": 60}
TOTAL_S = 420
SMOKE_SLOWER = 3  # the smoke run compiles on the CPU: minutes per graph on 2 busy cores
ARM_FIELDS = (
    "epoch_s",
    "samples_per_s",
    "first_step_cold_s",
    "first_step_warm_s",
    "final_loss",
    "graphs",
    "recompiles",
)
ARM_FIELDS += ("eval_accuracy", "loss_curve")
GPU_ONLY = ("8bit", "cudagraphs")  # parts that may fail on the CPU without failing the smoke run


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and few rows (the script's own test)")
    # Not under ./output, main.py's default OUTPUT_DIR, which refuses a folder holding anything else.
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "gpu-checks-work")
    return parser.parse_args()


def prepare(args) -> tuple[Path, Path]:
    """The model folder and the SST-2-like data (67,349 rows; --smoke: 512)."""
    rows = 512 if args.smoke else SST2_TRAIN_ROWS
    data = args.work_dir / f"data-sst2-{rows}"
    if not (data / "validation.csv").exists():
        write_dataset(data, train_rows=rows, validation_rows=128 if args.smoke else 872, profile="sst2")
    model = args.work_dir / ("tiny-bert" if args.smoke else "bert-base-random-12l")
    if not (model / "config.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        write_tiny_bert(model, data, layers=2 if args.smoke else 12, base=not args.smoke)
    return model, data


class Clock:
    """The time left to the whole call; a part gets its budget or what is left, whichever is less."""

    def __init__(self, total: float, scale: float):
        self.deadline, self.scale = time.monotonic() + total * scale, scale

    def budget(self, part: str) -> int:
        return int(min(BUDGET[part] * self.scale, self.deadline - time.monotonic()))


def run_child(name: str, cfg: dict, out_dir: Path, timeout: int, env: dict | None = None) -> dict:
    """One arm in its own process (benchmarks/arms.py): its figures, or {"error": ...}."""
    report, log = out_dir / f"{cfg['tag']}.json", out_dir / f"{cfg['tag']}.log"
    started = time.monotonic()
    if timeout < 10:
        return {"error": "skipped: no time left in the call's budget"}
    try:
        with open(log, "w") as handle:
            code = subprocess.call(
                [sys.executable, "-m", "benchmarks.arms", name, json.dumps(cfg), str(report)],
                env=clean_env(HF_DATASETS_CACHE=out_dir / "datasets-cache", **(env or {})),
                cwd=REPO,
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
    except subprocess.TimeoutExpired:
        return {"error": f"past its {timeout} s budget", "log": str(log)}
    if code != 0:
        return {"error": f"exit {code}: {log.read_text()[-1500:]}", "log": str(log)}
    return {**json.loads(report.read_text()), "wall_s": round(time.monotonic() - started, 1), "log": str(log)}


def summarise_arm(cold: dict, warm: dict) -> dict:
    """The fields gpu.json promises for an arm, from its cold and warm runs."""
    if "error" in cold:  # every field there, empty: the arm failed or had no time
        return {**dict.fromkeys(ARM_FIELDS), "error": cold["error"]}
    measured = cold["epoch_seconds_measured"] is not None
    compiled = cold["compile"] or {}
    return {
        "epoch_s": cold["epoch_seconds_measured"] if measured else cold["epoch_seconds_projected"],
        "epoch_measured": measured,
        "samples_per_s": cold["samples_per_s"],
        "first_step_cold_s": cold["time_to_first_step_s"],
        "first_step_warm_s": warm.get("time_to_first_step_s"),
        "final_loss": cold["loss_curve"][-1][1] if cold["loss_curve"] else None,
        "graphs": compiled.get("graphs", 0),
        "recompiles": compiled.get("recompiles", 0),
        "graph_breaks": compiled.get("graph_breaks", 0),
        "compile_s": compiled.get("compile_s", 0),
        "cudagraph_skips": compiled.get("cudagraph_skips", 0),  # inductor ran these graphs without CUDA graphs
        "eval_accuracy": cold["eval_accuracy"],
        "loss_curve": cold["loss_curve"],
        "precision": cold["precision"],
        "quantization": cold["quantization"],
        "step_ms": cold["step_ms"],
        "peak_memory_mib": cold["peak_memory_mib"],
        "padding_fraction": cold["padding_fraction"],
        "warm_error": warm.get("error"),
    }


def main() -> int:
    args = parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    args.work_dir = args.work_dir.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cuda = cuda_available()
    model, data = prepare(args)
    clock = Clock(TOTAL_S, SMOKE_SLOWER if args.smoke else 1)
    import torch

    results: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "smoke": args.smoke,
        "model": "tiny BERT (2 layers, 64 wide)" if args.smoke else "BertConfig() with 12 layers, random weights",
        "rows": SST2_TRAIN_ROWS if not args.smoke else 512,
        "arms": {},
        "int8_options": {},
        "profile": {},
        "failed": [],
    }
    target = args.results / "gpu.json"

    def save() -> None:
        target.write_text(json.dumps(results, indent=2) + "\n")

    def failed(part: str, outcome: dict) -> None:
        if "error" in outcome:
            results["failed"].append({"part": part, "error": outcome["error"][-300:]})

    base = {
        "model": str(model),
        "data": str(data),
        "batch_size": 64 if not args.smoke else 16,
        "epoch_rows": results["rows"],
        "warmup": 2,
        "max_seq_length": 32 if args.smoke else None,
    }
    # Most telling first, should the call's clock run out: bf16 eager and fast, then CUDA graphs (the lever most
    # likely to reach the 10 s epoch; cold only), the 8-bit arms (fast-8bit last: bitsandbytes' int8 linear under
    # the compiler is the least known), the profiles, bitsandbytes' options.
    for arm in ("eager-bf16", "fast-bf16", "fast-bf16-cudagraphs", "eager-8bit", "fast-8bit"):
        if arm in ARMS or cuda:
            run_arm(arm, base, args, clock, results, failed, warm=arm in ARMS)
            save()
    profile(model, data, base, args, clock, results, failed)
    save()
    int8_options(base, args, clock, results, failed)
    save()

    # On a GPU every part must run; on the CPU (the smoke run) the GPU-only ones may not.
    fatal = [f for f in results["failed"] if cuda or not any(word in f["part"] for word in GPU_ONLY)]
    summary = {arm: {k: v for k, v in a.items() if k != "loss_curve"} for arm, a in results["arms"].items()}
    print(json.dumps(summary, indent=2))
    print(f"gpu.json: {target}; failed parts: {[f['part'] for f in results['failed']] or 'none'}")
    return 1 if fatal else 0


def run_arm(arm: str, base: dict, args, clock: Clock, results: dict, failed, warm: bool = True) -> None:
    """One arm cold (a fresh OUTPUT_DIR) then, with `warm`, warm (the same folder, a few steps), each in its own
    process."""
    name = arm.removesuffix("-cudagraphs")
    # CUDA graphs as mode="reduce-overhead" would turn them on, through inductor's own switch.
    env = {"TORCHINDUCTOR_TRITON_CUDAGRAPHS": "1"} if arm.endswith("cudagraphs") else {}
    out_dir = args.work_dir / "arms" / arm
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    fast = name.startswith("fast")
    cfg = {**base, "output_dir": str(out_dir / "run"), "steps": 10 if args.smoke else EAGER_STEPS}
    print(f"[gpu-checks] {arm}: cold ...", file=sys.stderr, flush=True)
    cold = run_child(name, {**cfg, "tag": "cold", "epoch": fast, "evaluate": True}, out_dir, clock.budget("cold"), env)
    failed(f"{arm} cold", cold)
    warm_run = {}
    if warm and "error" not in cold:
        print(f"[gpu-checks] {arm}: warm ...", file=sys.stderr, flush=True)
        warm_run = run_child(
            name,
            {**cfg, "tag": "warm", "epoch": False, "warmup": 1, "steps": 2},
            out_dir,
            clock.budget("warm"),
            env,
        )
        failed(f"{arm} warm", warm_run)
    results["arms"][arm] = summarise_arm(cold, warm_run)
    if env and "error" not in cold:  # why inductor left CUDA graphs out, if it did (its warnings, in the arm's log)
        reasons = {line for line in Path(cold["log"]).read_text().splitlines() if "skipping cudagraphs" in line}
        results["arms"][arm]["cudagraph_skip_reasons"] = sorted(reasons)[:5]


def int8_options(base: dict, args, clock: Clock, results: dict, failed) -> None:
    """bitsandbytes' LLM.int8 outlier threshold, for speed: its default and none (no outlier columns, no host
    sync to find them)."""
    for threshold in (6.0, 0.0):  # bitsandbytes' default outlier threshold, and none
        tag = f"threshold-{threshold:g}"
        out_dir = args.work_dir / "int8" / tag
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        print(f"[gpu-checks] eager-8bit, llm_int8_threshold={threshold:g} ...", file=sys.stderr, flush=True)
        cfg = {**base, "output_dir": str(out_dir / "run"), "steps": 10 if args.smoke else INT8_STEPS, "epoch": False}
        outcome = run_child(
            "eager-8bit", {**cfg, "tag": tag, "int8_threshold": threshold}, out_dir, clock.budget("int8")
        )
        failed(f"8bit {tag}", outcome)
        results["int8_options"][tag] = (
            outcome
            if "error" in outcome
            else {
                key: outcome[key]
                for key in ("samples_per_s", "step_ms", "train_loss", "loss_curve", "peak_memory_mib")
            }
        )


def profile(model: Path, data: Path, base: dict, args, clock: Clock, results: dict, failed) -> None:
    """benchmarks/profile_step.py on the eager and the fast path (bf16): kernels and GPU-busy ms per step."""
    (args.work_dir / "profile").mkdir(parents=True, exist_ok=True)
    for label, compiled in (("eager", "false"), ("fast", "true")):
        print(f"[gpu-checks] step profile, {label} ...", file=sys.stderr, flush=True)
        # Beside the arms, not in RESULTS_DIR: gpu.json holds the report, and a lent machine may send back few files.
        report = args.work_dir / "profile" / f"profile-{label}.json"
        command = [sys.executable, "benchmarks/profile_step.py", "--set", f"torch_compile={compiled}"]
        command += ["--set", "quantization=none", "--json", str(report), "--work-dir", str(args.work_dir / "profile")]
        command += ["--model", str(model), "--data", str(data), "--warmup", "10" if not args.smoke else "3"]
        command += ["--steps", "20" if not args.smoke else "3", "--batch-size", str(base["batch_size"])]
        if args.smoke:
            command += ["--set", "max_seq_length=32"]
        # The fast arm's compiled graphs, reused: the profile times steps, not compiling.
        cache = args.work_dir / "arms" / "fast-bf16" / "run" / "cache" / "inductor"
        timeout = clock.budget("profile")
        try:
            if timeout < 10:
                raise subprocess.TimeoutExpired(command, timeout)
            with open(args.work_dir / "profile" / f"profile-{label}.log", "w") as handle:
                code = subprocess.call(
                    command,
                    cwd=REPO,
                    env=clean_env(TORCHINDUCTOR_CACHE_DIR=cache),
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                )
            outcome = json.loads(report.read_text()) if code == 0 else {"error": f"exit {code}"}
        except subprocess.TimeoutExpired:
            outcome = {"error": f"past its {timeout} s budget (or none left)"}
        failed(f"profile {label}", outcome)
        results["profile"][label] = outcome


if __name__ == "__main__":
    sys.exit(main())

"""Training speed: the configuration this job replaces against the job's defaults, same model, same data.

    # bert-base dimensions with random weights (BertConfig(): the FLOPs of bert-base-uncased) on
    # SST-2-like sentences, on whatever this machine has (CUDA if present, else the CPU):
    python benchmarks/train_speed.py
    # the CPU figures in the README: a 6-layer BERT, 50 timed steps of the defaults, 3 of the original
    python benchmarks/train_speed.py --layers 6 --steps 50 --original-steps 3
    # a GPU: one whole epoch (67,349 rows) of the defaults, the original and 8-bit timed beside it
    python benchmarks/train_speed.py --epoch
    # a real model folder and a DATASET_PATH-style data folder (train/validation files)
    python benchmarks/train_speed.py --model /pvc-home/bert-base-uncased --data /pvc-home/sst2

Arms, each in its own child process (this script again), one after the other:

  original       what the replaced pipeline ran: the HF Trainer, LoRA r8/alpha16 on query,value, gradient
                 checkpointing on, fp32, batch 64, every sentence padded to 128 tokens; everything it did
                 not set is the library's default (random order, no loader workers, no TF32)
  defaults       the job's defaults with QUANTIZATION=none: dynamic padding, length-grouped batches, no
                 gradient checkpointing, bf16 autocast where the GPU has it, fused AdamW, SDPA attention,
                 TF32 on Ampere+, loader workers, pinned memory
  defaults-8bit  the single-GPU default (8-bit base weights); on a GPU it runs beside bf16 to show what
                 the memory saving costs in speed (QUANTIZATION=none is the setting that buys it back)
  compiled       the defaults with TORCH_COMPILE=true (not run unless asked: minutes of compiling)

Both arms are built by the job's own code (utils.model.build_model, utils.data.load_sst2,
utils.training_utils.build_trainer); the original differs only in the settings and Trainer options
listed above and in a collator that pads to MAX_SEQ_LENGTH. Each arm trains `--warmup` steps, then
`--steps` timed steps (the original's batches all have one shape, so `--original-steps` can be
smaller on a slow machine without changing its figure).

Per arm: samples/s, real (non-pad) tokens/s, the padding fraction of what the model computed on,
peak memory (RSS on the CPU, torch.cuda.max_memory_allocated on CUDA), the time from process start
to the first training step, and on CUDA the model FLOPs utilisation against the GPU's peak bf16
FLOP/s. Also: `main.py --help` / `--dry-run` wall time; the real job (`main.py`) on one replica and
on two CPU replicas for one epoch of a small data set (time to first step, optimizer steps and rows
per replica: two replicas must each do half); the gradient bytes DDP all-reduces per step, the
all-reduce time on gloo here for 2 and 4 processes, and the projected 4-replica DDP efficiency.

Writes JSON (--json, default WORK_DIR/results.json) and prints a table. Nothing is downloaded: the
random model and the SST-2-like data (scripts/make_demo_assets.py, profile "sst2") are built locally
under --work-dir and reused by later runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.make_demo_assets import write_dataset, write_tiny_bert  # noqa: E402  (no torch at import)
from utils.settings import FIELDS, Settings, env_name  # noqa: E402  (pydantic only)

SST2_TRAIN_ROWS = 67_349  # GLUE SST-2's training split: "one epoch" in the figures below
SST2_VALIDATION_ROWS = 872
H100_TARGET_EPOCH_S = (
    20.0  # the target for one epoch on one H100, used to project DDP efficiency without a GPU
)

# What each arm changes from the job's defaults. Settings first (the job's own knobs), then Trainer
# options that the job sets and the original did not: those go back to the library's defaults.
ARMS = {
    "original": {
        "gradient_checkpointing": True,
        "precision": "fp32",
        "quantization": "none",
        "dataloader_num_workers": 0,
    },
    "defaults": {"quantization": "none"},
    "defaults-8bit": {"quantization": "8bit"},
    "compiled": {"quantization": "none", "torch_compile": True},
}
ORIGINAL_LIBRARY_DEFAULTS = (
    "train_sampling_strategy",
    "optim",
    "tf32",
    "dataloader_pin_memory",
    "dataloader_num_workers",
    "per_device_eval_batch_size",
    "logging_nan_inf_filter",
    "accelerator_config",
)
MEASUREMENT_OPTIONS = {
    "save_strategy": "no",
    "disable_tqdm": True,
}  # the same for every arm: no checkpoint writes in the timed run

# Peak dense bf16 tensor FLOP/s (vendor data sheets), matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10", 125e12),
)

# Variables that would make main.py think it is one of several replicas, or change its settings.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PET_NODE_RANK",
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "HF_TOKEN",
    "HF_TOKEN_PATH",
)


# =============================================================================== child: one arm
def training_flops(config, lengths_sum: float, lengths_sq_sum: float) -> float:
    """Model FLOPs of LoRA training steps over sequences of the given lengths (sum l, sum l^2).

    The base weights are frozen, so the backward pass computes input gradients only: 2x the forward
    FLOPs of the linear layers (2 * l * (4d^2 + 2df) per layer forward), 3x those of the attention
    matmuls (4 * l^2 * d per layer forward). Embeddings, the head and the adapters are negligible.
    Recomputation by gradient checkpointing is not counted: it is overhead, not model work.
    """
    d, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    linear = 2 * layers * (4 * d * d + 2 * d * f) * lengths_sum
    attention = 4 * layers * d * lengths_sq_sum
    return 2 * linear + 3 * attention


def peak_bf16_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((peak for name, peak in PEAK_BF16_FLOPS if name in device_name), None)


def run_arm(name: str, cfg: dict) -> dict:
    """Build the arm with the job's code, train warm-up + timed steps, measure. Runs in a child process."""
    import logging
    import resource

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)  # as main.py does
    import psutil
    import torch
    import transformers
    from transformers import DataCollatorWithPadding, TrainerCallback, TrainingArguments, set_seed

    from utils.data import load_sst2
    from utils.distributed import detect_env
    from utils.model import build_model, load_tokenizer
    from utils.outputs import open_run_dir
    from utils.training_utils import StartupTimer, build_trainer, resolve_numerics

    transformers.utils.logging.set_verbosity_error()
    warmup, steps = cfg["warmup"], cfg["steps"]
    settings = Settings(
        model_name=cfg["model"],
        dataset_path=cfg["data"],
        output_dir=cfg["output_dir"],
        per_device_batch_size=cfg["batch_size"],
        max_steps=None if cfg["epoch"] else warmup + steps,
        num_epochs=1,
        **ARMS[name],
    )
    dist = detect_env({})  # one process
    run = open_run_dir(settings)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    quantize, precision = resolve_numerics(settings, dist, cuda)
    tokenizer = load_tokenizer(settings)
    data = load_sst2(settings, tokenizer, run.cache)
    set_seed(settings.seed)
    model = build_model(settings, quantize, device)

    overrides = dict(MEASUREMENT_OPTIONS)
    collator = None
    if name == "original":
        fields = TrainingArguments.__dataclass_fields__
        library_default = lambda f: f.default_factory() if f.default is dataclasses.MISSING else f.default  # noqa: E731
        overrides |= {option: library_default(fields[option]) for option in ORIGINAL_LIBRARY_DEFAULTS}
        collator = DataCollatorWithPadding(tokenizer, padding="max_length", max_length=settings.max_seq_length)
    trainer = build_trainer(
        settings, run, dist, model, tokenizer, data, precision, cuda, overrides=overrides, data_collator=collator
    )

    # Rows and tokens of every batch, read where the Trainer hands it to the model (loader workers
    # collate in other processes). Per-row real lengths stay on the device until the end: no sync per step.
    batches: list[tuple[int, int, int, object]] = []  # (step, rows, padded length, real lengths)
    training_step = trainer.training_step

    def counting_step(model_, inputs, num_items_in_batch=None):
        mask = inputs["attention_mask"]
        batches.append((trainer.state.global_step, mask.shape[0], mask.shape[1], mask.sum(dim=1)))
        return training_step(model_, inputs, num_items_in_batch)

    trainer.training_step = counting_step
    marks: dict[int, float] = {}  # optimizer steps done -> wall time when the last of them ended
    cpu_marks: dict[int, float] = {}  # the same -> CPU seconds used so far by this process and its loader workers
    me = psutil.Process()

    def cpu_seconds() -> float:
        procs = [me, *me.children(recursive=True)]
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:  # a worker that has just exited
                pass
        return total

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks.setdefault(
                -1, time.perf_counter()
            )  # the first step's start: an epoch's training time counts from here

        def on_step_end(self, args, state, control, **kwargs):
            if (
                state.global_step == warmup
                or state.global_step == state.max_steps
                or state.global_step == warmup + steps
            ):
                if cuda:
                    torch.cuda.synchronize()
                marks[state.global_step] = time.perf_counter()
                cpu_marks[state.global_step] = cpu_seconds()

    trainer.add_callback(StepClock())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = trainer.train()
    end = trainer.state.global_step
    timed = end - warmup
    if timed < 1 or warmup not in marks:
        raise SystemExit(f"{name}: only {end} steps ran; lower --warmup or give more data")
    seconds = marks[end] - marks[warmup]
    cpu_used = cpu_marks[end] - cpu_marks[warmup]

    window = [b for b in batches if warmup <= b[0] < end]
    rows = sum(b[1] for b in window)
    padded = sum(b[1] * b[2] for b in window)
    lengths = torch.cat([b[3].reshape(-1) for b in window]).double().cpu()
    real, real_sq = float(lengths.sum()), float((lengths**2).sum())
    padded_sq = float(sum(b[1] * b[2] ** 2 for b in window))
    startup = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StartupTimer))

    train_lengths = data["train"].with_format("arrow")["input_ids"]
    import pyarrow.compute as pc

    token_counts = sorted(pc.list_value_length(train_lengths).to_pylist())
    config = trainer.model.get_base_model().config
    device_name = torch.cuda.get_device_name(0) if cuda else cpu_name()
    peak = peak_bf16_flops(device_name, cfg.get("peak_tflops")) if cuda else None
    useful, padded_flops = training_flops(config, real, real_sq), training_flops(config, padded, padded_sq)
    trainable, total = trainer.model.get_nb_trainable_parameters()
    grad_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    samples_per_s = rows / seconds
    report = {
        "arm": name,
        "device": device_name,
        "cuda": cuda,
        "torch_threads": torch.get_num_threads(),
        "quantization": "8bit" if quantize else "none",
        "precision": precision,
        "gradient_checkpointing": trainer.args.activation_checkpointing,
        "sampler": trainer.args.train_sampling_strategy,
        "padding": f"max_length {settings.max_seq_length}"
        if name == "original"
        else "longest in batch" + (", multiple of 8" if cuda else ""),
        "optim": str(trainer.args.optim.value if hasattr(trainer.args.optim, "value") else trainer.args.optim),
        "tf32": bool(cuda and torch.backends.cuda.matmul.allow_tf32),
        "attention": config._attn_implementation,
        "dataloader_num_workers": trainer.args.dataloader_num_workers,
        "torch_compile": trainer.args.torch_compile,
        "batch_size": settings.per_device_batch_size,
        "warmup_steps": warmup,
        "timed_steps": timed,
        "timed_seconds": round(seconds, 3),
        "step_ms": round(1000 * seconds / timed, 2),
        "samples_per_s": round(samples_per_s, 2),
        # On a shared machine the wall-clock figures depend on what else runs. The CPU seconds this arm got
        # (its loader workers included) show how much of the machine it had, and samples per CPU-second
        # is a throughput that other load barely moves. Meaningless on CUDA, where the GPU does the work.
        "cpu_share": None if cuda else round(cpu_used / (seconds * (os.cpu_count() or 1)), 3),
        "samples_per_cpu_s": None if cuda else round(rows / cpu_used, 3),
        "real_tokens_per_s": round(real / seconds, 1),
        "padding_fraction": round(1 - real / padded, 4),
        "mean_real_tokens_per_row": round(real / rows, 2),
        "epoch_seconds_projected": round(cfg["epoch_rows"] / samples_per_s, 1),
        "epoch_seconds_measured": round(marks[end] - marks[-1], 2) if cfg["epoch"] else None,
        "time_to_first_step_s": round(startup.seconds, 2),
        "peak_memory_mib": round(
            torch.cuda.max_memory_allocated() / 2**20
            if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            1,
        ),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if cuda else "process peak RSS",
        "model_tflops_per_s": round(useful / seconds / 1e12, 4),
        "peak_bf16_tflops": peak / 1e12 if peak else None,
        "mfu": round(useful / seconds / peak, 4) if peak else None,
        "mfu_counting_padding": round(padded_flops / seconds / peak, 4) if peak else None,
        "train_loss": round(result.training_loss, 4),
        "trainable_params": trainable,
        "total_params": total,
        "trainable_grad_bytes": grad_bytes,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "train_rows": len(data["train"]),
        "train_tokens_per_row": {
            "mean": round(statistics.fmean(token_counts), 2),
            "median": token_counts[len(token_counts) // 2],
            "p90": token_counts[int(0.9 * (len(token_counts) - 1))],
            "p99": token_counts[int(0.99 * (len(token_counts) - 1))],
            "max": token_counts[-1],
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "process_rss_at_end_mib": round(psutil.Process().memory_info().rss / 2**20, 1),
    }
    return report


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


# =============================================================================== child: all-reduce
def run_allreduce(rank: int, world: int, port: int, sizes: dict[str, int], out: Path | None) -> None:
    """Time one all-reduce of each size (fp32 elements) on gloo, as DDP does for the gradients each step."""
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
        for _ in range(10):
            td.all_reduce(buffer)
        times = []
        for _ in range(50):
            td.barrier()
            start = time.perf_counter()
            td.all_reduce(buffer)
            times.append(time.perf_counter() - start)
        timings[name] = {
            "ms_median": round(1000 * statistics.median(times), 3),
            "ms_p90": round(1000 * sorted(times)[44], 3),
        }
    td.destroy_process_group()
    if rank == 0 and out:
        out.write_text(json.dumps(timings))


# =============================================================================== parent
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra) -> dict[str, str]:
    """This environment without launcher variables or job settings, offline, plus `extra`."""
    drop = set(LAUNCHER_VARS) | {env_name(field) for field in FIELDS}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


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


def run_arms(args, model: Path, data: Path) -> dict[str, dict]:
    results = {}
    for name in args.arms:
        out_dir = args.work_dir / "arms" / name
        # Every arm starts cold, as a fresh replica does: no tokenized data in its OUTPUT_DIR, nothing in
        # datasets' own cache (which would otherwise hand the next arm the previous arm's tokenization).
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        steps = args.original_steps if name == "original" else args.steps
        cfg = {
            "model": str(model),
            "data": str(data),
            "output_dir": str(out_dir / "run"),
            "batch_size": args.batch_size,
            "warmup": args.warmup,
            "steps": steps,
            "epoch": args.epoch and name != "original",
            "epoch_rows": args.epoch_rows,
            "peak_tflops": args.peak_tflops,
        }
        report = out_dir / "result.json"
        log = out_dir / "child.log"
        print(
            f"[bench] {name}: {args.warmup} warm-up + {'one epoch' if cfg['epoch'] else steps} timed steps ...",
            file=sys.stderr,
            flush=True,
        )
        with open(log, "w") as handle:
            code = subprocess.call(
                [
                    sys.executable,
                    __file__,
                    "--child-arm",
                    name,
                    "--child-config",
                    json.dumps(cfg),
                    "--child-out",
                    str(report),
                ],
                env=clean_env(HF_DATASETS_CACHE=out_dir / "datasets-cache"),
                cwd=REPO,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        if code != 0:
            raise SystemExit(f"arm {name} failed (exit {code}); its log:\n{log.read_text()[-3000:]}")
        results[name] = json.loads(report.read_text())
    return results


def time_command(argv: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 3)


def run_job(args, model: Path, data: Path, world: int) -> dict:
    """The real entry point, one epoch: one process on this machine's device, or `world` CPU replicas."""
    out = args.work_dir / "job" / f"world-{world}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    settings = dict(
        MODEL_NAME=model,
        DATASET_PATH=data,
        OUTPUT_DIR=out / "run",
        NUM_EPOCHS=1,
        PER_DEVICE_BATCH_SIZE=args.batch_size,
        HF_DATASETS_CACHE=out / "datasets-cache",
    )  # cold, as a fresh replica
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
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(REPO / "main.py")], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
                ),
                log,
            )
        )
    codes = []
    for proc, log in procs:
        codes.append(proc.wait(timeout=args.job_timeout))
        log.close()
    if codes != [0] * world:
        tails = [(out / f"stdout-{r}.txt").read_text()[-2000:] for r in range(world)]
        raise SystemExit(f"main.py with {world} replica(s) failed: exit codes {codes}\n" + "\n---\n".join(tails))
    run = out / "run"
    ranks = []
    for rank in range(world):
        text = (run / "logs" / f"rank-{rank}.log").read_text()
        first = re.search(r"first training step \d+ began ([\d.]+) s after process start", text)
        samples = re.search(r"rank \d+ processed (\d+) training samples; trainable weights checksum ([0-9a-f]+)", text)
        ranks.append(
            {
                "rank": rank,
                "time_to_first_step_s": float(first.group(1)) if first else None,
                "samples": int(samples.group(1)),
                "checksum": samples.group(2),
            }
        )
    steps = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("checkpoint-*"))
    metrics = json.loads((run / "metrics.json").read_text())
    return {
        "world_size": world,
        "device": "cpu" if world > 1 else "default",
        "optimizer_steps_per_replica": steps,
        "ranks": ranks,
        "train_runtime_s": metrics["train_runtime"],
        "eval_accuracy": metrics["eval_accuracy"],
    }


def run_allreduce_all(args, sizes: dict[str, int]) -> dict:
    results = {}
    for world in (2, 4):
        port, out = free_port(), args.work_dir / f"allreduce-{world}.json"
        cmd = [
            sys.executable,
            __file__,
            "--child-allreduce",
            json.dumps({"world": world, "port": port, "sizes": sizes}),
        ]
        procs = [
            subprocess.Popen(
                [*cmd, "--child-rank", str(r), "--child-out", str(out)], cwd=REPO, env=clean_env(OMP_NUM_THREADS=1)
            )
            for r in range(world)
        ]
        if [p.wait(timeout=300) for p in procs] != [0] * world:
            raise SystemExit(f"gloo all-reduce with {world} processes failed")
        results[str(world)] = json.loads(out.read_text())
    return results


def lora_grad_bytes_bert_base() -> int:
    """fp32 gradient bytes of the job's LoRA on bert-base: adapters A (r x 768) and B (768 x r) per targeted
    module per layer, plus the 2-label classifier head (768 x 2 + 2)."""
    defaults = Settings()
    adapters = 12 * len(defaults.lora_target_modules) * defaults.lora_r * (768 + 768)
    return 4 * (adapters + 768 * 2 + 2)


def summarise(
    args, arms: dict, startup: dict, jobs: dict | None, allreduce: dict | None, sizes: dict, machine: dict
) -> dict:
    comparison = {}
    if "original" in arms and "defaults" in arms:
        o, d = arms["original"], arms["defaults"]
        comparison["defaults_vs_original"] = {
            "samples_per_s_ratio": round(d["samples_per_s"] / o["samples_per_s"], 2),
            "real_tokens_per_s_ratio": round(d["real_tokens_per_s"] / o["real_tokens_per_s"], 2),
            "peak_memory_ratio": round(d["peak_memory_mib"] / o["peak_memory_mib"], 2),
            "samples_per_cpu_s_ratio": None
            if d["cuda"]
            else round(d["samples_per_cpu_s"] / o["samples_per_cpu_s"], 2),
            "cpu_share": None if d["cuda"] else {"original": o["cpu_share"], "defaults": d["cpu_share"]},
            "cpu_target_ratio": 8.0,
            "meets_cpu_target": None if d["cuda"] else d["samples_per_s"] / o["samples_per_s"] >= 8.0,
        }
    if arms.get("defaults", {}).get("cuda"):
        d = arms["defaults"]
        epoch_s = d["epoch_seconds_measured"] or d["epoch_seconds_projected"]
        comparison["gpu_epoch"] = {
            "defaults_epoch_s": epoch_s,
            "measured": d["epoch_seconds_measured"] is not None,
            "target_s": H100_TARGET_EPOCH_S,
            "meets_target": epoch_s < H100_TARGET_EPOCH_S
            if d["layers"] == 12 and args.epoch_rows == SST2_TRAIN_ROWS
            else None,
        }
    if "defaults-8bit" in arms and "defaults" in arms:
        e, d = arms["defaults-8bit"], arms["defaults"]
        comparison["8bit_vs_defaults"] = {
            "samples_per_s_ratio": round(e["samples_per_s"] / d["samples_per_s"], 3),
            "peak_memory_ratio": round(e["peak_memory_mib"] / d["peak_memory_mib"], 3),
        }
    scale = None
    if allreduce:
        reference = arms.get("defaults") or next(iter(arms.values()))
        step_ms = reference["step_ms"]
        target_step_ms = 1000 * H100_TARGET_EPOCH_S / math.ceil(SST2_TRAIN_ROWS / args.batch_size)
        if (os.cpu_count() or 1) >= 4:
            basis = "gloo, 4 processes, measured here"
            ar_model, ar_base = allreduce["4"]["model"]["ms_median"], allreduce["4"]["bert-base"]["ms_median"]
        else:
            # 4 processes on fewer cores time the scheduler, not the all-reduce. A ring all-reduce over N
            # ranks takes 2(N-1) steps of 1/N of the bytes: going from 2 to 4 ranks at most triples it.
            basis = f"gloo, 2 processes measured here x 3 (ring steps 2 -> 6; 4 processes on {os.cpu_count()} cores time the scheduler)"
            ar_model, ar_base = (round(3 * allreduce["2"][size]["ms_median"], 3) for size in ("model", "bert-base"))
        scale = {
            "gradient_bytes_per_step": {"model": sizes["model"] * 4, "bert-base": sizes["bert-base"] * 4},
            "trainable_fraction": round(reference["trainable_params"] / reference["total_params"], 5),
            "gloo_allreduce": allreduce,
            "allreduce_ms_4_replicas_basis": basis,
            # No overlap of the all-reduce with the backward pass assumed (DDP does overlap): a lower bound.
            "projected_efficiency_4_replicas": {
                "this_device": {
                    "device": reference["device"],
                    "step_ms": step_ms,
                    "allreduce_ms": ar_model,
                    "efficiency": round(step_ms / (step_ms + ar_model), 4),
                },
                "h100_target": {
                    "step_ms": round(target_step_ms, 2),
                    "allreduce_ms": ar_base,
                    "efficiency": round(target_step_ms / (target_step_ms + ar_base), 4),
                    "note": f"bert-base at the {H100_TARGET_EPOCH_S:.0f} s/epoch target step time, gloo all-reduce measured here",
                },
            },
        }
    if jobs:
        one, two = jobs["1"], jobs["2"]
        jobs["half_steps_each"] = (
            math.ceil(one["optimizer_steps_per_replica"] / 2) == two["optimizer_steps_per_replica"]
            and two["ranks"][0]["samples"] == two["ranks"][1]["samples"]
            and 2 * two["ranks"][0]["samples"] - one["ranks"][0]["samples"] < 2 * args.batch_size
            and two["ranks"][0]["checksum"] == two["ranks"][1]["checksum"]
        )
    return {
        "machine": machine,
        "arms": arms,
        "comparison": comparison,
        "startup": startup,
        "job": jobs,
        "scale": scale,
    }


def fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: dict) -> None:
    m = results["machine"]
    print(
        f"\nmachine: {m['device']}; torch {m['torch']}; load average before/after {m['load_before']} / {m['load_after']}"
    )
    print(f"model: {m['model']}; data: {m['data']}\n")
    head = (
        "arm",
        "samples/s",
        "real tok/s",
        "padding",
        "step ms",
        "peak mem MiB",
        "first step s",
        "MFU",
        "epoch s (proj.)",
        "CPU share",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, a in results["arms"].items():
        row = (
            name,
            fmt(a["samples_per_s"], ".1f"),
            fmt(a["real_tokens_per_s"], ".0f"),
            f"{100 * a['padding_fraction']:.1f}%",
            fmt(a["step_ms"], ".1f"),
            fmt(a["peak_memory_mib"], ".0f"),
            fmt(a["time_to_first_step_s"], ".1f"),
            "-" if a["mfu"] is None else f"{100 * a['mfu']:.1f}%",
            fmt(a["epoch_seconds_projected"], ".1f"),
            "-" if a["cpu_share"] is None else f"{100 * a['cpu_share']:.0f}%",
        )
        print("| " + " | ".join(row) + " |")
    for name, a in results["arms"].items():
        if a["epoch_seconds_measured"] is not None:
            print(
                f"{name}: one epoch of {a['train_rows']} rows trained in {a['epoch_seconds_measured']} s (first step to last)"
            )
    for key, c in results["comparison"].items():
        if "samples_per_s_ratio" in c:
            per_cpu = (
                f", samples per CPU-second x{c['samples_per_cpu_s_ratio']}" if c.get("samples_per_cpu_s_ratio") else ""
            )
            print(f"{key}: samples/s x{c['samples_per_s_ratio']}{per_cpu}, peak memory x{c['peak_memory_ratio']}")
        else:
            print(f"{key}: {c}")
    s = results["startup"]
    print(f"main.py --help {s['help_s']} s, --dry-run {s['dry_run_s']} s (median of {s['repeats']})")
    if results["job"]:
        j = results["job"]
        print(
            f"job, 1 replica: {j['1']['optimizer_steps_per_replica']} steps, first step after {j['1']['ranks'][0]['time_to_first_step_s']} s; "
            f"2 CPU replicas: {j['2']['optimizer_steps_per_replica']} steps each, rows {[r['samples'] for r in j['2']['ranks']]}; "
            f"half the steps each: {j['half_steps_each']}"
        )
    if results["scale"]:
        sc = results["scale"]
        ar = sc["gloo_allreduce"]
        print(
            f"all-reduce per step: {sc['gradient_bytes_per_step']['model']} B (bert-base {sc['gradient_bytes_per_step']['bert-base']} B); "
            f"gloo here: 2 procs {ar['2']['model']['ms_median']} ms, 4 procs {ar['4']['model']['ms_median']} ms"
        )
        print(f"4-replica all-reduce time: {sc['allreduce_ms_4_replicas_basis']}")
        for where, p in sc["projected_efficiency_4_replicas"].items():
            print(
                f"projected 4-replica DDP efficiency ({where}): {100 * p['efficiency']:.1f}% (step {p['step_ms']} ms, all-reduce {p['allreduce_ms']} ms)"
            )


def main() -> None:
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
    parser.add_argument("--child-arm", help=argparse.SUPPRESS)
    parser.add_argument("--child-config", help=argparse.SUPPRESS)
    parser.add_argument("--child-allreduce", help=argparse.SUPPRESS)
    parser.add_argument("--child-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child_arm:
        args.child_out.write_text(json.dumps(run_arm(args.child_arm, json.loads(args.child_config)), indent=2))
        return
    if args.child_allreduce:
        spec = json.loads(args.child_allreduce)
        run_allreduce(args.child_rank, spec["world"], spec["port"], spec["sizes"], args.child_out)
        return

    args.work_dir = args.work_dir.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.original_steps = args.original_steps or args.steps
    cuda = cuda_available()
    args.arms = args.arms.split(",") if args.arms else ["original", "defaults", *(["defaults-8bit"] if cuda else [])]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    model, data, job_data, model_label, data_label = prepare_inputs(args)

    startup = {
        "help_s": time_command([sys.executable, "main.py", "--help"], args.startup_repeats),
        "dry_run_s": time_command([sys.executable, "main.py", "--dry-run"], args.startup_repeats),
        "repeats": args.startup_repeats,
    }
    arms = run_arms(args, model, data)
    reference = arms.get("defaults") or next(iter(arms.values()))
    sizes = {"model": reference["trainable_grad_bytes"] // 4, "bert-base": lora_grad_bytes_bert_base() // 4}
    allreduce = None if args.skip_allreduce else run_allreduce_all(args, sizes)
    jobs = None
    if not args.skip_job:
        print("[bench] main.py: one replica, then two CPU replicas ...", file=sys.stderr, flush=True)
        jobs = {"1": run_job(args, model, job_data, 1), "2": run_job(args, model, job_data, 2)}
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


def cuda_available() -> bool:
    """Whether the arms will see a GPU, without importing torch here (nvidia-smi, or CUDA_VISIBLE_DEVICES="")."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return (
        shutil.which("nvidia-smi") is not None
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    )


if __name__ == "__main__":
    main()

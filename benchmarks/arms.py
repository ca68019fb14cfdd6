"""One arm of the speed benchmark: build its Trainer, train warm-up + timed steps, measure; one child process each.

    python -m benchmarks.arms ARM CONFIG_JSON OUT_JSON    # what benchmarks/train_speed.py runs per arm

  original       what the replaced pipeline ran, rebuilt here: the plain `transformers.Trainer` with the
                 `TrainingArguments` it set (batch 64, gradient checkpointing on) and a collator that pads
                 every row to MAX_SEQ_LENGTH, on the job's model and data builders (LoRA r8/alpha16 on
                 query,value, SDPA). Everything it did not set is the library's default: fp32, random
                 order, no loader workers, no TF32, a NaN/inf check of every step's loss, lr 5e-5.
  defaults       the job's own `build_trainer` with its default settings and QUANTIZATION=none
  defaults-8bit  the same with QUANTIZATION=8bit (the single-GPU default)
  compiled       the same with TORCH_COMPILE=true
  eager-bf16, fast-bf16, eager-8bit, fast-8bit
                 QUANTIZATION=none or 8bit with TORCH_COMPILE=false or true (scripts/gpu_checks.sh); the
                 precision is the job's own (bf16 where the GPU has it)

The job's arms differ from the job only in settings: MAX_STEPS, SAVE_STEPS past the last step (the Trainer's
save at the end of training comes after the clock stops), EVAL_STEPS=0 (the job's periodic evaluation would
otherwise fall inside the timed steps) and REPORT_TO=none. Two measurement needs no setting covers:
- the progress bar: every arm drops the Trainer's ProgressCallback (`Trainer.remove_callback`); the job's
  loss logging every 10 steps is kept, as the job runs it;
- the rows and tokens of each batch: the Trainer hands callbacks no batch, and loader workers collate in
  other processes, so a forward pre-hook on the model (`register_forward_pre_hook`) reads each batch's
  attention mask where the model receives it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.processes import REPO, clean_env, cpu_name
from utils.config.settings import Settings

# The settings each arm of the job's own Trainer changes from the job's defaults.
JOB_ARMS = {
    "defaults": {"quantization": "none"},
    "defaults-8bit": {"quantization": "8bit"},
    "compiled": {"quantization": "none", "torch_compile": True},
    "eager-bf16": {"quantization": "none", "torch_compile": False},
    "fast-bf16": {"quantization": "none", "torch_compile": True},
    "eager-8bit": {"quantization": "8bit", "torch_compile": False},
    "fast-8bit": {"quantization": "8bit", "torch_compile": True},
}
ARMS = ("original", *JOB_ARMS)
# No checkpoint falls inside the timed steps (the Trainer saves once more after the last one, untimed).
SAVE_STEPS_NEVER = 10**9

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


def tf32_matmuls() -> bool:
    """Whether fp32 matmuls run as TF32. The Trainer sets it with torch's newer API (`fp32_precision`); reading the
    legacy `allow_tf32` after that raises in torch 2.11 and later."""
    import torch

    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:  # set through both APIs: torch refuses to say
        return precision == "tf32"


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


# ------------------------------------------------------------------------------- building an arm (child)
def arm_settings(name: str, cfg: dict) -> Settings:
    """The job's settings for this arm; the original uses them only for its model and data."""
    return Settings(
        model_name=cfg["model"],
        dataset_path=cfg["data"],
        output_dir=cfg["output_dir"],
        per_device_batch_size=cfg["batch_size"],
        max_steps=None if cfg["epoch"] else cfg["warmup"] + cfg["steps"],
        num_epochs=1,
        save_steps=SAVE_STEPS_NEVER,
        eval_steps=0,
        report_to=("none",),
        **({"max_seq_length": cfg["max_seq_length"]} if cfg.get("max_seq_length") else {}),
        # bitsandbytes' outlier threshold for 8-bit weights (INT8_THRESHOLD), where an arm sets one.
        **({"int8_threshold": cfg["int8_threshold"]} if cfg.get("int8_threshold") is not None else {}),
        **JOB_ARMS.get(name, {"quantization": "none"}),
    )


def build_job_arm(settings: Settings, cuda: bool):
    """(Trainer, 8-bit?, precision, compiled?): the job's own Trainer, built as utils/run.py builds it on one process."""
    from transformers import set_seed

    from utils.cluster.job import Job, PlanInputs
    from utils.cluster.preemption import Preemption
    from utils.config.distributed import detect_env
    from utils.config.plan import build_plan
    from utils.run_folder.record import open_run_dir
    from utils.training.data import DataSource, load_sst2
    from utils.training.model import ModelChoices, build_model, load_tokenizer
    from utils.training.trainer import TrainerChoices, build_trainer

    # One process, planned as main.py plans it; Job.start reads `cuda` from torch too. The stop-signal handler
    # is not installed: a benchmark stops at Ctrl-C.
    plan = build_plan(settings, 1)
    run_dir = open_run_dir(settings.output_dir, plan, settings.given_label_names, settings.base_model_id)
    job = Job.start(settings, settings.select(PlanInputs), detect_env({}), run_dir, plan, preemption=Preemption())
    tokenizer = load_tokenizer(settings.model_name, settings.max_seq_length, settings.lora_r)
    data = load_sst2(settings.select(DataSource), tokenizer, job.out.cache)
    job = job.with_rows(len(data["train"]))
    set_seed(settings.seed)
    model = build_model(settings.select(ModelChoices), job.plan.quantization, job.device)
    trainer = build_trainer(job, model, tokenizer, data, settings.select(TrainerChoices))
    return trainer, job.quantize, job.plan.precision, job.compiled


def build_original(settings: Settings, cuda: bool):
    """(Trainer, 8-bit?, precision, compiled?): the replaced pipeline, a plain Trainer on the job's model and data."""
    import torch
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments, set_seed

    from utils.training.data import DataSource, load_sst2
    from utils.training.model import ModelChoices, build_model, load_tokenizer

    cache = Path(settings.output_dir) / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(settings.model_name, settings.max_seq_length, settings.lora_r)
    data = load_sst2(settings.select(DataSource), tokenizer, cache)
    set_seed(settings.seed)
    model = build_model(
        settings.select(ModelChoices), "none", torch.device("cuda", 0) if cuda else torch.device("cpu")
    )
    args = TrainingArguments(
        output_dir=str(Path(settings.output_dir) / "checkpoints"),
        per_device_train_batch_size=settings.per_device_batch_size,
        num_train_epochs=1,
        max_steps=settings.max_steps or -1,
        activation_checkpointing=True,
        seed=settings.seed,
        # Measurement only: nothing written or reported while the clock runs (training is unchanged).
        save_strategy="no",
        report_to="none",
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        data_collator=DataCollatorWithPadding(tokenizer, padding="max_length", max_length=settings.max_seq_length),
        processing_class=tokenizer,
    )
    return trainer, False, "fp32", False


def run_arm(name: str, cfg: dict) -> dict:
    """Build the arm, train warm-up + timed steps, measure. Runs in a child process."""
    import gc
    import logging
    import resource

    # As main.py does: bitsandbytes warns once per process that its CPU kernels are slow.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import psutil
    import torch
    import transformers
    from transformers import ProgressCallback, TrainerCallback

    from utils.training.trainer import compile_record, token_counts

    transformers.utils.logging.set_verbosity_error()
    warmup, steps = cfg["warmup"], cfg["steps"]
    settings = arm_settings(name, cfg)
    cuda = torch.cuda.is_available()
    build = build_original if name == "original" else build_job_arm
    trainer, quantize, precision, compiled = build(settings, cuda)
    gc.freeze()  # as main.py does once its imports are done: collections walk the steps' own objects only
    trainer.remove_callback(ProgressCallback)

    # (rows, padded length, real length of each row) of every training batch, in order. The lengths stay on
    # the device until the end: no sync per step. Not the mask itself: on the CPU it is the loader worker's
    # shared-memory tensor, and an epoch of them would hold thousands of open files. One forward per
    # micro-batch (nothing is evaluated during training).
    batches: list[tuple[int, int, object]] = []

    # Kept out of TORCH_COMPILE's graphs: measuring must not add graphs or recompiles of its own.
    @torch.compiler.disable
    def count_batch(module, args, kwargs):
        mask = kwargs["attention_mask"]
        batches.append((mask.shape[0], mask.shape[1], mask.sum(dim=1)))

    trainer.model.register_forward_pre_hook(count_batch, with_kwargs=True)
    me = psutil.Process()

    def cpu_seconds() -> float:
        """CPU seconds used so far by this process and its loader workers."""
        total = 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:  # a worker that has just exited
                pass
        return total

    class StepClock(TrainerCallback):
        """Wall time, CPU time and batches seen at the end of the warm-up and of the last timed step."""

        def __init__(self):
            self.first_step_s: float | None = None
            self.started: float | None = None  # the first step's start: an epoch's training time counts from here
            self.marks: dict[int, tuple[float, float, int]] = {}

        def on_step_begin(self, args, state, control, **kwargs):
            if self.started is None:
                self.first_step_s = time.time() - me.create_time()
                self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (warmup, warmup + steps, state.max_steps):
                if cuda:
                    torch.cuda.synchronize()
                self.marks[state.global_step] = (time.perf_counter(), cpu_seconds(), len(batches))

    clock = StepClock()
    trainer.add_callback(clock)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = trainer.train()
    end = trainer.state.global_step
    timed = end - warmup
    if timed < 1 or warmup not in clock.marks or end not in clock.marks:
        raise SystemExit(f"{name}: only {end} steps ran; lower --warmup or give more data")
    (start_wall, start_cpu, first), (end_wall, end_cpu, last) = clock.marks[warmup], clock.marks[end]
    seconds, cpu_used = end_wall - start_wall, end_cpu - start_cpu

    window = batches[first:last]
    rows = sum(b[0] for b in window)
    padded = sum(b[0] * b[1] for b in window)
    padded_sq = float(sum(b[0] * b[1] ** 2 for b in window))
    lengths = torch.cat([b[2].reshape(-1) for b in window]).double().cpu()
    real, real_sq = float(lengths.sum()), float((lengths**2).sum())

    token_counts = sorted(token_counts(trainer.train_dataset).to_pylist())
    config = trainer.model.get_base_model().config
    device_name = torch.cuda.get_device_name(0) if cuda else cpu_name()
    peak = peak_bf16_flops(device_name, cfg.get("peak_tflops")) if cuda else None
    useful, padded_flops = training_flops(config, real, real_sq), training_flops(config, padded, padded_sq)
    trainable, total = trainer.model.get_nb_trainable_parameters()
    grad_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    samples_per_s = rows / seconds
    optim = trainer.args.optim
    return {
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
        else "length buckets (utils/training/trainer.length_buckets)",
        "optim": str(getattr(optim, "value", optim)),
        "tf32": cuda and tf32_matmuls(),
        "attention": config._attn_implementation,
        "dataloader_num_workers": trainer.args.dataloader_num_workers,
        "torch_compile": compiled,
        "compile": compile_record() if compiled else None,
        "int8_threshold": cfg.get("int8_threshold"),
        "max_seq_length": settings.max_seq_length,
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
        "epoch_seconds_measured": round(end_wall - clock.started, 2) if cfg["epoch"] else None,
        "time_to_first_step_s": round(clock.first_step_s, 2),
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
        # The logged losses (every LOGGING_STEPS), to set beside another arm's.
        "loss_curve": [[entry["step"], entry["loss"]] for entry in trainer.state.log_history if "loss" in entry],
        "eval_accuracy": trainer.evaluate()["eval_accuracy"] if cfg.get("evaluate") else None,
        "trainable_params": trainable,
        "total_params": total,
        "trainable_grad_bytes": grad_bytes,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "train_rows": len(trainer.train_dataset),
        "train_tokens_per_row": {
            "mean": round(statistics.fmean(token_counts), 2),
            "median": token_counts[len(token_counts) // 2],
            "p90": token_counts[int(0.9 * (len(token_counts) - 1))],
            "p99": token_counts[int(0.99 * (len(token_counts) - 1))],
            "max": token_counts[-1],
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "process_rss_at_end_mib": round(me.memory_info().rss / 2**20, 1),
    }


# ------------------------------------------------------------------------------- running the arms (parent)
def run_arms(args, model: Path, data: Path) -> dict[str, dict]:
    """Each arm of `args.arms` in its own child process, one after the other: {arm: its figures}."""
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
        report, log = out_dir / "result.json", out_dir / "child.log"
        print(
            f"[bench] {name}: {args.warmup} warm-up + {'one epoch' if cfg['epoch'] else steps} timed steps ...",
            file=sys.stderr,
            flush=True,
        )
        with open(log, "w") as handle:
            code = subprocess.call(
                [sys.executable, "-m", "benchmarks.arms", name, json.dumps(cfg), str(report)],
                env=clean_env(HF_DATASETS_CACHE=out_dir / "datasets-cache"),
                cwd=REPO,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        if code != 0:
            raise SystemExit(f"arm {name} failed (exit {code}); its log:\n{log.read_text()[-3000:]}")
        results[name] = json.loads(report.read_text())
    return results


if __name__ == "__main__":
    arm, config, out = sys.argv[1:]
    Path(out).write_text(json.dumps(run_arm(arm, json.loads(config)), indent=2))

"""The order of a run: output folder, data, model, Trainer, evaluation, publish.

Every rank runs `run`. The Trainer (Accelerate underneath) owns the loop, DDP, accumulation, mixed
precision, checkpoints, resume, logging and the progress bar; this module only decides what to build
and in which order, and where ranks must agree.
"""

from __future__ import annotations

import hashlib
import logging
import logging.handlers
import math
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import datasets
import evaluate
import numpy as np
import psutil  # an Accelerate dependency: the process start time, for the time-to-first-step log line
import pyarrow
import pyarrow.compute
import pyarrow.ipc
import torch
import transformers
from torch.utils.data import SequentialSampler
from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.integrations import TensorBoardCallback
from transformers.trainer_pt_utils import LengthGroupedSampler

from utils import distributed
from utils.data import load_sst2
from utils.distributed import DistEnv
from utils.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_PUSH_FAILED, JobError, Preempted
from utils.hub import Hub
from utils.hub_token import MaskingFilter, masker, read_token
from utils.model import build_model, load_tokenizer, merge_adapter, trainable_checksum
from utils.model_card import PLOT_NAME, plot_training_curves, write_label_names, write_model_card
from utils.outputs import (
    RunDir,
    checkpoint_resume_key,
    discard_incomplete_checkpoints,
    latest_complete_checkpoint,
    mark_checkpoint_complete,
    prune_checkpoints,
    read_json,
    replace_dir,
    usable_checkpoints,
    write_json,
    write_run_record,
)
from utils.preemption import PREEMPTION, stop_on_preemption_callback
from utils.recipe import describe_recipe, optimizer_groups, resolve_learning_rate
from utils.run_lock import RunLock
from utils.settings import Settings, resolve_base_model_id
from utils.strategy import StrategyCheck, check_strategy, full_state_dict, trainer_options

log = logging.getLogger(__name__)
METRICS_MODULE = str(Path(__file__).with_name("classification_metrics.py"))
LOG_FORMAT = "%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"


# ------------------------------------------------------------------------------- set-up
def setup_logging(dist: DistEnv) -> None:
    """Only rank 0 talks on the console (warnings from all); the rank log is added once the folder is ours."""
    fmt = logging.Formatter(LOG_FORMAT.format(rank=dist.rank))
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    console.setLevel(logging.INFO if dist.is_main else logging.WARNING)
    # The libraries' INFO records (config dumps, file lists) go to the rank log only.
    console.addFilter(lambda record: record.levelno >= logging.WARNING or record.name.startswith("utils."))
    console.addFilter(MaskingFilter(masker()))
    # Records before the rank log exists are held here and written to it first (log_to_file).
    early = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    early.addFilter(MaskingFilter(masker()))
    logging.basicConfig(level=logging.INFO, handlers=[console, early], force=True)
    transformers.utils.logging.disable_default_handler()  # its records go to our handlers instead
    transformers.utils.logging.enable_propagation()
    for library in (transformers, datasets):
        library.utils.logging.set_verbosity(logging.INFO if dist.is_main else logging.WARNING)
    if not dist.is_main:
        datasets.disable_progress_bars()


def log_to_file(run: RunDir, dist: DistEnv) -> None:
    """Every rank also logs to OUTPUT_DIR/logs/rank-R.log: after the rendezvous and the OUTPUT_DIR lock, so a
    job refused on a folder in use never writes into the logs of the job that holds it."""
    handler = logging.FileHandler(run.rank_log(dist.rank))
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=dist.rank)))
    handler.addFilter(MaskingFilter(masker()))
    root = logging.getLogger()
    for early in [h for h in root.handlers if isinstance(h, logging.handlers.MemoryHandler)]:
        early.setTarget(handler)
        early.flush()
        root.removeHandler(early)
    root.addHandler(handler)


def resolve_numerics(settings: Settings, dist: DistEnv, cuda: bool) -> tuple[bool, str]:
    """(8-bit?, precision) from QUANTIZATION / PRECISION and the hardware; impossible asks are bad input."""
    quantize = settings.quantization == "8bit" or (settings.quantization == "auto" and cuda and dist.world_size == 1)
    precision = settings.precision
    if precision == "auto":
        precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp16" and not cuda:
        raise JobError(EXIT_BAD_INPUT, "PRECISION=fp16 needs a CUDA GPU; use PRECISION=auto or fp32 on the CPU")
    if precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise JobError(EXIT_BAD_INPUT, "PRECISION=bf16 but this GPU has no bf16; use PRECISION=fp16 or auto")
    return quantize, precision


# ------------------------------------------------------------------------------- the Trainer
class JobTrainer(Trainer):
    """The HF Trainer, counting the rows this rank trained on and keeping evaluation in dataset order."""

    samples_seen = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # BERT's forward takes **kwargs, so the Trainer assumes it sums its loss over `num_items_in_batch`
        # and then scales it by the world size and skips the division by accumulation steps. The
        # classification loss is a per-batch mean: without this, DDP runs train at world-size x the rate.
        self.model_accepts_loss_kwargs = False

    param_groups = (
        None  # a recipe's optimizer groups (utils/recipe.py) when rates differ per group; None: the Trainer's own
    )

    def create_optimizer(self, model=None):
        if self.optimizer is None and self.param_groups is not None:
            opt_model = self.model if model is None else model
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            self.optimizer = optimizer_cls(self.param_groups(opt_model.named_parameters()), **optimizer_kwargs)
        return super().create_optimizer(model)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.samples_seen += int(inputs["input_ids"].shape[0])
        return super().training_step(model, inputs, num_items_in_batch)

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.train_sampling_strategy == "group_by_length" and isinstance(dataset, datasets.Dataset):
            # The library measures every row in a Python loop (1.7 s for SST-2, on every rank, before the
            # first step); Arrow has the lengths already. Same lengths, same sampler: the same batches.
            lengths = pyarrow.compute.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()
            return EpochSeededLengthGroupedSampler(
                self.args.train_batch_size * self.args.gradient_accumulation_steps, lengths, self.args.seed
            )
        return super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        # Length grouping speeds up training; for evaluation it would only reorder rows.
        return SequentialSampler(eval_dataset)


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """Length-grouped batches in an order drawn from SEED + epoch, not from the global RNG.

    The library's sampler draws each epoch's order from the global RNG when the epoch begins. A resume
    restores the RNG only after it has drawn the resumed epoch's order, so a run resumed in its second
    epoch or later trained other batches than the uninterrupted run (seen: another final checksum).
    `SamplerEpoch` tells it the epoch about to run (the Trainer's own `set_epoch` misses it in a resumed
    epoch under DDP, where accelerate's skip wrapper adds a level around it).
    """

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        super().__init__(batch_size, lengths=lengths)
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.generator = torch.Generator().manual_seed(self.seed + epoch)


class SamplerEpoch(TrainerCallback):
    """Sets the length-grouped sampler's epoch as the Trainer counts epochs (global step // steps per
    epoch), before the epoch's order is drawn: the same on every rank, fresh or resumed."""

    def on_epoch_begin(self, args, state, control, train_dataloader=None, **kwargs):
        batches = getattr(train_dataloader, "batch_sampler", None)
        while hasattr(batches, "batch_sampler"):  # accelerate's shard and skip wrappers
            batches = batches.batch_sampler
        sampler = getattr(batches, "sampler", None)
        if isinstance(sampler, EpochSeededLengthGroupedSampler):
            steps_per_epoch = max(math.ceil(len(train_dataloader) / args.gradient_accumulation_steps), 1)
            sampler.set_epoch(state.global_step // steps_per_epoch)


class StartupTimer(TrainerCallback):
    """Logs how long the process took to reach its first training step (imports, data, model, Trainer set-up)."""

    def __init__(self):
        self.first_step = 0
        self.seconds: float | None = None  # stays None when a resume finds no step left to train

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.first_step:
            self.seconds = time.time() - psutil.Process().create_time()
            log.info("first training step %d began %.2f s after process start", state.global_step + 1, self.seconds)

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_step = state.global_step  # after a resume, the first step is the checkpoint's next one


class CheckpointMarker(TrainerCallback):
    """Marks a checkpoint complete once every rank has written its part (resume skips unmarked ones),
    then keeps the newest SAVE_TOTAL_LIMIT complete ones."""

    def __init__(self, run: RunDir, dist: DistEnv, keep: int, resume_key: dict):
        self.run, self.dist, self.keep, self.resume_key = run, dist, keep, resume_key

    def on_save(self, args, state, control, **kwargs):
        distributed.barrier(self.dist)  # each rank saves its own RNG state; rank 0 alone cannot tell it is written
        if state.is_world_process_zero:
            mark_checkpoint_complete(Path(args.output_dir) / f"checkpoint-{state.global_step}", self.resume_key)
            prune_checkpoints(self.run, self.keep)


def classification_metrics():
    metric = evaluate.load(METRICS_MODULE)

    def compute(eval_pred):
        # Score against the labels that come back with the predictions, never the dataset's order.
        predictions = np.argmax(eval_pred.predictions, axis=-1)
        references = eval_pred.label_ids
        return {**metric.compute(predictions=predictions, references=references), "samples": len(references)}

    return compute


EVALUATIONS_PER_EPOCH = 4  # a validation curve with a handful of points; SST-2's 872 rows take seconds on a GPU


def evaluation_interval(settings: Settings, dist: DistEnv, train_rows: int) -> int:
    """EVAL_STEPS, or EVALUATIONS_PER_EPOCH evaluations an epoch (over the whole run when MAX_STEPS is
    shorter than an epoch); 0: no evaluation during training."""
    if settings.eval_steps is not None:
        return settings.eval_steps
    batches = math.ceil(train_rows / (settings.per_device_batch_size * dist.world_size))
    steps_per_epoch = math.ceil(batches / settings.gradient_accumulation_steps)
    steps = min(steps_per_epoch, settings.max_steps or steps_per_epoch)
    return max(1, steps // EVALUATIONS_PER_EPOCH)


def build_trainer(
    settings: Settings,
    run: RunDir,
    dist: DistEnv,
    model,
    tokenizer,
    data,
    precision: str,
    cuda: bool,
    *,
    overrides=None,
    data_collator=None,
    checkpoint_key: dict | None = None,
) -> JobTrainer:
    """The job's Trainer. `overrides` (TrainingArguments values) and `data_collator` exist for benchmarks/, which
    rebuilds the original configuration from this same Trainer to compare against. `checkpoint_key`: the run's
    `resume_key`, when the caller has it already (it hashes every tokenized row)."""
    tf32 = cuda and torch.cuda.get_device_capability()[0] >= 8  # Ampere and newer: TF32 matmuls for what stays fp32
    eval_every = evaluation_interval(settings, dist, len(data["train"]))
    options = dict(
        output_dir=str(run.checkpoints),
        run_name=settings.run_name,
        per_device_train_batch_size=settings.per_device_batch_size,
        per_device_eval_batch_size=settings.per_device_eval_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        num_train_epochs=settings.num_epochs,
        max_steps=settings.max_steps or -1,
        learning_rate=resolve_learning_rate(settings, dist.world_size),  # LEARNING_RATE, else the global-batch rule
        weight_decay=settings.weight_decay,
        warmup_steps=settings.warmup_ratio,  # below 1 the Trainer reads it as a fraction of all steps
        optim="adamw_torch_fused",
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        tf32=tf32 or None,
        activation_checkpointing=settings.gradient_checkpointing,  # transformers 5's name for gradient checkpointing
        activation_checkpointing_kwargs={
            "use_reentrant": False
        },  # the reentrant variant breaks DDP + LoRA (peft #899)
        train_sampling_strategy="group_by_length",  # batches of similar length: little padding
        torch_compile=settings.torch_compile,
        logging_steps=10,
        logging_first_step=True,
        logging_nan_inf_filter=False,  # the filter reads every step's loss on the host: one GPU sync per step
        save_strategy="steps",
        save_steps=settings.save_steps,
        save_total_limit=None,  # CheckpointMarker prunes, counting complete checkpoints only
        eval_strategy="steps"
        if eval_every
        else "no",  # the validation curve; the full evaluation at the end comes after training
        eval_steps=eval_every or None,
        load_best_model_at_end=False,  # no checkpoint chosen on the split whose accuracy is reported
        # Rank 0 reports; TensorBoard is added below with its folder under OUTPUT_DIR.
        report_to=[name for name in settings.report_to if name not in ("tensorboard", "none")]
        if dist.is_main
        else "none",
        seed=settings.seed,
        use_cpu=not cuda,  # without it, CPU ranks would not form a DDP group but each train alone
        ddp_find_unused_parameters=False,
        ddp_timeout=settings.rendezvous_timeout,
        dataloader_num_workers=settings.dataloader_num_workers,
        dataloader_pin_memory=cuda,
        accelerator_config={"non_blocking": cuda},  # pinned batches copied without waiting for the previous step
        disable_tqdm=not dist.is_main,
        log_level="info" if dist.is_main else "warning",
        log_level_replica="warning",
    )
    options.update(trainer_options(settings, model))  # STRATEGY=fsdp: FSDP2, one unit per transformer block
    args = TrainingArguments(**{**options, **(overrides or {})})
    callbacks: list[TrainerCallback] = [
        StrategyCheck(settings.strategy),  # stops the run if the Trainer did not shard as asked
        CheckpointMarker(run, dist, settings.save_total_limit, checkpoint_key or resume_key(settings, dist, data)),
        StartupTimer(),
        SamplerEpoch(),
        stop_on_preemption_callback(lambda signum: distributed.max_over_ranks(dist, signum)),
    ]
    if dist.is_main and "tensorboard" in settings.report_to:
        tensorboard = TensorBoardCallback()
        tensorboard.logging_dir = str(
            run.tensorboard / settings.run_name
        )  # kept when it reopens its writer for the final evaluation
        callbacks.append(tensorboard)
    trainer = JobTrainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=data_collator
        or DataCollatorWithPadding(
            tokenizer, pad_to_multiple_of=8 if cuda else None
        ),  # multiples of 8 for tensor cores
        processing_class=tokenizer,
        compute_metrics=classification_metrics(),
        callbacks=callbacks,
    )
    if settings.head_learning_rate_ratio != 1 or settings.loraplus_lr_ratio != 1:
        trainer.param_groups = partial(
            optimizer_groups, settings=settings, learning_rate=args.learning_rate, weight_decay=args.weight_decay
        )
    return trainer


# ------------------------------------------------------------------------------- publish
def save_model(
    run: RunDir, settings: Settings, trainer: Trainer, metrics: dict, state_dict: dict | None = None
) -> None:
    """Write model/ (adapter, tokenizer, label names, training curves, card) and metrics.json, each whole or not at all.

    `state_dict`: the gathered whole weights when the model is sharded (FSDP); None: the model's own.
    """
    staged = run.root / ".model.partial"
    shutil.rmtree(staged, ignore_errors=True)
    model = trainer.model
    base_id = resolve_base_model_id(settings)
    if base_id:  # the adapter names its base by Hub id, not by a path on this volume, so it loads anywhere
        model.peft_config["default"].base_model_name_or_path = base_id
    model.save_pretrained(staged, state_dict=state_dict)
    trainer.processing_class.save_pretrained(staged)
    write_label_names(staged, settings)
    plot_training_curves(trainer.state.log_history, staged / PLOT_NAME)
    write_model_card(staged, settings, metrics, settings.result_model_id)
    replace_dir(staged, run.model)
    write_json(run.metrics, metrics)  # last: a finished run is one with metrics.json (RunDir.is_finished)
    log.info("saved %s and %s", run.model, run.metrics)


def save_merged(run: RunDir, settings: Settings) -> None:
    """MERGE_ADAPTER: merged/, the base with model/'s adapter merged in, full precision, whole or not at all."""
    staged = run.root / ".merged.partial"
    shutil.rmtree(staged, ignore_errors=True)
    merge_adapter(settings, run.model, staged)
    write_model_card(staged, settings, read_json(run.metrics) or {}, settings.result_merged_model_id, merged=True)
    replace_dir(staged, run.merged)
    log.info("saved %s (adapter merged into the base, full precision)", run.merged)


def files_to_push(run: RunDir, settings: Settings, merged: bool) -> dict[str, Path]:
    """What a push sends, path in the repo -> file on the volume: the model folder (adapter or merged
    weights, tokenizer, card, plot), metrics.json, the masked run.json, and the TensorBoard event files
    under runs/ (what the Hub reads for its training-metrics tab). The same set on every retry."""
    folder = run.merged if merged else run.model
    files = {str(path.relative_to(folder)): path for path in sorted(folder.rglob("*")) if path.is_file()}
    files |= {"metrics.json": run.metrics, "run.json": run.run_record}
    events = run.tensorboard / settings.run_name
    if events.is_dir():
        files |= {
            f"runs/{settings.run_name}/{path.relative_to(events)}": path
            for path in sorted(events.rglob("*"))
            if path.is_file()
        }
    return files


def push_model(run: RunDir, settings: Settings, hub: Hub) -> int:
    """Push model/ to RESULT_MODEL_ID (and merged/ to RESULT_MERGED_MODEL_ID) unless already pushed; exit 3
    if a push fails after retries (the model stays on the volume)."""
    code = EXIT_OK
    metrics = read_json(run.metrics) or {}
    for merged, repo_id in ((False, settings.result_model_id), (True, settings.result_merged_model_id)):
        if not repo_id or already_pushed(run, repo_id, merged):
            continue
        folder = run.merged if merged else run.model
        # The card again, now naming the repo it is pushed to (after --push-only too).
        card = write_model_card(folder, settings, metrics, repo_id, merged=merged)
        log.info("pushing %s to %s", folder, repo_id)
        try:
            url = hub.push_files(
                files_to_push(run, settings, merged),
                repo_id,
                settings.hub_private,
                f"Upload {settings.run_name}",
                card=card,
            )
        except Exception as exc:
            log.error("push to %s failed: %s", repo_id, hub.describe(exc))
            print(
                f"error: push to {repo_id} failed ({hub.describe(exc)}); the model is in {folder}: rerun with --push-only",
                file=sys.stderr,
            )
            code = EXIT_PUSH_FAILED
            continue
        write_run_record(run, settings, **{PUSH_RECORD[merged]: {"repo_id": repo_id, "commit": url}})
        log.info("pushed to %s", url)
    return code


PUSH_RECORD = {False: "pushed", True: "pushed_merged"}  # run.json keys: what was pushed where


def already_pushed(run: RunDir, repo_id: str, merged: bool = False) -> bool:
    record = read_json(run.run_record) or {}
    return (record.get(PUSH_RECORD[merged]) or {}).get("repo_id") == repo_id


# ------------------------------------------------------------------------------- the run
def resume_key(settings: Settings, dist: DistEnv, data) -> dict:
    """What a resume must not change: the Trainer fast-forwards each rank's data loader by the saved step
    count, so another world size, global batch or data would skip or repeat rows without a word."""
    return {
        "world_size": dist.world_size,
        "global_batch": settings.per_device_batch_size * dist.world_size * settings.gradient_accumulation_steps,
        "data": {split: content_digest(data[split]) for split in sorted(data)},
    }


def content_digest(dataset: datasets.Dataset) -> str:
    """A hash of the tokenized rows themselves. The datasets fingerprint of a local file follows its
    modification time: a volume restored with the same files would look like new data."""
    digest = hashlib.sha256()
    table = dataset.with_format("arrow")[
        :
    ].combine_chunks()  # one chunk: the same rows give the same bytes however they were written
    sink = pyarrow.BufferOutputStream()
    with pyarrow.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    digest.update(sink.getvalue())
    return digest.hexdigest()[:16]


def resume_checkpoint(run: RunDir, key: dict) -> str | None:
    """Rank 0: the checkpoint to resume from (None: start afresh).

    Checkpoints a kill cut short are dropped; one marked complete whose files were damaged since is
    dropped with a warning, falling back to the previous one; one written by another run shape is
    refused (exit 2) with the fix.
    """
    for path in discard_incomplete_checkpoints(run):
        log.warning("removed %s: its save never completed (the job was killed while writing it)", path.name)
    latest, damaged = usable_checkpoints(run)
    for path, problem in damaged:
        log.warning(
            "removed %s: %s; falling back to %s", path.name, problem, latest.name if latest else "a fresh start"
        )
    if latest is None:
        return None
    theirs = checkpoint_resume_key(latest)
    if theirs != key:
        what = []
        if theirs.get("world_size") != key["world_size"]:
            what.append(f"{theirs.get('world_size')} replica(s), this start has {key['world_size']}")
        if theirs.get("global_batch") != key["global_batch"]:
            what.append(f"global batch {theirs.get('global_batch')}, this start {key['global_batch']}")
        if theirs.get("data") != key["data"]:
            what.append("other training or validation data (the files changed since)")
        fix = (
            f"restart with {theirs.get('world_size')} replica(s)"
            if theirs.get("world_size") != key["world_size"]
            else "restore the data and settings of that run"
        )
        raise JobError(
            EXIT_BAD_INPUT,
            f"{run.checkpoints / latest.name} was written by a run with {'; '.join(what)}; resuming would skip or repeat rows: "
            f"{fix}, or use a new OUTPUT_DIR to start over",
        )
    return str(latest)


@contextmanager
def progress_bar_closed_on_error(trainer: Trainer):
    """Close the progress bar before an error leaves training, so the `error:` line after it starts a line of its own."""
    try:
        yield
    except BaseException:
        for callback in trainer.callback_handler.callbacks:
            if getattr(callback, "training_bar", None) is not None:
                callback.training_bar.close()
                callback.training_bar = None
        raise


@contextmanager
def tracker_run(settings: Settings, dist: DistEnv):
    """One MLflow run for training and the final evaluation. The Trainer's callback ends the run it opened
    when training ends, and the final evaluation would then log into a second, nameless run; a run that
    is already open is left to its opener. MLflow reads MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME and
    MLFLOW_RUN_ID itself."""
    if not (dist.is_main and "mlflow" in settings.report_to):
        yield
        return
    import mlflow

    with mlflow.start_run(run_name=settings.run_name):
        yield


def resume_hint(run: RunDir) -> str:
    latest = latest_complete_checkpoint(run)
    return f"the run resumes from {latest.name}" if latest else "no checkpoint is complete yet: the run starts over"


def agreement(settings: Settings, dist: DistEnv) -> dict:
    """What every rank of one job must share, compared at the rendezvous."""
    return {
        "world_size": dist.world_size,
        "run_name": settings.run_name,
        "output_dir": settings.output_dir,
        **settings.training_settings(),
    }


def run(settings: Settings, dist: DistEnv, run_dir: RunDir) -> int:
    setup_logging(dist)
    log.info(
        "rank %d of %d (local rank %d, node %d) via %s; environment %s",
        dist.rank,
        dist.world_size,
        dist.local_rank,
        dist.node_rank,
        dist.source,
        distributed.masked_environ(),
    )
    if run_dir.is_finished():
        log.info("%s already holds a finished run", run_dir.root)
        if not dist.is_main:
            return EXIT_OK
        if settings.merge_adapter and not run_dir.merged.is_dir():  # stopped between saving and merging
            save_merged(run_dir, settings)
        return push_model(run_dir, settings, Hub(read_token(), settings.push_timeout, settings.hub_timeout))

    distributed.export_env(dist)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", dist.local_rank) if cuda else torch.device("cpu")
    quantize, precision = resolve_numerics(settings, dist, cuda)
    log.info("device %s, 8-bit %s, precision %s", device, quantize, precision)
    log.info(describe_recipe(settings, dist.world_size))
    check_strategy(
        settings, dist, cuda, quantize, precision, distributed.launcher_options()
    )  # e.g. fsdp on the CPU: exit 2, never DDP

    hub = Hub(read_token(), settings.push_timeout, settings.hub_timeout)
    if (
        settings.result_model_id
    ):  # on every rank, before the rendezvous: a silent Hub keeps no peer waiting in a collective
        hub.check_write_access(settings.result_model_id)
    lock = RunLock(run_dir.root)
    try:
        # Same settings and world size on every rank, one job per OUTPUT_DIR; then the process group.
        distributed.rendezvous(
            dist, settings.rendezvous_timeout, cuda, agreement(settings, dist), on_main=lock.acquire
        )
        log_to_file(run_dir, dist)
        with distributed.peers_watched(dist, settings.rendezvous_timeout, lambda: resume_hint(run_dir)):
            trainer, metrics, record, state_dict = train(settings, dist, run_dir, device, quantize, precision, cuda)
        distributed.leave_process_group()  # no rank enters a collective after this: rank 0 may upload for minutes
        code = EXIT_OK
        if dist.is_main:
            save_model(run_dir, settings, trainer, metrics, state_dict)
            if settings.merge_adapter:
                save_merged(run_dir, settings)
            code = push_model(run_dir, settings, hub)
            print(
                f"eval_accuracy={metrics['eval_accuracy']:.4f} train_samples_per_second={metrics['train_samples_per_second']:.1f} "
                f"model={run_dir.model}",
                flush=True,
            )
        # What tests and benchmarks read (logs/rank-R.json), and the same in words at the end of the rank's log.
        write_json(run_dir.rank_record(dist.rank), record)
        log.info(
            "rank %d processed %d training samples; trainable weights checksum %s",
            dist.rank,
            record["samples_trained"],
            record["trainable_checksum"],
        )
        return code
    finally:
        lock.release()


def train(settings: Settings, dist: DistEnv, run_dir: RunDir, device, quantize: bool, precision: str, cuda: bool):
    """Data, model, Trainer, resume, training and evaluation, on every rank; the final barrier included."""
    tokenizer = load_tokenizer(settings)
    data = distributed.on_main_then_others(dist, lambda: load_sst2(settings, tokenizer, run_dir.cache))
    set_seed(settings.seed)  # before the model: LoRA init and dropout are the same on every restart
    model = distributed.agree(dist, lambda: build_model(settings, quantize, device))

    key = resume_key(settings, dist, data)
    trainer = build_trainer(settings, run_dir, dist, model, tokenizer, data, precision, cuda, checkpoint_key=key)
    checkpoint = distributed.decide_on_main(dist, lambda: resume_checkpoint(run_dir, key))
    # Only now, with data, model and checkpoint checked: a start refused for bad input leaves no record that
    # would make the same OUTPUT_DIR refuse the corrected settings as "another run".
    distributed.run_on_main(dist, lambda: write_run_record(run_dir, settings))
    if checkpoint:
        log.info(
            "resuming from step %s (%s): the steps before it are not trained again",
            checkpoint.rsplit("-", 1)[-1],
            checkpoint,
        )
    with progress_bar_closed_on_error(trainer), tracker_run(settings, dist):
        with PREEMPTION.deferred():  # a stop signal now checkpoints at the next step all ranks agree on
            train_result = trainer.train(resume_from_checkpoint=checkpoint)
        signum = distributed.max_over_ranks(dist, PREEMPTION.signum)
        if signum:
            what = "SIGTERM" if signum == signal.SIGTERM else "SIGINT (Ctrl-C)"
            raise Preempted(
                f"{what} during training, checkpoint saved; a restart of all {dist.world_size} replica(s): {resume_hint(run_dir)}",
                code=128 + signum,
            )
        eval_metrics = trainer.evaluate()
        metrics = {
            **train_result.metrics,
            **eval_metrics,
            # What actually ran, for the card: the resolved rate and numerics, not `auto`.
            "world_size": dist.world_size,
            "global_batch": key["global_batch"],
            "learning_rate": trainer.args.learning_rate,
            "quantization": "8bit" if quantize else "none",
            "precision": precision,
            "run_name": settings.run_name,
            "data": {
                "train_rows": len(data["train"]),
                "validation_rows": len(data["validation"]),
                "fingerprint": key["data"]["train"],
            },
        }
        log.info(
            "eval accuracy %.4f, F1 %.4f on %d rows",
            metrics["eval_accuracy"],
            metrics["eval_f1"],
            metrics["eval_samples"],
        )
        trainer.accelerator.wait_for_everyone()
        # Collectives when FSDP shards the weights, so on every rank and before leaving the group.
        timer = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StartupTimer))
        record = {
            "rank": dist.rank,
            "local_rank": dist.local_rank,
            "node_rank": dist.node_rank,
            "world_size": dist.world_size,
            "source": dist.source,
            "samples_trained": trainer.samples_seen,
            "trainable_checksum": trainable_checksum(trainer.model),
            "first_step": timer.first_step + 1,
            "seconds_to_first_step": timer.seconds,
        }
        state_dict = full_state_dict(trainer.model, settings.strategy)
    return trainer, metrics, record, state_dict


def publish_only(settings: Settings, dist: DistEnv, run_dir: RunDir) -> int:
    """--push-only: upload an existing model/ (after a failed push) without training."""
    if not dist.is_main:
        return EXIT_OK
    setup_logging(dist)
    log_to_file(run_dir, dist)
    if not (settings.result_model_id or settings.result_merged_model_id):
        raise JobError(
            EXIT_BAD_INPUT, "--push-only needs RESULT_MODEL_ID (or RESULT_MERGED_MODEL_ID): the Hub repo to push to"
        )
    if not run_dir.is_finished():
        raise JobError(
            EXIT_BAD_INPUT, f"{run_dir.model} holds no finished model; run the training first (without --push-only)"
        )
    if settings.merge_adapter and not run_dir.merged.is_dir():
        save_merged(run_dir, settings)
    hub = Hub(read_token(), settings.push_timeout, settings.hub_timeout)
    for repo_id in filter(None, (settings.result_model_id, settings.result_merged_model_id)):
        hub.check_write_access(repo_id)
    return push_model(run_dir, settings, hub)

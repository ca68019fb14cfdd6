"""The order of a run, on every rank; each phase takes the Job and what the phase before returned:

    run(job)
      join(job, hub, lock)        checks that need no peer, the rendezvous, the rank log -> Collectives
      set_up(job, group)          tokenizer, data, model, the checkpoint to resume, the Trainer, run.json -> Ready
      train(job, group, ready)    training (a stop signal checkpoints), evaluation, the final barrier -> Trained
      save(job, group, trained)   rank 0 saves model/ inside the group, the others wait for it; then all leave it
      publish(job, hub, trained)  rank 0 answers the test split, merges and pushes; every rank writes its record

It is where the run is assembled: the training code's settings (DataSource, ModelChoices, TrainerChoices) are
built here from the Settings.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import math
import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import datasets
import huggingface_hub
import torch
import torch.distributed as td
import transformers
from transformers import Trainer, TrainerCallback, set_seed
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from utils.cluster.collectives import Collectives, rendezvous
from utils.cluster.job import Job
from utils.cluster.run_lock import RunLock
from utils.common.errors import EXIT_OK, EXIT_PREEMPTED, BadInput, JobError, Preempted, stage
from utils.common.hub_token import MaskingFilter
from utils.config.distributed import DistEnv, export_env, launcher_options, masked_environ
from utils.config.identity import check_same_run, short_digest
from utils.config.local_inputs import check_test_columns, test_split_file
from utils.config.plan import Plan, batch_warning
from utils.config.preflight import check_tracker_uri
from utils.config.recipe import describe_recipe
from utils.config.tasks import CLASSIFICATION, MULTI_LABEL, headline
from utils.publishing.hub import Hub, PushTargets, push_model, save_merged, save_model
from utils.publishing.model_card import CardFacts
from utils.run_folder.checkpoints import (
    checkpoint_resume_key,
    discard_incomplete_checkpoints,
    latest_complete_checkpoint,
    usable_checkpoints,
)
from utils.run_folder.layout import RunDir
from utils.run_folder.record import write_run_record
from utils.training.data import DataSource, label_names_of, load_sst2, problem_type_of
from utils.training.model import ModelChoices, build_model, load_tokenizer, trainable_checksum
from utils.training.predictions import PREDICTIONS_FILE, check_test_split, metrics_line, write_test_predictions
from utils.training.strategy import check_strategy, full_state_dict
from utils.training.trainer import JobTrainer, TrainerChoices, build_trainer, compile_record, seconds_since_start

log = logging.getLogger(__name__)
RANK_LOG_ONLY = {"rank_log_only": True}  # `extra=` of a record the console leaves out
CONSOLE_ONLY = {"console_only": True}  # `extra=` of a record the rank log leaves out (it has the record whole)


def masked(handler: logging.Handler, job: Job) -> logging.Handler:
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{job.dist.rank} %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(MaskingFilter(job.masker))
    return handler


def setup_logging(job: Job) -> None:
    """Only rank 0 talks on the console (warnings from all); the rank log is added once the folder is ours.
    Progress bars only on rank 0 with a terminal on stderr."""
    dist = job.dist
    console = masked(logging.StreamHandler(sys.stderr), job)
    console.setLevel(logging.INFO if dist.is_main else logging.WARNING)
    # The Trainer's INFO records (its training and evaluation banners) go to the rank log only.
    console.addFilter(lambda record: record.levelno >= logging.WARNING or record.name.startswith("utils."))
    console.addFilter(lambda record: not getattr(record, "rank_log_only", False))
    # Records before the rank log exists are held here and written to it first (log_to_file).
    early = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    early.addFilter(not_console_only)
    logging.basicConfig(level=logging.WARNING, handlers=[console, masked(early, job)], force=True)
    # The rank log tells the run's story, ours and the Trainer's; the other libraries' INFO records stay out.
    logging.getLogger("utils").setLevel(logging.INFO)
    logging.getLogger("transformers.trainer").setLevel(logging.INFO if dist.is_main else logging.WARNING)
    transformers.utils.logging.disable_default_handler()
    transformers.utils.logging.enable_propagation()
    # The Trainer's banners, filtered where they are logged: neither the console nor the rank log carries them.
    logging.getLogger("transformers.trainer").addFilter(is_not_banner)
    if not shows_progress_bars(dist):
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()


def not_console_only(record: logging.LogRecord) -> bool:
    return not getattr(record, "console_only", False)


def shows_progress_bars(dist: DistEnv) -> bool:
    return dist.is_main and sys.stderr.isatty()


def is_not_banner(record: logging.LogRecord) -> bool:
    """False for a line of the Trainer's banners (`***** Running ... *****`, the indented lines under it, `Do not
    forget to share`); a resume's own indented lines stay."""
    message = str(record.msg).lstrip("\n")
    resume = message.startswith(("  Fast-forwarding", "  Continuing training"))
    return resume or not (message.startswith(("***** ", "  ")) or "Do not forget to share" in message)


def log_to_file(job: Job) -> None:
    """Every rank also logs to logs/rank-R.log, after the OUTPUT_DIR lock: a job refused on a folder in use never
    writes into the holder's logs."""
    handler = masked(RankLogHandler(job.out, job.out.rank_log(job.dist.rank)), job)
    handler.addFilter(not_console_only)
    root = logging.getLogger()
    for early in [h for h in root.handlers if isinstance(h, logging.handlers.MemoryHandler)]:
        early.setTarget(handler)
        early.flush()
        root.removeHandler(early)
    root.addHandler(handler)


class LogToRankLog(TrainerCallback):
    """Each log of the Trainer in the rank log whole; each training loss on the console too, one short line."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        log.info("step %d: %s", state.global_step, logs, extra=RANK_LOG_ONLY)
        logs = logs or {}
        if "loss" in logs and "train_runtime" not in logs:
            epoch = f" (epoch {state.epoch:.2f})" if state.epoch is not None else ""
            rate = f", learning rate {logs['learning_rate']:.3g}" if "learning_rate" in logs else ""
            norm = f", grad norm {logs['grad_norm']:.3f}" if isinstance(logs.get("grad_norm"), float) else ""
            said = (state.global_step, state.max_steps, epoch, logs["loss"], rate, norm)
            log.info("step %d/%d%s: loss %.4f%s%s", *said, extra=CONSOLE_ONLY)


class EvaluationLine(TrainerCallback):
    """One line per evaluation, `step 30/186 (epoch 0.48): eval_accuracy=0.9535 eval_loss=0.1431`; MNLI's two
    validation splits share it."""

    def __init__(self, splits: int):
        self.splits, self.seen, self.metrics = splits, 0, {}

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.update(metrics or {})
        self.seen += 1
        if self.seen < self.splits:
            return
        losses = " ".join(
            f"{k}={v:.4f}" for k, v in self.metrics.items() if k.startswith("eval_") and k.endswith("loss")
        )
        epoch = f" (epoch {state.epoch:.2f})" if state.epoch is not None else ""
        log.info("step %d/%d%s: %s %s", state.global_step, state.max_steps, epoch, headline(self.metrics), losses)
        self.seen, self.metrics = 0, {}


class FiniteLoss(TrainerCallback):
    """A training loss that is NaN or infinite stops the run (exit 2) at the record that shows it, instead of exit 0
    with a NaN train_loss; logged averaged over ranks, so every rank stops alike. `check` also takes the run's mean
    loss once training ends, covering the steps after the last record."""

    def __init__(self):
        self.last = 0  # the step of the last finite record: the bad loss is in the steps after it

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = state.global_step  # a resume starts past its checkpoint's step

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.check((logs or {}).get("loss"), state.global_step)

    def check(self, loss: float | None, step: int) -> None:
        if loss is None or math.isfinite(loss):
            self.last = step if loss is not None else self.last
            return
        steps = f"step {step}" if step - self.last <= 1 else f"steps {self.last + 1}-{step}"
        raise BadInput(
            f"the training loss is {loss} in {steps}, so the weights are no longer numbers and the run stops before "
            "writing metrics.json or a model; check the labels (a regression target as large as 1e20 overflows the "
            "squared error) or lower LEARNING_RATE, and start again in a new OUTPUT_DIR",
        )


class ProgressBar(ProgressCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


class RankLogHandler(logging.FileHandler):
    """A FileHandler opening through RunDir.open: a planted link is refused, never appended to."""

    def __init__(self, run: RunDir, path):
        self.run = run
        super().__init__(path, encoding="utf-8")

    def _open(self):
        return self.run.open(Path(self.baseFilename), "a")

    def handleError(self, record):
        # A full or read-only volume fails every record: one warning, not a traceback per line.
        if not getattr(self, "failed", False):
            self.failed = True
            log.warning(
                "cannot write %s (%s); log records go to the console only", self.baseFilename, sys.exc_info()[1]
            )


def join_deepspeed(dist: DistEnv, cuda: bool) -> None:
    """DeepSpeed on the rendezvous' process group, before the model is built (ZeRO-3's zero.Init sees the world)."""
    if not td.is_initialized():
        # One process: a world of one, in memory (without a group DeepSpeed looks for MPI, and fails).
        td.init_process_group("nccl" if cuda else "gloo", store=td.HashStore(), rank=0, world_size=1)
    import deepspeed

    deepspeed.init_distributed(dist_backend=td.get_backend(), auto_mpi_discovery=False)


def agreement_of(plan: Plan, world_size: int, output_dir: str) -> dict:
    """What every rank of one start must share, compared at the rendezvous."""
    return {**plan.identity, "world_size": world_size, "run_name": plan.run_name, "output_dir": output_dir}


def resume_checkpoint(run: RunDir, identity: dict) -> str | None:
    """Rank 0: the checkpoint to resume from (None: start afresh). Incomplete or damaged checkpoints are dropped
    (falling back to the previous one); one of another run is refused."""
    # The newest one first, before anything is removed: a start refused as another run leaves every checkpoint.
    if (newest := latest_complete_checkpoint(run)) is not None and (recorded := checkpoint_identity(newest)):
        check_same_run(recorded, identity, str(run.checkpoints / newest.name))
    for path in discard_incomplete_checkpoints(run):
        log.warning("removed %s: its save never completed (the job was killed while writing it)", path.name)
    latest, damaged = usable_checkpoints(run)
    for path, problem in damaged:
        log.warning("removed %s: %s; falling back to %s", path.name, problem, getattr(latest, "name", "a fresh start"))
    if latest is None:
        return None
    if (recorded := checkpoint_identity(latest)) is not None:  # none: written before identities
        check_same_run(recorded, identity, str(run.checkpoints / latest.name))
    return str(latest)


def checkpoint_identity(checkpoint: Path) -> dict | None:
    """The identity a checkpoint records; None for an older one, or a manifest too damaged to read."""
    try:
        return checkpoint_resume_key(checkpoint).get("identity")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def resume_point(run: RunDir, identity: dict, world_size: int) -> tuple[str | None, list[dict]]:
    """Rank 0: the checkpoint to resume from, and the run's stretches so far (first step, replica count), this
    start's last; they travel in each checkpoint's key."""
    checkpoint = resume_checkpoint(run, identity)
    earlier = checkpoint_resume_key(Path(checkpoint)).get("segments", []) if checkpoint else []
    if earlier and earlier[-1]["world_size"] != world_size:
        log.info("resuming a run checkpointed on %d replica(s) on %d", earlier[-1]["world_size"], world_size)
    first = int(checkpoint.rsplit("-", 1)[-1]) + 1 if checkpoint else 1
    return checkpoint, [*earlier, {"first_step": first, "world_size": world_size}]


def close_segments(segments: list[dict], last_step: int) -> list[dict]:
    """Each stretch with its last step: [{"steps": [1, 120], "world_size": 4}, {"steps": [121, 263], ...}]."""
    ends = [segment["first_step"] - 1 for segment in segments[1:]] + [last_step]
    return [
        {"steps": [segment["first_step"], end], "world_size": segment["world_size"]}
        for segment, end in zip(segments, ends, strict=True)
        if end >= segment["first_step"]
    ]


def resume_hint(run: RunDir) -> str:
    latest = latest_complete_checkpoint(run)
    return f"the run resumes from {latest.name}" if latest else "no checkpoint is complete yet: the run starts over"


@contextmanager
def progress_bar_closed_on_error(trainer: Trainer):
    """Close the progress bar before an error leaves training: the `error:` line starts a line of its own."""
    try:
        yield
    except BaseException:
        for callback in trainer.callback_handler.callbacks:
            if getattr(callback, "training_bar", None) is not None:
                callback.training_bar.close()
                callback.training_bar = None
        raise


@contextmanager
def tracker_run(job: Job):
    """One MLflow run for training and the final evaluation, which would otherwise log into a second, nameless run
    (the Trainer's callback ends the run it opened with training)."""
    if not (job.dist.is_main and "mlflow" in job.settings.report_to):
        yield
        return
    import mlflow

    with mlflow.start_run(run_name=job.plan.run_name):
        yield


@dataclass(frozen=True)
class Ready:
    trainer: JobTrainer
    checkpoint: str | None  # the checkpoint to resume from; None: from step 1
    key: dict  # the run's identity and its segments so far: recorded in every checkpoint
    train_rows: int
    validation_rows: int
    plan: Plan  # the job's, completed with the step count
    labels: tuple[str, ...] = ()  # the class names in id order; none: regression
    problem_type: str = CLASSIFICATION  # what the data trains (utils/training/data.problem_type_of)
    startup: dict | None = None  # seconds after process start each set-up phase ended (logs/rank-R.json)


@dataclass(frozen=True)
class Trained:
    trainer: JobTrainer
    metrics: dict  # metrics.json: training, evaluation, and what actually ran
    record: dict  # logs/rank-R.json: this rank's samples, trainable-weight checksum, time to first step
    state_dict: dict  # the full trainable state (gathered under FSDP / DeepSpeed)


def run(job: Job, before_training: Callable[[Ready], None] | None = None) -> int:
    """Train, save and push, on every rank; the exit code. `before_training` is given what `set_up` built."""
    dist = job.dist
    setup_logging(job)
    seen = ", ".join(f"{k}={v}" for k, v in masked_environ().items()) or "none set"
    where = (dist.rank, dist.world_size, dist.local_rank, dist.node_rank, dist.source, seen)
    log.info("rank %d of %d (local rank %d, node %d) via %s; launcher variables: %s", *where)
    hub = Hub(job.settings.hub_token, job.settings.push_timeout, job.settings.hub_timeout)
    if job.out.is_finished():
        log.info("%s already holds a finished run", job.out.root)
        if dist.is_main:  # what the run ended with, as its own last line said it
            metrics = json.loads(job.out.metrics.read_text())
            rate = metrics.get("train_samples_per_second")
            rate = f" train_samples_per_second={rate:.1f}" if isinstance(rate, (int, float)) else ""
            print(f"{headline(metrics)}{rate} model={job.out.model}", flush=True)
        # Rank 0 finishes the merge and the push as the run recorded them, under the folder's lock (two restarts of
        # an unpushed run both pushed).
        if not dist.is_main:
            return EXIT_OK
        with RunLock(job.out):
            answer_test_split(job)
            return publish_saved(job, hub)
    lock = RunLock(job.out)
    group = None
    try:
        with stage("join"):
            group = join(job, hub, lock)
        with group.peers_watched(lambda: resume_hint(job.out)):
            ready = set_up(job, group)
            if before_training is not None:
                before_training(ready)
            trained = train(job, group, ready)
        save(job, group, trained)
        # No rank enters a collective after this: rank 0 may merge and upload for minutes.
        group.leave()
        return publish(job, hub, trained)
    except JobError as exc:  # main.py prints it on stderr; the rank log on the volume, once it exists, keeps it too
        log.error("error: %s (exit %d)", exc.message, exc.code, extra=RANK_LOG_ONLY)
        raise
    finally:
        # On an error too: a heartbeat or process group alive at shutdown can turn the exit code into SIGABRT.
        if group is not None:
            group.leave()
        lock.release()


def join(job: Job, hub: Hub, lock: RunLock) -> Collectives:
    settings, dist = job.settings, job.dist
    export_env(dist, deepspeed=job.strategy == "deepspeed")
    log.info("device %s, weights %s, precision %s", job.device, job.plan.quantization, job.plan.precision)
    batch = job.plan.batch
    log.info(
        "global batch %d rows a step (%s): %d replica(s) x %d micro-batch(es) of %d rows",
        *(batch.global_batch, batch.source, batch.world_size, batch.accumulation, batch.micro_batch),
    )
    log.info(describe_recipe(settings, job.plan))
    log.info("the run's identity: %s", job.plan.identity, extra=RANK_LOG_ONLY)
    if warning := batch_warning(job.plan.batch, settings.global_batch_size, settings.per_device_batch_size):
        log.warning(warning)
    # E.g. fsdp on the CPU: exit 2, never DDP.
    check_strategy(
        settings.strategy, settings.quantization, dist, job.cuda, job.quantize, job.plan.precision, launcher_options()
    )
    # On every rank, before the rendezvous: a silent Hub keeps no peer waiting in a collective.
    if settings.result_model_id:
        hub.check_write_access(settings.result_model_id)
    # Likewise a tracker that refuses its URI: exit 2 now, not a traceback after data and model are loaded.
    check_tracker_uri(settings.report_to)
    # Same settings and world size on every rank, one job per OUTPUT_DIR; then the process group.
    agreement = agreement_of(job.plan, dist.world_size, settings.output_dir)
    group = rendezvous(
        dist, settings.rendezvous_timeout, job.cuda, agreement, on_main=lock.acquire, finished=job.out.is_finished
    )
    log_to_file(job)
    if job.strategy == "deepspeed":
        join_deepspeed(dist, job.cuda)
    return group


def set_up(job: Job, group: Collectives) -> Ready:
    settings, dist = job.settings, job.dist
    startup = {"imports_and_rendezvous": seconds_since_start()}
    with stage("model"):
        tokenizer = load_tokenizer(settings.model_name, settings.max_seq_length, settings.lora_r)
    # Rank 0 downloads and tokenizes into the shared cache, the others reuse it.
    with group.main_first(), stage("data"):
        data = load_sst2(settings.select(DataSource), tokenizer, job.out.cache)
        # The test split is answered after training; its rows and labels are checked now, before any step.
        if (test := test_split_file(settings.dataset_path, settings.test_file)) is not None:
            check_test_columns(test, settings.text_columns)
            check_test_split(test, settings.text_columns, settings.label_column, list(label_names_of(data)))
    startup["data"] = seconds_since_start()
    # The optimizer steps, now that the rows are known (a global batch larger than the split is refused here).
    with stage("data"):
        job = job.with_rows(len(data["train"]))
    # Before the model: LoRA init and dropout are the same on every restart.
    set_seed(settings.seed)
    labels = label_names_of(data)  # the classes the data resolved to (none: regression)
    with group.agreed(), stage("model"):  # a model refused on one rank stops all with its message
        model = build_model(settings.select(ModelChoices), job.plan.quantization, job.device, labels)
    startup["model"] = seconds_since_start()  # the CUDA context included: the weights are moved to the GPU here

    identity = job.plan.identity
    checkpoint, segments = group.decide_on_main(lambda: resume_point(job.out, identity, dist.world_size))
    key = {"identity": identity, "segments": segments}
    trainer = build_trainer(job, model, tokenizer, data, settings.select(TrainerChoices), key=key, group=group)
    trainer.add_callback(LogToRankLog)
    # On the console: the bars where a terminal watches, a line per evaluation, no dict per log.
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    if shows_progress_bars(dist):
        trainer.add_callback(ProgressBar)
    trainer.add_callback(EvaluationLine(len(data) - 1))
    trainer.add_callback(FiniteLoss())
    # Only now, everything checked: a start refused for bad input leaves no record that would refuse the
    # corrected settings as "another run".
    group.run_on_main(lambda: write_run_record(job.out, settings.as_dict(), job.plan, segments=segments))
    if checkpoint:
        step = checkpoint.rsplit("-", 1)[-1]
        log.info("resuming from step %s (%s): the steps before it are not trained again", step, checkpoint)
    validation_rows = sum(len(rows) for split, rows in data.items() if split != "train")
    startup["trainer"] = seconds_since_start()
    seconds = {phase: round(s, 2) for phase, s in startup.items()}
    log.info("start-up, seconds after process start: %s", seconds, extra=RANK_LOG_ONLY)
    problem = problem_type_of(data)
    return Ready(trainer, checkpoint, key, len(data["train"]), validation_rows, job.plan, labels, problem, startup)


def train(job: Job, group: Collectives, ready: Ready) -> Trained:
    dist, trainer = job.dist, ready.trainer
    with progress_bar_closed_on_error(trainer), tracker_run(job):
        # A stop signal now checkpoints at the next step all ranks agree on.
        with job.preemption.deferred():
            train_result = trainer.train(resume_from_checkpoint=ready.checkpoint)
        signum = group.max_over_ranks(job.preemption.signum)
        if signum:
            what = "SIGTERM" if signum == signal.SIGTERM else "SIGINT (Ctrl-C)"
            n = dist.world_size
            restart = f"a restart of all {n} replicas" if n > 1 else "a restart of the job"
            raise Preempted(
                f"{what} during training, checkpoint saved; {restart}: {resume_hint(job.out)}",
                code=128 + signum,
            )
        with group.agreed():  # the mean loss is each rank's own over the steps after the last record
            check = next(c for c in trainer.callback_handler.callbacks if isinstance(c, FiniteLoss))
            check.check(train_result.metrics.get("train_loss"), trainer.state.global_step)
        eval_metrics = trainer.evaluate()
        metrics = run_metrics(job, ready, {**train_result.metrics, **eval_metrics})
        # The console has had the final evaluation's line (EvaluationLine).
        log.info("eval %s on %d rows", headline(metrics), ready.validation_rows, extra=RANK_LOG_ONLY)
        trainer.accelerator.wait_for_everyone()
        # Collectives when FSDP shards the weights: on every rank, before leaving the group.
        state_dict = full_state_dict(trainer.model, job.strategy)
        record = rank_record(job, ready, state_dict)
    return Trained(trainer, metrics, record, state_dict)


def run_metrics(job: Job, ready: Ready, measured: dict) -> dict:
    """metrics.json: what was `measured`, and what actually ran, for the card and predict.py."""
    trainer, plan, settings = ready.trainer, ready.plan, job.settings
    return {
        **measured,
        "world_size": job.dist.world_size,
        "global_batch": plan.batch.global_batch,
        "global_batch_source": plan.batch.source,
        "segments": close_segments(ready.key["segments"], trainer.state.global_step),
        "learning_rate": plan.learning_rate,
        "loraplus_ratio": plan.loraplus_ratio,
        "quantization": plan.quantization,
        "precision": plan.precision,
        "run_name": plan.run_name,
        "base_model_id": plan.base_model_id,  # the Hub id the card and the pushed adapter name
        "problem_type": ready.problem_type,
        # Multi-label: the sigmoid score at which a label counts as predicted, in the metrics and predict.py.
        **({"threshold": settings.threshold} if ready.problem_type == MULTI_LABEL else {}),
        "labels": list(ready.labels),
        **({"class_weights": trainer.class_weights.tolist()} if trainer.class_weights is not None else {}),
        **selected_checkpoint(trainer),
        "data": {
            "train_rows": ready.train_rows,
            "validation_rows": ready.validation_rows,
            "fingerprint": short_digest(job.plan.identity["data"]),  # of the data files (utils/config/identity.py)
        },
    }


def selected_checkpoint(trainer: Trainer) -> dict:
    """metrics.json's `selected_checkpoint` when LOAD_BEST_MODEL loaded the best checkpoint; else nothing."""
    state, args = trainer.state, trainer.args
    if not (args.load_best_model_at_end and state.best_model_checkpoint):
        return {}
    step = int(Path(state.best_model_checkpoint).name.rsplit("-", 1)[1])
    metric = args.metric_for_best_model
    return {
        "selected_checkpoint": {
            "step": step,
            "metric": metric if metric.startswith("eval_") else f"eval_{metric}",
            "score": state.best_metric,
            "steps_trained": state.global_step,
        }
    }


def rank_record(job: Job, ready: Ready, state_dict: dict) -> dict:
    """logs/rank-R.json: who this rank was, what it trained and how long each phase took."""
    dist, trainer, plan = job.dist, ready.trainer, ready.plan
    # Under DeepSpeed accelerate wraps the Trainer's scheduler (DeepSpeed's own, from a config's block, has no base_lrs).
    scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
    record = {
        **{field: getattr(dist, field) for field in ("rank", "local_rank", "node_rank", "world_size", "source")},
        "samples_trained": trainer.samples_seen,
        # DeepSpeed: the gathered fp32 weights (under ZeRO-3 the module's own are empty shards)
        "trainable_checksum": trainable_checksum(trainer.model, state_dict if job.strategy == "deepspeed" else None),
        "first_step": trainer.startup.first_step + 1,
        "seconds_to_first_step": trainer.startup.seconds,
        "startup": {**(ready.startup or {}), "first_step": trainer.startup.seconds},
        "timing": trainer.startup.record(plan.steps_per_epoch),
        "compile": compile_record() if job.compiled else None,
        "capture": trainer.captured.record() if trainer.captured is not None else None,
        # Loaded only for 8-bit weights (Job.leave_unused_libraries_out).
        "bitsandbytes_loaded": sys.modules.get("bitsandbytes") is not None,
        "peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20) if job.cuda else None,
        # What the Trainer trained with, read back from it: the plan's values, or a bug (tests compare them).
        "trained_with": {
            "micro_batch": trainer.args.per_device_train_batch_size,
            "accumulation": trainer.args.gradient_accumulation_steps,
            "steps": trainer.state.max_steps,
            "warmup_steps": trainer.args.get_warmup_steps(trainer.state.max_steps),
            "rates": sorted(set(getattr(scheduler, "base_lrs", []))),  # each group's peak rate
            "precision": "bf16" if trainer.args.bf16 else "fp16" if trainer.args.fp16 else "fp32",
        },
    }
    if job.compiled:
        log.info(
            "torch.compile: %(graphs)d graphs for length buckets %(buckets)s, %(recompiles)d recompiles, "
            "%(graph_breaks)d graph breaks, %(compile_s).1f s compiling",
            {**record["compile"], "buckets": trainer.buckets},
        )
    return record


def save(job: Job, group: Collectives, trained: Trained) -> None:
    """Rank 0 writes model/ inside the group while the others wait: no rank exits 0 before model/ is saved, and
    rank 0's failure is theirs."""
    out = job.out
    if not job.dist.is_main:
        log.info("waiting for rank 0 to save %s", out.model)
    try:
        with group.peers_watched(lambda: f"rank 0 was saving model/; {resume_hint(out)}"):
            model = (trained.trainer, trained.metrics, trained.state_dict)
            # The base as the run's identity fingerprinted it at the start: the weights this adapter was trained on.
            base = job.plan.identity["base_model"]
            card, repo_id = job.settings.select(CardFacts), job.settings.result_model_id
            group.run_on_main(lambda: save_model(out, card, job.plan, *model, base_fingerprint=base, repo_id=repo_id))
    except JobError as exc:
        if not (job.dist.is_main and exc.code == EXIT_PREEMPTED and out.is_finished()):
            raise
        # A peer lost once model/ was saved: restarted, it finds the run finished, so rank 0 goes on.
        log.warning(
            "rank 0 lost a peer after saving %s; it publishes the model, the restarted peer exits 0", out.model
        )
    if job.dist.is_main:
        # The user's wall time of the job, process start to model saved (benchmarks read it).
        trained.record["timing"]["model_saved_s"] = round(seconds_since_start(), 3)


def publish(job: Job, hub: Hub, trained: Trained) -> int:
    dist, out = job.dist, job.out
    code = EXIT_OK
    if dist.is_main:
        answer_test_split(job)
        code = publish_saved(job, hub)
        rate = trained.metrics["train_samples_per_second"]
        print(f"{headline(trained.metrics)} train_samples_per_second={rate:.1f} model={out.model}", flush=True)
    record = trained.record
    out.write_json(out.rank_record(dist.rank), record)
    said = (dist.rank, record["samples_trained"], record["trainable_checksum"], code, out.model)
    log.info("rank %d processed %d training samples; trainable weights checksum %s; exit %d, the model in %s", *said)
    return code


def answer_test_split(job: Job) -> None:
    """Rank 0, model/ saved: the test split answered into predictions/, unless a start before did."""
    if (test := test_split_file(job.settings.dataset_path, job.settings.test_file)) is None:
        return
    if (job.out.predictions / PREDICTIONS_FILE).is_file():
        log.info("%s already holds the answers to the test split %s", job.out.predictions, test)
        return
    settings = job.settings
    metrics = write_test_predictions(
        job.out,
        test,
        settings.model_name,
        settings.label_names,
        settings.text_columns,
        settings.label_column,
        settings.problem_type == MULTI_LABEL,
        settings.per_device_batch_size,
        settings.threshold,
    )
    scored = f"; {metrics_line(metrics, str(test))}" if metrics else " (no labels: no metrics)"
    log.info("answered the test split %s into %s%s", test, job.out.predictions, scored)


def publish_saved(job: Job, hub: Hub) -> int:
    """Rank 0, model/ saved: merged/ where MERGE_ADAPTER asks and it is missing (one present is this model's), then
    the push."""
    settings, card = job.settings, job.settings.select(CardFacts)
    if settings.merge_adapter and not job.out.merged.is_dir():
        save_merged(job.out, card, job.plan, settings.problem_type, settings.result_merged_model_id)
    return push_model(job.out, card, job.plan, settings.select(PushTargets), hub)


def publish_only(job: Job) -> int:
    settings, out = job.settings, job.out
    if not job.dist.is_main:
        return EXIT_OK
    setup_logging(job)
    if not (settings.result_model_id or settings.result_merged_model_id):
        raise BadInput("--push-only needs RESULT_MODEL_ID (or RESULT_MERGED_MODEL_ID): the Hub repo to push to")
    hub = Hub(settings.hub_token, settings.push_timeout, settings.hub_timeout)
    for repo_id in filter(None, (settings.result_model_id, settings.result_merged_model_id)):
        hub.check_write_access(repo_id)
    # What is published follows the run's metrics.json, under the folder's lock as every start that pushes.
    with RunLock(out):
        log_to_file(job)  # once the lock is this job's: a start refused on a folder in use writes none of its logs
        return publish_saved(job, hub)

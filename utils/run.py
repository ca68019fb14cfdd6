"""The order of a run: set-up, checks, rendezvous, data, model, Trainer, resume, training, evaluation, publish.

Every rank runs `run` (or `publish_only` for --push-only). It decides what to build and in which order,
and where the ranks must agree; the Trainer it builds is utils/trainer.py's, the collectives it runs are
utils/collectives.py's, and saving and pushing the model are utils/hub.py's. It branches on `dist.is_main`
(rank 0 writes and pushes) but reads no launcher variable itself.
"""

from __future__ import annotations

import logging
import logging.handlers
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import datasets
import torch
import torch.distributed as td
import transformers
from transformers import Trainer, set_seed

from utils.collectives import Collectives, rendezvous
from utils.data import load_sst2
from utils.distributed import DistEnv, export_env, launcher_options, masked_environ
from utils.errors import EXIT_BAD_INPUT, EXIT_OK, JobError, Preempted
from utils.hub import Hub, push_model, save_merged, save_model
from utils.hub_token import Masker, MaskingFilter, read_token
from utils.model import build_model, load_tokenizer, trainable_checksum
from utils.outputs import (
    RunDir,
    checkpoint_resume_key,
    discard_incomplete_checkpoints,
    latest_complete_checkpoint,
    usable_checkpoints,
    write_run_record,
)
from utils.preemption import Preemption
from utils.recipe import check_global_batch, describe_recipe
from utils.run_lock import RunLock
from utils.settings import Settings, check_tracker_uri
from utils.strategy import check_strategy, full_state_dict
from utils.trainer import StartupTimer, build_trainer, resume_key

log = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"


# ------------------------------------------------------------------------------- set-up
def setup_logging(dist: DistEnv, masker: Masker) -> None:
    """Only rank 0 talks on the console (warnings from all); the rank log is added once the folder is ours."""
    fmt = logging.Formatter(LOG_FORMAT.format(rank=dist.rank))
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    console.setLevel(logging.INFO if dist.is_main else logging.WARNING)
    # The libraries' INFO records (config dumps, file lists) go to the rank log only.
    console.addFilter(lambda record: record.levelno >= logging.WARNING or record.name.startswith("utils."))
    console.addFilter(MaskingFilter(masker))
    # Records before the rank log exists are held here and written to it first (log_to_file).
    early = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    early.addFilter(MaskingFilter(masker))
    logging.basicConfig(level=logging.INFO, handlers=[console, early], force=True)
    # Its records go to our handlers instead.
    transformers.utils.logging.disable_default_handler()
    transformers.utils.logging.enable_propagation()
    for library in (transformers, datasets):
        library.utils.logging.set_verbosity(logging.INFO if dist.is_main else logging.WARNING)
    if not dist.is_main:
        datasets.disable_progress_bars()


def log_to_file(run: RunDir, dist: DistEnv, masker: Masker) -> None:
    """Every rank also logs to OUTPUT_DIR/logs/rank-R.log: after the rendezvous and the OUTPUT_DIR lock, so a
    job refused on a folder in use never writes into the logs of the job that holds it."""
    handler = RankLogHandler(run, run.rank_log(dist.rank))
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=dist.rank)))
    handler.addFilter(MaskingFilter(masker))
    root = logging.getLogger()
    for early in [h for h in root.handlers if isinstance(h, logging.handlers.MemoryHandler)]:
        early.setTarget(handler)
        early.flush()
        root.removeHandler(early)
    root.addHandler(handler)


class RankLogHandler(logging.FileHandler):
    """A FileHandler that opens its file through RunDir.open: a planted link at logs/ or logs/rank-R.log (or
    a hard link to a file elsewhere) is refused, never appended to."""

    def __init__(self, run: RunDir, path):
        self.run = run
        super().__init__(path, encoding="utf-8")

    def _open(self):
        return self.run.open(Path(self.baseFilename), "a")

    def handleError(self, record):
        # A full or read-only volume fails every record: one warning on the console, not a traceback per line
        # burying the `error:` line the failure ends with. The console keeps getting the records.
        if not getattr(self, "failed", False):
            self.failed = True
            logging.getLogger(__name__).warning(
                "cannot write %s (%s); log records go to the console only", self.baseFilename, sys.exc_info()[1]
            )


def resolve_numerics(settings: Settings, dist: DistEnv, cuda: bool) -> tuple[bool, str]:
    """(8-bit?, precision) from QUANTIZATION / PRECISION and the hardware; impossible asks are bad input."""
    # auto: no 8-bit under DeepSpeed, which casts and shards the weights (an explicit 8bit is refused there).
    quantize = settings.quantization == "8bit" or (
        settings.quantization == "auto" and cuda and dist.world_size == 1 and settings.strategy != "deepspeed"
    )
    precision = settings.precision
    if precision == "auto":
        precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp16" and not cuda:
        raise JobError(EXIT_BAD_INPUT, "PRECISION=fp16 needs a CUDA GPU; use PRECISION=auto or fp32 on the CPU")
    if precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise JobError(EXIT_BAD_INPUT, "PRECISION=bf16 but this GPU has no bf16; use PRECISION=fp16 or auto")
    return quantize, precision


def join_deepspeed(dist: DistEnv, cuda: bool) -> None:
    """DeepSpeed's communication set up on the process group the rendezvous created (it reuses an initialised
    group): before the model is built, so anything DeepSpeed does on the way (ZeRO-3's zero.Init included)
    sees the whole world, not a world of one."""
    if not td.is_initialized():
        # One process (ZeRO-Offload on one GPU): a world of one, in memory. Without a group DeepSpeed looks for the
        # launcher variables, then for MPI (mpi4py), and fails.
        td.init_process_group("nccl" if cuda else "gloo", store=td.HashStore(), rank=0, world_size=1)
    import deepspeed

    deepspeed.init_distributed(dist_backend=td.get_backend(), auto_mpi_discovery=False)


def agreement(settings: Settings, dist: DistEnv) -> dict:
    """What every rank of one job must share, compared at the rendezvous."""
    return {
        "world_size": dist.world_size,
        "run_name": settings.run_name,
        "output_dir": settings.output_dir,
        **settings.training_settings(),
    }


# ------------------------------------------------------------------------------- resume
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
    # GLOBAL_BATCH_SIZE: one global order of the rows, so any replica count continues where the last one stopped.
    elastic = key.get("elastic") and theirs.get("elastic")
    if elastic and theirs.get("world_size") != key["world_size"]:
        log.info(
            "resuming a run checkpointed on %s replica(s) on %d: global batch %s on both",
            theirs.get("world_size"),
            key["world_size"],
            key["global_batch"],
        )
    if (
        theirs.get("global_batch") != key["global_batch"]
        or theirs.get("data") != key["data"]
        or (not elastic and theirs.get("world_size") != key["world_size"])
    ):
        what = []
        if theirs.get("world_size") != key["world_size"] and not elastic:
            what.append(f"{theirs.get('world_size')} replica(s), this start has {key['world_size']}")
        if theirs.get("global_batch") != key["global_batch"]:
            what.append(f"global batch {theirs.get('global_batch')}, this start {key['global_batch']}")
        if theirs.get("data") != key["data"]:
            what.append("other training or validation data (the files changed since)")
        if theirs.get("world_size") == key["world_size"] or elastic:
            fix = "restore the data and settings of that run"
        elif theirs.get("optimizer_per_rank"):
            fix = (
                f"restart with {theirs.get('world_size')} replica(s): DeepSpeed partitions the optimizer state by "
                "rank, and this job does not convert a checkpoint to another count (for elastic runs use "
                "STRATEGY=ddp with GLOBAL_BATCH_SIZE)"
            )
        else:
            fix = (
                f"restart with {theirs.get('world_size')} replica(s) (or, for a new run, set GLOBAL_BATCH_SIZE: "
                "then the replica count may change between restarts)"
            )
        raise JobError(
            EXIT_BAD_INPUT,
            f"{run.checkpoints / latest.name} was written by a run with {'; '.join(what)}; resuming would skip or repeat rows: "
            f"{fix}, or use a new OUTPUT_DIR to start over",
        )
    return str(latest)


def resume_point(run: RunDir, key: dict, world_size: int) -> tuple[str | None, list[dict]]:
    """Rank 0: the checkpoint to resume from (`resume_checkpoint`), and the stretches of the run so far, each a
    first step and a replica count, this start's last; they travel from checkpoint to checkpoint in its key."""
    checkpoint = resume_checkpoint(run, key)
    earlier = checkpoint_resume_key(Path(checkpoint)).get("segments", []) if checkpoint else []
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


# ------------------------------------------------------------------------------- the run
def run(settings: Settings, dist: DistEnv, run_dir: RunDir, *, preemption: Preemption, masker: Masker) -> int:
    """Train, save and push, on every rank; the exit code. `preemption`: the installed stop-signal handler;
    `masker`: the token masking installed on stdout and stderr, for the log handlers too."""
    setup_logging(dist, masker)
    log.info(
        "rank %d of %d (local rank %d, node %d) via %s; environment %s",
        dist.rank,
        dist.world_size,
        dist.local_rank,
        dist.node_rank,
        dist.source,
        masked_environ(),
    )
    if run_dir.is_finished():
        log.info("%s already holds a finished run", run_dir.root)
        if not dist.is_main:
            return EXIT_OK
        # Stopped between saving and merging.
        if settings.merge_adapter and not run_dir.merged.is_dir():
            save_merged(run_dir, settings)
        return push_model(run_dir, settings, Hub(read_token(), settings.push_timeout, settings.hub_timeout))

    export_env(dist, deepspeed=settings.strategy == "deepspeed")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", dist.local_rank) if cuda else torch.device("cpu")
    quantize, precision = resolve_numerics(settings, dist, cuda)
    log.info("device %s, 8-bit %s, precision %s", device, quantize, precision)
    log.info(describe_recipe(settings, dist.world_size))
    # E.g. fsdp on the CPU: exit 2, never DDP.
    check_strategy(settings, dist, cuda, quantize, precision, launcher_options())

    hub = Hub(read_token(), settings.push_timeout, settings.hub_timeout)
    # On every rank, before the rendezvous: a silent Hub keeps no peer waiting in a collective.
    if settings.result_model_id:
        hub.check_write_access(settings.result_model_id)
    # Likewise a tracker that refuses its URI: exit 2 now, not a traceback after data and model are loaded.
    check_tracker_uri(settings)
    lock = RunLock(run_dir)
    try:
        # Same settings and world size on every rank, one job per OUTPUT_DIR; then the process group.
        group = rendezvous(dist, settings.rendezvous_timeout, cuda, agreement(settings, dist), on_main=lock.acquire)
        log_to_file(run_dir, dist, masker)
        if settings.strategy == "deepspeed":
            join_deepspeed(dist, cuda)
        with group.peers_watched(lambda: resume_hint(run_dir)):
            trainer, metrics, record, state_dict = train(
                settings, group, run_dir, device, quantize, precision, cuda, preemption
            )
        # No rank enters a collective after this: rank 0 may upload for minutes.
        group.leave()
        code = EXIT_OK
        if dist.is_main:
            with group.saving_model():
                save_model(run_dir, settings, trainer, metrics, state_dict)
            # From here a restart of rank 0 alone finishes the run from the volume (merge, push).
            if settings.merge_adapter:
                save_merged(run_dir, settings)
            code = push_model(run_dir, settings, hub)
            print(
                f"eval_accuracy={metrics['eval_accuracy']:.4f} train_samples_per_second={metrics['train_samples_per_second']:.1f} "
                f"model={run_dir.model}",
                flush=True,
            )
        else:
            # Not exit 0 before model/ is saved: `restartPolicy: ExitCode` would then restart a lost rank 0 alone.
            log.info("waiting for rank 0 to save %s", run_dir.model)
            group.wait_for_model(run_dir.is_finished, lambda: resume_hint(run_dir))
        # What tests and benchmarks read (logs/rank-R.json), and the same in words at the end of the rank's log.
        run_dir.write_json(run_dir.rank_record(dist.rank), record)
        log.info(
            "rank %d processed %d training samples; trainable weights checksum %s",
            dist.rank,
            record["samples_trained"],
            record["trainable_checksum"],
        )
        return code
    finally:
        lock.release()


def train(
    settings: Settings,
    group: Collectives,
    run_dir: RunDir,
    device,
    quantize: bool,
    precision: str,
    cuda: bool,
    preemption: Preemption,
):
    """Data, model, Trainer, resume, training and evaluation, on every rank; the final barrier included."""
    dist = group.dist
    tokenizer = load_tokenizer(settings)
    data = group.on_main_then_others(lambda: load_sst2(settings, tokenizer, run_dir.cache))
    # Every rank holds the same rows, so every rank takes the same decision here.
    check_global_batch(settings, dist.world_size, len(data["train"]))
    # Before the model: LoRA init and dropout are the same on every restart.
    set_seed(settings.seed)
    model = group.agree(lambda: build_model(settings, quantize, device))

    key = resume_key(settings, dist, data)
    # The replica counts the run trained on go to metrics.json and the card.
    checkpoint, key["segments"] = group.decide_on_main(lambda: resume_point(run_dir, key, dist.world_size))
    trainer = build_trainer(
        settings,
        run_dir,
        dist,
        model,
        tokenizer,
        data,
        precision,
        cuda,
        checkpoint_key=key,
        collectives=group,
        preemption=preemption,
    )
    # Only now, with data, model and checkpoint checked: a start refused for bad input leaves no record that
    # would make the same OUTPUT_DIR refuse the corrected settings as "another run".
    group.run_on_main(
        lambda: write_run_record(run_dir, settings, global_batch=key["global_batch"], segments=key["segments"])
    )
    if checkpoint:
        log.info(
            "resuming from step %s (%s): the steps before it are not trained again",
            checkpoint.rsplit("-", 1)[-1],
            checkpoint,
        )
    with progress_bar_closed_on_error(trainer), tracker_run(settings, dist):
        # A stop signal now checkpoints at the next step all ranks agree on.
        with preemption.deferred():
            train_result = trainer.train(resume_from_checkpoint=checkpoint)
        signum = group.max_over_ranks(preemption.signum)
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
            "segments": close_segments(key["segments"], trainer.state.global_step),
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
        timer = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StartupTimer))
        # The checksum and the full state dict are collectives when FSDP shards the weights: on every rank,
        # and before leaving the group.
        state_dict = full_state_dict(trainer.model, settings.strategy)
        record = {
            "rank": dist.rank,
            "local_rank": dist.local_rank,
            "node_rank": dist.node_rank,
            "world_size": dist.world_size,
            "source": dist.source,
            "samples_trained": trainer.samples_seen,
            # DeepSpeed: the gathered fp32 weights (under ZeRO-3 the module's own are empty shards)
            "trainable_checksum": trainable_checksum(
                trainer.model, state_dict if settings.strategy == "deepspeed" else None
            ),
            "first_step": timer.first_step + 1,
            "seconds_to_first_step": timer.seconds,
        }
    return trainer, metrics, record, state_dict


def publish_only(settings: Settings, dist: DistEnv, run_dir: RunDir, *, masker: Masker) -> int:
    """--push-only: upload an existing model/ (after a failed push) without training."""
    if not dist.is_main:
        return EXIT_OK
    setup_logging(dist, masker)
    log_to_file(run_dir, dist, masker)
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

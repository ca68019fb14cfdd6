"""The job's Trainer: its arguments, subclass, callbacks and metrics. The HF Trainer owns the loop, DDP,
accumulation, precision, checkpoints and resume; this adds a batch order a resume reproduces, checkpoints every
rank agrees on, a stop on every rank together, and the rows each rank trained on."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial, partialmethod
from pathlib import Path

import datasets
import evaluate
import numpy as np
import psutil  # an Accelerate dependency: the process start time, for the time-to-first-step log line
import pyarrow
import pyarrow.compute
import torch
from torch.utils.data import SequentialSampler
from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments
from transformers.integrations import TensorBoardCallback
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

from utils.cluster.collectives import Collectives
from utils.cluster.job import Job
from utils.cluster.preemption import SIGNALS, Preemption
from utils.common.errors import BadInput, JobError, quiet_volume_faults_in_threads, volume_state
from utils.config.deepspeed_config import offloads, zero_stage
from utils.config.plan import Plan
from utils.config.recipe import optimizer_groups
from utils.config.tasks import (
    CLASSIFICATION,
    LOWER_IS_BETTER,
    METRIC_MODULES,
    MULTI_LABEL,
    REGRESSION,
    best_metric,
    eval_prefix,
)
from utils.run_folder.checkpoints import mark_checkpoint_complete, prune_checkpoints, volume_fault
from utils.run_folder.layout import RunDir
from utils.run_folder.record import record_written
from utils.training.rng import rng_preserved
from utils.training.step_capture import CapturedStep, four_d_mask, takes_4d_mask
from utils.training.strategy import count_fsdp_units, trainer_options

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- the Trainer
class JobTrainer(Trainer):
    """The HF Trainer, counting the rows this rank trained on and keeping evaluation in dataset order. Five private
    methods are overridden where the public route falls short (transformers 5.23; tests/test_library_contract.py):

    - `_get_train_sampler`: the public `length` column is dropped before the sampler is built (every row measured
      again in Python, 1.7 s for SST-2 per rank), and its order would not survive a resume: GlobalOrderSampler.
    - `_get_eval_sampler`: group_by_length would reorder evaluation too; no public switch for it alone.
    - `_save_checkpoint`: a failed save raises on one rank before any callback; every rank agrees first.
    - `_run_epoch`: resuming a checkpoint of step MAX_STEPS inside an epoch trained one step past it.
    - `_clip_grad_norm` (DDP): over the trainable weights, not every parameter each step.

    With the host levers on, the wrapped model's `train` and `zero_grad` are replaced too (`_walk_less`).
    """

    def __init__(
        self,
        *args,
        plan: Plan,
        startup: StepClock,
        buckets: list[int],
        compiled: bool = False,
        captured: bool = False,
        class_weights: torch.Tensor | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        # BERT's forward takes **kwargs, so the Trainer takes its loss for a sum over `num_items_in_batch`; it is a
        # per-batch mean: without this, DDP trains at world-size x the rate.
        self.model_accepts_loss_kwargs = False
        self.plan, self.startup, self.buckets = plan, startup, buckets
        # Rows this process trained on (logs/rank-R.json); after a resume, only the rows trained since.
        self.samples_seen = 0
        self.compile_pending = compiled and not captured  # a captured step compiles in its warm-up
        self.capture_pending = captured
        self.captured: CapturedStep | None = None  # CUDA_GRAPHS: the step captured per bucket, from the first step on
        self._ddp_group = None  # DDP's process group, for the captured step's all-reduce
        self.class_weights = class_weights  # CLASS_WEIGHTS: each class's weight in the loss, on the device
        self.cudagraphs = compiled and cudagraphs_enabled()  # Inductor's, told where each step begins
        self._parameters: int | None = None  # num_parameters(exclude_embeddings=True), counted once
        self._trainable: list[torch.nn.Parameter] | None = None

    # Each step the Trainer walks the whole model, frozen base included (train(), floating_point_ops, clipping,
    # zero_grad: 2.2, 2, 1.1, 1.1 ms on a LoRA BERT-base), host time a compiled GPU step waits on; the job does each
    # once or over the trainable weights, same results (tests/test_host_levers.py, benchmarks/host_levers.py).
    host_levers = True

    def floating_point_ops(self, inputs) -> int:
        if not self.host_levers:
            return super().floating_point_ops(inputs)
        name = getattr(self.model, "main_input_name", "input_ids")
        if name not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self._parameters is None:
            self._parameters = self.model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[name].numel() * self._parameters

    def _clip_grad_norm(self, model):
        # FSDP and DeepSpeed clip through their own engines, which take the model's own parameters.
        if not self.host_levers or self.plan.strategy != "ddp":
            return super()._clip_grad_norm(model)
        return self.accelerator.clip_grad_norm_(self._trainable_of(model), self.args.max_grad_norm)

    def _trainable_of(self, model) -> list[torch.nn.Parameter]:
        if self._trainable is None:
            self._trainable = [p for p in model.parameters() if p.requires_grad]
        return self._trainable

    def _walk_less(self, model) -> None:
        """train() returns at once when the wrapper and the inner model already have the mode (evaluation's eval()
        reaches the inner one); zero_grad() drops the trainable weights' gradients only."""
        walk_train, walk_zero_grad, inner = model.train, model.zero_grad, self.model
        # The first call walks: from_pretrained leaves the base in eval mode under a peft wrapper that says training.
        walked = []

        def train(mode: bool = True):
            if self.host_levers and walked and model.training == inner.training == mode:
                return model
            walked.append(mode)
            return walk_train(mode)

        def zero_grad(set_to_none: bool = True) -> None:
            if self.captured is not None:  # the captured step's gradients stay where its graphs write them
                return self.captured.zero_grad()
            if not (self.host_levers and set_to_none):
                return walk_zero_grad(set_to_none)
            for parameter in self._trainable_of(model):
                parameter.grad = None

        model.train, model.zero_grad = train, zero_grad

    def create_optimizer(self, model=None):
        if self.optimizer is None and len(set(self.plan.rates.values())) > 1:  # else the Trainer's own groups
            opt_model = self.model if model is None else model
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            groups = optimizer_groups(opt_model.named_parameters(), self.plan.rates, self.args.weight_decay)
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        optimizer = super().create_optimizer(model)
        if self.args.deepspeed and offloads(self.args.hf_deepspeed_config.config)[0]:
            # ZeRO-Offload steps on the CPU with DeepSpeed's own CPU Adam only: the same groups and hyperparameters.
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            keys = ("lr", "weight_decay", "betas", "eps")
            groups = [{k: v for k, v in group.items() if k in ("params", *keys)} for group in optimizer.param_groups]
            optimizer = self.optimizer = DeepSpeedCPUAdam(
                groups, **{k: optimizer.defaults[k] for k in keys}, adamw_mode=True
            )
        return optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        # The only public place that sees each batch's rows (callbacks get the step).
        if self.compile_pending:
            self.compile_every_bucket(model, inputs)
        if self.cudagraphs:  # each step a new run of the captured graphs: the last step's outputs are done with
            torch.compiler.cudagraph_mark_step_begin()
        self.samples_seen += int(inputs["input_ids"].shape[0])
        # Once, on the model the Trainer steps (DDP's wrapper, or the model); FSDP and DeepSpeed keep their own.
        if self.plan.strategy == "ddp" and "zero_grad" not in vars(model):
            self._walk_less(model)
        if self.capture_pending:
            self.capture_every_bucket(model, inputs)
        if self.captured is not None:
            return self.captured_training_step(model, inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's loss, or with CLASS_WEIGHTS the class-weighted cross-entropy, a per-batch mean as the model's
        (the forward takes no weights)."""
        if self.class_weights is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs["labels"]
        outputs = model(**{name: value for name, value in inputs.items() if name != "labels"})
        logits = outputs["logits"]
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), labels.view(-1), weight=self.class_weights
        )
        return (loss, outputs) if return_outputs else loss

    def captured_training_step(self, model, inputs) -> torch.Tensor:
        """The eager training_step with forward and backward replayed; the last micro-batch of a step all-reduces
        the gradients, as DDP's hooks would."""
        model.train()
        step = self.captured
        if self.trainable_grads_detached():
            step.attach_grads()
        loss = step.run(inputs, self.current_gradient_accumulation_steps)
        if self.accelerator.sync_gradients and self._ddp_group is not None:
            step.all_reduce(self._ddp_group)
        return loss

    def trainable_grads_detached(self) -> bool:
        return self.captured.trainable[0].grad is not self.captured.grads[0]

    def capture_every_bucket(self, model, inputs) -> None:
        """CUDA_GRAPHS: every bucket's step prepared before the first trains, from the first batch cut to each."""
        self.capture_pending = False
        ddp = torch.nn.parallel.DistributedDataParallel
        self._ddp_group = model.process_group if isinstance(model, ddp) else None

        def loss_of(batch: dict) -> torch.Tensor:
            with self.compute_loss_context_manager():
                return self.compute_loss(self.model, batch)

        cuda = self.args.device.type == "cuda"
        self.captured = CapturedStep(loss_of, self._trainable_of(model), self.args.device, graphs=cuda)
        pad = self.processing_class.pad_token_id or 0
        self.captured.prepare([bucket_batch(inputs, length, pad) for length in self.buckets])
        self.startup.capture_s = self.captured.capture_s

    def compile_every_bucket(self, model, inputs) -> None:
        """The fast path's graphs, one per length bucket, built before the first step (else each compiled mid-epoch,
        tens of seconds counted as training): the first batch cut to each bucket (bucket_batch), forward and
        backward, gradients dropped, RNG restored, nothing exchanged: training then is the eager path's."""
        self.compile_pending = False
        started = time.perf_counter()
        pad = self.processing_class.pad_token_id or 0
        with rng_preserved(self.args.device), self.accelerator.no_sync(model):
            for length in self.buckets:
                batch = bucket_batch(inputs, length, pad)
                if self.cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                super().training_step(model, batch)
        model.zero_grad(set_to_none=True)
        synchronize(self.args.device)
        self.startup.compile_s = time.perf_counter() - started
        log.info("torch.compile: graphs for length buckets %s built in %.1f s", self.buckets, self.startup.compile_s)

    def evaluate(self, *args, **kwargs):
        # Iterating a DataLoader draws its base seed from the global RNG: every evaluation during training shifted
        # the dropout masks of every later step, so EVAL_STEPS (free to change on a restart) changed the model.
        # Eager on the fast path: evaluation batches (another size, no gradients) would double the graphs.
        with rng_preserved(self.args.device), torch.compiler.set_stance("force_eager"), self.startup.aside():
            return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        marker = next(c for c in self.callback_handler.callbacks if isinstance(c, Checkpoints))
        with self.startup.aside():
            marker.save_agreed(
                lambda: super(JobTrainer, self)._save_checkpoint(model, trial),
                f"saving checkpoint-{self.state.global_step}",
            )

    def _run_epoch(self, *args, **kwargs):
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.train_sampling_strategy == "group_by_length" and isinstance(dataset, datasets.Dataset):
            # Arrow's lengths are the library loop's: the same batches.
            return GlobalOrderSampler(self.plan.batch.global_batch, token_counts(dataset).to_pylist(), self.args.seed)
        return super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        return SequentialSampler(eval_dataset)


def balanced_class_weights(split: datasets.Dataset, classes: int) -> torch.Tensor:
    """CLASS_WEIGHTS=balanced, as scikit-learn's: rows / (classes x the class's rows); 0 for a class with none."""
    counts = np.bincount(np.asarray(split.with_format("arrow")["labels"]), minlength=classes)[:classes]
    weights = np.where(counts > 0, len(split) / (classes * np.maximum(counts, 1)), 0.0)
    return torch.tensor(weights, dtype=torch.float32)


def bucket_batch(inputs: dict, length: int, pad: int) -> dict:
    """`inputs` cut or padded to `length` tokens, ending in a padded column as a bucket's batches do (without one,
    transformers drops the attention mask: a graph no real batch uses). Every tensor whose last dimension is the
    sequence is cut, filled with the pad id (ids) or 0; never the labels (a multi-label row could match in size)."""
    tokens = inputs["input_ids"].shape[-1]
    batch = {}
    for name, value in inputs.items():
        if name != "labels" and torch.is_tensor(value) and value.dim() >= 2 and value.shape[-1] == tokens:
            filler = pad if name == "input_ids" else 0
            value = value[..., : length - 1]
            value = torch.nn.functional.pad(value, (0, length - value.shape[-1]), value=filler)
        batch[name] = value
    return batch


class GlobalOrderSampler(LengthGroupedSampler):
    """The rows of every global batch drawn from SEED + epoch, the data and the global batch alone: never from the
    replica count, the global RNG or TORCH_COMPILE. Accelerate deals the micro-batches to the ranks in turn and a
    step takes world size x accumulation of them, one global batch on any count: step k trains the same rows on
    1, 2 or 4 replicas, and a resume on another count starts at the same row. An epoch trains whole global
    batches only (the rest wait, drawn anew each epoch): every micro-batch the same size, one graph per bucket.

    The library's sampler draws from the global RNG, which a resume restores only after the resumed epoch's
    order is drawn; `SamplerEpoch` sets the epoch (the Trainer's `set_epoch` misses it in a resumed DDP epoch).
    """

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        super().__init__(batch_size, lengths=lengths)
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.generator = torch.Generator().manual_seed(self.seed + epoch)

    def __len__(self) -> int:
        return len(self.lengths) // self.batch_size * self.batch_size

    def __iter__(self):
        kept = torch.randperm(len(self.lengths), generator=self.generator)[: len(self)].tolist()
        # Length-grouped within the kept rows (little padding); the grouping is by global batch, not by micro-batch.
        grouped = get_length_grouped_indices(
            [self.lengths[i] for i in kept], self.batch_size, generator=self.generator
        )
        return iter([kept[i] for i in grouped])


def epoch_sampler(train_dataloader) -> GlobalOrderSampler | None:
    batches = getattr(train_dataloader, "batch_sampler", None)
    while hasattr(batches, "batch_sampler"):
        batches = batches.batch_sampler
    sampler = getattr(batches, "sampler", None)
    return sampler if isinstance(sampler, GlobalOrderSampler) else None


# ------------------------------------------------------------------------------- callbacks
class SamplerEpoch(TrainerCallback):
    """The sampler's epoch (global step // steps per epoch), set before its order is drawn: fresh or resumed."""

    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch

    def on_epoch_begin(self, args, state, control, train_dataloader=None, **kwargs):
        if (sampler := epoch_sampler(train_dataloader)) is not None:
            sampler.set_epoch(state.global_step // self.steps_per_epoch)


def seconds_since_start() -> float:
    return time.time() - psutil.Process().create_time()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock(TrainerCallback):
    """When the first training step began and ended (seconds after process start), and the steady step time past
    it, evaluations and checkpoints set aside; the GPU is waited for around those, never per step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.first_step = 0
        self.seconds: float | None = None  # the first step began; None: a resume found no step left
        self.first_step_done_s: float | None = None
        self.compile_s: float | None = None  # the fast path's graphs, built before the first step
        self.capture_s: float | None = None  # CUDA_GRAPHS: every bucket's step warmed up and captured, before it
        self.steps = 0
        self.train_s = 0.0
        self._began: float | None = None
        self._aside = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_step = state.global_step  # after a resume, the checkpoint's next one

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.first_step:
            self.seconds = seconds_since_start()
            log.info("first training step %d began %.2f s after process start", state.global_step + 1, self.seconds)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        if self._began is None:  # the first step, compile included, is not a steady one
            synchronize(self.device)
            self.first_step_done_s = seconds_since_start()
            self._began, self._aside, self.steps = time.perf_counter(), 0.0, 0
            log.info("first training step done %.2f s after process start", self.first_step_done_s)

    def on_train_end(self, args, state, control, **kwargs):
        if self._began is not None and self.steps:
            synchronize(self.device)
            self.train_s = time.perf_counter() - self._began - self._aside

    @contextmanager
    def aside(self) -> Iterator[None]:
        if self._began is None:
            yield
            return
        synchronize(self.device)
        started = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self._aside += time.perf_counter() - started

    def record(self, steps_per_epoch: int) -> dict:
        """logs/rank-R.json's `timing`."""
        step_ms = 1000 * self.train_s / self.steps if self.steps else None
        return {
            "first_step_began_s": self.seconds,
            "first_step_done_s": self.first_step_done_s,
            "compile_s": self.compile_s,
            "capture_s": round(self.capture_s, 3) if self.capture_s is not None else None,
            "steady_steps": self.steps,
            "steady_step_ms": round(step_ms, 3) if step_ms else None,
            "steady_epoch_s": round(step_ms * steps_per_epoch / 1000, 3) if step_ms else None,
            "steps_per_epoch": steps_per_epoch,
        }


class Checkpoints(TrainerCallback):
    """Saves and stops at the first step where any rank got SIGTERM or SIGINT; makes each checkpoint's folder; marks
    it complete once every rank wrote its part (resume skips unmarked ones); keeps SAVE_TOTAL_LIMIT complete ones."""

    def __init__(self, run: RunDir, collectives: Collectives, keep: int, resume_key: dict, preemption: Preemption):
        self.run, self.collectives, self.keep, self.resume_key = run, collectives, keep, resume_key
        self.preemption = preemption

    def on_step_end(self, args, state, control, **kwargs):
        # The signal's max over ranks (gloo, no GPU sync): one decision at one step; SIGTERM (15) wins over SIGINT.
        if signum := self.collectives.max_over_ranks(self.preemption.signum):
            self.preemption.follow(signum)
            log.warning(f"{SIGNALS.get(signum, signum)}: saving a checkpoint at step {state.global_step} and stopping")
            control.should_save = control.should_training_stop = True
            # The grace period goes to the checkpoint (the Trainer would evaluate first on an evaluation step),
            # unless evaluations choose the checkpoint and the stop: a resume never evaluates that step again.
            control.should_evaluate = control.should_evaluate and args.load_best_model_at_end
        if state.global_step >= state.max_steps and not args.load_best_model_at_end:
            # The Trainer evaluates before the last save: an evaluation out of memory there lost every step since
            # the last checkpoint. The final evaluation after training gives the curve its last point.
            control.should_evaluate = False
        if control.should_save:
            # The Trainer would follow a link planted at checkpoint-N (a predictable name): refused on every rank.
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            self.save_agreed(lambda: self.run.make_dir(folder), f"creating {folder.name}")

    def on_save(self, args, state, control, **kwargs):
        # Each rank saves its own RNG state; rank 0 alone cannot tell it is written.
        self.collectives.barrier()

        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"

        def mark() -> None:
            with self.volume_checked(f"marking {folder.name} complete"):
                mark_checkpoint_complete(self.run, folder, self.resume_key)
                prune_checkpoints(
                    self.run, self.keep, state.best_model_checkpoint if args.load_best_model_at_end else None
                )

        self.collectives.run_on_main(mark)

    def save_agreed(self, save: Callable[[], None], doing: str) -> None:
        """Run this rank's part of a save, then agree on how it went: a full or read-only volume stops every rank
        with the same `error:` line and exit 2, not a traceback on one and a lost peer (143) on the others."""
        with self.collectives.agreed(), self.volume_checked(doing):
            save()

    @contextmanager
    def volume_checked(self, doing: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            fault = None if isinstance(exc, JobError) else volume_fault(self.run, exc, doing)
            if fault is None:
                raise
            raise fault from None


class EarlyStopping(TrainerCallback):
    """EARLY_STOPPING_PATIENCE: stop once that many evaluations in a row have not beaten the best before them,
    counted from log_history (which a resume restores), so a restart stops where the run would have."""

    def __init__(self, patience: int):
        self.patience = patience

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if control.should_training_stop or state.global_step >= state.max_steps:
            return
        key = args.metric_for_best_model
        key = key if key.startswith("eval_") else f"eval_{key}"
        scores = [entry[key] for entry in state.log_history if key in entry and "step" in entry]
        if not scores:
            return
        better = (lambda a, b: a > b) if args.greater_is_better else (lambda a, b: a < b)
        best_at = 0
        for index, score in enumerate(scores):
            if better(score, scores[best_at]):
                best_at = index
        if len(scores) - 1 - best_at >= self.patience:
            control.should_training_stop = True
            said = (state.global_step, key, scores[best_at], best_at + 1, self.patience)
            log.warning("early stopping at step %d: %s has not beaten %.4f (evaluation %d) in %d evaluation(s)", *said)


class RecordedTensorBoard(TensorBoardCallback):
    """The TensorBoard callback writing into the job's folder, recording each event file it creates
    (record_written): a push sends those files, never whatever else is in the folder."""

    def __init__(self, run: RunDir, folder: Path):
        super().__init__()
        self.run = run
        self.logging_dir = str(folder)
        # A full or read-only volume stops the curves; the next checkpoint save ends the job with the error line.
        self.volume_failed = False
        quiet_volume_faults_in_threads()  # the event writer's thread dies of it without a traceback

    def _unless_volume_failed(self, event: str, *args, **kwargs) -> None:
        if self.volume_failed:
            return
        try:
            getattr(super(), event)(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, JobError) or (state := volume_state(exc, self.run.root)) is None:
                raise
            self.volume_failed = True
            log.warning(f"TensorBoard stopped writing to {self.logging_dir}: the volume is {state} ({exc})")

    on_train_begin = partialmethod(_unless_volume_failed, "on_train_begin")
    on_log = partialmethod(_unless_volume_failed, "on_log")
    on_train_end = partialmethod(_unless_volume_failed, "on_train_end")

    def _init_summary_writer(self, args):
        folder = self.run.make_dir(Path(self.logging_dir))
        # A name no one can guess ahead, so no link can be waiting under it.
        suffix = f".{uuid.uuid4().hex}"
        self.tb_writer = self._SummaryWriter(log_dir=str(folder), filename_suffix=suffix)
        events = [path for path in folder.iterdir() if path.name.endswith(suffix)]
        for path in events:
            self.run.check_owned(path)
        record_written(self.run, "tensorboard", [str(path.relative_to(self.run.root)) for path in events])


class StrategyCheck(TrainerCallback):
    """At the start of training: stop unless the model is wrapped as asked (the Trainer and Accelerate drop FSDP
    without a word where it cannot run)."""

    def __init__(self, strategy: str):
        self.strategy = strategy

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.strategy == "deepspeed":
            from accelerate.state import AcceleratorState
            from accelerate.utils import DistributedType

            if AcceleratorState().distributed_type != DistributedType.DEEPSPEED:
                raise BadInput(
                    f"STRATEGY=deepspeed but Accelerate set the run up as {AcceleratorState().distributed_type.value} "
                    "(it would train without DeepSpeed); launch without --cpu / ACCELERATE_USE_CPU",
                )
            config = args.hf_deepspeed_config.config
            state, weights = offloads(config)
            log.info(
                f"strategy deepspeed: ZeRO stage {zero_stage(config)}, optimizer state offloaded {state}, weights offloaded {weights}"
            )
            return
        units = count_fsdp_units(model)
        if self.strategy != "fsdp":
            whole = "a whole model on every rank" if args.world_size > 1 else "one process, the whole model"
            log.info(f"strategy {self.strategy}: {f'{units} FSDP units' if units else whole}")
        elif not units:
            raise BadInput(
                "STRATEGY=fsdp but the Trainer did not shard the model (it would train plain DDP); "
                "FSDP needs one process per CUDA GPU and a MULTI_GPU launch",
            )
        else:
            layers = ", ".join(args.fsdp_config.get("transformer_layer_cls_to_wrap", []))
            log.info(f"strategy fsdp: the model is sharded by FSDP in {units} units ({layers} + the root)")


# ------------------------------------------------------------------------------- metrics
# The loss is computed here from the gathered split: the Trainer's eval_loss averages each rank's batch means,
# counting the rows a sampler repeats to even out ranks (eval_loss 7.378 where the MSE is 7.427); a `loss` from
# compute_metrics replaces it.
def classification_metrics(num_labels: int = 2):
    """compute_metrics: accuracy, F1, precision, recall, Matthews correlation (macro over more than two classes)."""
    metric = evaluate.load(METRIC_MODULES[CLASSIFICATION])

    def compute(eval_pred):
        # Against the labels gathered with the predictions, never the dataset's order.
        predictions = np.argmax(eval_pred.predictions, axis=-1)
        references = eval_pred.label_ids
        scores = metric.compute(predictions=predictions, references=references, num_labels=num_labels)
        logits = np.asarray(eval_pred.predictions, dtype=np.float64)
        # Cross-entropy, as the model's loss: log-sum-exp of the logits less the true class's logit.
        top = logits.max(axis=-1)
        log_norm = top + np.log(np.exp(logits - top[:, None]).sum(axis=-1))
        loss = float(np.mean(log_norm - logits[np.arange(len(references)), references]))
        return {**scores, "samples": len(references), "loss": loss}

    return compute


def regression_metrics():
    """compute_metrics for a regression: Pearson, Spearman, MSE."""
    metric = evaluate.load(METRIC_MODULES[REGRESSION])

    def compute(eval_pred):
        predictions = np.asarray(eval_pred.predictions, dtype=np.float64).reshape(-1)
        references = np.asarray(eval_pred.label_ids, dtype=np.float64).reshape(-1)
        scores = metric.compute(predictions=predictions, references=references)
        return {**scores, "samples": len(references), "loss": scores["mse"]}  # the model's loss is the MSE

    return compute


def multi_label_metrics(threshold: float):
    """compute_metrics for a multi-label model: micro and macro F1 and subset accuracy at `threshold` (THRESHOLD),
    and the mean binary cross-entropy, the model's loss."""
    metric = evaluate.load(METRIC_MODULES[MULTI_LABEL])

    def compute(eval_pred):
        logits = np.asarray(eval_pred.predictions, dtype=np.float64)
        references = np.asarray(eval_pred.label_ids, dtype=np.float64)
        # sigmoid(logit) >= threshold, as the logit against the threshold's own (no overflow for a large logit).
        predicted = logits >= np.log(threshold / (1 - threshold))
        scores = metric.compute(predictions=predicted.astype(np.int32), references=references.astype(np.int32))
        # BCEWithLogitsLoss, written so that a large logit does not overflow the exponential.
        loss = float(np.mean(np.maximum(logits, 0) - logits * references + np.log1p(np.exp(-np.abs(logits)))))
        return {**scores, "samples": len(references), "loss": loss}

    return compute


def problem_of(config) -> str:
    return {"regression": REGRESSION, MULTI_LABEL: MULTI_LABEL}.get(config.problem_type, CLASSIFICATION)


# ------------------------------------------------------------------------------- building it
@dataclass(frozen=True)
class TrainerChoices:
    """The settings the Trainer and its callbacks read (Settings.select); the rest is the plan's."""

    task: str | None
    label_column: str
    class_weights: str
    threshold: float
    max_seq_length: int
    per_device_eval_batch_size: int
    weight_decay: float
    gradient_checkpointing: bool
    logging_steps: int
    save_steps: int
    save_total_limit: int
    load_best_model: bool
    early_stopping_patience: int | None
    report_to: tuple[str, ...]
    seed: int
    rendezvous_timeout: int
    dataloader_num_workers: int


def training_arguments(job: Job, model, choices: TrainerChoices) -> TrainingArguments:
    dist, cuda, plan = job.dist, job.cuda, job.plan
    # Rank 0 reports; TensorBoard is added by build_trainer with its folder under OUTPUT_DIR.
    trackers = [name for name in choices.report_to if name not in ("tensorboard", "none")]
    options = dict(
        output_dir=str(job.out.checkpoints),
        run_name=plan.run_name,
        per_device_train_batch_size=plan.batch.micro_batch,
        per_device_eval_batch_size=choices.per_device_eval_batch_size,
        gradient_accumulation_steps=plan.batch.accumulation,
        num_train_epochs=plan.num_epochs,
        max_steps=plan.max_steps or -1,
        learning_rate=plan.learning_rate,
        weight_decay=choices.weight_decay,
        # A count: the plan's never makes every step warm-up (a linear warm-up trains its first step at rate 0).
        warmup_steps=plan.warmup_steps,
        optim="adamw_torch_fused",
        bf16=plan.precision == "bf16",
        fp16=plan.precision == "fp16",
        # Not `tf32=True`: use_tf32_matmuls sets it through one torch API (pytorch#166387).
        tf32=None,
        # transformers 5's name for gradient checkpointing; the reentrant variant breaks DDP + LoRA (peft #899).
        activation_checkpointing=choices.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        train_sampling_strategy="group_by_length",
        logging_steps=choices.logging_steps,
        logging_first_step=True,
        # The filter reads every step's loss on the host: one GPU sync per step.
        logging_nan_inf_filter=False,
        report_to=trackers if dist.is_main else "none",
        seed=choices.seed,
        # Without it, CPU ranks would not form a DDP group but each train alone.
        use_cpu=not cuda,
        ddp_find_unused_parameters=False,
        ddp_timeout=choices.rendezvous_timeout,
        dataloader_num_workers=choices.dataloader_num_workers,
        dataloader_pin_memory=cuda,
        accelerator_config={"non_blocking": cuda},
        disable_tqdm=not dist.is_main,
        log_level="passive",  # utils/run.setup_logging decides which library records reach the logs
        log_level_replica="passive",
    )
    # LOAD_BEST_MODEL (or early stopping, which keeps the best): a checkpoint at every evaluation, the candidates.
    load_best = choices.load_best_model or choices.early_stopping_patience is not None
    best = best_metric(choices.task, problem_of(model.config))
    options.update(evaluation_options(plan.eval_every, best, load_best, choices.save_steps))
    options.update(trainer_options(job.strategy, model, plan.deepspeed))
    return TrainingArguments(**options)


def evaluation_options(eval_every: int, best: str, load_best: bool, save_steps: int) -> dict:
    """When the Trainer evaluates and checkpoints, and which checkpoint it keeps (the `best` one where `load_best`)."""
    return dict(
        save_strategy="steps",
        save_steps=eval_every if load_best else save_steps,
        save_total_limit=None,  # Checkpoints prunes, counting complete checkpoints only
        eval_strategy="steps" if eval_every else "no",
        eval_steps=eval_every or None,
        # By default the last step's model is saved, the metric only tracked; LOAD_BEST_MODEL loads the best one,
        # chosen on the validation split (the card says so).
        load_best_model_at_end=load_best,
        metric_for_best_model=best,
        greater_is_better=best.rsplit("_", 1)[-1] not in LOWER_IS_BETTER,
    )


def build_trainer(
    job: Job,
    model,
    tokenizer,
    data,
    choices: TrainerChoices,
    *,
    key: dict | None = None,
    group: Collectives | None = None,
) -> JobTrainer:
    """The job's Trainer over `data`. `key`: what each complete checkpoint records (default: the plan's identity);
    `group`: the rendezvous' Collectives, which a single process may leave out."""
    if group is None and job.dist.is_distributed:
        raise ValueError(
            "a distributed job passes build_trainer the Collectives of utils.cluster.collectives.rendezvous"
        )
    group = group or Collectives(job.dist, choices.rendezvous_timeout)
    args = training_arguments(job, model, choices)
    startup = StepClock(args.device)
    callbacks = job_callbacks(job, choices, group, startup, key or {"identity": job.plan.identity})
    if job.cuda:
        use_tf32_matmuls()
    buckets, collator = bucket_collator(tokenizer, data, choices.max_seq_length, takes_4d_mask(model.config))
    if job.plan.precision == "bf16" and not job.quantize and job.strategy == "ddp":
        store_frozen_linears_in_bf16(model)
    if job.compiled:
        compile_model(model, job)
    problem = problem_of(model.config)
    class_weights = loss_class_weights(
        choices.class_weights, choices.label_column, problem, data["train"], model.config
    )
    # Several validation splits (MNLI's): the Trainer prefixes each one's metrics with its name.
    evaluated = {eval_prefix(split): data[split] for split in data if split != "train"}
    return JobTrainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["validation"] if set(data) == {"train", "validation"} else evaluated,
        data_collator=collator,
        processing_class=tokenizer,
        compute_metrics={
            REGRESSION: regression_metrics,
            MULTI_LABEL: partial(multi_label_metrics, choices.threshold),
            CLASSIFICATION: partial(classification_metrics, model.config.num_labels),
        }[problem](),
        callbacks=callbacks,
        plan=job.plan,
        startup=startup,
        buckets=buckets,
        compiled=job.compiled,
        captured=job.captured,
        class_weights=class_weights.to(args.device) if class_weights is not None else None,
    )


def job_callbacks(job: Job, choices: TrainerChoices, group: Collectives, startup: StepClock, key: dict) -> list:
    """The job's own callbacks, in the order the Trainer calls them."""
    out = job.out
    callbacks: list[TrainerCallback] = [
        StrategyCheck(job.strategy),
        startup,
        SamplerEpoch(job.plan.steps_per_epoch),
        Checkpoints(out, group, choices.save_total_limit, key, job.preemption),
    ]
    if choices.early_stopping_patience is not None:
        callbacks.append(EarlyStopping(choices.early_stopping_patience))
    if job.dist.is_main and "tensorboard" in choices.report_to:
        callbacks.append(RecordedTensorBoard(out, out.tensorboard / job.plan.run_name))
    return callbacks


def bucket_collator(tokenizer, data, max_length: int, mask_4d: bool) -> tuple[list[int], partial]:
    """The length buckets (the longest row of any split) and the collator padding each batch to its bucket: the same
    shapes, so the same dropout masks, compiled or eager."""
    longest = max(pyarrow.compute.max(token_counts(split)).as_py() for split in data.values())
    buckets = length_buckets(max_length, longest)
    collators = {n: DataCollatorWithPadding(tokenizer, padding="max_length", max_length=n) for n in buckets}
    return buckets, partial(pad_to_bucket, collators, mask_4d=mask_4d)


def loss_class_weights(asked: str, label_column: str, problem: str, train, config) -> torch.Tensor | None:
    if asked != "none" and problem == REGRESSION:
        raise BadInput(
            f"CLASS_WEIGHTS={asked} weighs classes, and the label column '{label_column}' "
            "holds regression scores; unset CLASS_WEIGHTS, or give class labels",
        )
    if asked != "balanced":
        return None
    weights = balanced_class_weights(train, config.num_labels)
    named = ", ".join(f"{config.id2label[i]} {w:.3f}" for i, w in enumerate(weights.tolist()))
    log.info("class weights (balanced) in the loss: %s", named)
    return weights


# ------------------------------------------------------------------------------- the fast path
SMALLEST_BUCKET = 16  # SST-2's median row is 10 tokens: at 32, 61% of the padded tokens were padding


def length_buckets(max_length: int, longest: int) -> list[int]:
    """16, 32, 64 ... up to the longest row (a multiple of 8) or MAX_SEQ_LENGTH, whichever is less."""
    top = min(max_length, -(-longest // 8) * 8)
    buckets = [min(SMALLEST_BUCKET, top)]
    while buckets[-1] < top:
        buckets.append(min(2 * buckets[-1], top))
    return buckets


def token_counts(split: datasets.Dataset) -> pyarrow.Array:
    return pyarrow.compute.list_value_length(split.with_format("arrow")["input_ids"])


def use_tf32_matmuls() -> None:
    """TF32 for fp32 matmuls (Ampere and newer) through torch's legacy API only: once the new one (which
    TrainingArguments(tf32=True) sets) is used too, the legacy getters raise, and inductor calls them."""
    if torch.cuda.get_device_capability()[0] >= 8:
        torch.set_float32_matmul_precision("high")


def pad_to_bucket(collators: dict[int, DataCollatorWithPadding], features: list[dict], mask_4d: bool = False) -> dict:
    """A batch padded to the smallest bucket that holds its longest row. `mask_4d`: its attention mask made 4D here,
    off the GPU step (no host read of the mask at each forward)."""
    longest = max(len(row["input_ids"]) for row in features)
    bucket = next((length for length in collators if length >= longest), max(collators))
    batch = collators[bucket](features)
    if mask_4d and "attention_mask" in batch:
        batch["attention_mask"] = four_d_mask(batch["attention_mask"])
    return batch


def store_frozen_linears_in_bf16(model) -> None:
    """The frozen linear layers stored in bf16 once, the values autocast would cast them to at every forward (it
    caches no cast of a weight without gradient: 420 copies a step of bert-base); trained weights stay fp32."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not any(p.requires_grad for p in module.parameters()):
            module.to(torch.bfloat16)


def compile_model(model, job: Job) -> None:
    """TORCH_COMPILE: each transformer block compiled in place, one static graph per length bucket shared by all
    blocks (a tenth of compiling the whole model); in place, the weights keep their names. Not the Trainer's
    `torch_compile`: dynamic shapes, over the DDP wrapper (graphs split at each gradient bucket), evaluation too."""
    import torch._inductor.config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from torch._inductor.utils import clear_caches

    # Dropout masks from torch's generator, as the eager path draws them: the same seed trains the same model.
    torch._inductor.config.fallback_random = True
    # Compiled code on the shared volume, for restarts and replicas, unless TORCHINDUCTOR_CACHE_DIR says otherwise.
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(job.out.cache / "inductor")
        clear_caches()
    base = model.get_base_model()
    # The first block's input (frozen embeddings) would take no gradient, the others' would: two graphs a bucket.
    base.enable_input_require_grads()
    for block in repeated_blocks(base):
        block.compile(dynamic=False)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The longest ModuleList of one class (BERT's `encoder.layer`); the whole model if it has none."""
    stacks = [
        list(modules)
        for modules in model.modules()
        if isinstance(modules, torch.nn.ModuleList) and len(modules) > 1 and len({type(m) for m in modules}) == 1
    ]
    return max(stacks, key=len) if stacks else [model]


def cudagraphs_enabled() -> bool:
    import torch._inductor.config

    return bool(torch._inductor.config.triton.cudagraphs)


def compile_record() -> dict:
    """What the compiler did in this process (logs/rank-R.json); cudagraphs is inductor's own switch, read back."""
    from torch._dynamo.utils import calculate_time_spent, counters

    spent = calculate_time_spent()
    frames = counters["frames"]["total"]
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": max(frames - 1, 0),
        "graph_breaks": sum(counters["graph_break"].values()),
        "compile_s": round(spent.get("total_wall_time", 0), 2),  # forward and backward graphs
        "cudagraphs": cudagraphs_enabled(),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],  # graphs run without CUDA graphs, where asked
    }

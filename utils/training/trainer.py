"""The Trainer the job uses: its TrainingArguments, the HF Trainer subclass, its callbacks and its metrics.

The Trainer (Accelerate underneath) owns the loop, DDP, accumulation, mixed precision, checkpoints, resume and
logging. This module adds what it lacks: a batch order a resume reproduces, checkpoints every rank agrees on, a
stop on every rank together, the rows each rank trained on. The order of a run around it is utils/run.py's.
"""

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
    """The HF Trainer, counting the rows this rank trained on and keeping evaluation in dataset order.

    Five private methods are overridden, because the public route does not give what the job needs
    (transformers 5.23, checked by tests/test_library_contract.py):

    - training: `train_sampling_strategy="group_by_length"` with a precomputed `length` column is the public
      way, but `_get_dataloader` drops the columns the model's forward does not take before it builds the
      sampler, so the library measures every row in a Python loop again (1.7 s for SST-2, on every rank). And
      its order would not survive a resume: GlobalOrderSampler.
    - evaluation: the same strategy makes the eval sampler length-grouped too (rows reordered); there is
      no public switch for evaluation alone, so the override keeps it sequential.
    - checkpoints: a save that fails (a full or read-only volume) raises out of the Trainer on the rank that
      hit it, before any callback runs; the override lets every rank agree on the outcome first
      (Checkpoints.save_agreed).
    - resume at the last step: a checkpoint of step MAX_STEPS (a run stopped in its final evaluation or before
      model/ was saved) resumed inside an epoch, and the library trains one step before it checks for the
      end: the restart trained a step past MAX_STEPS. The override runs no epoch once the last step is trained.
    - clipping (`_clip_grad_norm`, DDP): over the trainable weights only; the library scans every parameter each step.

    And, with the host levers on, the wrapped model's `train` and `zero_grad` are replaced on the instance
    (`_walk_less`): the library walks every module of the frozen base at each step.
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
        # BERT's forward takes **kwargs, so the Trainer assumes it sums its loss over `num_items_in_batch`
        # and then scales it by the world size and skips the division by accumulation steps. The
        # classification loss is a per-batch mean: without this, DDP runs train at world-size x the rate.
        self.model_accepts_loss_kwargs = False
        self.plan, self.startup, self.buckets = plan, startup, buckets
        # Rows this process trained on (logs/rank-R.json); after a resume, only the rows trained since.
        self.samples_seen = 0
        # A captured step compiles its blocks (TORCH_COMPILE) in the warm-up before each capture.
        self.compile_pending = compiled and not captured
        self.capture_pending = captured
        self.captured: CapturedStep | None = None  # CUDA_GRAPHS: the step captured per bucket, from the first step on
        self._ddp_group = None  # the process group DDP's wrapper reduces over; the captured step's all-reduce uses it
        self.class_weights = class_weights  # CLASS_WEIGHTS: each class's weight in the loss, on the device
        # Inductor's CUDA graphs (TORCHINDUCTOR_CUDAGRAPHS=1), which need to be told where a step begins.
        self.cudagraphs = compiled and cudagraphs_enabled()
        self._parameters: int | None = None  # num_parameters(exclude_embeddings=True), counted once
        self._trainable: list[torch.nn.Parameter] | None = None

    # At every step the Trainer walks the whole model, its frozen base included: model.train() sets the mode of
    # every module, floating_point_ops counts every parameter, clipping and zero_grad visit every parameter (2.2,
    # 2, 1.1 and 1.1 ms on a LoRA BERT-base, 2 CPU cores). A compiled GPU step waits on that host time; the job does
    # each once or over the trainable weights, with the same results (tests/test_host_levers.py). Off: the
    # library's own calls (benchmarks/host_levers.py compares the two).
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
        """The wrapped model's train() and zero_grad() on the trainable weights only: train() returns at once when
        the model and the module inside the wrapper already have the mode asked for (evaluation's eval() reaches
        the inner module, which then differs); zero_grad() drops the gradients only the trainable weights have."""
        walk_train, walk_zero_grad, inner = model.train, model.zero_grad, self.model
        walked = []  # the first call walks: from_pretrained returns the base's modules in eval mode under a wrapper
        # (peft's) that says training, so the wrappers' modes alone would leave the base's dropout and bitsandbytes'
        # training path off for the whole run

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
            # ZeRO-Offload steps on the CPU, where DeepSpeed takes its own CPU Adam only (a C++ op compiled once
            # with g++, no nvcc); the same groups and AdamW hyperparameters as the torch optimizer it replaces.
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            keys = ("lr", "weight_decay", "betas", "eps")
            groups = [{k: v for k, v in group.items() if k in ("params", *keys)} for group in optimizer.param_groups]
            optimizer = self.optimizer = DeepSpeedCPUAdam(
                groups, **{k: optimizer.defaults[k] for k in keys}, adamw_mode=True
            )
        return optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        # The only public place that sees each batch: callbacks get the step, not the rows (a step count
        # times the batch size would be wrong for the last, shorter batch of an epoch).
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
        """The model's own loss, or with CLASS_WEIGHTS the cross-entropy weighted by class (a per-batch weighted mean,
        as the model's loss is a per-batch mean, so the Trainer's division by the accumulation steps still holds).
        The model's forward takes no weights: the logits are scored here."""
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
        """The eager training_step's work with the forward and backward replayed: the loss divided by the
        micro-batches of this optimizer step, the gradients added into .grad, and on the last micro-batch of a step
        exchanged between the replicas (what DDP's hooks do in the eager step)."""
        model.train()
        step = self.captured
        if self.trainable_grads_detached():
            step.attach_grads()
        loss = step.run(inputs, self.current_gradient_accumulation_steps)
        if self.accelerator.sync_gradients and self._ddp_group is not None:
            step.all_reduce(self._ddp_group)
        return loss

    def trainable_grads_detached(self) -> bool:
        """Whether something set a trainable weight's .grad aside (a zero_grad(set_to_none=True) past the job's)."""
        return self.captured.trainable[0].grad is not self.captured.grads[0]

    def capture_every_bucket(self, model, inputs) -> None:
        """CUDA_GRAPHS: the step of every length bucket prepared before the first step trains, from the first batch
        padded (or cut) to each bucket, on the model the Trainer wrapped (its own forward, autocast included)."""
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
        """The fast path's graphs, one per length bucket, built before the first step trains: a forward and
        backward of the first batch padded (or cut) to each bucket, its gradients dropped, the RNG state
        restored and no gradient exchanged, so the training that follows is the eager path's. Without it each
        bucket compiled when a batch of its length first came, in the middle of the epoch (tens of seconds on
        the GPU, counted as training time).

        Each warm-up batch ends in a padded column, as a bucket's batches do: the first batch holds the longest
        rows, and cut to a shorter bucket it would have no padding at all, for which transformers drops the
        attention mask (SDPA then takes None) and the graph built would be one no real batch uses (seen on an
        H200: 5 graphs for 3 buckets, two of them compiled inside the epoch)."""
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
    """CLASS_WEIGHTS=balanced: rows / (classes x the class's rows) for each class id, from the split's labels (Arrow,
    no pass in Python), as scikit-learn's `balanced`. A class without training rows weighs nothing: no row has it."""
    counts = np.bincount(np.asarray(split.with_format("arrow")["labels"]), minlength=classes)[:classes]
    weights = np.where(counts > 0, len(split) / (classes * np.maximum(counts, 1)), 0.0)
    return torch.tensor(weights, dtype=torch.float32)


def bucket_batch(inputs: dict, length: int, pad: int) -> dict:
    """`inputs` cut or padded to `length` tokens, its last column padding, as a bucket's batches end: cut to a shorter
    bucket, the first batch's longest rows would have no padding left, a batch no real one is (in transformers,
    without padding the attention runs without a mask). Every tensor whose last dimension is the sequence (the ids,
    the 2D or 4D masks) is cut; the filler is the pad token for the ids, 0 (masked) for the rest. The labels never
    are: a multi-label batch's (rows x labels) would be taken for the sequence where the labels are as many as its
    tokens."""
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
    """The rows of every global batch drawn from SEED + epoch, the data and the global batch alone, never from
    the replica count, the global RNG or TORCH_COMPILE.

    Accelerate hands the micro-batches of this order to the ranks in turn (rank r takes micro-batches r,
    r + world size, ...), and one optimizer step consumes world size x accumulation micro-batches: exactly
    one global batch, whatever the count. So the same rows make up step k on 1, 2 or 4 replicas, and a
    resume on another count (the Trainer skips step x accumulation micro-batches on each rank) starts at
    the same row. An epoch trains floor(rows / global batch) whole global batches: the rows left over
    (fewer than one global batch) are drawn at random each epoch and wait for the next one, so every step
    averages the same number of rows, no row is trained twice in an epoch, and every micro-batch has the
    same size (one compiled graph per length bucket, no extra one for a short last batch).

    The library's sampler draws each epoch's order from the global RNG when the epoch begins; a resume
    restores the RNG only after it has drawn the resumed epoch's order (seen: another final checksum). Here
    the order comes from SEED + epoch, which `SamplerEpoch` sets (the Trainer's own `set_epoch` misses it in
    a resumed epoch under DDP, where accelerate's skip wrapper adds a level around it).
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
    """The job's sampler inside a prepared training loader (through accelerate's shard and skip wrappers)."""
    batches = getattr(train_dataloader, "batch_sampler", None)
    while hasattr(batches, "batch_sampler"):
        batches = batches.batch_sampler
    sampler = getattr(batches, "sampler", None)
    return sampler if isinstance(sampler, GlobalOrderSampler) else None


# ------------------------------------------------------------------------------- callbacks
class SamplerEpoch(TrainerCallback):
    """Sets the length-grouped sampler's epoch as the Trainer counts epochs (global step // the plan's steps per
    epoch), before the epoch's order is drawn: the same on every rank, fresh or resumed."""

    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch

    def on_epoch_begin(self, args, state, control, train_dataloader=None, **kwargs):
        if (sampler := epoch_sampler(train_dataloader)) is not None:
            sampler.set_epoch(state.global_step // self.steps_per_epoch)


def seconds_since_start() -> float:
    """Seconds since this process started: the start-up milestones of the rank log and logs/rank-R.json."""
    return time.time() - psutil.Process().create_time()


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that a clock read next includes it (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock(TrainerCallback):
    """When this process began and finished its first training step (seconds after process start: imports, data,
    model, Trainer set-up, the compile), and how long its training steps took, evaluations and checkpoints
    set aside: the steady training time an epoch is projected from. Three waits for the GPU (the first step's
    end, before and after each thing set aside, the end of training), none per step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.first_step = 0
        # Stay None when a resume finds no step left to train.
        self.seconds: float | None = None  # the first step began
        self.first_step_done_s: float | None = None
        self.compile_s: float | None = None  # the fast path's graphs, built before the first step
        self.capture_s: float | None = None  # CUDA_GRAPHS: every bucket's step warmed up and captured, before it
        self.steps = 0
        self.train_s = 0.0
        self._began: float | None = None
        self._aside = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        # After a resume, the first step is the checkpoint's next one.
        self.first_step = state.global_step

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
        """Time spent in the block (an evaluation, a checkpoint) is not training time."""
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
        """logs/rank-R.json's `timing`: the steady step time and the epoch it makes, measured past the first step."""
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
    """Saves and stops at the first step where any rank got SIGTERM or SIGINT (utils/cluster/preemption.py); makes each
    checkpoint's folder before the Trainer writes into it; marks a checkpoint complete once every rank has written
    its part (resume skips unmarked ones), then keeps the newest SAVE_TOTAL_LIMIT complete ones."""

    def __init__(self, run: RunDir, collectives: Collectives, keep: int, resume_key: dict, preemption: Preemption):
        self.run, self.collectives, self.keep, self.resume_key = run, collectives, keep, resume_key
        self.preemption = preemption

    def on_step_end(self, args, state, control, **kwargs):
        # One all-reduce of the signal number at every step end: every rank takes the same decision at the same
        # step; SIGTERM (15) wins over SIGINT (2). It goes over the gloo control group: no GPU sync.
        if signum := self.collectives.max_over_ranks(self.preemption.signum):
            self.preemption.follow(signum)
            log.warning(f"{SIGNALS.get(signum, signum)}: saving a checkpoint at step {state.global_step} and stopping")
            control.should_save = control.should_training_stop = True
            # The grace period goes to the checkpoint: the Trainer would evaluate first on an evaluation step.
            control.should_evaluate = False
        if state.global_step >= state.max_steps and not args.load_best_model_at_end:
            # (LOAD_BEST_MODEL: the last step's evaluation and checkpoint are a candidate like the others.)
            # At the last step the Trainer evaluated, then saved: an evaluation that failed there (a huge
            # PER_DEVICE_EVAL_BATCH_SIZE, out of memory) lost every step since the last checkpoint. The job's final
            # evaluation after training gives the curve its last point; a restart after a failure in it resumes at
            # the last step and only evaluates.
            control.should_evaluate = False
        if control.should_save:
            # The Trainer would follow a link planted at checkpoints/checkpoint-N, a name anyone can predict. The
            # first write of a save: a link there, or a volume full or read-only by now, stops every rank alike.
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
        """Run `save`, a part of a checkpoint's save on this rank, then agree with every rank on how it went.

        A full or read-only volume fails the save on one rank or on all: every rank then stops with the same
        `error:` line and exit 2, instead of a traceback on one and a lost peer (143, restarted into the same
        full volume) on the others. The checkpoint cut short has no COMPLETE marker; the next start discards it.
        """
        with self.collectives.agreed(), self.volume_checked(doing):
            save()

    @contextmanager
    def volume_checked(self, doing: str) -> Iterator[None]:
        """A failure because OUTPUT_DIR's volume is full or read-only becomes its one-line JobError (exit 2)."""
        try:
            yield
        except Exception as exc:
            fault = None if isinstance(exc, JobError) else volume_fault(self.run, exc, doing)
            if fault is None:
                raise
            raise fault from None


class EarlyStopping(TrainerCallback):
    """EARLY_STOPPING_PATIENCE: training stops once that many evaluations in a row have not beaten the best score
    before them (the metric the Trainer tracks as best). Counted from the run's own history (trainer_state.json's
    log_history, which a resume restores), not from a counter of its own: a restart stops where the run would have.
    Every rank evaluates the same gathered rows, so every rank stops at the same step."""

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
            log.warning(
                "early stopping at step %d: %s has not beaten %.4f (evaluation %d) in %d evaluation(s)",
                state.global_step,
                key,
                scores[best_at],
                best_at + 1,
                self.patience,
            )


class RecordedTensorBoard(TensorBoardCallback):
    """The Trainer's TensorBoard callback writing into a folder of the job's own, and recording the event file
    each of its writers creates (record.py record_written): a push sends those files, never whatever else is in
    the folder. It reopens a writer for the final evaluation: a second event file, recorded too."""

    def __init__(self, run: RunDir, folder: Path):
        super().__init__()
        self.run = run
        self.logging_dir = str(folder)
        # Set once the volume is full or read-only: the curves stop, training goes on to its next checkpoint
        # save, which every rank agrees on and which ends the job with the one error line.
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
    """At the start of training, after the Trainer prepared the model: stop unless it is wrapped as asked
    (the Trainer and Accelerate drop FSDP without a word where it cannot run: utils/training/strategy.py)."""

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
# The loss is computed here too, from the predictions and labels gathered over the whole split: the Trainer's own
# eval_loss averages each rank's batch means, and on several replicas the last, uneven batch counts the rows a
# sampler repeats to even out the ranks (two replicas: eval_loss 7.378 where the split's MSE is 7.427). A
# `loss` from compute_metrics replaces the Trainer's as it prefixes the keys (`eval_loss`), on any replica count.
def classification_metrics(num_labels: int = 2):
    """compute_metrics for the Trainer: accuracy, F1, precision, recall, Matthews correlation (the offline metric
    module; F1, precision and recall macro-averaged over more than two classes) and the row count."""
    metric = evaluate.load(METRIC_MODULES[CLASSIFICATION])

    def compute(eval_pred):
        # Score against the labels that come back with the predictions, never the dataset's order. The Trainer
        # has gathered both from every rank (and dropped the rows a sampler repeats to even out the ranks).
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
    """compute_metrics for a regression model (one score): Pearson, Spearman, MSE (the offline module) and the row count."""
    metric = evaluate.load(METRIC_MODULES[REGRESSION])

    def compute(eval_pred):
        predictions = np.asarray(eval_pred.predictions, dtype=np.float64).reshape(-1)
        references = np.asarray(eval_pred.label_ids, dtype=np.float64).reshape(-1)
        scores = metric.compute(predictions=predictions, references=references)
        return {**scores, "samples": len(references), "loss": scores["mse"]}  # the model's loss is the MSE

    return compute


def multi_label_metrics(threshold: float):
    """compute_metrics for a multi-label model: micro and macro F1 and subset accuracy of the labels whose sigmoid
    score is at least `threshold` (THRESHOLD; the offline module), the row count, and the mean binary cross-entropy
    per label, the model's loss."""
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
    """The problem a model's config says it solves, in utils/config/tasks.py's names (what its metrics are chosen by)."""
    return {"regression": REGRESSION, MULTI_LABEL: MULTI_LABEL}.get(config.problem_type, CLASSIFICATION)


# ------------------------------------------------------------------------------- building it
@dataclass(frozen=True)
class TrainerChoices:
    """The settings the Trainer and its callbacks read (Settings.select: named as the settings are); the rest is
    the plan's."""

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
    """The TrainingArguments the plan (completed with the step count: Job.with_rows) and the settings give."""
    dist, cuda, plan = job.dist, job.cuda, job.plan
    # Rank 0 reports; TensorBoard is added by build_trainer with its folder under OUTPUT_DIR.
    trackers = [name for name in choices.report_to if name not in ("tensorboard", "none")]
    options = dict(
        output_dir=str(job.out.checkpoints),
        run_name=job.plan.run_name,
        per_device_train_batch_size=plan.batch.micro_batch,
        per_device_eval_batch_size=choices.per_device_eval_batch_size,
        gradient_accumulation_steps=plan.batch.accumulation,
        # The Trainer counts the steps itself; the plan's count must match it (logs/rank-R.json shows both).
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
        # Batches of similar length: little padding (JobTrainer keeps their order reproducible).
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
        # Pinned batches copied without waiting for the previous step.
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
    """When the Trainer evaluates and checkpoints (the plan's interval, SAVE_STEPS), and which checkpoint it keeps
    (`best`, the metric tracked; the best one at the end where `load_best`)."""
    return dict(
        save_strategy="steps",
        save_steps=eval_every if load_best else save_steps,
        # Checkpoints prunes, counting complete checkpoints only.
        save_total_limit=None,
        # The validation curve; the full evaluation at the end comes after training.
        eval_strategy="steps" if eval_every else "no",
        eval_steps=eval_every or None,
        # By default no checkpoint is chosen on the split whose accuracy is reported (the last step's model is
        # saved); the task's metric is tracked (trainer_state.json's best_metric) for the validation curve. With
        # LOAD_BEST_MODEL the Trainer loads the best checkpoint at the end: chosen on the validation split, which
        # the card says.
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
    """The job's Trainer over `data` ("train" and "validation"), its callbacks given what they act on.

    `key`: what each complete checkpoint records (the run's identity, its segments); by default the plan's identity.
    `group`: the process group from the rendezvous; a single process may leave it out.
    """
    dist, out = job.dist, job.out
    if group is None and dist.is_distributed:
        raise ValueError(
            "a distributed job passes build_trainer the Collectives of utils.cluster.collectives.rendezvous"
        )
    group = group or Collectives(dist, choices.rendezvous_timeout)
    args = training_arguments(job, model, choices)
    startup = StepClock(args.device)
    callbacks: list[TrainerCallback] = [
        StrategyCheck(job.strategy),
        startup,
        SamplerEpoch(job.plan.steps_per_epoch),
        Checkpoints(out, group, choices.save_total_limit, key or {"identity": job.plan.identity}, job.preemption),
    ]
    if choices.early_stopping_patience is not None:
        callbacks.append(EarlyStopping(choices.early_stopping_patience))
    if dist.is_main and "tensorboard" in choices.report_to:
        callbacks.append(RecordedTensorBoard(out, out.tensorboard / job.plan.run_name))
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
    # `validation` alone, or several (MNLI's matched and mismatched), whose metrics the Trainer prefixes with the name.
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


def bucket_collator(tokenizer, data, max_length: int, mask_4d: bool) -> tuple[list[int], partial]:
    """The length buckets and the collator padding each batch to its bucket.

    Every path pads to the same length buckets: the same rows and the same padded shapes (so the same dropout
    masks) compiled or eager; a bucket is a static shape for the compiled graphs, and a multiple of 8.
    Evaluation batches use the same collator: the longest row of any split.
    """
    longest = max(pyarrow.compute.max(token_counts(split)).as_py() for split in data.values())
    buckets = length_buckets(max_length, longest)
    collators = {n: DataCollatorWithPadding(tokenizer, padding="max_length", max_length=n) for n in buckets}
    return buckets, partial(pad_to_bucket, collators, mask_4d=mask_4d)


def loss_class_weights(asked: str, label_column: str, problem: str, train, config) -> torch.Tensor | None:
    """CLASS_WEIGHTS: each class's weight in the loss (balanced: inverse to its share of the train rows), or None."""
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
    """The padded lengths of every batch: 16, 32, 64 ... up to the data's longest row (rounded up to a multiple of
    8) or MAX_SEQ_LENGTH, whichever is less; one compiled graph each on the fast path."""
    top = min(max_length, -(-longest // 8) * 8)
    buckets = [min(SMALLEST_BUCKET, top)]
    while buckets[-1] < top:
        buckets.append(min(2 * buckets[-1], top))
    return buckets


def token_counts(split: datasets.Dataset) -> pyarrow.Array:
    """Each row's token count, from Arrow (no pass over the rows in Python)."""
    return pyarrow.compute.list_value_length(split.with_format("arrow")["input_ids"])


def use_tf32_matmuls() -> None:
    """TF32 for the fp32 matmuls (Ampere and newer), set through torch's legacy API only. Once the new one
    (`torch.backends.fp32_precision`, which TrainingArguments(tf32=True) sets) has been used too, the legacy getters
    raise, and inductor's autotuning and cache keys call them: every compiled graph would fail to build."""
    if torch.cuda.get_device_capability()[0] >= 8:
        torch.set_float32_matmul_precision("high")


def pad_to_bucket(collators: dict[int, DataCollatorWithPadding], features: list[dict], mask_4d: bool = False) -> dict:
    """A batch padded to the smallest bucket (`collators`, smallest first) that holds its longest row: static
    shapes, a graph per bucket. `mask_4d`: its attention mask as the 4D mask the model takes as it is
    (utils/training/step_capture.four_d_mask: no host read of the mask at each forward), made here, beside the GPU step."""
    longest = max(len(row["input_ids"]) for row in features)
    bucket = next((length for length in collators if length >= longest), max(collators))
    batch = collators[bucket](features)
    if mask_4d and "attention_mask" in batch:
        batch["attention_mask"] = four_d_mask(batch["attention_mask"])
    return batch


def store_frozen_linears_in_bf16(model) -> None:
    """The frozen linear layers stored in bf16 once, instead of cast by autocast at every forward (casts of
    weights that take no gradient are not cached: about 420 copies a step of bert-base). Autocast casts to
    the same bf16 values, so the steps compute the same numbers. The trained weights (adapters, classifier,
    pooler) and every LayerNorm and embedding stay fp32."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not any(p.requires_grad for p in module.parameters()):
            module.to(torch.bfloat16)


def compile_model(model, job: Job) -> None:
    """TORCH_COMPILE: each transformer block compiled in place, one static graph per length bucket, shared by the
    blocks (regional compilation: the blocks run the same code, so one block's graph serves all twelve, about a
    tenth of compiling the whole model). The embeddings, pooler and head stay eager: a few kernels.

    Not the Trainer's `torch_compile`: it compiles with dynamic shapes allowed, over the DDP wrapper (its graphs
    split at every gradient bucket), and for evaluation too. In place (`Module.compile`), the weights keep their
    names: checkpoints and the saved adapter are the eager path's.
    """
    import torch._inductor.config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from torch._inductor.utils import clear_caches

    # Dropout masks from torch's generator, as the eager path draws them: the same seed trains the same model.
    torch._inductor.config.fallback_random = True
    # Compiled code kept on the shared volume: a restart or another replica does not compile from zero. Unless
    # TORCHINDUCTOR_CACHE_DIR names another place: inductor writes its /tmp default there once it is asked.
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(job.out.cache / "inductor")
        clear_caches()
    base = model.get_base_model()
    # The first block's input (the frozen embeddings' output) would take no gradient and the others' would: two
    # graphs per bucket. Marked as taking one, every block runs the same graph (one more input gradient, on a GPU
    # a few microseconds against a second compile of every bucket).
    base.enable_input_require_grads()
    for block in repeated_blocks(base):
        block.compile(dynamic=False)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's stack of identical transformer blocks (the longest ModuleList of one class: BERT's
    `encoder.layer`, DistilBERT's `transformer.layer`, ModernBERT's `layers`); the whole model if it has none."""
    stacks = [
        list(modules)
        for modules in model.modules()
        if isinstance(modules, torch.nn.ModuleList) and len(modules) > 1 and len({type(m) for m in modules}) == 1
    ]
    return max(stacks, key=len) if stacks else [model]


def cudagraphs_enabled() -> bool:
    """Whether inductor wraps its graphs in CUDA graphs, from its own config (TORCHINDUCTOR_CUDAGRAPHS)."""
    import torch._inductor.config

    return bool(torch._inductor.config.triton.cudagraphs)


def compile_record() -> dict:
    """What the compiler did in this process (logs/rank-R.json): graphs, recompiles, graph breaks, seconds, and
    whether inductor captured CUDA graphs (its own switch, read back: an environment variable it does not know
    switches nothing on)."""
    from torch._dynamo.utils import calculate_time_spent, counters

    spent = calculate_time_spent()
    frames = counters["frames"]["total"]
    return {
        "graphs": counters["stats"]["unique_graphs"],
        # Every compile of the blocks' frame after its first: one per new shape.
        "recompiles": max(frames - 1, 0),
        "graph_breaks": sum(counters["graph_break"].values()),
        "compile_s": round(spent.get("total_wall_time", 0), 2),  # forward and backward graphs
        "cudagraphs": cudagraphs_enabled(),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],  # graphs run without CUDA graphs, where asked
    }

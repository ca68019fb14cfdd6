"""The plan: every value a run derives from its settings, computed here once and only read elsewhere.

`build_plan` (every rank, no torch) resolves the batches, the learning rates, the strategy and the steps MAX_STEPS
sets; `with_device` (Job.start) and `with_rows` (utils/run.set_up) complete what the hardware and the data tell.
`--dry-run` prints it, run.json records it completed; the Trainer's arguments, the DeepSpeed config, the logs and
the model card read it.

The global batch follows one of three rules (`plan_batches`; docs/launchers.md, "The global batch"): GLOBAL_BATCH_SIZE
on any replica count (a count that cannot share it is refused); by default 64 on any count (one that cannot share
64 trains its multiple nearest 64, with a warning); PER_DEVICE_BATCH_SIZE x world size x accumulation when
either is set. Under the first two a replica computes its share in micro-batches of at most PER_DEVICE_BATCH_SIZE.

The learning rate follows the global batch, tuned at 64 (docs/quality.md: `sqrt` overshot on 4 replicas):

    learning_rate = BASE_LEARNING_RATE x (global batch / 64) ** 0.25     (LEARNING_RATE_SCALING=fourth-root)
    loraplus_lr_ratio = 8 x min(1, (64 / global batch) ** 0.5), never below 1

Values set by hand are used exactly; a resolved rate must pass LEARNING_RATE's own bounds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from utils.common.errors import BadInput
from utils.config.identity import run_identity, run_name, with_numerics
from utils.config.settings import (
    DEFAULT_GLOBAL_BATCH,
    MAX_GLOBAL_BATCH,
    Settings,
    resolve_base_model_id,
    runs_under,
)

REFERENCE_GLOBAL_BATCH = DEFAULT_GLOBAL_BATCH  # one replica with the defaults: where BASE_LEARNING_RATE was measured
REFERENCE_LORAPLUS_RATIO = 8.0  # the LoRA+ ratio measured best at the reference batch (docs/quality.md)

# A validation curve with a handful of points; SST-2's 872 rows take seconds on a GPU.
EVALUATIONS_PER_EPOCH = 4


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # rows per optimizer step, over all replicas
    micro_batch: int  # rows per forward/backward on one replica
    accumulation: int  # micro-batches per optimizer step on one replica
    world_size: int
    fixed: bool  # the same global batch on any replica count (GLOBAL_BATCH_SIZE, or the default)
    source: str  # where the global batch came from, in the settings' names: what --dry-run and the card say


@dataclass(frozen=True)
class Plan:
    batch: BatchPlan
    learning_rate: float  # the base rate: LoRA's A matrices and what is neither head nor B
    learning_rate_source: str  # where the rate came from, in the settings' names
    loraplus_ratio: float  # B at this x the rate
    head_ratio: float  # the head at this x the rate
    max_steps: int | None  # MAX_STEPS, else the epochs decide
    num_epochs: float
    strategy: str
    zero_stage: int | None  # DeepSpeed only
    zero_offload: str | None
    precision: str  # fp32, bf16 or fp16; `auto` until the device is known
    quantization: str  # 8bit or none; `auto` until the device is known
    steps: int | None  # optimizer steps: MAX_STEPS, else known once the rows are
    warmup_steps: int | None
    steps_per_epoch: int | None = None  # known once the rows are
    eval_every: int | None = None  # optimizer steps between evaluations (0: none during training); known with the rows
    identity: dict[str, Any] | None = None  # what makes two starts one run (utils/config/identity.py)
    run_name: str | None = None  # RUN_NAME, else derived from the identity
    base_model_id: str | None = None  # the Hub id the adapter and card name as the base (resolve_base_model_id)
    # The config handed to the Trainer, "auto" where it fills in the values above (deepspeed_config.with_deepspeed).
    deepspeed: dict[str, Any] | None = None
    # TORCH_COMPILE and CUDA_GRAPHS, speed switches only; `auto` until the device is known.
    compile: bool | str = "auto"
    capture: bool | str = "auto"

    @property
    def rates(self) -> dict[str, float]:
        """The learning rate of each optimizer group (recipe.optimizer_groups)."""
        rate = self.learning_rate
        return {"base": rate, "head": rate * self.head_ratio, "lora_B": rate * self.loraplus_ratio}

    def as_dict(self) -> dict:
        """What --dry-run prints and run.json records (the DeepSpeed config has a key of its own)."""
        shown = asdict(self)
        del shown["deepspeed"], shown["identity"]
        return {**shown, "rates": self.rates}


def largest_micro_batch(share: int, cap: int) -> int:
    """The largest micro-batch of at most `cap` rows that divides a replica's `share`: every micro-batch full, so
    each optimizer step averages the same rows with the same weights on any count."""
    divisors = (d for small in range(1, math.isqrt(share) + 1) if share % small == 0 for d in (small, share // small))
    return max(d for d in divisors if d <= cap)


def splits_well(global_batch: int, world_sizes: list[int], cap: int) -> bool:
    """Every count divides `global_batch`, and none computes its share in micro-batches under half of what the
    cap (or the share, when smaller) allows."""
    shares = [global_batch // world for world in world_sizes if global_batch % world == 0]
    return len(shares) == len(world_sizes) and all(2 * largest_micro_batch(s, cap) >= min(s, cap) for s in shares)


def nearby_global_batches(global_batch: int, world_sizes: list[int], cap: int) -> str:
    """The nearest global batches below and above `global_batch` that every count in `world_sizes` shares in
    well-filled micro-batches (`splits_well`), as "992 or 999": the suggestion instead of one that is not."""
    step = math.lcm(*world_sizes)
    if step > 4 * global_batch:
        return str(step)  # the smallest batch every count shares is far from the one asked for: no search around it
    start = global_batch // step * step
    # A suggestion, not a search: 100 steps from the value asked for, a batch helps no one.
    below, above = range(start, max(start - 101 * step, 0), -step), range(start + step, start + 102 * step, step)
    found = [next((size for size in sizes if splits_well(size, world_sizes, cap)), 0) for sizes in (below, above)]
    return " or ".join(str(size) for size in found if size and size != global_batch) or str(step)


def plan_batches(
    world_size: int,
    global_batch_size: int | None,
    per_device_batch_size: int,
    gradient_accumulation_steps: int,
    follows_replicas: bool,
) -> BatchPlan:
    """The batches of `world_size` replicas under the rule `follows_replicas` (Settings.batch_follows_replicas)
    names; a replica count that cannot divide GLOBAL_BATCH_SIZE is bad input."""
    if follows_replicas:
        micro, accumulation = per_device_batch_size, gradient_accumulation_steps
        source = (
            f"PER_DEVICE_BATCH_SIZE={micro} x {world_size} replica(s) x GRADIENT_ACCUMULATION_STEPS={accumulation}: "
            "the global batch follows the replica count"
        )
        return BatchPlan(micro * world_size * accumulation, micro, accumulation, world_size, False, source)
    total, source = fixed_global_batch(world_size, global_batch_size, per_device_batch_size)
    share = total // world_size
    micro = largest_micro_batch(share, per_device_batch_size)
    return BatchPlan(total, micro, share // micro, world_size, fixed=True, source=source)


def fixed_global_batch(world_size: int, global_batch_size: int | None, per_device_batch_size: int) -> tuple[int, str]:
    """The global batch `world_size` replicas train when it does not follow the count, and why."""
    total = global_batch_size
    if total is not None:
        if total % world_size:
            counts = ", ".join(str(n) for n in range(1, total + 1) if total % n == 0)
            sizes = nearby_global_batches(total, [world_size], per_device_batch_size)
            raise BadInput(
                f"GLOBAL_BATCH_SIZE={total} cannot be shared by {world_size} replicas; run on one of {counts} "
                f"replica(s), or set a GLOBAL_BATCH_SIZE that {world_size} divides, e.g. {sizes}",
            )
        return total, f"GLOBAL_BATCH_SIZE={total}, on any replica count"
    if DEFAULT_GLOBAL_BATCH % world_size == 0:
        return DEFAULT_GLOBAL_BATCH, (
            f"the default, {DEFAULT_GLOBAL_BATCH} (one GPU's batch) on any replica count that divides it "
            "(GLOBAL_BATCH_SIZE, PER_DEVICE_BATCH_SIZE and GRADIENT_ACCUMULATION_STEPS unset)"
        )
    nearest = max(world_size, round(DEFAULT_GLOBAL_BATCH / world_size) * world_size)
    return nearest, (
        f"the default {DEFAULT_GLOBAL_BATCH} made {nearest}, the nearest multiple of {world_size} replicas, which "
        f"cannot share {DEFAULT_GLOBAL_BATCH} rows equally (set GLOBAL_BATCH_SIZE to choose the batch)"
    )


def batch_warning(plan: BatchPlan, global_batch_size: int | None, per_device_batch_size: int) -> str | None:
    """A warning for the default global batch rounded for this count (a little another model than one GPU's), or
    for micro-batches far smaller than PER_DEVICE_BATCH_SIZE allows (997, a prime, on one replica: micro-batches of
    1): the same model, many times slower."""
    if plan.fixed and global_batch_size is None and plan.global_batch != DEFAULT_GLOBAL_BATCH:
        return (
            f"the global batch is {plan.global_batch} rows, not the default {DEFAULT_GLOBAL_BATCH}: {plan.world_size} "
            f"replicas cannot share {DEFAULT_GLOBAL_BATCH} rows equally, so this run differs a little from one GPU's "
            f"(its learning rate follows {plan.global_batch}); run on 1, 2, 4 or 8 replicas for the default, or set "
            f"GLOBAL_BATCH_SIZE (e.g. {plan.global_batch}) to make the choice yours"
        )
    if not plan.fixed or splits_well(plan.global_batch, [plan.world_size], per_device_batch_size):
        return None
    share = plan.global_batch // plan.world_size
    better = nearby_global_batches(plan.global_batch, [plan.world_size], per_device_batch_size)
    return (
        f"GLOBAL_BATCH_SIZE={plan.global_batch} on {plan.world_size} replica(s) is {share} rows a replica, which only "
        f"micro-batches of {plan.micro_batch} divide under PER_DEVICE_BATCH_SIZE={per_device_batch_size} "
        f"({plan.accumulation} forward passes a step); the model is the same but the run is slower: "
        f"GLOBAL_BATCH_SIZE={better} would keep micro-batches of at least half PER_DEVICE_BATCH_SIZE"
    )


def check_elastic_range(settings: Settings, counts: range, variable: str) -> None:
    """Refuse (exit 2) an elastic range of replica counts (`variable` as the launcher set it) the global batch
    cannot follow: a count reached after a loss would be refused on every restart, ending the job there."""
    if len(counts) < 2:
        return
    cap = settings.per_device_batch_size
    if settings.batch_follows_replicas:
        sizes = nearby_global_batches(cap * counts[-1] * settings.gradient_accumulation_steps, list(counts), cap)
        raise BadInput(
            f"{variable} lets the job go on with {counts[0]} to {counts[-1]} replicas, but with PER_DEVICE_BATCH_SIZE or "
            "GRADIENT_ACCUMULATION_STEPS set and no GLOBAL_BATCH_SIZE the global batch follows the replica count, so a "
            f"restart on another count after a loss is refused; set GLOBAL_BATCH_SIZE to a multiple of every count, "
            f"e.g. {sizes}",
        )
    total = settings.global_batch_size or DEFAULT_GLOBAL_BATCH
    named = f"GLOBAL_BATCH_SIZE={total}" if settings.global_batch_size else f"the default global batch ({total})"
    refused = [world for world in counts if total % world]
    if refused:
        sizes = nearby_global_batches(total, list(counts), cap)
        raise BadInput(
            f"{named} cannot be shared by {', '.join(map(str, refused))} replica(s), a count {variable} "
            "lets the job go on with after a loss (every restart there would be refused); set GLOBAL_BATCH_SIZE to a "
            f"multiple of every count from {counts[0]} to {counts[-1]}, e.g. {sizes}, or narrow the range",
        )


# ------------------------------------------------------------------------------- the learning rate
def scaled_learning_rate(base_learning_rate: float, global_batch: int, rule: str) -> float:
    """BASE_LEARNING_RATE at the reference batch, scaled to `global_batch` by `rule` (LEARNING_RATE_SCALING)."""
    ratio = global_batch / REFERENCE_GLOBAL_BATCH
    factor = {"fourth-root": ratio**0.25, "sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[rule]
    return float(f"{base_learning_rate * factor:.6g}")  # a readable number in logs, run.json and the card


def resolve_learning_rate(
    batch: BatchPlan, learning_rate: float | None, base_learning_rate: float, learning_rate_scaling: str
) -> float:
    """LEARNING_RATE exactly when set, else the scaling rule's rate, held to LEARNING_RATE's bounds."""
    if learning_rate is not None:
        return learning_rate
    global_batch = batch.global_batch
    rate = scaled_learning_rate(base_learning_rate, global_batch, learning_rate_scaling)
    refusal = _learning_rate_refusal(rate)
    if refusal:
        rules = ", ".join(
            f"LEARNING_RATE_SCALING={rule} gives {value:g}"
            for rule in ("fourth-root", "none")
            if rule != learning_rate_scaling
            and not _learning_rate_refusal(value := scaled_learning_rate(base_learning_rate, global_batch, rule))
        )
        raise BadInput(
            f"LEARNING_RATE_SCALING={learning_rate_scaling} resolves the learning rate to {rate:g} at global batch "
            f"{global_batch} ({batch.source}; BASE_LEARNING_RATE "
            f"{base_learning_rate:g} at batch {REFERENCE_GLOBAL_BATCH}), which LEARNING_RATE's own check refuses "
            f"({refusal}); set LEARNING_RATE to the rate to train at, or another rule ({rules})",
        )
    return rate


def resolve_loraplus_ratio(loraplus_lr_ratio: float | None, global_batch: int) -> float:
    if loraplus_lr_ratio is not None:
        return loraplus_lr_ratio
    shrink = min(1.0, (REFERENCE_GLOBAL_BATCH / global_batch) ** 0.5)
    return max(1.0, float(f"{REFERENCE_LORAPLUS_RATIO * shrink:.6g}"))


def _learning_rate_refusal(rate: float) -> str | None:
    """Why LEARNING_RATE would refuse `rate` (None: it takes it): the field's own bounds, so a resolved rate and
    one typed by hand are held to the same."""
    try:
        TypeAdapter(Annotated[(float, *Settings.model_fields["learning_rate"].metadata)]).validate_python(rate)
    except ValidationError as exc:
        return exc.errors()[0]["msg"].lower()
    return None


def warmup_steps(warmup_ratio: float, total_steps: int) -> int:
    """WARMUP_RATIO of `total_steps` rounded up, as the Trainer counts them, but never all: a linear warm-up trains
    its first step at rate 0, so a 1-step run whose only step is warm-up would change no weight."""
    return max(0, min(math.ceil(total_steps * warmup_ratio), total_steps - 1))


# ------------------------------------------------------------------------------- building and completing the plan
def build_plan(settings: Settings, world_size: int, deepspeed_file: dict[str, Any] | None = None) -> Plan:
    """The plan for `world_size` replicas, from the settings alone (no torch); bad input raises JobError.
    `deepspeed_file`: DEEPSPEED_CONFIG as the settings' load read it (DeepSpeedChoices.file), for the identity."""
    batch = plan_batches(
        world_size,
        settings.global_batch_size,
        settings.per_device_batch_size,
        settings.gradient_accumulation_steps,
        settings.batch_follows_replicas,
    )
    # Each factor has its range, but their product (x the replica count) is held to GLOBAL_BATCH_SIZE's own bound.
    if batch.global_batch > MAX_GLOBAL_BATCH:
        raise BadInput(
            f"the global batch is {batch.global_batch} rows ({batch.source}), above the "
            f"{MAX_GLOBAL_BATCH} a global batch may be (GLOBAL_BATCH_SIZE's range, 1 to {MAX_GLOBAL_BATCH}); lower "
            "PER_DEVICE_BATCH_SIZE or GRADIENT_ACCUMULATION_STEPS, or set GLOBAL_BATCH_SIZE",
        )
    rate = resolve_learning_rate(
        batch, settings.learning_rate, settings.base_learning_rate, settings.learning_rate_scaling
    )
    deepspeed = runs_under(settings.strategy, "a DeepSpeed config")
    plan = Plan(
        batch=batch,
        learning_rate=rate,
        learning_rate_source="LEARNING_RATE as set"
        if settings.learning_rate is not None
        else f"BASE_LEARNING_RATE {settings.base_learning_rate:g} x {settings.learning_rate_scaling} scaling from batch {REFERENCE_GLOBAL_BATCH}",
        loraplus_ratio=resolve_loraplus_ratio(settings.loraplus_lr_ratio, batch.global_batch),
        head_ratio=settings.head_learning_rate_ratio,
        max_steps=settings.max_steps,
        num_epochs=settings.num_epochs,
        strategy=settings.strategy,
        zero_stage=settings.zero_stage if deepspeed else None,
        zero_offload=settings.zero_offload if deepspeed else None,
        precision=settings.precision,
        quantization=settings.quantization,
        steps=settings.max_steps,
        warmup_steps=warmup_steps(settings.warmup_ratio, settings.max_steps) if settings.max_steps else None,
        compile=settings.torch_compile,
        capture=settings.cuda_graphs,
        base_model_id=resolve_base_model_id(settings.base_model_id, settings.model_name),
    )
    # A fixed global batch where one global order of the rows continues on any replica count (RUNS_UNDER).
    elastic = batch.fixed and runs_under(settings.strategy, "another replica count")
    identity = run_identity(settings, batch.global_batch, world_size, elastic, plan.rates, deepspeed_file)
    name = settings.run_name or run_name(identity, settings.model_name, settings.local_data, settings.dataset_config)
    return replace(plan, identity=identity, run_name=name)


def with_device(plan: Plan, cuda: bool, bf16_supported: bool, gradient_checkpointing: bool) -> Plan:
    """The plan with its `auto` precision, quantization, compile and capture resolved for this hardware;
    impossible asks are bad input."""
    # auto: 8-bit only where quantized weights run (an explicit 8bit is refused elsewhere).
    quantize = plan.quantization in ("8bit", "4bit") or (
        plan.quantization == "auto"
        and cuda
        and plan.batch.world_size == 1
        and runs_under(plan.strategy, "quantized weights")
    )
    precision = plan.precision
    if precision == "auto":
        precision = "bf16" if cuda and bf16_supported else "fp32"
    if precision == "fp16" and not cuda:
        raise BadInput("PRECISION=fp16 needs a CUDA GPU; use PRECISION=auto or fp32 on the CPU")
    if precision == "bf16" and cuda and not bf16_supported:
        raise BadInput("PRECISION=bf16 but this GPU has no bf16; use PRECISION=fp16 or auto")
    quantization = (plan.quantization if plan.quantization != "auto" else "8bit") if quantize else "none"
    # auto: the captured step on CUDA wherever it can run (DDP, no recomputed forwards, no fp16 loss scaler, which
    # skips steps on the host's word). On the CPU a step is arithmetic, not launches: nothing to gain. 4-bit weights
    # stay eager: their capture has not run on a GPU here.
    capture = plan.capture is True or (
        plan.capture == "auto"
        and cuda
        and runs_under(plan.strategy, "captured step")
        and not gradient_checkpointing
        and precision != "fp16"
        and quantization != "4bit"
    )
    # auto: compiled blocks on CUDA under DDP with full-precision weights, where the step is not captured: a captured
    # step replays eager kernels, a cold start without minutes of compiling (on the CPU compiling takes minutes for
    # no gain; bitsandbytes' int8 matmul breaks the graphs: 195 ms a step compiled against 112 eager on an H200).
    compiled = plan.compile is True or (
        plan.compile == "auto"
        and cuda
        and runs_under(plan.strategy, "compiled blocks")
        and not quantize
        and not capture
    )
    return replace(
        plan,
        precision=precision,
        quantization=quantization,
        compile=compiled,
        capture=capture,
        identity=with_numerics(plan.identity, precision, quantization) if plan.identity is not None else None,
    )


def with_rows(
    plan: Plan, train_rows: int, gradient_accumulation_steps: int, eval_steps: int | None, warmup_ratio: float
) -> Plan:
    """The plan with the optimizer steps the Trainer will count over `train_rows` rows, and the warm-up. A global
    batch larger than the split is bad input; every rank holds the same rows, so all decide alike without a collective."""
    batch = plan.batch
    if batch.global_batch > train_rows:
        fitting = train_rows // (batch.world_size * gradient_accumulation_steps)
        fewer = ", run fewer replicas" if batch.world_size > 1 else ""  # one process has none to spare
        if batch.fixed and fitting >= 1:
            fix = f"set GLOBAL_BATCH_SIZE to {fitting * batch.world_size} or less, or train on more data"
        elif batch.fixed:
            fix = "run fewer replicas (even 1 row per replica is too many), or train on more data"
        elif fitting >= 1:
            fix = f"set PER_DEVICE_BATCH_SIZE to {fitting} or less, lower GRADIENT_ACCUMULATION_STEPS{fewer}, or train on more data"
        else:
            fix = (
                f"lower GRADIENT_ACCUMULATION_STEPS{fewer} (even 1 row per device is too many), or train on more data"
            )
        raise BadInput(
            f"the global batch is {batch.global_batch} rows ({batch.source}) but the "
            f"training split has only {train_rows}: a step would take more rows than there are; {fix}",
        )
    per_epoch = max(train_rows // batch.global_batch, 1)  # whole global batches only (GlobalOrderSampler)
    steps = plan.max_steps or math.ceil(plan.num_epochs * per_epoch)
    # EVAL_STEPS, else EVALUATIONS_PER_EPOCH an epoch (or a MAX_STEPS run, if shorter).
    evaluated = min(per_epoch, plan.max_steps or per_epoch)
    eval_every = max(1, evaluated // EVALUATIONS_PER_EPOCH) if eval_steps is None else eval_steps
    return replace(
        plan,
        steps_per_epoch=per_epoch,
        steps=steps,
        warmup_steps=warmup_steps(warmup_ratio, steps),
        eval_every=eval_every,
    )

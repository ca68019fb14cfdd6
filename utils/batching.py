"""The batch plan: the global batch a run trains with, and how this job's replicas compute it.

Two ways to size a run's batches:

- GLOBAL_BATCH_SIZE unset (the default): the global batch follows the job's shape,
  PER_DEVICE_BATCH_SIZE x world size x GRADIENT_ACCUMULATION_STEPS, so another replica count is
  another run (a restart on another count is refused).
- GLOBAL_BATCH_SIZE set: the global batch is a hyperparameter and the replica count a deployment
  detail. Each optimizer step averages the same GLOBAL_BATCH_SIZE rows whatever the count; a replica
  computes its share (global batch / world size) in micro-batches of at most PER_DEVICE_BATCH_SIZE rows,
  accumulating as many as it takes. Together with one global order of the rows (utils/trainer.py's
  GlobalOrderSampler) 1, 2 and 4 replicas train the same model up to floating-point summation order,
  and a run can resume on any count that divides the global batch. PER_DEVICE_BATCH_SIZE is then a
  memory cap, not a training setting: a restart may lower it (the rows and their averaging stay the same).

An elastic launcher (a PyTorchJob's elasticPolicy: PET_NNODES=2:4) lets the job go on with any count in its
range: every one of them must be able to share the global batch, or the job dies after the loss it was made
to survive. `check_elastic_range` refuses such a start at once, on whatever count it begins.

Plain arithmetic, no torch: `--dry-run` shows the plan for the launcher's world size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from utils.errors import EXIT_BAD_INPUT, JobError
from utils.settings import Settings


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # rows per optimizer step, over all replicas
    micro_batch: int  # rows per forward/backward on one replica
    accumulation: int  # micro-batches per optimizer step on one replica
    world_size: int
    fixed: bool  # GLOBAL_BATCH_SIZE set: the same global batch on any replica count

    def as_dict(self) -> dict:
        return asdict(self)


def replica_counts(global_batch: int) -> list[int]:
    """The replica counts that can share `global_batch` rows evenly."""
    return [n for n in range(1, global_batch + 1) if global_batch % n == 0]


def largest_micro_batch(share: int, cap: int) -> int:
    """The largest micro-batch of at most `cap` rows that divides a replica's `share`: every micro-batch is
    full, so each optimizer step averages exactly the same rows with the same weights on any count."""
    divisors = (d for small in range(1, math.isqrt(share) + 1) if share % small == 0 for d in (small, share // small))
    return max(d for d in divisors if d <= cap)


def splits_well(global_batch: int, world_sizes: list[int], cap: int) -> bool:
    """Every count divides `global_batch`, and none computes its share in micro-batches under half of what the
    cap (or the share, when smaller) allows."""
    for world in world_sizes:
        if global_batch % world:
            return False
        share = global_batch // world
        if 2 * largest_micro_batch(share, cap) < min(share, cap):
            return False
    return True


def nearby_global_batches(global_batch: int, world_sizes: list[int], cap: int) -> list[int]:
    """The nearest global batch below and above `global_batch` that every count in `world_sizes` shares in
    well-filled micro-batches (`splits_well`): what to suggest instead of one that is not."""
    step = math.lcm(*world_sizes)
    if step > 4 * global_batch:
        return [step]  # the smallest batch every count shares is far from the one asked for: no search around it
    found = []
    for direction in (-1, 1):
        candidate = (global_batch // step + (direction > 0)) * step
        for _ in range(100):  # a suggestion, not a search: far from the value asked for it helps no one
            if candidate <= 0 or splits_well(candidate, world_sizes, cap):
                break
            candidate += direction * step
        if candidate > 0 and candidate != global_batch and splits_well(candidate, world_sizes, cap):
            found.append(candidate)
    return found or [step]


def suggested(sizes: list[int]) -> str:
    return " or ".join(map(str, sizes))


def plan_batches(settings: Settings, world_size: int) -> BatchPlan:
    """The plan for `world_size` replicas; a replica count that cannot divide GLOBAL_BATCH_SIZE is bad input."""
    if settings.global_batch_size is None:
        return BatchPlan(
            global_batch=settings.per_device_batch_size * world_size * settings.gradient_accumulation_steps,
            micro_batch=settings.per_device_batch_size,
            accumulation=settings.gradient_accumulation_steps,
            world_size=world_size,
            fixed=False,
        )
    total = settings.global_batch_size
    if total % world_size:
        counts = ", ".join(map(str, replica_counts(total)))
        raise JobError(
            EXIT_BAD_INPUT,
            f"GLOBAL_BATCH_SIZE={total} cannot be shared by {world_size} replicas; run on one of {counts} "
            f"replica(s), or set a GLOBAL_BATCH_SIZE that {world_size} divides",
        )
    share = total // world_size
    micro = largest_micro_batch(share, settings.per_device_batch_size)
    return BatchPlan(
        global_batch=total, micro_batch=micro, accumulation=share // micro, world_size=world_size, fixed=True
    )


def micro_batch_warning(settings: Settings, plan: BatchPlan) -> str | None:
    """A warning when GLOBAL_BATCH_SIZE leaves this count far smaller micro-batches than PER_DEVICE_BATCH_SIZE
    allows (997, a prime, on one replica: 997 micro-batches of 1 a step): the same model, many times slower."""
    if not plan.fixed:
        return None
    share = plan.global_batch // plan.world_size
    if 2 * plan.micro_batch >= min(share, settings.per_device_batch_size):
        return None
    better = nearby_global_batches(plan.global_batch, [plan.world_size], settings.per_device_batch_size)
    return (
        f"GLOBAL_BATCH_SIZE={plan.global_batch} on {plan.world_size} replica(s) is {share} rows a replica, which only "
        f"micro-batches of {plan.micro_batch} divide under PER_DEVICE_BATCH_SIZE={settings.per_device_batch_size} "
        f"({plan.accumulation} forward passes a step); the model is the same but the run is slower: "
        f"GLOBAL_BATCH_SIZE={suggested(better)} would keep micro-batches of at least half PER_DEVICE_BATCH_SIZE"
    )


def check_elastic_range(settings: Settings, counts: range, variable: str) -> None:
    """Refuse (exit 2) an elastic range of replica counts (`variable` as the launcher set it) the global batch
    cannot follow: one of them reached after a loss would be refused on every restart, and the job would end
    there instead of going on."""
    if len(counts) < 2:
        return
    cap = settings.per_device_batch_size
    if settings.global_batch_size is None:
        sizes = nearby_global_batches(cap * counts[-1] * settings.gradient_accumulation_steps, list(counts), cap)
        raise JobError(
            EXIT_BAD_INPUT,
            f"{variable} lets the job go on with {counts[0]} to {counts[-1]} replicas, but without GLOBAL_BATCH_SIZE the "
            f"global batch follows the replica count, so a restart on another count after a loss is refused; "
            f"set GLOBAL_BATCH_SIZE to a multiple of every count, e.g. {suggested(sizes)}",
        )
    total = settings.global_batch_size
    refused = [world for world in counts if total % world]
    if refused:
        sizes = nearby_global_batches(total, list(counts), cap)
        raise JobError(
            EXIT_BAD_INPUT,
            f"GLOBAL_BATCH_SIZE={total} cannot be shared by {', '.join(map(str, refused))} replica(s), a count {variable} "
            "lets the job go on with after a loss (every restart there would be refused); set GLOBAL_BATCH_SIZE to a "
            f"multiple of every count from {counts[0]} to {counts[-1]}, e.g. {suggested(sizes)}, or narrow the range",
        )


def replica_count_change(record: dict, settings: Settings, world_size: int) -> str | None:
    """Why a run folder's run.json holds other training settings, when the cause is the replica count: without
    GLOBAL_BATCH_SIZE the global batch follows the count, and the learning rate the global batch (None: the
    count is not the cause)."""
    segments = record.get("segments") or [{}]
    theirs = segments[-1].get("world_size") if isinstance(segments[-1], dict) else None
    if settings.global_batch_size is not None or not isinstance(theirs, int) or theirs == world_size:
        return None
    ours = plan_batches(settings, world_size).global_batch
    if record.get("global_batch") == ours:
        return None
    return (
        f"its run was trained on {theirs} replica(s) at global batch {record.get('global_batch')} and this start has "
        f"{world_size} (global batch {ours}: PER_DEVICE_BATCH_SIZE x replicas x GRADIENT_ACCUMULATION_STEPS)"
    )

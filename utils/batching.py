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
  and a run can resume on any count that divides the global batch.

Plain arithmetic, no torch: `--dry-run` shows the plan for the launcher's world size.
"""

from __future__ import annotations

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
    # The largest micro-batch that fits the cap and divides this replica's share: every micro-batch is full,
    # so each optimizer step averages exactly the same rows with the same weights on any count.
    micro = max(size for size in range(1, min(share, settings.per_device_batch_size) + 1) if share % size == 0)
    return BatchPlan(
        global_batch=total, micro_batch=micro, accumulation=share // micro, world_size=world_size, fixed=True
    )

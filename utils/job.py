"""What a rank knows once it has started: one frozen object, built once, read by every phase of the run.

main.py resolves the settings and the ranks without torch (`main.configure`); `Job.start` adds what needs
it, the device and the numerics the hardware allows, and the batch plan, so utils/run.py's phases
(set-up, train, publish) and the Trainer utils/trainer.py builds take one argument instead of a bundle.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from utils.batching import BatchPlan, plan_batches
from utils.distributed import DistEnv
from utils.errors import EXIT_BAD_INPUT, JobError
from utils.hub_token import Masker
from utils.outputs import RunDir
from utils.preemption import Preemption
from utils.settings import Settings


@dataclass(frozen=True)
class Job:
    settings: Settings  # resolved: the learning rate is the one this world size gets
    dist: DistEnv  # this process's rank, world size and rendezvous address
    out: RunDir  # OUTPUT_DIR, checked to be this job's
    cuda: bool
    device: torch.device
    quantize: bool  # 8-bit base weights (bitsandbytes)
    precision: str  # fp32, bf16 or fp16: never `auto`
    batch: BatchPlan  # global batch, micro-batch and accumulation for this world size
    preemption: Preemption | None = None  # the installed stop-signal handler; None: signals are not deferred
    masker: Masker | None = None  # the token masking on stdout/stderr, for the log handlers too

    @classmethod
    def start(
        cls,
        settings: Settings,
        dist: DistEnv,
        out: RunDir,
        *,
        preemption: Preemption | None = None,
        masker: Masker | None = None,
    ) -> Job:
        cuda = torch.cuda.is_available()
        quantize, precision = resolve_numerics(settings, dist, cuda)
        return cls(
            settings=settings,
            dist=dist,
            out=out,
            cuda=cuda,
            device=torch.device("cuda", dist.local_rank) if cuda else torch.device("cpu"),
            quantize=quantize,
            precision=precision,
            batch=plan_batches(settings, dist.world_size),
            preemption=preemption,
            masker=masker,
        )

    @property
    def strategy(self) -> str:
        return self.settings.strategy

    @property
    def compiled(self) -> bool:
        """TORCH_COMPILE: the fast path (utils/trainer.compile_model); `auto` takes it on CUDA under DDP."""
        wanted = self.settings.torch_compile
        return wanted is True or (wanted == "auto" and self.cuda and self.strategy == "ddp")

    def leave_unused_libraries_out(self) -> None:
        """DeepSpeed only for STRATEGY=deepspeed, bitsandbytes only for 8-bit weights (`leave_out`). Called before
        transformers is imported."""
        unused = {"deepspeed": self.strategy != "deepspeed", "bitsandbytes": not self.quantize}
        leave_out(*(name for name, left_out in unused.items() if left_out))


def leave_out(*libraries: str) -> None:
    """Make installed libraries this process will not use look not installed. Installed, each is imported by the
    stack whether it is used or not: Accelerate imports DeepSpeed (and MLflow behind it) to recognise its engine,
    peft imports bitsandbytes, which compiles wrappers with torch.compile as it loads: about 2 s of CPU at every
    start, and their notices in the log. None in sys.modules is Python's "not installed": an import fails,
    `importlib.util.find_spec` says it is missing, which is how Accelerate, transformers and peft ask
    (tests/test_library_contract.py holds them to it). Before transformers is imported."""
    for name in libraries:
        sys.modules.setdefault(name, None)


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

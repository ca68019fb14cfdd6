"""What a rank knows once it has started, read by every phase of the run: main.py resolves the settings, the ranks
and the plan without torch; `Job.start` adds the device and the numerics the hardware allows."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass, replace

import torch

from utils.cluster.preemption import Preemption
from utils.common.hub_token import Masker
from utils.config.deepspeed_config import check_pinned
from utils.config.distributed import DistEnv
from utils.config.plan import Plan, with_device, with_rows
from utils.config.settings import Settings
from utils.run_folder.layout import RunDir

# Notices about what the job neither uses nor can change, silenced for main.py and predict.py (both import this first):
# peft 0.21 still asks transformers 5 for `is_gradient_checkpointing`, which warns on every model built or loaded;
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
# bitsandbytes looks for an optional 4-bit CPU kernel (package `kernels`) as it loads; the 8-bit path never calls it.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


@dataclass(frozen=True)
class PlanInputs:
    """The settings that complete the plan once the device and the training rows are known."""

    gradient_checkpointing: bool
    deepspeed_config: str | None
    weight_decay: float
    gradient_accumulation_steps: int
    eval_steps: int | None
    warmup_ratio: float


@dataclass(frozen=True)
class Job:
    settings: Settings  # as the user gave them, for utils/run.py; what they resolve to is the plan's
    dist: DistEnv  # this process's rank, world size and rendezvous address
    out: RunDir  # OUTPUT_DIR, checked to be this job's
    cuda: bool
    device: torch.device
    plan: Plan  # what the run trains with (utils/config/plan.py), its numerics resolved for this device
    inputs: PlanInputs
    preemption: Preemption  # the stop-signal handler (main.py installs it); training defers signals through it
    masker: Masker | None = None  # the token masking on stdout/stderr, for the log handlers too

    @classmethod
    def start(
        cls,
        settings: Settings,
        inputs: PlanInputs,
        dist: DistEnv,
        out: RunDir,
        plan: Plan,
        *,
        preemption: Preemption,
        masker=None,
    ) -> Job:
        cuda = torch.cuda.is_available()
        plan = with_device(plan, cuda, cuda and torch.cuda.is_bf16_supported(), inputs.gradient_checkpointing)
        if plan.deepspeed is not None and inputs.deepspeed_config is not None:
            # A precision the file pins, now that PRECISION is resolved.
            check_pinned(plan.deepspeed, plan, inputs.deepspeed_config, inputs.weight_decay)
        device = torch.device("cuda", dist.local_rank) if cuda else torch.device("cpu")
        return cls(settings, dist, out, cuda, device, plan, inputs, preemption, masker)

    def with_rows(self, train_rows: int) -> Job:
        inputs = self.inputs
        plan = with_rows(
            self.plan, train_rows, inputs.gradient_accumulation_steps, inputs.eval_steps, inputs.warmup_ratio
        )
        return replace(self, plan=plan)

    @property
    def strategy(self) -> str:
        return self.plan.strategy

    @property
    def quantize(self) -> bool:  # 8-bit or 4-bit base weights (bitsandbytes)
        return self.plan.quantization in ("8bit", "4bit")

    @property
    def compiled(self) -> bool:  # TORCH_COMPILE, as the plan resolved it for this device
        return self.plan.compile is True

    @property
    def captured(self) -> bool:  # CUDA_GRAPHS, as the plan resolved it for this device
        return self.plan.capture is True

    def leave_unused_libraries_out(self) -> None:
        """Before transformers is imported."""
        unused = {"deepspeed": self.strategy != "deepspeed", "bitsandbytes": not self.quantize}
        leave_out(*(name for name, left_out in unused.items() if left_out))
        if self.strategy == "deepspeed" and not self.cuda:  # else DeepSpeed probes for a GPU and warns it found none
            os.environ.setdefault("DS_ACCELERATOR", "cpu")


def leave_out(*libraries: str) -> None:
    """Make installed libraries this process will not use look not installed (None in sys.modules: `find_spec` says
    missing), else Accelerate imports DeepSpeed and peft bitsandbytes anyway: about 2 s of CPU a start, and notices."""
    for name in libraries:
        sys.modules.setdefault(name, None)

"""main.py with a lever the job has no setting for, for the GPU benchmark's arms only (benchmarks/gpu_checks.py):

  python benchmarks/job_variant.py [--compile-region encoder] [--no-cudnn-attention] [--no-host-levers] main.py ...

--compile-region encoder  TORCH_COMPILE compiles the module holding the stack of blocks (BERT's encoder) instead
                          of each block: one graph per bucket instead of twelve calls of one, the shape CUDA
                          graphs capture whole
--no-cudnn-attention      SDPA without its cuDNN backend (a plan lookup of ~0.3 ms of CPU per call on the GPU
                          seen), so the memory-efficient kernel runs
--no-host-levers          the Trainer's own per-step walks of the whole model (JobTrainer.host_levers off): the
                          baseline the job's calls are measured against
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--compile-region", choices=("encoder",))
parser.add_argument("--no-cudnn-attention", action="store_true")
parser.add_argument("--no-host-levers", action="store_true")
parser.add_argument("script")
args, rest = parser.parse_known_args()
sys.argv = [args.script, *rest]
sys.path[0] = str(Path(args.script).resolve().parent)  # as `python main.py` would have it: the repository's modules

from utils.cluster.job import leave_out  # noqa: E402

# As the job does before transformers is imported (Job.leave_unused_libraries_out), which the levers below import
# first: bitsandbytes only for 8-bit weights.
if os.environ.get("QUANTIZATION") != "8bit":
    leave_out("bitsandbytes")

if args.compile_region == "encoder":
    import utils.training.trainer

    blocks_of = utils.training.trainer.repeated_blocks

    def encoder_of(model):
        blocks = blocks_of(model)
        return next(
            [module]
            for module in model.modules()
            if any(child is blocks[0] for grandchildren in module.children() for child in grandchildren.children())
        )

    utils.training.trainer.repeated_blocks = encoder_of

if args.no_cudnn_attention:
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)

if args.no_host_levers:
    from utils.training.trainer import JobTrainer

    JobTrainer.host_levers = False

runpy.run_path(args.script, run_name="__main__")

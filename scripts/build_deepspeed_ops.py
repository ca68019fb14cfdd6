"""Compile DeepSpeed's two CPU ops once: the shared-memory collectives (every STRATEGY=deepspeed run on a machine
without a GPU) and the CPU Adam (ZERO_OFFLOAD=optimizer). A run compiles them by itself on first use, which costs
a couple of minutes of g++ on 2 cores; `make test-all` runs this first, so no test pays it and the suite's time is
the tests' own.

    python scripts/build_deepspeed_ops.py        # into $TORCH_EXTENSIONS_DIR, default <venv>/torch-extensions

<venv>/torch-extensions is where the tests point TORCH_EXTENSIONS_DIR. An op already built from the same sources
and flags is loaded, not rebuilt.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
os.environ["DS_ACCELERATOR"] = "cpu"  # the ops the CPU accelerator uses, also on a machine that has a GPU


def main() -> None:
    from deepspeed.accelerator import get_accelerator

    for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):
        start = time.monotonic()
        get_accelerator().create_op_builder(name).load(verbose=False)
        print(f"{name}: ready in {time.monotonic() - start:.0f} s ({os.environ['TORCH_EXTENSIONS_DIR']})")


if __name__ == "__main__":
    main()

"""The global random state kept across a block that must not draw from it (a warm-up, an evaluation)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def rng_preserved(device: torch.device) -> Iterator[None]:
    """Python's, numpy's and torch's global RNG states (the CPU's and `device`'s) as they were before the block."""
    python, legacy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(legacy)

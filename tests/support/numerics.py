"""The yardstick every strategy is held to against one process: the tolerances, the loss curves and the adapter
weights of a finished run, and where two curves first part."""

from __future__ import annotations

import json
from pathlib import Path

# DDP against one process (tests/test_ddp_numerics.py), measured on 2 CPU cores (fp32, gloo): losses within 9e-8
# relative, adapter weights within 3.4e-7 absolute (values up to 0.17). The tolerances sit a few times above that;
# a rate x2 moves step 2's eval loss by 1e-2 (relative) and the weights by up to 0.3.
LOSS_RTOL = 1e-6
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-6


def adapter_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "model" / "adapter_model.safetensors")


def first_divergence(one: dict[int, float], two: dict[int, float], rtol: float) -> str | None:
    """Where two curves (step -> value) first differ by more than `rtol` (relative), in words; None if nowhere."""
    assert one.keys() == two.keys(), f"logged at different steps: {sorted(one)} vs {sorted(two)}"
    for step in sorted(one):
        a, b = one[step], two[step]
        if abs(a - b) > rtol * max(abs(a), abs(b)):
            later = ", ".join(f"{s}: {one[s]:.6g} vs {two[s]:.6g}" for s in sorted(one) if s > step)
            why = " (before any update: other rows, other initial weights or another loss scale)" if step == 1 else ""
            return (
                f"first differs at step {step}: {a:.8g} (1 process) vs {b:.8g} (2 replicas), "
                f"relative difference {abs(a - b) / max(abs(a), abs(b)):.2e} > {rtol:g}{why}"
                + (f"; later: {later}" if later else "")
            )
    return None


def step_losses(out: Path) -> dict[int, float]:
    """Every step's training loss (LOGGING_STEPS=1) from the last checkpoint's trainer_state.json."""
    last = max((out / "checkpoints").glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    history = json.loads((last / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}

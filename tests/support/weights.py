"""Model folders whose weights are not what they seem, for the refusals that must meet them."""

from __future__ import annotations

import os
from pathlib import Path


def pickled_weights(folder: Path, how: str, marker: Path) -> Path:
    """`folder`'s model.safetensors replaced by pytorch_model.bin: a pickle that runs `touch marker` when unpickled
    without torch's weights-only guard (`how` "malicious"), or the real weights cut in half ("truncated")."""
    import torch
    from safetensors.torch import load_file

    weights, state = folder / "pytorch_model.bin", load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    if how == "malicious":

        class Payload:
            def __reduce__(self):
                return os.system, (f"touch {marker}",)

        torch.save({"bert.embeddings.word_embeddings.weight": Payload()}, weights)
    else:
        torch.save(state, weights)
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    return folder

"""The one file layout of every head this toolkit writes: ``config.json`` + ``model.safetensors`` in a directory.

Shared by :mod:`toolkit.eagle.checkpoint` (the EAGLE / EAGLE-3 repositories' layout) and
:mod:`toolkit.eagle.speculators` (the speculators layout), which differ only in the tensor names and config they
hand it.
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_head_files(directory: Path, state: dict[str, torch.Tensor], config: dict) -> None:
    """Write ``state`` as ``model.safetensors`` (contiguous, on the CPU) and ``config`` as ``config.json`` into
    ``directory`` (created), each file atomically: the one file layout of every head this toolkit writes."""
    from safetensors.torch import save_file

    from toolkit.io import atomic_write, atomic_write_json

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().cpu() for k, v in state.items()}
    atomic_write(directory / "model.safetensors", lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}),
                 suffix=".safetensors")
    atomic_write_json(directory / "config.json", config)

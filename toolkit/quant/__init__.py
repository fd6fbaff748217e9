"""Weight-quantization backends: ``bitsandbytes`` (LLM.int8(), NF4) and ``torchao`` (int8 weight-only, int8 dynamic
activation, int4 weight-only), chosen per model by ``ModelSpec.backend`` (``auto`` picks the backend measured
fastest for the precision and device, see :mod:`toolkit.quant.auto`).

Plain precisions (fp32 / fp16 / bf16) need no backend: :func:`choose_backend` returns ``"none"`` for them.
"""

from __future__ import annotations

import importlib.util

import torch

from toolkit.errors import ConfigError, ModelLoadError
from toolkit.quant import torchao as torchao_backend
from toolkit.quant.auto import TABLE

BACKENDS = ("auto", "bitsandbytes", "torchao")
QUANTIZED = ("int8", "int4")


def installed(backend: str) -> bool:
    """Whether ``backend``'s package is importable (not imported)."""
    return importlib.util.find_spec(backend) is not None


def choose_backend(spec, device: torch.device, field: str) -> str:
    """The concrete backend that loads ``spec`` on ``device``: ``"none"``, ``"bitsandbytes"`` or ``"torchao"``.

    Raises:
        ConfigError: the explicit ``{field}.backend`` has no kernel for ``{field}.precision`` on the device.
        ModelLoadError: no backend package that could load the spec is installed.
    """
    if spec.precision not in QUANTIZED:
        return "none"
    if spec.backend == "torchao":
        torchao_backend.check_kernel(spec, device, field)
        return "torchao"
    if spec.backend == "bitsandbytes":
        return "bitsandbytes"
    row = TABLE.get((spec.precision, device.type), ())
    for entry in row:
        if not installed(entry.backend):
            continue
        if entry.backend == "torchao":
            try:
                torchao_backend.check_kernel(spec, device, field)
            except ConfigError:
                continue
        return entry.backend
    raise ModelLoadError(f"{field}.precision={spec.precision} on {device.type}: none of the backends "
                         f"{[e.backend for e in row]} is installed (pip install torchao bitsandbytes)")

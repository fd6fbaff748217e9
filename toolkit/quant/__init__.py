"""Weight-quantization backends: ``bitsandbytes`` (LLM.int8(), NF4) and ``torchao`` (int8 weight-only, int8 dynamic
activation, int4 weight-only), chosen per model by ``ModelSpec.backend`` (``auto`` picks the backend measured
fastest for the precision and device, see :mod:`toolkit.quant.auto`).

Plain precisions (fp32 / fp16 / bf16) need no backend: :func:`choose_backend` returns ``"none"`` for them.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from toolkit.errors import ConfigError, ModelLoadError
from toolkit.quant import torchao as torchao_backend
from toolkit.quant.auto import TABLE

BACKENDS = ("auto", "bitsandbytes", "torchao")
QUANTIZED = ("int8", "int4")

# The one line per process that says which kernel runs quantized weights is INFO on this logger; its level is set
# here so that an application logging at WARNING (the toolkit CLI) still shows it.
logging.getLogger("toolkit.quant").setLevel(logging.INFO)


class _DropKnownNoise(logging.Filter):
    """Drop import-time notices about optional GPU pieces that say nothing about the kernels actually used."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "is an Enum subclass and is now natively supported" in text or "Detected no triton" in text:
            return False
        return not ("Failed to load" in text and "torchao/_C" in text and not torch.cuda.is_available())


for _name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):  # filters act on the emitting logger only
    logging.getLogger(_name).addFilter(_DropKnownNoise())


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

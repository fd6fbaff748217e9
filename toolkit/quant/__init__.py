"""Weight-quantization backends: ``bitsandbytes`` (LLM.int8(), NF4) and ``torchao`` (int8 weight-only, int8 dynamic
activation, int4 weight-only), chosen per model by ``ModelSpec.backend`` (``auto`` picks the backend measured
fastest for the precision and device, see :mod:`toolkit.quant.auto`).

Each backend file holds a :class:`~toolkit.quant.registry.WeightBackend` registered under its name
(:mod:`toolkit.quant.registry`); the import lines below are the registrations. Plain precisions (fp32 / fp16 / bf16)
need no backend: :func:`choose_backend` returns ``"none"`` for them.

The kernel each load runs is logged once per process at INFO on the ``toolkit.quant`` logger; importing this package
changes no logging level (the ``toolkit`` command shows that line, see :func:`toolkit_cli.app.configure_logging`).
"""

from __future__ import annotations

import logging

import torch

from toolkit.errors import ConfigError, ModelLoadError
from toolkit.quant.auto import TABLE
from toolkit.quant.registry import (
    AUTO,
    NONE,
    WeightBackend,
    backend_choices,
    backend_names,
    register_backend,
    weight_backend,
)

# The registrations, one line per backend (registration order = the order of the allowed names in errors).
from toolkit.quant import bitsandbytes  # noqa: E402,F401,I001
from toolkit.quant import torchao  # noqa: E402,F401
from toolkit.quant import llamacpp  # noqa: E402,F401

BACKENDS = backend_choices()
QUANTIZED = ("int8", "int4")


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
    """Whether ``backend`` can run here (:meth:`~toolkit.quant.registry.WeightBackend.installed`: its package is
    importable; llama.cpp's build must also be one that runs)."""
    return weight_backend(backend).installed()


def choose_backend(spec, device: torch.device, field: str) -> str:
    """The name of the registered backend that loads ``spec`` on ``device`` (``"none"`` for a plain precision).

    Raises:
        ConfigError: the explicit ``{field}.backend`` has no kernel for ``{field}.precision`` on the device.
        ModelLoadError: no backend package that could load the spec is installed.
    """
    if spec.precision not in QUANTIZED:
        return NONE
    if spec.backend != AUTO:
        weight_backend(spec.backend, f"{field}.backend").check_kernel(spec, device, field)
        return spec.backend
    row = TABLE.get((spec.precision, device.type), ())
    for entry in row:
        if not installed(entry.backend):
            continue
        try:
            weight_backend(entry.backend).check_kernel(spec, device, field)
        except ConfigError:
            continue
        return entry.backend
    raise ModelLoadError(f"{field}.precision={spec.precision} on {device.type}: none of the backends "
                         f"{[e.backend for e in row]} is installed (pip install torchao bitsandbytes)")


def fallback_after(backend: str, spec, device: torch.device) -> str | None:
    """The backend measured next after ``backend`` for ``spec`` on ``device`` (what ``auto`` loads when ``backend``
    turns out not to fit the loaded model); ``None`` when it is the last of its row."""
    names = [entry.backend for entry in TABLE.get((spec.precision, device.type), ())]
    return names[names.index(backend) + 1] if backend in names[:-1] else None


__all__ = ["AUTO", "BACKENDS", "NONE", "QUANTIZED", "WeightBackend", "backend_choices", "backend_names",
           "choose_backend", "fallback_after", "installed", "register_backend", "weight_backend"]

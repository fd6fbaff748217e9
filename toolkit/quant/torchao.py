"""torchao weights through its public entry point ``torchao.quantization.quantize_(model, config)``.

Formats (each ``nn.Linear`` weight, the LM head included; embeddings and norms stay at the compute dtype):

* int8, ``torchao_int8: weight_only`` — symmetric per-output-channel int8 weights (``Int8WeightOnlyConfig``); the
  matmul runs at the compute dtype on the dequantized weight.
* int8, ``torchao_int8: dynamic`` — int8 weights and per-token dynamically quantized symmetric int8 activations
  (``Int8DynamicActivationInt8WeightConfig``; W8A8 as in SmoothQuant without smoothing, Xiao et al. 2023); the matmul
  is an int8 x int8 -> int32 GEMM (``torch._int_mm``: oneDNN VNNI/AMX on x86, cuBLASLt on CUDA).
* int4 — asymmetric group-wise int4 weights (GPTQ/AWQ-style groups, tinygemm layout of gpt-fast): on CPU
  ``PrototypeInt4WeightOnlyConfig`` (``Int4OpaqueTensor``, ATen's ``_weight_int4pack_mm_for_cpu``, AVX-512 when the
  CPU has it); on CUDA ``Int4WeightOnlyConfig`` with the ``tile_packed_to_4d`` packing (tinygemm, sm80+, bf16).

A combination without a kernel raises one :class:`ConfigError` naming the recipe field.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

import torch

from toolkit.dtypes import torch_dtype
from toolkit.errors import ConfigError, ModelLoadError
from toolkit.quant.registry import WeightBackend, register_backend

log = logging.getLogger("toolkit.quant")
INT8_MODES = ("weight_only", "dynamic")
INT4_GROUP_SIZES_CPU = (32, 64, 128)
INT4_GROUP_SIZES_CUDA = (32, 64, 128, 256)
_SAID: set[str] = set()


def available() -> bool:
    """Whether the ``torchao`` package is installed (it is not imported)."""
    return importlib.util.find_spec("torchao") is not None


def import_quietly(field: str):
    """Import ``torchao.quantization`` (its import-time notices about CUDA-only libraries are filtered by
    :mod:`toolkit.quant`). Raises :class:`ModelLoadError` when torchao is not installed."""
    if not available():
        raise ModelLoadError(f"{field}.backend=torchao needs torchao: pip install torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao.quantization as quantization
    return quantization


def compute_dtype(spec, device: torch.device) -> torch.dtype:
    """Dtype of activations and of the unquantized weights: ``torchao_compute_dtype``, or with ``auto`` bf16 for
    int4 (the tinygemm kernels' dtype) and fp32 for int8 (keeps int8 within 1% of fp32 perplexity)."""
    if spec.torchao_compute_dtype != "auto":
        return torch_dtype(spec.torchao_compute_dtype)
    if spec.precision == "int4":
        return torch.bfloat16
    if spec.precision == "int8":
        return torch.float32
    return torch_dtype(spec.precision)


def check_kernel(spec, device: torch.device, field: str) -> None:
    """Raise :class:`ConfigError` when torchao has no kernel for ``spec`` on ``device`` (before any weights load)."""
    if spec.precision not in ("int8", "int4"):
        return
    dtype = compute_dtype(spec, device)
    if spec.precision == "int4":
        sizes = INT4_GROUP_SIZES_CPU if device.type == "cpu" else INT4_GROUP_SIZES_CUDA
        if spec.torchao_group_size not in sizes:
            raise ConfigError(f"{field}.torchao_group_size", f"torchao int4 on {device.type} has no kernel for "
                              f"group size {spec.torchao_group_size}", sizes)
        if device.type == "cuda":
            if torch.cuda.get_device_capability(device) < (8, 0):
                raise ConfigError(f"{field}.precision", "torchao int4 on CUDA needs compute capability >= 8.0 "
                                  f"(tinygemm); this GPU has {torch.cuda.get_device_capability(device)}: use "
                                  f"{field}.backend=bitsandbytes", ["fp32", "fp16", "bf16", "int8"])
            if dtype != torch.bfloat16:
                raise ConfigError(f"{field}.torchao_compute_dtype", "torchao int4 on CUDA (tinygemm) runs in bf16 "
                                  "only", ["auto", "bf16"])
        elif dtype == torch.float16:
            raise ConfigError(f"{field}.torchao_compute_dtype", "torchao int4 on CPU has no fp16 kernel",
                              ["auto", "fp32", "bf16"])
    elif spec.torchao_int8 == "dynamic" and device.type == "cpu" and dtype == torch.float16:
        raise ConfigError(f"{field}.torchao_compute_dtype", "torchao int8 dynamic activation on CPU has no fp16 "
                          "kernel", ["auto", "fp32", "bf16"])


def config_for(spec, device: torch.device, field: str):
    """The torchao ``AOBaseConfig`` for ``spec`` on ``device`` (``None`` for fp32/fp16/bf16)."""
    check_kernel(spec, device, field)
    quantization = import_quietly(field)
    if spec.precision == "int8":
        if spec.torchao_int8 == "weight_only":
            return quantization.Int8WeightOnlyConfig()
        # Symmetric per-token activations. Asymmetric ones measured better (PPL ratio 1.021 vs 1.037 on the embedded
        # model) but 4x slower on CPU: torchao 0.18 recomputes the weight row sums for the zero-point term per call.
        return quantization.Int8DynamicActivationInt8WeightConfig()
    if spec.precision == "int4":
        if device.type == "cpu":
            from torchao.prototype.quantization.int4 import (
                PrototypeInt4WeightOnlyConfig,
            )

            return PrototypeInt4WeightOnlyConfig(group_size=spec.torchao_group_size)
        return quantization.Int4WeightOnlyConfig(group_size=spec.torchao_group_size,
                                                 int4_packing_format="tile_packed_to_4d")
    return None


def kernel_path(spec, device: torch.device) -> str:
    """One sentence naming the kernel that runs ``spec``'s matmuls on ``device``."""
    dtype = str(compute_dtype(spec, device)).replace("torch.", "")
    if spec.precision == "int4":
        if device.type == "cpu":
            return (f"torchao int4 (group {spec.torchao_group_size}) on CPU: ATen _weight_int4pack_mm_for_cpu, "
                    f"{dtype} activations ({torch.backends.cpu.get_cpu_capability()})")
        return f"torchao int4 (group {spec.torchao_group_size}) on CUDA: tinygemm, {dtype} activations"
    if spec.torchao_int8 == "dynamic":
        return f"torchao int8 dynamic activation + int8 weight on {device.type}: torch._int_mm (int8 GEMM)"
    return f"torchao int8 weight-only on {device.type}: weights dequantized to {dtype}, then a {dtype} matmul"


def check_group_size(model: torch.nn.Module, group_size: int, field: str) -> None:
    """Raise :class:`ConfigError` unless every ``nn.Linear``'s ``in_features`` is a multiple of ``group_size``
    (``quantize_`` would otherwise leave such layers silently unquantized)."""
    widths = sorted({m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)})
    bad = [w for w in widths if w % group_size]
    if bad:
        fits = [g for g in (32, 64, 128, 256) if all(w % g == 0 for w in widths)]
        raise ConfigError(f"{field}.torchao_group_size", f"{group_size} does not divide the input width(s) {bad} "
                          "of this model's linear layers", fits)


def quantize(model: torch.nn.Module, spec, device: torch.device, field: str) -> torch.nn.Module:
    """Quantize ``model`` (already at :func:`compute_dtype` on ``device``) in place with ``quantize_``; return it.

    Raises:
        ConfigError: no kernel for the combination (:func:`check_kernel`), or an int4 group size that does not
            divide a linear layer's input width (:func:`check_group_size`).
    """
    config = config_for(spec, device, field)
    if config is None:
        return model
    if spec.precision == "int4":
        check_group_size(model, spec.torchao_group_size, field)
    quantization = import_quietly(field)
    quantization.quantize_(model, config, device=device)
    key = f"{spec.precision}/{spec.torchao_int8}/{spec.torchao_group_size}/{device.type}"
    if key not in _SAID:
        _SAID.add(key)
        log.info(kernel_path(spec, device))
    return model


@register_backend
class TorchaoBackend(WeightBackend):
    """torchao's ``quantize_`` on the model loaded at :func:`compute_dtype` and moved to its device; engines need a
    checkpoint quantized with torchao (they do not quantize this way in flight)."""

    name = "torchao"
    package = "torchao"
    precisions = ("int8", "int4")
    devices = ("cpu", "cuda")

    def check_kernel(self, spec, device: torch.device, field: str) -> None:
        super().check_kernel(spec, device, field)
        check_kernel(spec, device, field)

    def load_kwargs(self, spec, device: torch.device, field: str) -> dict:
        import_quietly(field)  # fail before reading weights when torchao is missing
        return {"dtype": compute_dtype(spec, device)}

    def check_model(self, model: torch.nn.Module, spec, field: str) -> None:
        if spec.precision == "int4":
            check_group_size(model, spec.torchao_group_size, field)

    def quantize(self, model: torch.nn.Module, spec, device: torch.device, field: str) -> torch.nn.Module:
        return quantize(model, spec, device, field)

    def kernel_path(self, spec, device: torch.device) -> str:
        return kernel_path(spec, device)

"""bitsandbytes weights: int8 = LLM.int8() (Dettmers et al., 2022), int4 = NF4 (QLoRA, Dettmers et al., 2023).

Both run on CPU and CUDA through transformers' ``BitsAndBytesConfig`` at ``from_pretrained`` time. On an AVX-512 BF16
CPU bitsandbytes tries, at import, to fetch an optional NF4 GEMM from the ``kernels`` hub package and logs a warning
on every process when it cannot; :func:`import_quietly` swallows that warning and :func:`kernel_path` says once, in
plain words, which NF4 kernel actually runs.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from toolkit.dtypes import torch_dtype
from toolkit.errors import ModelLoadError
from toolkit.quant.registry import WeightBackend, register_backend

log = logging.getLogger("toolkit.quant")
_SAID: set[str] = set()


class _DropKernelHubWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward" not in record.getMessage()


class _DropCastNotice(logging.Filter):
    """LLM.int8() on CPU logs a cast notice on every matmul call; :func:`kernel_path` says it once instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast from" not in record.getMessage()


logging.getLogger("bitsandbytes.autograd._functions").addFilter(_DropCastNotice())


def import_quietly(field: str):
    """Import bitsandbytes without its kernel-hub warning. Raises :class:`ModelLoadError` when it is missing."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError(f"{field}.backend=bitsandbytes needs bitsandbytes: pip install bitsandbytes")
    noisy = logging.getLogger("bitsandbytes.backends.cpu.ops")
    quiet = _DropKernelHubWarning()
    noisy.addFilter(quiet)
    try:
        import bitsandbytes
        import bitsandbytes.backends.cpu.ops  # noqa: F401  (the module that logs at import)
    finally:
        noisy.removeFilter(quiet)
    return bitsandbytes


def kernel_path(precision: str, device: torch.device) -> str:
    """One sentence naming the bitsandbytes kernel that runs ``precision`` on ``device``."""
    if device.type == "cuda":
        return f"bitsandbytes {precision} on CUDA: the library's own CUDA kernels"
    if precision == "int8":
        return ("bitsandbytes LLM.int8() on CPU: activations cast to fp16 and quantized per row, an int8 matmul, "
                "outlier columns in float (no fused CPU kernel)")
    from bitsandbytes.backends.cpu import ops

    fused = getattr(ops, "gemm_4bit_forward_kernel", None) is not None
    if fused:
        return "bitsandbytes NF4 on CPU: the kernels-community fused GEMM (AVX-512 BF16)"
    if ops.has_avx512bf16():
        return ("bitsandbytes NF4 on CPU: the library's built-in AVX-512 BF16 GEMV, activations cast to bf16 "
                "(the optional kernels-community GEMM is not installed)")
    return "bitsandbytes NF4 on CPU: dequantize to float, then a plain matmul (no fused NF4 kernel on this CPU)"


def say_kernel_path_once(precision: str, device: torch.device) -> None:
    """Log :func:`kernel_path` at INFO the first time each (precision, device type) loads in this process."""
    key = f"{precision}/{device.type}"
    if key not in _SAID:
        _SAID.add(key)
        log.info(kernel_path(precision, device))


def from_pretrained_kwargs(spec, device: torch.device, field: str) -> dict:
    """``from_pretrained`` keyword arguments loading ``spec`` (precision int8 or int4) with bitsandbytes."""
    import_quietly(field)
    from transformers import BitsAndBytesConfig

    if spec.precision == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=spec.int8_threshold)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch_dtype(spec.int4_compute_dtype),
            bnb_4bit_use_double_quant=spec.int4_double_quant,
        )
    return {
        "quantization_config": config,
        "device_map": {"": str(device) if device.type == "cpu" else device.index or 0},
        "dtype": torch.float32 if device.type == "cpu" else torch.float16,
    }


@register_backend
class BitsandbytesBackend(WeightBackend):
    """LLM.int8() / NF4 through transformers' ``BitsAndBytesConfig`` at ``from_pretrained`` time (placed on the
    device by its ``device_map``); the serving engines quantize the same way in flight."""

    name = "bitsandbytes"
    package = "bitsandbytes"
    precisions = ("int8", "int4")
    devices = ("cpu", "cuda")
    places_weights = True
    engine_in_flight = True

    def load_kwargs(self, spec, device: torch.device, field: str) -> dict:
        return from_pretrained_kwargs(spec, device, field)

    def quantize(self, model, spec, device: torch.device, field: str):
        say_kernel_path_once(spec.precision, device)  # quantized while loading: only the kernel line is left
        return model

    def kernel_path(self, spec, device: torch.device) -> str:
        return kernel_path(spec.precision, device)

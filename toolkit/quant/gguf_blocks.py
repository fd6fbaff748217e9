"""GGUF quantized blocks as they are: each block format read into integer codes plus one scale and one minimum per
group of 32 weights, ``w = scale * code + min`` — the codes unchanged, the scale and minimum derived from the block's
own fields (llama.cpp's ``ggml-quants.c`` formats, as the ``gguf`` package reads them).

| format | group of 32 | codes | w |
|---|---|---|---|
| Q4_0 | block, fp16 ``d`` | 4-bit ``q`` | ``d (q - 8)`` |
| Q4_1 | block, fp16 ``d``, ``m`` | 4-bit | ``d q + m`` |
| Q5_0 | block, fp16 ``d`` | 5-bit | ``d (q - 16)`` |
| Q5_1 | block, fp16 ``d``, ``m`` | 5-bit | ``d q + m`` |
| Q8_0 | block, fp16 ``d`` | int8 ``q`` (stored as ``q + 128``) | ``d q`` |
| Q4_K | sub-block of a 256 super-block, fp16 ``d``, ``dmin``, 6-bit ``sc``, ``mn`` | 4-bit | ``d sc q - dmin mn`` |
| Q5_K | as Q4_K | 5-bit | as Q4_K |

Every other type (Q6_K and Q2_K / Q3_K with sub-blocks of 16, the IQ formats, F16 / BF16 / F32) has no group-32
affine form: :func:`block_fields` / :func:`affine_groups` return ``None`` and the caller keeps the tensor dequantized.

:func:`block_fields` gives the codes with the blocks' own fields as they are (fp16 ``d`` and ``m`` / ``dmin``, a
K-quant's 6-bit sub-scales as bytes): the input embedding keeps them so (:mod:`toolkit.quant.block_embedding`).
:func:`affine_groups` multiplies them into one scale and one minimum per group of 32: the linear layers' form.

The codes are read with the ``gguf`` package's own dequantizer on a copy of the blocks whose scales are set to one
and whose minimums are set to zero (so its output *is* the code, exactly, in float32): the bit layouts stay the
library's, not a second copy of them here. Wider codes than 4 bits are split into 4-bit planes by
:func:`nibble_planes` for the int4 kernels (:mod:`toolkit.quant.int4_linear`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32


@dataclass(frozen=True)
class BlockFormat:
    """Where a block format keeps its fields (byte offsets in one block) and how its codes map to weights.

    Attributes:
        bits: bits per code (4, 5 or 8).
        block_bytes: bytes per block (``gguf.GGML_QUANT_SIZES``).
        scale_at: byte offset of the fp16 scale ``d``.
        min_at: byte offset of the fp16 minimum (``m`` or ``dmin``), or ``None``.
        code_offset: what the unit-scale dequantizer returns minus the stored code (``-8`` for Q4_0: it returns
            ``q - 8``), so ``code = unit_value - code_offset``.
        k_scales_at: byte offset of a K-quant super-block's 12 bytes of 6-bit sub-scales and sub-minimums, or
            ``None`` for a plain block of 32.
    """

    bits: int
    block_bytes: int
    scale_at: int
    min_at: int | None
    code_offset: int
    k_scales_at: int | None = None


def _formats() -> dict:
    from gguf import GGMLQuantizationType as T

    return {
        T.Q4_0: BlockFormat(4, 18, 0, None, -8),
        T.Q4_1: BlockFormat(4, 20, 0, 2, 0),
        T.Q5_0: BlockFormat(5, 22, 0, None, -16),
        T.Q5_1: BlockFormat(5, 24, 0, 2, 0),
        T.Q8_0: BlockFormat(8, 34, 0, None, -128),
        T.Q4_K: BlockFormat(4, 144, 0, 2, 0, k_scales_at=4),
        T.Q5_K: BlockFormat(5, 176, 0, 2, 0, k_scales_at=4),
    }


def block_format(qtype) -> BlockFormat | None:
    """The :class:`BlockFormat` of a ``gguf.GGMLQuantizationType``, or ``None`` when it has no group-32 affine form."""
    return _formats().get(qtype)


#: 12 bytes of K-quant sub-scales that read as sc = 1 and mn = 0 for all 8 sub-blocks (the ``get_scale_min`` packing)
_UNIT_K_SCALES = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16)[:, 0]


@dataclass(frozen=True)
class BlockFields:
    """One tensor's rows read into their codes and the blocks' own fields, unchanged.

    Attributes:
        codes: ``(rows, columns)`` uint8 in ``[0, 2**bits)``: the stored codes (Q8_0's int8 ``q`` as ``q + 128``).
        d: ``(rows, columns // block)`` float16: each block's scale ``d`` (``block`` = 32, or 256 for a K-quant).
        m: ``(rows, columns // block)`` float16: each block's minimum ``m`` (Q4_1, Q5_1) or ``dmin`` (K-quants),
            or ``None`` (Q4_0, Q5_0, Q8_0: the minimum is ``code_offset * d``).
        sub_scales: ``(rows, columns // 32, 2)`` uint8: a K-quant's 6-bit ``sc`` and ``mn`` per sub-block of 32,
            unpacked from their 12 bytes, or ``None``.
        format: the :class:`BlockFormat` they came from.
    """

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    sub_scales: np.ndarray | None
    format: BlockFormat


def block_fields(raw: np.ndarray, qtype, columns: int) -> BlockFields | None:
    """The codes and fields of one tensor's rows (see :class:`BlockFields`), or ``None`` when ``qtype`` has no
    group-32 affine form.

    Args:
        raw: ``(rows, bytes_per_row)`` uint8, the tensor's blocks as the file holds them (``GGUFReader`` data:
            memory-mapped; only these rows are read).
        qtype: the tensor's ``gguf.GGMLQuantizationType``.
        columns: weights per row (the input width), a multiple of the format's block size.
    """
    from gguf.quants import Q4_K, dequantize

    fmt = block_format(qtype)
    if fmt is None:
        return None
    rows = raw.shape[0]
    blocks = np.array(raw, dtype=np.uint8).reshape(-1, fmt.block_bytes)  # a copy: the file stays untouched
    d = _fp16(blocks, fmt.scale_at)
    m = _fp16(blocks, fmt.min_at) if fmt.min_at is not None else None
    unit = blocks.copy()
    unit[:, fmt.scale_at:fmt.scale_at + 2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    if fmt.min_at is not None:
        unit[:, fmt.min_at:fmt.min_at + 2] = 0
    sub_scales = None
    if fmt.k_scales_at is not None:
        sc, mn = Q4_K.get_scale_min(blocks[:, fmt.k_scales_at:fmt.k_scales_at + 12].copy())
        unit[:, fmt.k_scales_at:fmt.k_scales_at + 12] = _UNIT_K_SCALES
        sub_scales = np.stack([sc, mn], axis=-1).astype(np.uint8).reshape(rows, columns // GROUP, 2)
    codes = dequantize(unit, qtype).reshape(-1) - fmt.code_offset
    del unit
    per_row = d.size // rows
    return BlockFields(codes.astype(np.uint8).reshape(rows, columns), d.reshape(rows, per_row),
                       None if m is None else m.reshape(rows, per_row), sub_scales, fmt)


def affine_groups(raw: np.ndarray, qtype, columns: int):
    """Codes and per-group scale and minimum of one tensor's rows (arguments as :func:`block_fields`).

    Returns:
        ``None`` when ``qtype`` has no group-32 affine form, else ``(codes, scale, minimum, bits)``: ``codes``
        ``(rows, columns)`` uint8 in ``[0, 2**bits)``, ``scale`` and ``minimum`` ``(rows, columns // 32)`` float32,
        exact (fp16 fields and 6-bit sub-scales multiplied in float32), with ``w = scale * code + minimum``.
    """
    fields = block_fields(raw, qtype, columns)
    if fields is None:
        return None
    fmt, groups = fields.format, columns // GROUP
    d = np.repeat(fields.d.astype(np.float32), groups // fields.d.shape[1], axis=1)  # (rows, groups)
    if fields.sub_scales is not None:
        dmin = np.repeat(fields.m.astype(np.float32), groups // fields.m.shape[1], axis=1)
        scale = d * fields.sub_scales[..., 0].astype(np.float32)
        minimum = -(dmin * fields.sub_scales[..., 1].astype(np.float32))
    else:
        scale = d
        minimum = fields.m.astype(np.float32) if fields.m is not None else fmt.code_offset * d
    return fields.codes, scale, minimum, fmt.bits


def nibble_planes(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray, bits: int):
    """Split ``bits``-bit codes into 4-bit planes for the int4 kernels' convention ``w = (c - 8) * S + Z``.

    Plane ``p`` holds ``(code >> 4p) & 15`` with scale ``S_p = scale * 16**p``; the zeros must add up to
    ``minimum + 8 * sum_p S_p`` so that ``sum_p (c_p - 8) S_p + Z_p = scale * code + minimum`` exactly. The kernel
    holds zeros in bf16, so a large zero carries a large rounding error (a Q5_0 group's total zero is ``120 d``:
    0.23 of a step off). So each upper plane's zero is ``0`` or ``8 S_p`` — a power-of-two multiple of its scale,
    rounded exactly as the scale is — whichever leaves plane 0 the smaller zero, per group: Q8_0 keeps ``Z_0 = 8 d``
    (``Z_1 = 0``), Q5_0 ``Z_0 = -8 d`` (``Z_1 = 128 d``).

    Args:
        codes: ``(rows, columns)`` uint8; scale, minimum: ``(rows, columns // 32)`` float32; bits: 4, 5 or 8.

    Returns:
        ``(plane_codes, plane_scale, plane_zero)``: ``(rows, planes * columns)`` uint8 (the planes side by side
        along the input dimension) and ``(rows, planes * columns // 32)`` float32 each.
    """
    planes = (bits + 3) // 4
    if planes == 1:
        return codes, scale, minimum + 8 * scale
    if planes != 2:
        raise ValueError(f"bits must be 4, 5 or 8 (one or two 4-bit planes), got {bits}")
    upper = 16 * scale
    zero_high = minimum + 8 * scale  # plane 0's zero when plane 1 takes 8 S_1
    zero_low = zero_high + 8 * upper  # ... when plane 1's zero is 0
    high = np.abs(zero_high) < np.abs(zero_low)
    out_codes = np.concatenate([codes & 15, codes >> 4], axis=1)
    out_scale = np.concatenate([scale, upper], axis=1)
    out_zero = np.concatenate([np.where(high, zero_high, zero_low), np.where(high, 8 * upper, 0.0)], axis=1)
    return out_codes, out_scale, out_zero.astype(np.float32)

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
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """``(rows, columns)`` uint8 codes in ``[0, 16)`` -> ``(rows, columns // 2)`` uint8, two codes a byte (low
    nibble first): the canonical on-disk form, independent of the CPU's kernel layout."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``(rows, columns // 2)`` uint8 -> ``(rows, columns)`` int32."""
    low, high = (packed & 15).to(torch.int32), (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


class PackedInt4Linear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` held as int4 planes (see the module docstring).

    Args:
        nibbles: ``(out_features, planes * in_features // 2)`` uint8 from :func:`pack_nibbles`.
        scale_and_zero: ``(planes * in_features // 32, out_features, 2)`` bf16: per group, scale then zero.
        in_features, out_features: the layer's widths; ``in_features`` a multiple of 32.
        bias: ``(out_features,)`` or ``None``.

    Input ``(..., in_features)`` bf16 -> output ``(..., out_features)`` bf16.

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
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scale_and_zero", scale_and_zero.to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.planes > 1:
            flat = flat.repeat(1, self.planes)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed, GROUP, self.scale_and_zero)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, planes={self.planes}, "
                f"group={GROUP}, bias={self.bias is not None}")

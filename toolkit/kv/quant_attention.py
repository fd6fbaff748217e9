"""Attention of a KIVI layer over its packed groups and its full-precision slots, without concatenating them.

The static KIVI cache (:mod:`toolkit.kv.static_quant`) holds, per layer and row, packed key groups ``(kv_heads,
head_dim, T)`` (per-channel groups run along the token axis, so the codes are laid out channel-major), packed value
groups ``(kv_heads, T, head_dim)`` and full-precision slots (sinks, residual, the forward's own tokens, the shadow).
Concatenating ``[dequantized groups | fp slots]`` for SDPA writes a transposed copy of every key and a second copy of
every value per forward; at 4,096 packed tokens that copy was most of a decode step's attention on this CPU.

:class:`QuantKeys` instead computes the softmax attention part by part, as the math allows: the scores of the queries
against each part (``q @ K^T``; the dequantized key groups are already ``K^T``), one softmax over the concatenated
scores (``W x span`` per head: small), then the probabilities of each part times that part's values, summed. The
query heads of a GQA group are stacked as rows (``(B, kv_heads, groups * W, head_dim)``), so every product is a plain
batched matmul over the KV heads. One layer, one query over 4,096 packed 4-bit tokens + 200 fp slots, compiled, fp32,
this 2-core CPU: 1.2 ms against 2.9 ms for dequantize + concatenate + SDPA (uncompressed SDPA: 0.4 ms); 17 queries
3.4 vs 4.2 ms (``bench/kivi_attention.py``).

**One-token forwards** (a decode step): the packed parts are not dequantized at all. A key group's
element is ``code * scale + zero`` with one scale and zero point per (channel, group), so
``q . k_t = sum_c (q_c scale_cg) code_ct + sum_c q_c zero_cg``: the scales fold into the query (one small
``(rows, head_dim, groups)`` tensor), and the scores are one reduction over the channels that reads each byte of codes
once per query row, unpacked in registers. Values the same way from the other side: a value group's scale and zero
point fold into the probabilities (``p_t scale_tg``). No dequantized copy of the keys or values is written (3 MB
each per layer at 4,096 4-bit tokens in fp32, written and read again by the matmul). Its cost grows with the rows
(each reads the codes again), so compiled one-token forwards (a decode step, a plain step of the cost-aware
planner) run it and wider ones dequantize; eager forwards always dequantize (their matmuls are faster than unfused
reductions). One layer of the embedded model (3 KV heads, 3 query heads each), 4,096 packed 4-bit tokens + 200 fp
slots, compiled, fp32, this 2-core CPU, medians of 5 x 40 calls, folded / dequantized ms: width 1 0.44 / 0.73, 2 0.78
/ 0.87, 3 1.16 / 1.13, 4 1.75 / 2.27, 8 3.4 / 2.1-3.6, 17 6.4 / 3.5-3.7 (uncompressed SDPA at width 1: 0.35). Only
width 1 folds: a width-1 forward is a graph of its own already (dynamo specializes sizes of 1), while a width bound
would split the dynamic-width graph in two (8 graphs instead of 4 for a lookup recipe) for gains within noise.
"""

from __future__ import annotations

import torch

from toolkit.kv.quant_pack import Packed, code_planes, dequantize


class QuantKeys:
    """A KIVI layer's keys and values for one forward, handed to the attention function in place of its keys
    (:func:`toolkit.kv.attention.static_attention` calls :meth:`attend`).

    Args:
        qkeys: packed key groups, ``(B, kv_heads, head_dim, T)`` (``T`` tokens, whole groups).
        qvalues: packed value groups, ``(B, kv_heads, T, head_dim)``.
        keys / values: full-precision parts, each ``(B, kv_heads, n_i, head_dim)``, in mask order after the packed
            tokens.
        mask: boolean ``(B, 1, W, T + sum(n_i))``, True where a query sees a key.
    """

    def __init__(self, qkeys: Packed, qvalues: Packed, keys: list[torch.Tensor], values: list[torch.Tensor],
                 mask: torch.Tensor):
        self.qkeys, self.qvalues, self.keys, self.values, self.mask = qkeys, qvalues, keys, values, mask

    def attend(self, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """Softmax attention of ``query`` ``(B, q_heads, W, head_dim)`` (``q_heads`` a multiple of ``kv_heads``, HF's
        GQA order: query head ``i`` reads KV head ``i // groups``) over every part under :attr:`mask`; the softmax in
        float32 at least (float64 queries stay float64). Returns ``(B, q_heads, W, head_dim)`` in the query's dtype."""
        rows, q_heads, width, dim = query.shape
        kv_heads = self.keys[0].shape[1]
        groups = q_heads // kv_heads
        dtype = query.dtype
        q = query.reshape(rows, kv_heads, groups * width, dim) * (dim ** -0.5 if scaling is None else scaling)
        folded = width == 1 and torch.compiler.is_compiling()  # a decode step (see the module docstring)
        packed_scores = folded_matmul(q, self.qkeys) if folded else q @ dequantize(self.qkeys, dtype)
        scores = [packed_scores.to(dtype)] + [q @ k.to(dtype).transpose(-1, -2) for k in self.keys]
        scores = torch.cat(scores, -1).to(torch.promote_types(dtype, torch.float32))
        span = scores.shape[-1]  # every query head of a GQA group under the same (B, 1, W, span) mask, broadcast
        scores = scores.view(rows, kv_heads, groups, width, span).masked_fill(~self.mask.unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores, -1).view(rows, kv_heads, groups * width, span).to(dtype)
        packed = self.qkeys.length
        out = (folded_matmul(probs[..., :packed], self.qvalues).to(dtype) if folded
               else probs[..., :packed] @ dequantize(self.qvalues, dtype))
        start = packed
        for v in self.values:
            out = out + probs[..., start:start + v.shape[-2]] @ v.to(dtype)
            start += v.shape[-2]
        return out.reshape(rows, q_heads, width, dim)


def folded_matmul(a: torch.Tensor, packed: Packed) -> torch.Tensor:
    """``a @ dequantize(packed)`` without the dequantized tensor: ``a`` ``(B, h, m, R)``, ``packed`` ``(B, h, R, N)``
    grouped along its last axis (keys transposed, ``R`` = head_dim, ``N`` = tokens; values, ``R`` = tokens, ``N`` =
    head_dim). Element ``(r, n)`` of ``packed`` is ``code * scale + zero`` with one scale and zero point per ``(r,
    group of n)``, so each group's scales fold into ``a`` and the product is a reduction over ``R`` of ``a * scale``
    times the codes, unpacked plane by plane (:func:`~toolkit.kv.quant_pack.code_planes`). Computed in float32 at
    least; returns ``(B, h, m, N)``."""
    compute = torch.promote_types(a.dtype, torch.float32)
    af = a.to(compute).unsqueeze(-1)                                                      # (B, h, m, R, 1)
    scaled = (af * packed.scale.to(compute).unsqueeze(2)).unsqueeze(-1)                   # (B, h, m, R, groups, 1)
    offset = (af * packed.zero.to(compute).unsqueeze(2)).sum(3)                           # (B, h, m, groups)
    parts = [(scaled * plane.unsqueeze(2).to(compute)).sum(3)                             # (B, h, m, groups, g')
             for plane in code_planes(packed)]
    return (torch.cat(parts, -1) + offset.unsqueeze(-1)).flatten(-2)

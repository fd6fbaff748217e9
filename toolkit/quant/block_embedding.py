"""``BlockEmbedding``: a GGUF file's input embedding held in the file's own blocks — each row's codes and its
blocks' fields as they are — dequantizing only the rows a forward looks up.

A decode step reads one row of the ``(vocab, hidden)`` table, so keeping the whole table dequantized (at bf16: 2
bytes a weight) buys nothing; held in its blocks it costs what the file costs. The blocks are ggml's
(``ggml-common.h``), read by :func:`toolkit.quant.gguf_blocks.block_fields`; per row of ``hidden`` weights this
module holds (uint8 unless said; the fp16 fields as their int16 bit patterns, so a ``.to(dtype)`` of the module or
of a model holding it leaves them unrounded):

* Q8_0 — ggml: ``d`` fp16, ``qs`` int8 x 32 (34 bytes / 32 weights); here ``codes`` ``hidden`` (``q + 128``),
  ``d`` ``hidden / 32``; ``w = d q``;
* Q4_0 — ggml: ``d``, ``qs`` 4-bit x 32 (18 / 32); here ``codes`` ``hidden / 2`` (two a byte, low nibble first),
  ``d``; ``w = d (q - 8)``;
* Q4_1 — ggml: ``d``, ``m`` fp16, ``qs`` (20 / 32); here as Q4_0 plus ``m`` ``hidden / 32``; ``w = d q + m``;
* Q5_0 — ggml: ``d``, ``qh`` 4 bytes of fifth bits, ``qs`` (22 / 32); here as Q4_0 (the low 4 bits) plus
  ``high_bits`` ``hidden / 8`` (the fifth bits, eight a byte, first weight lowest); ``w = d (q - 16)``;
* Q5_1 — ggml: ``d``, ``m``, ``qh``, ``qs`` (24 / 32); here as Q5_0 plus ``m``; ``w = d q + m``;
* Q4_K — ggml: ``d``, ``dmin`` fp16, 12 bytes of 6-bit sub-scales ``sc`` and sub-minimums ``mn`` for its 8
  sub-blocks of 32, ``qs`` 4-bit x 256 (144 / 256); here ``codes`` ``hidden / 2``, ``d`` and ``m`` (``dmin``)
  ``hidden / 256``, ``sub_scales`` ``(hidden / 32, 2)`` (``sc``, ``mn``); ``w = d sc q - dmin mn``;
* Q5_K — ggml: as Q4_K plus ``qh`` 32 bytes (176 / 256); here as Q4_K plus ``high_bits``; as Q4_K.

So Q4_0 .. Q8_0 hold exactly the file's bytes, the K-quants 4 bytes per 256 weights more (their 6-bit sub-scales
unpacked to bytes). SmolLM2-135M's Q8_0 table (49152 x 576): 28,311,552 bytes of codes + 1,769,472 of scales =
30,081,024 bytes, against 56,623,104 at bf16. Formats without such a form (Q6_K, Q2_K, Q3_K, the IQ formats) have no
``BlockEmbedding``: :func:`toolkit.quant.gguf_blocks.block_format` is ``None`` and the caller keeps a bf16 table.

A looked-up row is computed in float32 as the ``gguf`` package dequantizes it (``d (q + offset)``, ``+ m``, or
``(d sc) q - dmin mn``; every product of an fp16 field, a 6-bit sub-scale and a code is exact in float32, so only
the final sum rounds, as there), then cast to the compute dtype: bit for bit the row of the bf16 table the
conversion made before.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

from toolkit.quant.gguf_blocks import GROUP, BlockFields, block_format
from toolkit.quant.int4_linear import pack_nibbles

log = logging.getLogger(__name__)
# inductor's CPU code generation notes that a compiled lookup loads fp16 fields and stores bf16 rows in one kernel;
# it computes such a kernel in float32, as the eager forward does (compiled rows equal eager rows bit for bit)
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node", category=UserWarning)

#: rows dequantized at once by :meth:`BlockEmbedding.dequantized` (float32 temporaries of rows x hidden)
TABLE_CHUNK_ROWS = 4096
_FIELDS = ("codes", "high_bits", "d", "m", "sub_scales")


def _qtype(gguf_type: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[gguf_type]


def layout(gguf_type: str, rows: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """``{field: shape}`` a :class:`BlockEmbedding` of ``rows`` x ``hidden`` weights in ``gguf_type`` holds (see the
    module docstring); ``codes`` / ``high_bits`` / ``sub_scales`` uint8, ``d`` / ``m`` int16 (fp16 bits).

    Raises:
        ValueError: ``gguf_type`` has no block form here, or ``hidden`` is no multiple of its block.
    """
    from gguf import GGML_QUANT_SIZES

    fmt = block_format(_qtype(gguf_type))
    if fmt is None:
        raise ValueError(f"{gguf_type} has no block form for an embedding (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K)")
    block = GGML_QUANT_SIZES[_qtype(gguf_type)][0]
    if hidden % block:
        raise ValueError(f"a {gguf_type} row of {hidden} weights is not whole blocks of {block}")
    shapes = {"codes": (rows, hidden if fmt.bits == 8 else hidden // 2), "d": (rows, hidden // block)}
    if fmt.bits == 5:
        shapes["high_bits"] = (rows, hidden // 8)
    if fmt.min_at is not None:
        shapes["m"] = (rows, hidden // block)
    if fmt.k_scales_at is not None:
        shapes["sub_scales"] = (rows, hidden // GROUP, 2)
    return shapes


def block_tensors(fields: BlockFields) -> dict[str, np.ndarray]:
    """The arrays a :class:`BlockEmbedding` holds for rows read by :func:`~toolkit.quant.gguf_blocks.block_fields`
    (``{field: array}`` of :func:`layout`'s shapes; rows of several calls concatenate along axis 0)."""
    bits = fields.format.bits
    out = {"codes": fields.codes if bits == 8 else pack_nibbles(fields.codes & 15), "d": fields.d.view(np.int16)}
    if bits == 5:
        out["high_bits"] = np.packbits(fields.codes >> 4, axis=1, bitorder="little")
    if fields.m is not None:
        out["m"] = fields.m.view(np.int16)
    if fields.sub_scales is not None:
        out["sub_scales"] = fields.sub_scales
    return out


class BlockEmbedding(torch.nn.Module):
    """A drop-in for ``torch.nn.Embedding`` (no ``weight``) holding a GGUF table in its blocks (module docstring).

    Args:
        tensors: ``{field: tensor}`` of :func:`layout`'s shapes for ``gguf_type`` (from :func:`block_tensors`);
            held as given, not copied.
        gguf_type: the table's GGUF type name (``"Q8_0"``, ``"Q4_K"``, ...).
        dtype: the compute dtype rows come out in (the model's; bf16 for a native GGUF model).

    Input ``input_ids`` ``(batch, seq)`` (any shape) int64 -> ``(batch, seq, hidden)`` in ``dtype``.

    Raises:
        ValueError: a ``gguf_type`` without a block form, or tensors missing, extra, or of the wrong shape or dtype.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], gguf_type: str, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        from gguf import GGML_QUANT_SIZES

        if "d" not in tensors or tensors["d"].dim() != 2:
            raise ValueError(f"a {gguf_type} block embedding needs its (rows, blocks) fp16 scales 'd'")
        block = GGML_QUANT_SIZES[_qtype(gguf_type)][0]
        rows, hidden = tensors["d"].shape[0], tensors["d"].shape[1] * block
        expected = layout(gguf_type, rows, hidden)
        got = {name: tuple(t.shape) for name, t in tensors.items()}
        if got != expected or any(t.dtype != (torch.int16 if name in ("d", "m") else torch.uint8)
                                  for name, t in tensors.items()):
            raise ValueError(f"a {gguf_type} block embedding of {rows} x {hidden} holds {expected} (d, m int16; "
                             f"the rest uint8), got {got}")
        for name in _FIELDS:
            self.register_buffer(name, tensors[name].contiguous() if name in tensors else None)
        fmt = block_format(_qtype(gguf_type))
        self.gguf_type, self.bits, self.offset, self.block = gguf_type, fmt.bits, fmt.code_offset, block
        self.num_embeddings, self.embedding_dim, self.compute_dtype = rows, hidden, dtype

    def _codes(self, ids: torch.Tensor) -> torch.Tensor:
        """The stored codes of rows ``ids`` ``(...)`` -> ``(..., hidden)`` uint8 in ``[0, 2**bits)``."""
        packed = self.codes[ids]
        if self.bits == 8:
            return packed
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)
        if self.high_bits is not None:
            shifts = torch.arange(8, dtype=torch.uint8, device=ids.device)
            fifth = (self.high_bits[ids].unsqueeze(-1) >> shifts) & 1
            codes = codes | (fifth.flatten(-2) << 4)
        return codes

    def _per_group(self, field: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """An fp16 field of rows ``ids`` as float32 ``(..., hidden / 32)``: a K-quant's super-block value repeated
        over its 8 groups."""
        value = field[ids].view(torch.float16).float()
        per = self.block // GROUP
        return value if per == 1 else value.unsqueeze(-1).expand(*value.shape, per).flatten(-2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``input_ids`` ``(batch, seq)`` of the table -> ``(batch, seq, hidden)`` in the compute dtype."""
        ids = input_ids.long()
        groups = self._codes(ids).float().reshape(*ids.shape, -1, GROUP)
        if self.offset:
            groups = groups + self.offset
        scale, minimum = self._per_group(self.d, ids), None
        if self.sub_scales is not None:
            sub = self.sub_scales[ids].float()
            scale = scale * sub[..., 0]
            minimum = -(self._per_group(self.m, ids) * sub[..., 1])
        elif self.m is not None:
            minimum = self._per_group(self.m, ids)
        weights = groups * scale.unsqueeze(-1)
        if minimum is not None:
            weights = weights + minimum.unsqueeze(-1)
        return weights.reshape(*ids.shape, self.embedding_dim).to(self.compute_dtype)

    def dequantized(self) -> torch.Tensor:
        """The whole ``(vocab, hidden)`` table in the compute dtype (``vocab x hidden x 2`` bytes at bf16), built
        :data:`TABLE_CHUNK_ROWS` rows at a time; for a caller that needs it all (an EAGLE head trainer's copy)."""
        out = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.compute_dtype, device=self.d.device)
        for start in range(0, self.num_embeddings, TABLE_CHUNK_ROWS):
            stop = min(start + TABLE_CHUNK_ROWS, self.num_embeddings)
            out[start:stop] = self(torch.arange(start, stop, device=self.d.device))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, fifth bits, fp16 fields and sub-scales, exactly."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, gguf_type={self.gguf_type}, "
                f"dtype={self.compute_dtype}, bytes={self.nbytes}")


def embedding_table(module: torch.nn.Module) -> torch.Tensor:
    """The whole ``(vocab, hidden)`` table of an input embedding: an ``nn.Embedding``'s weight as it is (detached),
    a :class:`BlockEmbedding`'s dequantized (logged: it allocates the table the module avoids holding)."""
    if isinstance(module, BlockEmbedding):
        log.info("dequantizing the whole %s input embedding (%d x %d at %s) for a copy of the table",
                 module.gguf_type, module.num_embeddings, module.embedding_dim, module.compute_dtype)
        return module.dequantized()
    return module.weight.detach()

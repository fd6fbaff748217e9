"""The KIVI-quantized KV cache per row of a batch (:class:`~toolkit.kv.quantized.QuantizedKV`, ``policy:
quantized``): each row quantizes its own oldest tokens at its own commit points, and every query sees exactly what it
sees when its row decodes alone under the policy.

Per layer, per row ``r`` (``S`` sink tokens, groups of ``G`` tokens, ``R`` residual tokens; Liu et al., ICML 2024)::

    packed     positions [S, S + quantized[r])          keys per channel, values per token, 2/4/8-bit codes
    fp buffer  slots [0, S): positions [0, S)           sinks, full precision
               slots [S, length[r]): positions + quantized[r]   the residual, full precision, newest tokens

The full-precision buffer is a :class:`~toolkit.kv.ragged.BatchCache` whose ``evicted[r]`` counts the
tokens row ``r`` moved into its packed groups (slot ``s >= S`` holds position ``s + evicted[r]``). At a commit point
(:meth:`QuantBatchCache.compress`) a row holding ``n`` tokens packs its residual's oldest whole groups up to
:meth:`~toolkit.kv.quantized.QuantizedKVCache.boundary` ``(n)`` and moves the rest of its residual down behind its
sinks, so its residual stays within ``max(R, G - 1)`` tokens plus a round's.

A forward attends to ``[dequantized groups | fp buffer | shadow]``: the shadow is the fp buffer's first whole groups
after the sinks, quantized and dequantized, for the queries that are past their boundary inside this forward (a
verify forward over W positions may straddle one). The mask shows query ``i`` of row ``r`` at position ``p`` its
packed groups, the shadow copy of positions in ``[S + evicted[r], boundary(p))`` and the full-precision copy of the
others up to ``p``: each query's autoregressive view, as in :class:`~toolkit.kv.quantized.QuantizedKVCache`. The
memory held is the packed codes, scales and zero points plus the fp buffer (sinks and residuals).
"""

from __future__ import annotations

import torch

from toolkit.kv.quant_pack import Packed, dequantize, quantize
from toolkit.kv.ragged import GROW_MIN, BatchCache, RaggedLayer, additive_mask, ragged_causal


class QuantRaggedLayer(RaggedLayer):
    """One layer: the fp buffer of :class:`RaggedLayer` (``keys`` / ``values``) and each row's packed groups.

    ``qkeys``: :class:`Packed` of ``(B, kv_heads, head_dim, capacity)`` (groups along tokens); ``qvalues``: of
    ``(B, kv_heads, capacity, head_dim)`` (groups along channels); row ``r`` holds ``evicted[r]`` tokens.
    """

    def __init__(self, owner: QuantBatchCache):
        super().__init__(owner)
        self.qkeys: Packed | None = None
        self.qvalues: Packed | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        owner = self.owner
        parts_k, parts_v = [], []
        if owner.q_span:
            parts_k.append(dequantize(_head(self.qkeys, owner.q_span, -1), keys.dtype).transpose(-1, -2))
            parts_v.append(dequantize(_head(self.qvalues, owner.q_span, -2), values.dtype))
        parts_k.append(keys)
        parts_v.append(values)
        if owner.shadow:
            lo, hi = owner.sinks, owner.sinks + owner.shadow
            parts_k.append(dequantize(self._quantize_keys(keys[:, :, lo:hi]), keys.dtype).transpose(-1, -2))
            parts_v.append(dequantize(quantize(values[:, :, lo:hi], owner.bits, owner.group), values.dtype))
        return torch.cat(parts_k, dim=-2), torch.cat(parts_v, dim=-2)

    def _quantize_keys(self, keys: torch.Tensor) -> Packed:
        return quantize(keys.transpose(-1, -2), self.owner.bits, self.owner.group)

    def pack(self, row: int, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``keys`` / ``values`` ``(kv_heads, n, head_dim)`` (``n`` whole groups) into row ``row``'s packed
        tokens ``[at, at + n)``."""
        n = keys.shape[-2]
        self.reserve_packed(at + n, keys)
        _write(self.qkeys, row, at, self._quantize_keys(keys[None]), -1)
        _write(self.qvalues, row, at, quantize(values[None], self.owner.bits, self.owner.group), -2)

    def reserve_packed(self, tokens: int, like: torch.Tensor) -> None:
        """Grow the packed buffers to hold at least ``tokens`` per row (doubling)."""
        held = 0 if self.qkeys is None else self.qkeys.length
        if tokens <= held:
            return
        group = self.owner.group
        capacity = -(-max(tokens, 2 * held, held + GROW_MIN) // group) * group
        rows = self.keys.shape[0] if self.qkeys is None else self.qkeys.data.shape[0]
        heads, dim = like.shape[-3], like.shape[-1]
        empty_k = quantize(like.new_zeros(rows, heads, dim, capacity), self.owner.bits, group)
        empty_v = quantize(like.new_zeros(rows, heads, capacity, dim), self.owner.bits, group)
        if held:
            _write(empty_k, slice(None), 0, self.qkeys, -1)
            _write(empty_v, slice(None), 0, self.qvalues, -2)
        self.qkeys, self.qvalues = empty_k, empty_v

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the packed rows ``index`` (the fp buffer is selected by the owner)."""
        if self.qkeys is not None:
            self.qkeys, self.qvalues = (Packed(*(t.index_select(0, index) for t in p.tensors()), p.bits, p.group)
                                        for p in (self.qkeys, self.qvalues))

    def packed_bytes(self) -> int:
        return 0 if self.qkeys is None else self.qkeys.nbytes() + self.qvalues.nbytes()


def _head(packed: Packed, tokens: int, token_axis: int) -> Packed:
    """The first ``tokens`` tokens of every row of ``packed`` (keys: ``token_axis`` -1, values: -2)."""
    if token_axis == -1:
        nbytes, groups = tokens * packed.bits // 8, tokens // packed.group
        return Packed(packed.data[..., :nbytes], packed.scale[..., :groups], packed.zero[..., :groups],
                      packed.bits, packed.group)
    return Packed(*(t[:, :, :tokens] for t in packed.tensors()), packed.bits, packed.group)


def _append_row(packed: Packed) -> Packed:
    """``packed`` with one more (zero) row at the end of its batch axis."""
    return Packed(*(torch.cat((t, t.new_zeros(1, *t.shape[1:]))) for t in packed.tensors()), packed.bits, packed.group)


def _write(dest: Packed, row, at: int, src: Packed, token_axis: int) -> None:
    """Copy ``src`` into ``dest``'s row(s) ``row`` from token ``at`` on (whole groups)."""
    if token_axis == -1:
        nbytes, groups = at * dest.bits // 8, at // dest.group
        starts = (nbytes, groups, groups)
        for d, s, start in zip(dest.tensors(), src.tensors(), starts):
            d[row, ..., start:start + s.shape[-1]] = s[0] if isinstance(row, int) else s
    else:
        for d, s in zip(dest.tensors(), src.tensors()):
            d[row, :, at:at + s.shape[-2]] = s[0] if isinstance(row, int) else s


class QuantBatchCache(BatchCache):
    """A batch's KIVI-quantized cache (see the module docstring); ``policy`` a :class:`QuantizedKV`."""

    layer_class = QuantRaggedLayer

    def __init__(self, num_layers: int, device: torch.device, dtype: torch.dtype = torch.float32, policy=None,
                 model=None):
        super().__init__(num_layers, device, dtype, policy, model)
        self.sinks, self.group = policy.sink_tokens, policy.quant_group_size
        self.bits, self.residual = policy.quant_bits, policy.residual_length
        self.q_span = self.shadow = 0  # packed tokens / shadow slots the next forward reads

    def boundary(self, n: torch.Tensor) -> torch.Tensor:
        """Elementwise :meth:`toolkit.kv.quantized.QuantizedKVCache.boundary`: the position before which a query
        at ``n`` (or a row of ``n`` committed tokens) sees tokens quantized (sinks excepted)."""
        s, g, r = self.sinks, self.group, self.residual
        whole = torch.div(n - s, g, rounding_mode="floor")
        residual = -torch.div(-(n - s - r), g, rounding_mode="floor")
        return torch.where(n - s - r > 0, s + g * torch.minimum(whole, residual), torch.full_like(n, s))

    def forward_inputs(self, width: int, dtype: torch.dtype | None = None) -> dict:
        """As :meth:`BatchCache.forward_inputs`, with the mask over ``[packed | fp buffer | shadow]`` (see the module
        docstring)."""
        lengths = self.lengths
        self.write_at, self.width = lengths, width
        self.span = int(lengths.max()) + width
        new = torch.arange(width, device=lengths.device).view(1, -1)
        positions = (self.committed - 1).view(-1, 1) + new  # (B, W) absolute
        bound = self.boundary(positions)[:, :, None]  # (B, W, 1)
        q_end = self.sinks + self.evicted  # (B,) first position of each row's fp residual
        self.q_span = int(self.evicted.max()) if self.rows else 0
        self.shadow = int((bound[:, -1, 0] - q_end).clamp_min(0).max())
        slots = torch.arange(self.span, device=lengths.device).view(1, 1, -1)
        held_at = slots + (slots >= self.sinks) * self.evicted.view(-1, 1, 1)
        fp = ragged_causal(lengths, width, self.span) & ((held_at < self.sinks) | (held_at >= bound))
        packed = torch.arange(self.q_span, device=lengths.device).view(1, 1, -1) < self.evicted.view(-1, 1, 1)
        shadow_at = q_end.view(-1, 1, 1) + torch.arange(self.shadow, device=lengths.device).view(1, 1, -1)
        visible = torch.cat((packed.expand(-1, width, -1), fp, shadow_at < bound), dim=-1)
        return {"position_ids": positions, "attention_mask": additive_mask(visible, dtype or self.dtype)}

    def compress(self) -> None:
        """The commit point: every row packs its residual's oldest whole groups up to ``boundary(held tokens)``."""
        held = self.committed - 1
        move = (self.boundary(held) - self.sinks - self.evicted).clamp_min(0)
        for r in torch.nonzero(move).flatten().tolist():
            n, at, length = int(move[r]), int(self.evicted[r]), int(self.lengths[r])
            lo = self.sinks
            for layer in self._layers():
                layer.pack(r, at, layer.keys[r, :, lo:lo + n], layer.values[r, :, lo:lo + n])
                layer.keys[r, :, lo:length - n] = layer.keys[r, :, lo + n:length].clone()
                layer.values[r, :, lo:length - n] = layer.values[r, :, lo + n:length].clone()
            self.evicted[r] += n

    def remove(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.committed.device)
        for layer in self._layers():
            layer.select_rows(index)
        super().remove(keep)

    def join(self, prefill, committed: int, evicted: int = 0) -> None:
        """Append a request prefilled alone under the policy: ``prefill`` a
        :class:`~toolkit.kv.quantized.QuantizedKVCache` (batch 1, committed) whose layers hold fp sinks, packed
        groups and the fp residual; its first generated token is committed and not yet in the cache."""
        from transformers import DynamicCache

        fp = DynamicCache()
        for i, single in enumerate(prefill.layers):
            parts = [t for t in (single.sink_keys, single.keys if single.residual else None) if t is not None]
            vals = [t for t in (single.sink_values, single.values if single.residual else None) if t is not None]
            fp.update(torch.cat(parts, dim=-2), torch.cat(vals, dim=-2), i)
        quantized = prefill.layers[0].q_len
        super().join(fp, committed, quantized)
        row = self.rows - 1
        for layer, single in zip(self._layers(), prefill.layers):
            layer.reserve_packed(max(quantized, self.group), layer.keys)
            if layer.qkeys.data.shape[0] < self.rows:  # the new row's packed space
                layer.qkeys, layer.qvalues = (_append_row(p) for p in (layer.qkeys, layer.qvalues))
            if quantized:
                _write(layer.qkeys, row, 0, single.qkeys, -1)
                _write(layer.qvalues, row, 0, single.qvalues, -2)

    def kv_bytes(self) -> int:
        """Bytes held: the fp buffers (sinks and residuals, allocated capacity) and the packed groups."""
        return super().kv_bytes() + sum(layer.packed_bytes() for layer in self._layers())

"""The KIVI-quantized KV cache on the engine's static cache: fixed buffers per row, packed at commit points.

KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024) as
:class:`~toolkit.kv.quantized.QuantizedKV` defines it (``S`` fp sink tokens, groups of ``G``, a residual of ``R``
newest tokens at full precision, :func:`~toolkit.kv.quantized.boundary`), in gpt-fast's static layout. Per decoder
layer, per row ``r``, allocated once::

    packed  groups of G tokens after the sinks     keys per channel, values per token, 2/4/8-bit codes with float16
                                                   scales and zero points (toolkit.kv.quant_pack)
    fp      slots [0, S): positions [0, S)         the sinks, full precision
            slot s >= S: position s + quantized[r] the residual, full precision: every token after the packed ones

``quantized[r]`` (a ``(rows,)`` device counter, mirrored on the host) counts the tokens row ``r`` has packed. A
forward of ``W`` tokens per row writes them into the fp slots by index (``position - quantized[r]``; static shapes,
no reallocation) and attends to ``[packed groups | fp slots | shadow]`` (:class:`~toolkit.kv.quant_attention.QuantKeys`:
the scores of each part, one softmax, no concatenated copy) under a boolean mask built on the device
from ``lengths`` and ``quantized`` alone. Query ``p`` sees position ``t <= p`` at full precision where ``t < S`` or
``t >= boundary(p)``, else from its quantized group — exactly the per-query view of the single-sequence
:class:`~toolkit.kv.quantized.QuantizedKVCache`, so a row decodes token for token as the policy does alone. A verify
forward may straddle a boundary: the groups after ``S + quantized[r]`` that become quantized for some of its queries
are quantized and dequantized inside the forward (the *shadow*, the first groups of the fp residual) and shown to
exactly those queries. Dequantization runs inside the (compiled) graph; rejected draft tokens lie in fp slots past
the row's length, never visible, overwritten by the next forward: rollback is exact and free.

Commit points (:meth:`StaticQuantKV.commit`, eager, host counters only) are the only place entries move: a row of
``n`` tokens packs the residual's oldest whole groups up to ``boundary(n)`` (a quantize into the packed buffers at
fixed offsets) and moves the rest of its residual down behind the sinks (a copy of static shape). The residual then
holds at most ``max(R, G - 1)`` tokens, so ``S + max(R, G - 1) + widest`` fp slots hold every forward.

Composed with StreamingLLM (:class:`~toolkit.kv.quantized.QuantizedStreamingLLM`, exact window): the packed groups
form a ring of ``(window - 1) // G + 2`` groups (group ``g`` at ring slot ``g mod groups``) and every part of the mask
adds the window, so memory is fixed whatever the generation length. Without the exact window the ring shows the
groups the commit points have not evicted (:mod:`toolkit.kv.static_stream_quant`).

A prompt is prefilled alone at full precision (a ``DynamicCache``, SDPA's causal kernel; under the window's mask in
the streaming composition), as KIVI and the single-sequence cache prefill, and packed into its row as that cache's
first commit would (:meth:`StaticQuantKV.load_row`). At a 4,096-token prompt this is the plain prefill's ~14 s on
this CPU; showing each prompt query its own quantized view instead (a shadow of every group, an explicit mask over
twice the keys) took 25-32 s.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from toolkit.kv.quant_attention import QuantKeys
from toolkit.kv.quant_pack import Packed, dequantize, quantize
from toolkit.kv.quantized import boundary
from toolkit.kv.static import SPAN_STEP, StaticKV, StaticLayer, kv_geometry, spare_rows, static_buffer


def shadow(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` / ``values`` ``(B, kv_heads, n, head_dim)`` (``n`` whole groups) quantized as the cache packs them and
    dequantized again, in their dtype."""
    dtype = keys.dtype
    k = dequantize(quantize(keys.transpose(-1, -2), bits, group), dtype).transpose(-1, -2)
    return k, dequantize(quantize(values, bits, group), dtype)


class QuantLayer(StaticLayer):
    """One decoder layer: fp slots ``keys`` / ``values`` ``(rows, kv_heads, fp_slots, head_dim)`` and the packed
    groups, ``qkeys`` a :class:`~toolkit.kv.quant_pack.Packed` of ``(rows, kv_heads, head_dim, groups * G)`` (groups
    along tokens), ``qvalues`` of ``(rows, kv_heads, groups * G, head_dim)`` (groups along channels). ``update``
    returns a :class:`~toolkit.kv.quant_attention.QuantKeys` (the packed groups, the fp parts and the forward's mask:
    attention part by part, no concatenated copy)."""

    def __init__(self, owner: StaticQuantKV, keys: torch.Tensor, values: torch.Tensor, qkeys: Packed,
                 qvalues: Packed):
        super().__init__(owner, keys, values)
        self.qkeys, self.qvalues = qkeys, qvalues

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        owner = self.owner
        rows = slice(owner.first, owner.first + key_states.shape[0])
        heads = torch.arange(key_states.shape[1], device=key_states.device).view(1, -1, 1)
        index = (owner.row_index.view(-1, 1, 1), heads, owner.write_index[:, None, :])
        self.keys.index_put_(index, key_states.to(self.keys.dtype))
        self.values.index_put_(index, value_states.to(self.values.dtype))
        keys, values = self.keys[rows], self.values[rows]
        packed, fp = owner.packed_mask, owner.fp_mask
        groups = owner.ring_groups or packed.shape[-1]  # the standalone form's mask is per group
        code_bytes = owner.group * owner.bits // 8
        qk, qv = self.qkeys, self.qvalues
        qk = Packed(qk.data[rows, ..., :groups * code_bytes], qk.scale[rows, ..., :groups], qk.zero[rows, ..., :groups],
                    qk.bits, qk.group)
        qv = Packed(*(t[rows, :, :groups * owner.group] for t in qv.tensors()), qv.bits, qv.group)
        parts_k, parts_v = [keys], [values]
        shadowed = fp.shape[-1] - keys.shape[-2]  # 0: a one-token forward right after a commit point
        if shadowed:
            lo, hi = owner.sinks, owner.sinks + shadowed
            k, v = shadow(keys[:, :, lo:hi], values[:, :, lo:hi], owner.bits, owner.group)
            parts_k.append(k)
            parts_v.append(v)
        if not owner.ring_groups:
            packed = packed.unsqueeze(-1).expand(*packed.shape, owner.group).flatten(-2)
        mask = torch.cat((packed, fp), dim=-1)
        return QuantKeys(qk, qv, parts_k, parts_v, mask), value_states

    def pack(self, row: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``keys`` / ``values`` ``(kv_heads, n * G, head_dim)`` into row ``row``'s packed groups ``slots``
        ``(n,)``."""
        owner = self.owner
        heads, _, dim = keys.shape
        n, g, bits = slots.numel(), owner.group, owner.bits
        pk, pv = quantize(keys.transpose(-1, -2), bits, g), quantize(values, bits, g)
        qk, qv = self.qkeys, self.qvalues
        allocated = qk.scale.shape[-1]
        qk.data[row].view(heads, dim, allocated, -1).index_copy_(2, slots, pk.data.view(heads, dim, n, -1))
        qk.scale[row].index_copy_(2, slots, pk.scale)
        qk.zero[row].index_copy_(2, slots, pk.zero)
        for dest, src in zip(qv.tensors(), pv.tensors()):
            dest[row].view(heads, allocated, g, -1).index_copy_(1, slots, src.view(heads, n, g, -1))

    def buffers(self):
        yield self.keys
        yield self.values
        yield from self.qkeys.tensors()
        yield from self.qvalues.tensors()


class StaticQuantKV(StaticKV):
    """The static cache of ``rows`` rows under a KIVI ``policy`` (see the module docstring).

    Args:
        model: the HF causal LM whose layers write into it.
        rows / capacity / widest / dtype / device / static_span: as :class:`~toolkit.kv.static.StaticKV`
            (``capacity``: positions per row, prompt + new tokens; it sizes the packed groups of the standalone
            form; the ring's are fixed by the window).
        policy: a :class:`~toolkit.kv.quantized.QuantizedKV`, or a
            :class:`~toolkit.kv.quantized.QuantizedStreamingLLM` with the exact window.

    Attributes:
        quantized: ``(rows,)`` long on the device, tokens each row has packed (absolute, evicted groups included);
        quantized_held: the same on the host.
        fp_slots / shadow_slots / groups: fp slots per row, shadow tokens of a wider forward, packed groups per row.
        pending_limit: tokens a row may take between commit points (the widest forward): a drafter feeding more
            commits between its forwards.

    Raises:
        ValueError: ``rows`` or ``capacity`` < 1; a streaming policy without the exact window (its form is
            :class:`~toolkit.kv.static_stream_quant.StaticStreamQuantKV`).
        ConfigError: ``quant_group_size`` does not divide the model's head_dim.
    """

    #: the StreamingLLM window this form holds: the exact one (the band mask)
    exact_window = True
    #: a prompt is prefilled whole: :meth:`load_row` packs groups from every position of it
    chunks_prompts = False

    def __init__(self, model, rows: int, capacity: int, widest: int, policy, dtype=None, device=None,
                 static_span: bool = False):
        if rows < 1 or capacity < 1:
            raise ValueError(f"rows and capacity: must be >= 1, got {rows} and {capacity}")
        streaming = getattr(policy, "window", None) is not None
        if streaming and policy.exact_window != self.exact_window:
            raise ValueError(f"policy: {type(self).__name__} holds a StreamingLLM window with exact_window "
                             f"{self.exact_window} only")
        policy.check_model(model, getattr(policy, "_prefix", "kv"))  # groups of values must divide head_dim
        layers_n, kv_heads, head_dim, dtype, device = kv_geometry(model, dtype, device)
        self.policy, self.widest, self.capacity = policy, widest, capacity
        self.window = policy if streaming else None  # StaticKV's meaning: a window fixes the memory, not capacity
        self.sinks, self.group, self.bits = policy.sink_tokens, policy.quant_group_size, policy.quant_bits
        self.residual = policy.residual_length
        self.static_span, self.pending_limit = static_span, widest
        self.fp_slots = self.sinks + max(self.residual, self.group - 1) + widest
        self.shadow_slots = self.group * ((widest - 1) // self.group + 1)
        # the standalone form's packed span is a dynamic size (in groups) of a compiled graph on CPU: at least 2
        # groups, rounded up to SPAN_STEP tokens, one step short of the buffer (see StaticKV)
        self.group_step = 1 if static_span else max(2, SPAN_STEP // self.group)
        if streaming:
            self.ring_groups = self.groups = self.ring_size()
        else:
            self.ring_groups = 0
            whole = max(1, (capacity - self.sinks) // self.group)
            self.groups = -(-whole // self.group_step) * self.group_step
        allocated = self.groups + (0 if static_span or streaming else self.group_step)
        spare = spare_rows(rows, static_span)
        per_row = (rows + spare, kv_heads)
        layers = []
        for _ in range(layers_n):
            fp = [static_buffer((*per_row, self.fp_slots, head_dim), dtype, device) for _ in range(2)]
            qk = Packed(static_buffer((*per_row, head_dim, allocated * self.group * self.bits // 8), torch.uint8,
                                      device),
                        *(static_buffer((*per_row, head_dim, allocated), torch.float16, device) for _ in range(2)),
                        self.bits, self.group)
            tokens = allocated * self.group
            qv = Packed(static_buffer((*per_row, tokens, head_dim * self.bits // 8), torch.uint8, device),
                        *(static_buffer((*per_row, tokens, head_dim // self.group), torch.float16, device)
                          for _ in range(2)), self.bits, self.group)
            layers.append(QuantLayer(self, *fp, qk, qv))
        self._adopt(layers, rows, static_span, device)
        self.quantized = torch.zeros(rows + spare, dtype=torch.long, device=device)
        self.quantized_held = [0] * rows
        self.compressions = 0
        self.write_index = self.attention_mask = self.packed_mask = self.fp_mask = None

    @property
    def dynamic_span(self) -> bool:
        """Whether the forward's ``attention_mask`` (the packed groups' mask) has a dynamic last size."""
        return not self.static_span and not self.ring_groups

    # ------------------------------------------------------------------------------------------------ a forward
    def packed_span(self, rows: range) -> int:
        """Packed groups a forward over ``rows`` reads (the standalone form): every group with ``static_span``, else
        those the rows hold, rounded up to :attr:`group_step` (host-side)."""
        if self.static_span:
            return self.groups
        held = max((self.quantized_held[r] for r in rows if r < self.allocated), default=0) // self.group
        return min(self.groups, max(self.group_step, -(-held // self.group_step) * self.group_step))

    def prepare(self, width: int, rows: range | None = None, span: int | None = None) -> dict:
        """Model inputs of a forward appending ``width`` tokens to each of ``rows``: ``position_ids`` ``(B, width)``
        and, as ``attention_mask``, the packed groups' boolean mask ``(B, 1, width, groups)`` (per token of the ring,
        ``(B, 1, width, ring tokens)``, under a window); the mask over the fp slots and the shadow ``(B, 1, width,
        fp_slots [+ shadow_slots])`` is :attr:`fp_mask`. Reads no device value.

        Raises:
            ValueError: a row would write past its fp slots (more than :attr:`pending_limit` tokens since its last
                commit point).
        """
        rows = rows if rows is not None else range(self.active)
        for r in rows:
            if r < self.allocated and self.held[r] - self.quantized_held[r] + width > self.fp_slots:
                raise ValueError(f"StaticQuantKV: row {r} cannot take {width} more tokens before a commit point "
                                 f"(its {self.fp_slots} full-precision slots hold {self.held[r]} - "
                                 f"{self.quantized_held[r]} packed)")
        device = self.lengths.device
        self.first = rows.start
        self.row_index = torch.arange(rows.start, rows.stop, device=device)
        positions = self.lengths[rows.start:rows.stop, None] + torch.arange(width, device=device)[None, :]
        quantized = self.quantized[rows.start:rows.stop, None, None]  # (B, 1, 1)
        self.write_index = positions - quantized[:, 0]
        query, bound = positions[:, :, None], boundary(positions, self.policy)[:, :, None]
        slot = torch.arange(self.fp_slots, device=device).view(1, 1, -1)
        held_at = torch.where(slot < self.sinks, slot, slot + quantized)
        parts = [(held_at, (held_at <= query) & ((held_at < self.sinks) | (held_at >= bound)))]
        if width > 1 or self._straddles(rows):
            at = self.sinks + quantized + torch.arange(self.shadow_slots, device=device).view(1, 1, -1)
            parts.append((at, at < bound))
        if self.ring_groups:
            parts.insert(0, self._ring_positions(quantized))
        else:
            groups = torch.arange(self.packed_span(rows), device=device).view(1, 1, -1) * self.group
            self.packed_mask = (groups < quantized).expand(-1, width, -1).contiguous()[:, None]
        if self.window is not None:
            parts = [(at, seen & self.window_mask(at, query, rows)) for at, seen in parts]
        if self.ring_groups:
            self.packed_mask = parts.pop(0)[1][:, None]
        self.fp_mask = torch.cat([seen for _, seen in parts], dim=-1)[:, None]
        self.attention_mask = self.packed_mask
        return {"position_ids": positions, "attention_mask": self.packed_mask, "past_key_values": self}

    def ring_size(self) -> int:
        """Packed groups of the ring under a window: every group the exact window shows some query,
        ``(window - 1) // G + 2``."""
        return (self.policy.window - 1) // self.group + 2

    def window_mask(self, at: torch.Tensor, query: torch.Tensor, rows: range) -> torch.Tensor:
        """Under a window, whether a query at ``query`` ``(B, W, 1)`` sees the entry at position ``at`` ``(B, 1, T)``
        of rows ``rows``, causality and quantization apart: the exact window."""
        return self.window.in_window(at, query)

    def _straddles(self, rows: range) -> bool:
        """Whether a one-token forward's query is past the boundary of a row's last commit point (a drafter's steps
        between commit points); a wider forward always carries the shadow."""
        return any(boundary(self.held[r], self.policy) > self.sinks + self.quantized_held[r]
                   for r in rows if r < self.allocated)

    def _ring_positions(self, quantized: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(position, packed)`` ``(B, 1, ring tokens)`` of the ring: the position each ring token holds (the newest
        packed group ``g`` with ``g mod groups`` its slot) and whether it holds one."""
        g, n = self.group, self.ring_groups
        token = torch.arange(n * g, device=quantized.device).view(1, 1, -1)
        newest = torch.div(quantized, g, rounding_mode="floor") - 1
        held = newest - torch.remainder(newest - torch.div(token, g, rounding_mode="floor"), n)
        return self.sinks + held * g + torch.remainder(token, g), held >= 0

    def dynamic_inputs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [self.packed_mask, self.fp_mask], [self.write_index]

    def tree_view(self, view) -> torch.Tensor:
        """Token trees (:mod:`toolkit.kv.static_tree`): ``view`` over the packed mask (no written slot) and the fp
        slots' mask (its shadow columns follow the rows only)."""
        self.packed_mask, _ = view(self.packed_mask, None)
        self.fp_mask, self.write_index = view(self.fp_mask, self.write_index)
        self.attention_mask = self.packed_mask
        return self.packed_mask

    def check_tree_room(self, start: int, tree) -> None:
        """No quantization group may hold a tree node below the root (its scales would depend on the path): the
        deepest query's boundary stays at or below the region's first node, as
        :func:`~toolkit.kv.quantized.check_quant_tree` (which the plan checks) ensures."""
        if boundary(start + tree.deepest, self.policy) > start + tree.rooted:
            raise ValueError(f"StaticQuantKV: a token tree {tree.deepest + (not tree.rooted)} levels deep reaches a "
                             "quantization group; residual_length must be >= tree_depth + quant_group_size - 2")

    # ------------------------------------------------------------------------------------------------ commit points
    def commit(self) -> None:
        """The commit point: every row of ``n`` tokens packs its residual's oldest whole groups up to
        ``boundary(n)`` and moves the rest of its residual down behind the sinks (see the module docstring)."""
        packed = False
        for r in range(self.active):
            move = boundary(self.held[r], self.policy) - self.sinks - self.quantized_held[r]
            if move > 0:
                self._pack_row(r, move)
                packed = True
        self.compressions += packed

    def _group_slots(self, first: int, count: int) -> torch.Tensor:
        """Packed slots of groups ``first .. first + count - 1`` (the ring's, modulo its size)."""
        groups = torch.arange(first, first + count, device=self.lengths.device)
        return torch.remainder(groups, self.ring_groups) if self.ring_groups else groups

    def _pack_row(self, row: int, move: int, skip: int = 0) -> None:
        """Row ``row`` packs the ``move`` oldest tokens of its residual (whole groups) but the first ``skip`` (whole
        groups evicted at the same commit point: dropped unpacked) and moves the rest of its residual down."""
        s, done = self.sinks, self.quantized_held[row]
        slots = self._group_slots((done + skip) // self.group, (move - skip) // self.group)
        for layer in self.layers:
            if move > skip:
                layer.pack(row, slots, layer.keys[row, :, s + skip:s + move], layer.values[row, :, s + skip:s + move])
            for buffer in (layer.keys, layer.values):
                buffer[row, :, s:self.fp_slots - move] = buffer[row, :, s + move:].clone()
        self.quantized[row] = done + move
        self.quantized_held[row] = done + move

    # ------------------------------------------------------------------------------------------------ rows
    def load_row(self, row: int, source: Cache, length: int) -> None:
        """Row ``row`` takes a prompt of ``length`` tokens prefilled alone (``source``: batch 1, every position in
        full precision), packed as the single-sequence cache's first commit packs it: sinks, whole groups up to
        ``boundary(length)`` (the ring: the newest that fit), the rest in the residual."""
        if self.window is None and length + self.widest > self.capacity:
            raise ValueError(f"StaticQuantKV: a {length}-token prompt leaves no room in capacity {self.capacity} "
                             f"for a {self.widest}-token forward")
        s, g = self.sinks, self.group
        end = boundary(length, self.policy)
        done = end - s
        first = max(0, done // g - self.ring_groups) if self.ring_groups else 0
        for layer, single in zip(self.layers, source.layers):
            keys, values = (t[0].to(layer.keys.dtype) for t in (single.keys, single.values))
            sinks = min(s, length)
            layer.keys[row, :, :sinks], layer.values[row, :, :sinks] = keys[:, :sinks], values[:, :sinks]
            if done:
                lo = s + first * g
                layer.pack(row, self._group_slots(first, done // g - first), keys[:, lo:end], values[:, lo:end])
            rest = max(0, length - end)
            layer.keys[row, :, s:s + rest], layer.values[row, :, s:s + rest] = keys[:, end:], values[:, end:]
        self.compressions += done > 0  # the commit point after the prefill (as the single-sequence cache counts it)
        self.lengths[row], self.quantized[row] = length, done
        self.held[row], self.quantized_held[row] = length, done

    def row_counters(self) -> tuple[list[torch.Tensor], list[list[int]]]:
        return [self.lengths, self.quantized], [self.held, self.quantized_held]

    # ------------------------------------------------------------------------------------------------ reports
    def needed_bytes(self) -> int:
        """Bytes of what the rows in use hold now: their packed groups (the ring's: those it keeps), sinks and
        residual (what a cache sized to the request would need)."""
        layer = self.layers[0]
        per_group = sum(t[0].nbytes for t in (*layer.qkeys.tensors(), *layer.qvalues.tensors())) // \
            layer.qkeys.scale.shape[-1]
        per_slot = (layer.keys[0].nbytes + layer.values[0].nbytes) // self.fp_slots
        total = 0
        for r in range(self.active):
            total += per_group * self.groups_held(r) + per_slot * (self.held[r] - self.quantized_held[r])
        return total * len(self.layers)

    def groups_held(self, row: int) -> int:
        """Packed groups row ``row`` holds (the ring's: at most its size)."""
        groups = self.quantized_held[row] // self.group
        return min(groups, self.ring_groups) if self.ring_groups else groups

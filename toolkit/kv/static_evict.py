"""Score-based eviction on the static engine: L2-norm (:class:`~toolkit.kv.l2norm.L2Norm`; Devoto et al., EMNLP 2024;
kvpress ``KnormPress``) and head-aware budgets (:class:`~toolkit.kv.head_aware.HeadAware`; Ada-KV / HeadKV budgets in
DuoAttention-style dense tiers) as fixed-budget buffers compacted in place at commit points.

Layout. A decoder layer's KV heads form *tiers*: a compressed L2 layer is one tier of all its heads, a head-aware
layer one tier per budget factor among its heads, a layer the policy skips (``skip_layers``) one uncompressed tier.
Each tier is a pair of preallocated buffers ``(rows, tier_heads, slots, head_dim)`` whose addresses never change:

* an uncompressed tier is the plain static cache (slot = position, ``slots`` = the request's capacity);
* a tier of budget factor ``f`` holds at most ``budget_f + compress_interval + widest`` entries per head (``budget_f =
  max(sinks + recent, round(f * policy.budget_for(length)))``), so its memory is fixed by the KV budget, not by the
  generation length, and the attention reads only what is kept.

Every row has one slot count per factor (``fill[f][r]``; the same for every layer and head of that factor, since
tiers of a factor compress at the same commit points) next to its absolute length (the next position, used for the
rotary positions of new tokens). A forward of ``W`` tokens writes each tier at slots ``fill[f][r] .. + W - 1`` and
query ``i`` sees slots ``0 .. fill[f][r] + i``: a boolean mask per factor, built from the fills alone. Rejected draft
tokens lie past the fill and are overwritten by the next forward, so rollback is exact and free, as in
:mod:`toolkit.kv.static`.

Commit points (:meth:`StaticEvictKV.commit`, after the decoder's ``accept``) are the only place entries move: a row
whose fill exceeds ``budget_f + compress_interval`` keeps, per head, what the policy's own ``select`` picks from the
row's entries (sinks, recent tokens, lowest key norms), gathered to the front of the same buffer (``index_select``
of static buffers, eager, once every ``compress_interval`` tokens). This is exactly the single-sequence policy's
rule (:class:`~toolkit.kv.base.CompressedCache`: same trigger, same budget, same selection over the same entries),
so a row decodes as it would alone under the policy whenever the rounds commit the same tokens; the forwards
themselves are shape-stable and compile (:class:`~toolkit.engine.forward.TargetForward`).

The attention (:func:`toolkit.kv.attention.static_attention`) receives a :class:`TierKeys` per layer and attends
tier by tier with each tier's mask.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from toolkit.kv.base import gather_seq
from toolkit.kv.static import SPAN_STEP, StaticKV, StaticLayer, kv_geometry, slot_bytes, spare_rows, static_buffer

#: the factor key of uncompressed tiers (skipped layers)
FULL = None


class TierKeys:
    """A layer's tiers for one forward, handed to the attention function in place of its keys.

    ``parts``: per tier ``(kv heads (n,), keys (B, n, span, d), values (B, n, span, d), boolean mask (B, 1, W,
    span))``."""

    def __init__(self, parts: list, num_kv_heads: int):
        self.parts, self.num_kv_heads = parts, num_kv_heads

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """``(B, q_heads, W, head_dim)``: each tier's query heads over its own keys, under its own mask."""
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if len(self.parts) == 1:
            _, keys, values, mask = self.parts[0]
            return sdpa(query, keys.to(query.dtype), values.to(query.dtype), attn_mask=mask, scale=scaling,
                        enable_gqa=query.shape[1] != keys.shape[1])
        groups = query.shape[1] // self.num_kv_heads
        offsets = torch.arange(groups, device=query.device)
        out = query.new_empty(query.shape[:-1] + (self.parts[0][2].shape[-1],))
        for heads, keys, values, mask in self.parts:
            q_heads = (heads[:, None] * groups + offsets).flatten()
            out[:, q_heads] = sdpa(query[:, q_heads], keys.to(query.dtype), values.to(query.dtype), attn_mask=mask,
                                   scale=scaling, enable_gqa=groups > 1)
        return out


class Tier:
    """One tier of a layer: KV heads ``heads`` of budget factor ``factor`` (``FULL``: uncompressed) in buffers
    ``(rows, len(heads), slots, head_dim)``."""

    def __init__(self, factor, heads: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, whole: bool):
        self.factor, self.heads, self.keys, self.values, self.whole = factor, heads, keys, values, whole
        self.head_index = torch.arange(len(heads), device=keys.device).view(1, -1, 1)


class EvictLayer(StaticLayer):
    """One decoder layer's tiers; ``update`` writes each tier at its factor's slots and returns :class:`TierKeys`."""

    def __init__(self, owner: StaticEvictKV, tiers: list[Tier], num_kv_heads: int):
        super().__init__(owner, tiers[0].keys, tiers[0].values)
        self.tiers, self.num_kv_heads = tiers, num_kv_heads

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        owner = self.owner
        rows = slice(owner.first, owner.first + key_states.shape[0])
        parts = []
        for tier in self.tiers:
            keys = key_states if tier.whole else key_states.index_select(1, tier.heads)
            values = value_states if tier.whole else value_states.index_select(1, tier.heads)
            index = (owner.row_index.view(-1, 1, 1), tier.head_index, owner.write_index_of[tier.factor][:, None, :])
            tier.keys.index_put_(index, keys.to(tier.keys.dtype))
            tier.values.index_put_(index, values.to(tier.values.dtype))
            mask = owner.masks[tier.factor]
            span = mask.shape[-1]
            parts.append((tier.heads, tier.keys[rows, :, :span], tier.values[rows, :, :span], mask))
        return TierKeys(parts, self.num_kv_heads), value_states

    def buffers(self):
        for tier in self.tiers:
            yield tier.keys
            yield tier.values


class StaticEvictKV(StaticKV):
    """The static cache of ``rows`` rows under an L2-norm or head-aware ``policy`` (see the module docstring).

    Args:
        model: the HF causal LM (head-aware tiers come from its calibrated head importance).
        rows / capacity / widest / dtype / device / static_span: as :class:`~toolkit.kv.static.StaticKV`
            (``capacity``: positions per row, prompt + new tokens; it sizes the uncompressed tiers and, under a
            ``keep_ratio`` budget, the largest budget).
        policy: an :class:`~toolkit.kv.l2norm.L2Norm` or :class:`~toolkit.kv.head_aware.HeadAware`.

    Attributes:
        fill: ``{factor: (rows,) long}`` on the device, slots each row holds in the tiers of ``factor``;
        fill_held: the same on the host.
        slots_of: ``{factor: slots per row}`` of the tiers' buffers.
        pending_limit: tokens a row may take between commit points (the widest forward): a drafter feeding more
            commits between its forwards.
    """

    def __init__(self, model, rows: int, capacity: int, widest: int, policy, dtype=None, device=None,
                 static_span: bool = False):
        if rows < 1 or capacity < 1:
            raise ValueError(f"rows and capacity: must be >= 1, got {rows} and {capacity}")
        layers_n, kv_heads, head_dim, dtype, device = kv_geometry(model, dtype, device)
        self.policy, self.window, self.widest, self.sinks, self.ring = policy, None, widest, 0, 0
        self.capacity, self.static_span, self.num_kv_heads = capacity, static_span, kv_heads
        self.pending_limit = widest  # a tier holds budget + interval + widest: one forward between commit points
        plans = policy.plan(model) if hasattr(policy, "plan") else [
            ([torch.arange(kv_heads)], [1.0]) if policy.compresses_layer(i) else None for i in range(layers_n)]
        plans = [([torch.arange(kv_heads)], [FULL]) if p is None else p for p in plans]
        self.factors = sorted({f for _, factors in plans for f in factors if f is not FULL})
        self.slots_of = {f: self._slots(f, capacity) for f in self.factors}
        self.slots_of[FULL] = capacity
        spare = spare_rows(rows, static_span)
        layers = []
        for heads_of, factors in plans:
            tiers = []
            for heads, factor in zip(heads_of, factors):
                pad = 0 if static_span or factor is not FULL else SPAN_STEP
                shape = (rows + spare, len(heads), self.slots_of[factor] + pad, head_dim)
                tiers.append(Tier(factor, heads.to(device), static_buffer(shape, dtype, device),
                                  static_buffer(shape, dtype, device), len(heads_of) == 1))
            layers.append(EvictLayer(self, tiers, kv_heads))
        self._adopt(layers, rows, static_span, device)
        self.fill = {f: torch.zeros(rows + spare, dtype=torch.long, device=device) for f in self.factors}
        self.fill_held = {f: [0] * rows for f in self.factors}
        self.compressions = 0
        self.write_index = self.attention_mask = None
        self.write_index_of, self.masks = {}, {}

    def _slots(self, factor: float, capacity: int) -> int:
        """Slots per row of a tier of ``factor``: its largest budget + the commit slack + one forward (at most the
        request's capacity)."""
        return min(capacity, self.budget(factor, capacity) + self.policy.compress_interval + self.widest)

    def budget(self, factor: float, length: int) -> int:
        """Entries per head a tier of ``factor`` keeps after compressing a row of ``length`` tokens."""
        sinks, recent = self.policy.protected()
        return max(sinks + recent, round(factor * self.policy.budget_for(length)))

    def fits(self, capacity: int) -> bool:
        return self.capacity >= capacity

    # ------------------------------------------------------------------------------------------------ a forward
    def prepare(self, width: int, rows: range | None = None, span: int | None = None) -> dict:
        """As :meth:`StaticKV.prepare`, with one write index ``(B, W)`` and one boolean mask ``(B, 1, W, span_f)``
        per factor: a tier of factor ``f`` attends to all its slots (a static span), the uncompressed tier to the
        slots in use, rounded up to :data:`~toolkit.kv.static.SPAN_STEP` (every slot with ``static_span``)."""
        rows = rows if rows is not None else range(self.active)
        self.first = rows.start
        self.row_index = torch.arange(rows.start, rows.stop, device=self.lengths.device)
        new = torch.arange(width, device=self.lengths.device)[None, :]
        positions = self.lengths[rows.start:rows.stop, None] + new
        fills = {FULL: positions} | {f: self.fill[f][rows.start:rows.stop, None] + new for f in self.factors}
        spans = {f: self.slots_of[f] for f in self.factors}
        spans[FULL] = span if span is not None else self.span_for(width, rows)
        for factor, index in fills.items():
            slot = torch.arange(spans[factor], device=index.device).view(1, 1, -1)
            self.write_index_of[factor] = index
            self.masks[factor] = (slot <= index[:, :, None])[:, None]
        self.write_index, self.attention_mask = positions, self.masks[FULL]
        return {"position_ids": positions, "attention_mask": self.attention_mask, "past_key_values": self}

    def dynamic_inputs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(masks, write indices)`` of the current forward; only the uncompressed mask's span is dynamic."""
        return list(self.masks.values()), list(self.write_index_of.values())

    def tree_view(self, view) -> torch.Tensor:
        """Token trees (:mod:`toolkit.kv.static_tree`): ``view`` over every factor's mask and write index (the model's
        ``attention_mask`` stays the same factor's: the uncompressed tier's, or a single tier's)."""
        main = next(f for f, mask in self.masks.items() if mask is self.attention_mask)
        for factor in self.masks:
            self.masks[factor], self.write_index_of[factor] = view(self.masks[factor], self.write_index_of[factor])
        self.write_index, self.attention_mask = self.write_index_of[main], self.masks[main]
        return self.attention_mask

    def tree_entries(self):
        """Every tier's keys and values, at its factor's write index."""
        for layer in self.layers:
            for tier in layer.tiers:
                yield tier.keys, self.write_index_of[tier.factor]
                yield tier.values, self.write_index_of[tier.factor]

    def accept(self, kept: torch.Tensor, kept_host: list[int], rows: range | None = None) -> None:
        rows = rows if rows is not None else range(self.active)
        for factor in self.factors:
            self.fill[factor][rows.start:rows.stop] += kept
            for r, k in zip(rows, kept_host):
                self.fill_held[factor][r] += k
        super().accept(kept, kept_host, rows)

    def commit(self) -> None:
        """The commit point: every row over ``budget_f + compress_interval`` in a factor's tiers keeps, per head, what
        the policy selects from its entries, gathered to the front (see the module docstring)."""
        compressed = False
        for factor in self.factors:
            for r in range(self.active):
                n, budget = self.fill_held[factor][r], self.budget(factor, self.held[r])
                if n > budget + self.policy.compress_interval:
                    self._compact(factor, r, n, budget)
                    compressed = True
        self.compressions += compressed

    def _compact(self, factor: float, row: int, n: int, budget: int) -> None:
        """Row ``row`` of every tier of ``factor`` keeps the policy's ``budget`` of its ``n`` entries per head."""
        for index, layer in enumerate(self.layers):
            for tier in layer.tiers:
                if tier.factor == factor:
                    keys, values = self.kept(tier.keys[row:row + 1, :, :n], tier.values[row:row + 1, :, :n], index,
                                             budget)
                    tier.keys[row:row + 1, :, :budget], tier.values[row:row + 1, :, :budget] = keys, values
        self.fill[factor][row] = budget
        self.fill_held[factor][row] = budget

    def kept(self, keys: torch.Tensor, values: torch.Tensor, layer: int, budget: int):
        """What a compaction of layer ``layer`` keeps of one row's entries ``keys`` / ``values`` ``(1, heads, n,
        head_dim)``: per head the ``budget`` entries the policy's ``select`` picks, in order, ``(1, heads, budget,
        head_dim)`` each."""
        keep = self.policy.select(keys, values, layer, budget)
        return gather_seq(keys, keep), gather_seq(values, keep)

    # ------------------------------------------------------------------------------------------------ rows
    def load_row(self, row: int, source: Cache, length: int) -> None:
        """Row ``row`` takes a prompt of ``length`` tokens prefilled alone (``source``: batch 1, every position),
        compressed as the policy's commit after the prefill would (over budget + interval: down to the budget)."""
        if length + self.widest > self.capacity:
            raise ValueError(f"StaticEvictKV: a {length}-token prompt leaves no room in capacity {self.capacity} "
                             f"for a {self.widest}-token forward")
        for index, (layer, single) in enumerate(zip(self.layers, source.layers)):
            for tier in layer.tiers:
                keys = single.keys[:, tier.heads.to(single.keys.device)].to(tier.keys.dtype)
                values = single.values[:, tier.heads.to(single.values.device)].to(tier.values.dtype)
                if tier.factor is not FULL:
                    budget = self.budget(tier.factor, length)
                    if length > budget + self.policy.compress_interval:
                        keys, values = self.kept(keys, values, index, budget)
                tier.keys[row, :, :keys.shape[-2]] = keys[0]
                tier.values[row, :, :values.shape[-2]] = values[0]
        compacted = False
        for factor in self.factors:
            budget = self.budget(factor, length)
            kept = budget if length > budget + self.policy.compress_interval else length
            compacted |= kept < length
            self.fill[factor][row] = kept
            self.fill_held[factor][row] = kept
        self.compressions += compacted  # the commit point after the prefill (as the single-sequence cache counts it)
        self.lengths[row] = length
        self.held[row] = length

    def row_counters(self) -> tuple[list[torch.Tensor], list[list[int]]]:
        """The lengths and every factor's fills (moved and reset with the rows)."""
        return [self.lengths, *self.fill.values()], [self.held, *self.fill_held.values()]

    # ------------------------------------------------------------------------------------------------ reports
    def needed_bytes(self) -> int:
        """Bytes of the entries the rows in use hold now (what a cache sized to the request would need)."""
        total = 0
        for layer in self.layers:
            for tier in layer.tiers:
                fills = self.held if tier.factor is FULL else self.fill_held[tier.factor]
                per_slot = 2 * slot_bytes(tier.keys)
                total += per_slot * sum(fills[: self.active])
        return total

"""Score-based eviction per row of a batch: L2-norm (:class:`~toolkit.kv.l2norm.L2Norm`; Devoto et al., EMNLP 2024;
kvpress ``KnormPress``) and head-aware budgets (:class:`~toolkit.kv.head_aware.HeadAware`; Ada-KV / HeadKV budgets
in DuoAttention-style dense tiers), each row compressed at its own commit points.

A layer's KV heads form *tiers*: a compressed L2 layer is one tier of all its heads, a head-aware layer one tier per
budget factor, a layer the policy skips (``skip_layers``) one uncompressed tier. Every tier is a ragged buffer
(:class:`TierBuffer`, the layout of :class:`~toolkit.kv.ragged.BatchCache`): row ``r`` holds its
entries compacted into its first ``length`` slots, the same number for every head of the tier, so its rejected
drafts lie past its length and are overwritten by its next forward. Tiers of the same budget factor compress at the
same commit points in every layer, so a row has one length per factor (``evicted[factor][r]`` positions dropped;
uncompressed tiers hold all ``committed[r] - 1``). At a commit point a row whose tier holds more than its budget +
``compress_interval`` keeps, per head, what the policy's own ``select`` picks from that row's entries (sinks, recent
tokens, lowest key norms), gathered to the front (:meth:`EvictBatchCache.compress`). A layer hands the attention an
object that attends tier by tier with each tier's mask (:class:`TierKeys`, read by the toolkit's attention function
:func:`toolkit.kv.attention.compressed_attention`, which the policy installs for the call).

Which entries a row keeps depends on when it compresses, and a batch commits at round boundaries chosen for the whole
batch: a row's greedy output equals its prompt decoded alone under the policy when the rounds commit the same tokens
(autoregressive rows, or no compression between the prefill and the end: tested), and is the policy applied to that
row's own entries in any case.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from toolkit.kv.base import gather_seq
from toolkit.kv.ragged import BatchCache, RaggedLayer, additive_mask, ragged_causal

#: the tier key of uncompressed layers
FULL = None


class TierBuffer(RaggedLayer):
    """One tier's keys and values ``(B, tier_heads, capacity, head_dim)``, written at its factor's row offsets."""

    def __init__(self, owner: EvictBatchCache, factor: float | None, heads: torch.Tensor):
        super().__init__(owner)
        self.factor, self.heads = factor, heads

    def offsets(self) -> tuple[torch.Tensor, int]:
        return self.owner.offsets_of[self.factor]


class TierKeys:
    """A layer's tiers for one forward: what :func:`~toolkit.kv.attention.compressed_attention` calls ``attend`` on.

    ``parts``: ``(kv heads (n,), keys, values, additive mask (B, 1, W, span))`` per tier."""

    def __init__(self, parts: list, num_kv_heads: int):
        self.parts, self.num_kv_heads = parts, num_kv_heads

    def attend(self, query: torch.Tensor, scaling: float, mask=None) -> torch.Tensor:
        """``(B, q_heads, W, head_dim)``: each tier's query heads over its own keys, with its own mask."""
        if len(self.parts) == 1:
            _, keys, values, tier_mask = self.parts[0]
            return torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, attn_mask=tier_mask, scale=scaling, enable_gqa=query.shape[1] != keys.shape[1])
        groups = query.shape[1] // self.num_kv_heads
        out = query.new_empty(query.shape[:-1] + (self.parts[0][2].shape[-1],))
        offsets = torch.arange(groups, device=query.device)
        for heads, keys, values, tier_mask in self.parts:
            q_heads = (heads[:, None] * groups + offsets).flatten()
            out[:, q_heads] = torch.nn.functional.scaled_dot_product_attention(
                query[:, q_heads], keys, values, attn_mask=tier_mask, scale=scaling, enable_gqa=groups > 1)
        return out


class EvictLayer(DynamicLayer):
    """One decoder layer: its tiers (:class:`TierBuffer`), updated together."""

    def __init__(self, owner: EvictBatchCache, tiers: list[TierBuffer], num_kv_heads: int):
        super().__init__()
        self.owner, self.tiers, self.num_kv_heads = owner, tiers, num_kv_heads

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        parts = []
        for tier in self.tiers:
            heads = tier.heads.to(key_states.device)
            whole = len(self.tiers) == 1
            keys, values = tier.update(key_states if whole else key_states.index_select(1, heads),
                                       value_states if whole else value_states.index_select(1, heads))
            parts.append((heads, keys, values, self.owner.masks[tier.factor]))
        self.is_initialized = True
        return TierKeys(parts, self.num_kv_heads), value_states

    def get_seq_length(self) -> int:
        return self.owner.span_full - self.owner.width if self.is_initialized else 0


class EvictBatchCache(BatchCache):
    """A batch's cache under L2-norm or head-aware eviction, per row (see the module docstring).

    Args:
        num_layers / device / dtype: as :class:`BatchCache`.
        policy: an :class:`~toolkit.kv.l2norm.L2Norm` or :class:`~toolkit.kv.head_aware.HeadAware`.
        model: the target (head-aware tiers come from its calibrated head importance).
    """

    def __init__(self, num_layers: int, device: torch.device, dtype: torch.dtype = torch.float32, policy=None,
                 model=None):
        self.policy = policy
        config = model.config.get_text_config(decoder=True)
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        plan = policy.plan(model) if hasattr(policy, "plan") else [
            ([torch.arange(self.num_kv_heads)], [1.0]) if policy.compresses_layer(i) else None
            for i in range(num_layers)]
        self._plan = [([torch.arange(self.num_kv_heads)], [FULL]) if p is None else p for p in plan]
        self.factors = sorted({f for _, factors in self._plan for f in factors if f is not FULL})
        super().__init__(num_layers, device, dtype, policy, model)
        self.evicted_of = {f: self.committed.new_zeros(0) for f in self.factors}
        self.masks: dict = {}
        self.offsets_of: dict = {}
        self.span_full = 0

    def new_layer(self, index: int) -> EvictLayer:
        heads, factors = self._plan[index]
        return EvictLayer(self, [TierBuffer(self, f, h) for h, f in zip(heads, factors)], self.num_kv_heads)

    def tier_lengths(self, factor) -> torch.Tensor:
        """``(B,)`` slots each row holds in the tiers of ``factor`` (``FULL``: every position but the last)."""
        held = self.committed - 1
        return held if factor is FULL else held - self.evicted_of[factor]

    def _buffers(self):
        for layer in self.cache.layers:
            for tier in layer.tiers:
                if tier.is_initialized:
                    yield tier

    # ------------------------------------------------------------------------------------------------ a forward
    def forward_inputs(self, width: int, dtype: torch.dtype | None = None) -> dict:
        """``position_ids`` ``(B, width)`` (absolute) and, per factor, the additive mask ``(B, 1, width, span)``:
        query ``i`` of row ``r`` sees the first ``length + i`` slots of its tiers of that factor."""
        new = torch.arange(width, device=self.committed.device).view(1, -1)
        for factor in [FULL, *self.factors]:
            lengths = self.tier_lengths(factor)
            span = int(lengths.max()) + width
            self.offsets_of[factor] = (lengths, span)
            self.masks[factor] = additive_mask(ragged_causal(lengths, width, span), dtype or self.dtype)
        self.width, self.span_full = width, self.offsets_of[FULL][1]
        return {"position_ids": (self.committed - 1).view(-1, 1) + new, "attention_mask": self.masks[FULL]}

    def compress(self) -> None:
        """The commit point: per row and factor, tiers holding more than their budget + ``compress_interval``
        keep, per head, the policy's selection, gathered to their first slots."""
        policy = self.policy
        floor = policy.sink_tokens + policy.protect_recent
        for factor in self.factors:
            for r, n in enumerate(self.tier_lengths(factor).tolist()):
                budget = max(floor, round(factor * policy.budget_for(int(self.committed[r]) - 1)))
                if n <= budget + policy.compress_interval:
                    continue
                for index, layer in enumerate(self.cache.layers):
                    for tier in layer.tiers:
                        if tier.factor == factor and tier.is_initialized:
                            keys, values = tier.keys[r:r + 1, :, :n], tier.values[r:r + 1, :, :n]
                            keep = policy.select(keys, values, index, budget)
                            tier.keys[r:r + 1, :, :budget] = gather_seq(keys, keep)
                            tier.values[r:r + 1, :, :budget] = gather_seq(values, keep)
                self.evicted_of[factor][r] += n - budget

    # ------------------------------------------------------------------------------------------------ layout
    def remove(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.committed.device)
        for tier in self._buffers():
            tier.keys, tier.values = tier.keys.index_select(0, index), tier.values.index_select(0, index)
        self.committed = self.committed.index_select(0, index)
        self.evicted_of = {f: e.index_select(0, index) for f, e in self.evicted_of.items()}

    def join(self, prefill, committed: int, evicted: int = 0) -> None:
        """Append a request prefilled alone under the policy (its commit may have compressed it already): every
        tier's entries as they are."""
        dropped = {}
        for layer, single in zip(self.cache.layers, prefill.layers):
            parts = single.tier_keys if hasattr(single, "tier_keys") else [single.keys]
            vals = single.tier_values if hasattr(single, "tier_values") else [single.values]
            for tier, keys, values in zip(layer.tiers, parts, vals):
                tier.append_row(keys, values)
                if tier.factor is not FULL:
                    dropped[tier.factor] = committed - 1 - keys.shape[-2]
            layer.is_initialized = True
        self.committed = torch.cat([self.committed, self.committed.new_tensor([committed])])
        self.evicted_of = {f: torch.cat([e, e.new_tensor([dropped.get(f, 0)])]) for f, e in self.evicted_of.items()}

    def kv_bytes(self) -> int:
        return sum(t.keys.nbytes + t.values.nbytes for t in self._buffers())


"""Score-based eviction per row of a batch: the L2-norm policy (:class:`~toolkit.kv.l2norm.L2Norm`; Devoto et al.,
EMNLP 2024; kvpress ``KnormPress``) applied to each row at its own commit points.

Every row of every compressed layer keeps, per KV head, the same number of entries (its sinks, its most recent
tokens and its lowest-norm keys), compacted into its first ``length[r]`` slots, so the batch layout of
:class:`~toolkit.speculative.batch_cache.BatchCache` holds: a row's rejected drafts lie past its length, a row's
compression gathers its kept entries per head to the front (:meth:`EvictBatchCache.compress`, the single-sequence
policy's own ``select`` on that row's entries). Layers the policy leaves uncompressed (``skip_layers``) hold every
position. The two groups of layers have different lengths per row, so their attention cannot share one mask: a layer
returns its keys as an object that attends with its own group's mask (:class:`GroupKeys`, read by the toolkit's
attention function :func:`toolkit.kv.attention.compressed_attention`, which the policy installs for the call).

Which entries a row keeps depends on when it compresses (every ``compress_interval`` tokens past its budget, at
commit points), and a batch commits at round boundaries chosen for the whole batch: a row's greedy output equals its
prompt decoded alone under the policy when the rounds commit the same tokens (autoregressive rows: tested), and is
the policy applied to that row's own entries in any case.
"""

from __future__ import annotations

import torch

from toolkit.kv.attention import sdpa
from toolkit.kv.base import gather_seq
from toolkit.speculative.batch_cache import GROW_MIN, BatchCache, RaggedLayer


class GroupKeys:
    """A layer's keys for one forward with the additive mask of its group of layers: what
    :func:`~toolkit.kv.attention.compressed_attention` calls ``attend`` on."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor):
        self.keys, self.values, self.mask = keys, values, mask

    def attend(self, query: torch.Tensor, scaling: float, mask=None) -> torch.Tensor:
        """``(B, q_heads, W, head_dim)`` attention of ``query`` over the group's visible slots."""
        return sdpa(query, self.keys, self.values, self.mask, scaling)


class EvictLayer(RaggedLayer):
    """A :class:`RaggedLayer` of one group: compressed (per-row lengths ``BatchCache.lengths``) or not (every
    position: ``committed - 1``)."""

    def __init__(self, owner: EvictBatchCache, compressed: bool):
        super().__init__(owner)
        self.compressed = compressed

    def offsets(self) -> tuple[torch.Tensor, int]:
        return self.owner.group_offsets(self.compressed)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        return GroupKeys(keys, values, self.owner.masks[self.compressed]), values


class EvictBatchCache(BatchCache):
    """A batch's cache under a score-based eviction policy, per row (see the module docstring).

    ``evicted[r]`` counts the positions row ``r``'s compressed layers dropped; uncompressed layers hold all
    ``committed[r] - 1``.
    """

    def __init__(self, num_layers: int, device: torch.device, policy):
        self.policy = policy
        self._groups = [policy.compresses_layer(i) for i in range(num_layers)]
        super().__init__(num_layers, device)
        self.masks: dict[bool, torch.Tensor] = {}
        self._offsets: dict[bool, tuple[torch.Tensor, int]] = {}

    def new_layer(self, index: int) -> EvictLayer:
        return EvictLayer(self, self._groups[index])

    def group_offsets(self, compressed: bool) -> tuple[torch.Tensor, int]:
        """``(write_at (B,), span)`` of the current forward for the compressed or the uncompressed layers."""
        return self._offsets[compressed]

    def forward_inputs(self, width: int, dtype: torch.dtype) -> dict:
        """``position_ids`` ``(B, width)`` (absolute) and each group's additive mask ``(B, 1, width, span)``: query
        ``i`` of row ``r`` sees its group's first ``length + i`` slots."""
        new = torch.arange(width, device=self.committed.device).view(1, -1)
        positions = (self.committed - 1).view(-1, 1) + new
        for compressed, lengths in ((True, self.lengths), (False, self.committed - 1)):
            span = int(lengths.max()) + width
            self._offsets[compressed] = (lengths, span)
            slots = torch.arange(span, device=lengths.device).view(1, 1, -1)
            visible = slots <= (lengths.view(-1, 1) + new)[:, :, None]
            self.masks[compressed] = torch.zeros(visible.shape, dtype=dtype, device=lengths.device).masked_fill(
                ~visible, torch.finfo(dtype).min)[:, None]
        self.width = width
        return {"position_ids": positions, "attention_mask": self.masks[False]}

    def compress(self) -> None:
        """The commit point: a row whose compressed layers hold more than ``budget + compress_interval`` entries
        keeps, per layer and head, the ``budget`` the policy selects, gathered to its first slots."""
        policy = self.policy
        for r, n in enumerate(self.lengths.tolist()):
            budget = policy.budget_for(int(self.committed[r]) - 1)
            if n <= budget + policy.compress_interval:
                continue
            for index, layer in enumerate(self.cache.layers):
                if layer.compressed and layer.is_initialized:
                    keys, values = layer.keys[r:r + 1, :, :n], layer.values[r:r + 1, :, :n]
                    keep = policy.select(keys, values, index, budget)
                    layer.keys[r:r + 1, :, :budget] = gather_seq(keys, keep)
                    layer.values[r:r + 1, :, :budget] = gather_seq(values, keep)
            self.evicted[r] += n - budget

    def join(self, prefill, committed: int, evicted: int = 0) -> None:
        """Append a request prefilled alone under the policy (its commit may have compressed it already): every
        layer's entries as they are, uncompressed layers holding all ``committed - 1``."""
        held = [single.keys.shape[-2] for single in prefill.layers]
        dropped = committed - 1 - min(h for h, c in zip(held, self._groups) if c) if any(self._groups) else 0
        for layer, single in zip(self.cache.layers, prefill.layers):
            n = single.keys.shape[-2]
            if not layer.is_initialized:
                layer.reserve(n + GROW_MIN, single.keys[:0])
            elif layer.keys.shape[-2] < n:
                layer.reserve(n, layer.keys)
            row_k, row_v = layer.keys.new_zeros(1, *layer.keys.shape[1:]), layer.values.new_zeros(
                1, *layer.values.shape[1:])
            row_k[:, :, :n], row_v[:, :, :n] = single.keys, single.values
            layer.keys, layer.values = torch.cat([layer.keys, row_k]), torch.cat([layer.values, row_v])
        self.committed = torch.cat([self.committed, self.committed.new_tensor([committed])])
        self.evicted = torch.cat([self.evicted, self.evicted.new_tensor([dropped])])

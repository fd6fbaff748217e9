"""The KV cache of a batch of sequences that each accept their own number of draft tokens per round.

One ``transformers.DynamicCache`` holds every active row: per layer keys / values ``(B, kv_heads, S, head_dim)``, and
``valid`` ``(B, S)`` says which slots hold an entry of that row. A row's entries are in order of position but need not
be contiguous: a round appends ``W`` slots to every row (its last committed token, its drafts, padding), after
verification only the row's first ``1 + accepted`` of them stay valid, and the cache is cropped to the longest kept
block. The rejected slots of rows that accepted less are *holes*: masked out of every later forward, and squeezed out
by :meth:`BatchCache.compact` once they are a fixed share of the cache. Rows leave (:meth:`remove`) and join
(:meth:`join`, left-padded to the common length) between rounds.

Invariant between rounds, per row ``r``: ``committed[r]`` tokens are committed and the valid slots hold the first
``committed[r] - 1`` of them (the last one is the next forward's first input), at positions ``0 .. committed[r] - 2``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

#: compact when the holes and the left padding are more than this share of the slots
HOLE_SHARE = 0.25


class BatchCache:
    """A batch's cache with per-row validity (see the module docstring).

    Attributes:
        cache: the ``DynamicCache`` passed to the model.
        valid: ``(B, S)`` bool, slot ``s`` of row ``r`` holds an entry of row ``r``.
        committed: ``(B,)`` long, tokens committed per row (prompt included).
    """

    def __init__(self, cache: DynamicCache, valid: torch.Tensor, committed: torch.Tensor):
        self.cache, self.valid, self.committed = cache, valid, committed

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def _layers(self):
        return [layer for layer in self.cache.layers if layer.is_initialized]

    # ------------------------------------------------------------------------------------------------ a forward
    def forward_inputs(self, width: int, dtype: torch.dtype) -> dict:
        """``position_ids`` ``(B, width)`` and the additive ``attention_mask`` ``(B, 1, width, S + width)`` of a
        forward appending ``width`` tokens per row: each query sees its row's valid slots and the new block causally."""
        device = self.valid.device
        positions = (self.committed - 1).view(-1, 1) + torch.arange(width, device=device).view(1, -1)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        visible = torch.cat([self.valid[:, None, :].expand(-1, width, -1),
                             causal[None].expand(self.rows, -1, -1)], dim=2)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
        return {"position_ids": positions, "attention_mask": mask[:, None]}

    def accept(self, kept: torch.Tensor, width: int) -> None:
        """After a forward of ``width`` slots: row ``r`` keeps its first ``kept[r]`` new slots (``1 + accepted``);
        the cache is cropped to the longest kept block and ``committed`` advances by ``kept``."""
        device = self.valid.device
        new = torch.arange(width, device=device).view(1, -1) < kept.view(-1, 1)
        longest = int(kept.max())
        if width > longest:
            self.cache.crop(longest - width)
        self.valid = torch.cat([self.valid, new[:, :longest]], dim=1)
        self.committed = self.committed + kept
        if self.slots > 8 and self.valid.sum(1).max() < (1 - HOLE_SHARE) * self.slots:
            self.compact()

    # ------------------------------------------------------------------------------------------------ layout
    def compact(self) -> None:
        """Squeeze out holes: every row's valid slots, in order, right-aligned in ``max(valid per row)`` slots."""
        counts = self.valid.sum(1)
        width = int(counts.max())
        order = torch.sort(self.valid.long(), dim=1, stable=True).indices  # invalid slots first, then valid in order
        index = order[:, self.slots - width:]
        for layer in self._layers():
            gather = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.valid = torch.arange(width, device=self.valid.device).view(1, -1) >= (width - counts).view(-1, 1)

    def remove(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices, in the new order)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.valid.device)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self.valid, self.committed = self.valid.index_select(0, index), self.committed.index_select(0, index)
        if self.rows and self.valid.sum(1).max() < (1 - HOLE_SHARE) * self.slots:
            self.compact()

    def join(self, other: BatchCache) -> None:
        """Append ``other``'s rows (a freshly prefilled request), both left-padded to the longer slot count."""
        if self.rows == 0:
            self.cache, self.valid, self.committed = other.cache, other.valid, other.committed
            return
        slots = max(self.slots, other.slots)
        mine, theirs = self._layers(), other._layers()
        for a, b in zip(mine, theirs):
            a.keys = torch.cat([_left_pad(a.keys, slots), _left_pad(b.keys, slots)], dim=0)
            a.values = torch.cat([_left_pad(a.values, slots), _left_pad(b.values, slots)], dim=0)
        pad = lambda v: torch.cat([v.new_zeros(v.shape[0], slots - v.shape[1]), v], dim=1)  # noqa: E731
        self.valid = torch.cat([pad(self.valid), pad(other.valid)], dim=0)
        self.committed = torch.cat([self.committed, other.committed])

    def kv_bytes(self) -> int:
        """Bytes of the batch's keys and values (holes and padding included: they are held)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self._layers())


def _left_pad(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    """``(B, H, S, D)`` -> ``(B, H, slots, D)`` with zeros before the existing slots."""
    missing = slots - tensor.shape[2]
    if missing == 0:
        return tensor
    return torch.cat([tensor.new_zeros(tensor.shape[0], tensor.shape[1], missing, tensor.shape[3]), tensor], dim=2)

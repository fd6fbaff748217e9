"""The static KV cache of the compiled engine: preallocated, written by position, rolled back by moving a length.

gpt-fast's layout through transformers' own ``StaticCache``: per layer one ``(1, kv_heads, capacity, head_dim)``
key and value buffer allocated at the first forward; a forward writes its new entries at the next positions
(``index_copy_`` at the layer's length, a tensor); the attention mask spans all ``capacity`` slots and hides every
slot past the query's position, so entries of rejected draft tokens left behind a rollback are never read, and the
next forward overwrites them. Rollback (:meth:`crop` with ``-n``) subtracts ``n`` from the per-layer length in place:
nothing is moved, freed or re-allocated, and buffer addresses never change (what compiled graphs and CUDA graphs
need).

Capacity is fixed per request: prompt + ``max_new_tokens`` + the widest verify forward, rounded up to 512 so
that requests of similar length share one compiled graph (:func:`capacity_for`).

This cache holds every position (no compression); KV policies keep their own caches on the eager path. Token trees
need a gather over the appended tail, which this cache does not offer: :meth:`keep_tail` raises.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

#: capacities are multiples of this many tokens (one compiled graph serves every request up to it)
CAPACITY_STEP = 512


def capacity_for(tokens: int, step: int = CAPACITY_STEP) -> int:
    """The smallest multiple of ``step`` that holds ``tokens`` positions. Raises ``ValueError`` for ``tokens < 1``."""
    if tokens < 1:
        raise ValueError(f"tokens: must be >= 1, got {tokens}")
    return -(-tokens // step) * step


class StaticKVCache(StaticCache):
    """A ``StaticCache`` of ``capacity`` positions that speaks the decode loop's cache protocol
    (:class:`~toolkit.kv.contract.CacheProtocol`): ``crop(-n)`` = exact rollback of the last ``n`` positions,
    ``commit()`` = nothing to compress, ``forward_kwargs`` = absolute ``position_ids``.

    Args:
        model: the HF causal LM whose layers write into it.
        capacity: positions per layer (tokens).
    """

    compressions = 0

    def __init__(self, model, capacity: int):
        super().__init__(config=model.config, max_cache_len=capacity)
        self.capacity = capacity

    def commit(self) -> None:
        """A commit point: nothing to do (no compression)."""

    def keep_tail(self, keep) -> None:
        raise NotImplementedError("StaticKVCache: token trees run on the eager cache (no gather over the tail)")

    def forward_kwargs(self, position_ids: torch.Tensor, tree_mask: torch.Tensor | None = None) -> dict:
        if tree_mask is not None:
            raise NotImplementedError("StaticKVCache: token trees run on the eager cache")
        return {"position_ids": position_ids}

    def kv_bytes(self) -> int:
        """Bytes of the allocated key and value buffers (all ``capacity`` slots: the memory really held)."""
        return sum(t.nbytes for layer in self.layers if layer.is_initialized for t in (layer.keys, layer.values))

"""The KV cache of a batch of sequences that each accept their own number of draft tokens per round.

Every row owns the first ``length[r]`` slots of a preallocated per-layer buffer ``(B, kv_heads, capacity, head_dim)``
(:class:`RaggedLayer`, a ``transformers`` cache layer): slot ``s`` of row ``r`` holds position ``s``. A forward
appending ``W`` tokens per row writes them at each row's own offset (slots ``length[r] .. length[r] + W - 1``, a
scatter) and the model attends to the first ``max(length) + W`` slots through a per-row causal mask
(:meth:`BatchCache.forward_inputs`). Verification then just advances each row's length by what it kept
(:meth:`BatchCache.accept`): the rejected slots lie past the row's length and are overwritten by its next forward.
So ragged acceptance leaves no holes and needs no compaction, and a forward copies only its new keys and values (a
``DynamicCache`` concatenates the whole cache every forward). This is the layout of gpt-fast's static cache and
vLLM's per-sequence slots, with one buffer per layer. Rows leave (:meth:`remove`) and join (:meth:`join`: a
request prefilled alone) between rounds; the buffer grows by doubling when a row would run past it.

StreamingLLM per row (Xiao et al., ICLR 2024; :class:`toolkit.kv.streaming.StreamingLLM` with absolute positions and
the exact window, passed as ``streaming``): every query sees its row's ``sinks`` first positions and its own last
``window`` positions (the band mask of the single-sequence policy), and at each commit point a row holding more than
``sinks + window + interval`` slots moves its last ``window`` down behind its sinks (:meth:`compress`), counting
what it dropped in ``evicted[r]``: slot ``s`` then holds position ``s`` below ``sinks``, else ``s + evicted[r]``.
Since the mask shows exactly what the policy keeps, each row decodes as it does alone under the policy.

Invariant between rounds, per row ``r``: ``committed[r]`` tokens are committed; slots ``0 .. held[r] - 1`` hold the
first ``committed[r] - 1`` of them less the ``evicted[r]`` dropped (the last one is the next forward's first input).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

#: slots allocated beyond the longest row when the buffer grows (then doubling)
GROW_MIN = 64


def ragged_causal(lengths: torch.Tensor, width: int, span: int) -> torch.Tensor:
    """Boolean ``(B, width, span)``: query ``i`` of row ``r`` sees slots ``0 .. lengths[r] + i`` (the row's held
    entries, then the new block causally)."""
    new = torch.arange(width, device=lengths.device).view(1, -1)
    slots = torch.arange(span, device=lengths.device).view(1, 1, -1)
    return slots <= (lengths.view(-1, 1) + new)[:, :, None]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean visibility ``(B, q, keys)`` -> the additive attention mask ``(B, 1, q, keys)`` in ``dtype``."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None]


class RaggedLayer(DynamicLayer):
    """One layer's keys and values, written at per-row offsets (see the module docstring).

    ``keys`` / ``values`` are ``(B, kv_heads, capacity, head_dim)``; before a forward the owning
    :class:`BatchCache` sets ``write_at`` ``(B,)`` (each row's first new slot) and ``span`` (slots the forward
    attends to).
    """

    def __init__(self, owner: BatchCache):
        super().__init__()
        self.owner = owner

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``(B, kv_heads, W, head_dim)`` new states at each row's offset; returns the first ``span`` slots."""
        width = key_states.shape[-2]
        write_at, need = self.offsets()
        if not self.is_initialized or self.keys.shape[-2] < need:
            self.reserve(need, key_states)
        index = (write_at.view(-1, 1) + torch.arange(width, device=key_states.device).view(1, -1))
        index = index[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[-1])
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        return self.keys[:, :, :need], self.values[:, :, :need]

    def append_row(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append a row holding ``keys`` / ``values`` ``(1, kv_heads, n, head_dim)`` in its first ``n`` slots
        (growing the buffer to ``n`` slots if needed; a first row allocates ``n + GROW_MIN``)."""
        n = keys.shape[-2]
        if not self.is_initialized:
            self.reserve(n + GROW_MIN, keys[:0])
        elif self.keys.shape[-2] < n:
            self.reserve(n, self.keys)
        row_k, row_v = keys.new_zeros(1, *self.keys.shape[1:]), values.new_zeros(1, *self.values.shape[1:])
        row_k[:, :, :n], row_v[:, :, :n] = keys, values
        self.keys, self.values = torch.cat([self.keys, row_k]), torch.cat([self.values, row_v])

    def offsets(self) -> tuple[torch.Tensor, int]:
        """``(write_at (B,), span)`` of the current forward (set by the owner's ``forward_inputs``)."""
        return self.owner.write_at, self.owner.span

    def reserve(self, slots: int, like: torch.Tensor) -> None:
        """Grow the buffer to at least ``slots`` (doubling, at least :data:`GROW_MIN` more), keeping what it holds."""
        held = self.keys.shape[-2] if self.is_initialized else 0
        capacity = max(slots, 2 * held, held + GROW_MIN)
        shape = (like.shape[0], like.shape[1], capacity, like.shape[-1])
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        if held:
            keys[:, :, :held], values[:, :, :held] = self.keys, self.values
        self.keys, self.values = keys, values
        self.dtype, self.device, self.is_initialized = like.dtype, like.device, True

    def get_seq_length(self) -> int:
        return self.owner.span - self.owner.width if self.is_initialized else 0


class BatchCache:
    """A batch's cache with per-row lengths (see the module docstring).

    Attributes:
        cache: the ``transformers`` cache passed to the model (one :class:`RaggedLayer` per decoder layer).
        committed: ``(B,)`` long, tokens committed per row (prompt included).
    """

    layer_class = RaggedLayer

    def __init__(self, num_layers: int, device: torch.device, streaming=None):
        self.cache = Cache(layers=[self.new_layer(i) for i in range(num_layers)])
        self.committed = torch.zeros(0, dtype=torch.long, device=device)
        self.evicted = torch.zeros(0, dtype=torch.long, device=device)
        self.streaming = streaming  # a StreamingLLM policy applied per row (``batch_rows``), or None
        self.write_at = self.committed
        self.span = self.width = 0

    def new_layer(self, index: int) -> RaggedLayer:
        """The storage of decoder layer ``index``."""
        return self.layer_class(self)

    @property
    def rows(self) -> int:
        return self.committed.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` slots each row holds (its committed tokens but the last, less what StreamingLLM dropped)."""
        return self.committed - 1 - self.evicted

    def _layers(self) -> list[RaggedLayer]:
        return [layer for layer in self.cache.layers if layer.is_initialized]

    # ------------------------------------------------------------------------------------------------ a forward
    def forward_inputs(self, width: int, dtype: torch.dtype) -> dict:
        """``position_ids`` ``(B, width)`` and the additive ``attention_mask`` ``(B, 1, width, max(length) + width)``
        of a forward appending ``width`` tokens per row: query ``i`` of row ``r`` sees slots ``0 .. length[r] + i``
        (its own history and the new block causally), with StreamingLLM only those holding its sinks and its last
        ``window`` positions. Sets where the layers write (:class:`RaggedLayer`)."""
        lengths = self.lengths
        self.write_at, self.width = lengths, width
        self.span = int(lengths.max()) + width
        new = torch.arange(width, device=lengths.device).view(1, -1)
        positions = (self.committed - 1).view(-1, 1) + new  # absolute
        visible = ragged_causal(lengths, width, self.span)
        if self.streaming is not None:  # the policy's exact window over the positions the slots hold
            slots = torch.arange(self.span, device=lengths.device).view(1, 1, -1)
            held_at = slots + (slots >= self.streaming.sink_tokens) * self.evicted.view(-1, 1, 1)
            visible &= self.streaming.in_window(held_at, positions[:, :, None])
        return {"position_ids": positions, "attention_mask": additive_mask(visible, dtype)}

    def accept(self, kept: torch.Tensor) -> None:
        """After a forward: row ``r`` keeps its first ``kept[r]`` new slots (``1 + accepted``); the rest lie past
        its length and are overwritten by its next forward."""
        self.committed = self.committed + kept

    def rollback(self, held: torch.Tensor) -> None:
        """Row ``r`` keeps only its first ``held[r]`` slots (``held`` ``(B,)`` long, at most its length): a draft
        cache dropping the draft tokens the target rejected. What lies past a row's length is overwritten by its
        next forward. The next forward's first input of row ``r`` sits at position ``held[r]``.

        Raises:
            ValueError: with a StreamingLLM policy (its slots do not map to positions one to one), or a row asked
                to keep more than it holds.
        """
        if self.streaming is not None:
            raise ValueError("BatchCache.rollback: not with a StreamingLLM policy")
        if bool((held > self.lengths).any()) or bool((held < 0).any()):
            raise ValueError(f"BatchCache.rollback: held {held.tolist()} outside 0..{self.lengths.tolist()}")
        self.committed = held + 1

    def compress(self) -> None:
        """StreamingLLM's commit point: every row holding more than ``sinks + window + interval`` slots keeps its
        sinks and its last ``window`` slots (moved down behind the sinks); nothing without a policy."""
        policy = self.streaming
        if policy is None:
            return
        sinks, window, budget = policy.sink_tokens, policy.window, policy.budget_for()
        for r, n in enumerate(self.lengths.tolist()):
            if n <= budget + policy.compress_interval:
                continue
            for layer in self._layers():
                layer.keys[r, :, sinks:budget] = layer.keys[r, :, n - window:n].clone()
                layer.values[r, :, sinks:budget] = layer.values[r, :, n - window:n].clone()
            self.evicted[r] += n - budget

    # ------------------------------------------------------------------------------------------------ layout
    def remove(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices, in the new order)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.committed.device)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self.committed = self.committed.index_select(0, index)
        self.evicted = self.evicted.index_select(0, index)

    def join(self, prefill: Cache, committed: int, evicted: int = 0) -> None:
        """Append a request prefilled alone: ``prefill`` (batch 1) holds its ``committed - 1`` prompt slots less the
        ``evicted`` its policy dropped; its first generated token is committed and not yet in the cache."""
        held = committed - 1 - evicted
        for layer, single in zip(self.cache.layers, prefill.layers):
            layer.append_row(single.keys[:, :, :held], single.values[:, :, :held])
        self.committed = torch.cat([self.committed, self.committed.new_tensor([committed])])
        self.evicted = torch.cat([self.evicted, self.evicted.new_tensor([evicted])])

    def join_empty(self) -> None:
        """Append a row holding nothing yet (filled later by :meth:`fill`: a draft prefilled only once it drafts)."""
        for layer in self._layers():
            layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(1, *layer.keys.shape[1:])])
            layer.values = torch.cat([layer.values, layer.values.new_zeros(1, *layer.values.shape[1:])])
        self.committed = torch.cat([self.committed, self.committed.new_tensor([1])])
        self.evicted = torch.cat([self.evicted, self.evicted.new_tensor([0])])

    def fill(self, row: int, prefill: Cache, committed: int) -> None:
        """Write into the empty row ``row`` a request prefilled alone: ``prefill`` (batch 1) holds its
        ``committed - 1`` first tokens."""
        held = committed - 1
        for layer, single in zip(self.cache.layers, prefill.layers):
            keys, values = single.keys[:, :, :held], single.values[:, :, :held]
            if not layer.is_initialized or layer.keys.shape[-2] < held:
                layer.reserve(held, layer.keys if layer.is_initialized else keys.expand(self.rows, -1, -1, -1))
            layer.keys[row, :, :held], layer.values[row, :, :held] = keys[0], values[0]
        self.committed[row] = committed

    def kv_bytes(self) -> int:
        """Bytes of the batch's key and value buffers (allocated capacity: what is held)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self._layers())

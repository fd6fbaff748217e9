"""The eager per-row KV cache of batches whose policy changes what it holds at commit points (and of batched drafts).

Every row owns the first ``length[r]`` slots of a per-layer buffer ``(B, kv_heads, capacity, head_dim)``
(:class:`RaggedLayer`, a ``transformers`` cache layer). A forward appending ``W`` tokens per row writes them at each
row's own offset (slots ``length[r] .. length[r] + W - 1``, a scatter) and the model attends to the first
``max(length) + W`` slots through a per-row causal mask (:meth:`BatchCache.prepare`). Verification then advances each
row's length by what it kept (:meth:`BatchCache.accept`): the rejected slots lie past the row's length and are
overwritten by its next forward, so ragged acceptance leaves no holes. Rows leave (:meth:`BatchCache.keep_rows`) and
join (:meth:`BatchCache.add_row`: a request prefilled alone) between rounds; the buffer grows by doubling when a row
would run past it.

It speaks the decoder's row protocol (:mod:`toolkit.kv.rows`) and is the base of the KIVI-quantized per-row cache
(:mod:`toolkit.kv.quantized_rows`), which subclasses its layers and its commit point. Unlike the static cache (:mod:`toolkit.kv.static`) its attended span is
read from the device every forward, and its buffers grow: it runs eager. A batched draft model keeps its cache here
too (:meth:`rollback`, :meth:`join_empty` / :meth:`fill`).

Invariant between rounds, per row ``r``: ``committed[r]`` tokens are committed; slots ``0 .. held[r] - 1`` hold the
first ``committed[r] - 1`` of them less the ``evicted[r]`` a policy dropped (the last one is the next forward's first
input).
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
    static = False
    compressions = 0

    def __init__(self, num_layers: int, device: torch.device, dtype: torch.dtype = torch.float32, policy=None,
                 model=None):
        self.cache = Cache(layers=[self.new_layer(i) for i in range(num_layers)])
        self.committed = torch.zeros(0, dtype=torch.long, device=device)
        self.evicted = torch.zeros(0, dtype=torch.long, device=device)
        self.dtype, self.policy, self.model = dtype, policy, model
        self.write_at = self.committed
        self.span = self.width = 0

    @classmethod
    def for_model(cls, model, policy=None) -> BatchCache:
        """A cache for ``model``'s layers on its device, masks in its dtype (what a policy's ``rows_cache`` returns)."""
        from toolkit.dtypes import mask_dtype

        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        return cls(layers, next(model.parameters()).device, mask_dtype(model), policy, model)

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
    def forward_inputs(self, width: int, dtype: torch.dtype | None = None) -> dict:
        """``position_ids`` ``(B, width)`` and the additive ``attention_mask`` ``(B, 1, width, max(length) + width)``
        of a forward appending ``width`` tokens per row: query ``i`` of row ``r`` sees slots ``0 .. length[r] + i``
        (its own history and the new block causally). Sets where the layers write (:class:`RaggedLayer`)."""
        lengths = self.lengths
        self.write_at, self.width = lengths, width
        self.span = int(lengths.max()) + width
        new = torch.arange(width, device=lengths.device).view(1, -1)
        positions = (self.committed - 1).view(-1, 1) + new  # absolute
        visible = ragged_causal(lengths, width, self.span)
        return {"position_ids": positions, "attention_mask": additive_mask(visible, dtype or self.dtype)}

    def prepare(self, width: int, rows: range | None = None) -> dict:
        """The row protocol's forward inputs (:meth:`forward_inputs` and the HF cache to pass)."""
        return {**self.forward_inputs(width), "past_key_values": self.cache}

    def accept(self, kept: torch.Tensor, kept_host: list[int] | None = None) -> None:
        """After a forward: row ``r`` keeps its first ``kept[r]`` new slots (``1 + accepted``); the rest lie past
        its length and are overwritten by its next forward."""
        self.committed = self.committed + kept

    def commit(self) -> None:
        """A commit point: where a policy's subclass compresses (:meth:`compress`)."""
        self.compress()

    def rollback(self, held: torch.Tensor) -> None:
        """Row ``r`` keeps only its first ``held[r]`` slots (``held`` ``(B,)`` long, at most its length): a draft
        cache dropping the draft tokens the target rejected. What lies past a row's length is overwritten by its
        next forward. The next forward's first input of row ``r`` sits at position ``held[r]``.

        Raises:
            ValueError: a row asked to keep more than it holds.
        """
        if bool((held > self.lengths).any()) or bool((held < 0).any()):
            raise ValueError(f"BatchCache.rollback: held {held.tolist()} outside 0..{self.lengths.tolist()}")
        self.committed = held + 1

    def compress(self) -> None:
        """The policy's compression at a commit point (nothing here: the uncompressed cache)."""

    # ------------------------------------------------------------------------------------------------ layout
    def begin_row(self, length: int) -> tuple[Cache, dict]:
        """Where a new request's prompt of ``length`` tokens is prefilled alone: the policy's single-sequence cache
        (its mask and positions), or a ``DynamicCache`` without a policy."""
        from transformers import DynamicCache

        from toolkit.kv.contract import new_cache

        if self.policy is None:
            cache = DynamicCache()
            return cache, {"past_key_values": cache}
        cache = new_cache(self.policy, self.model)
        positions = torch.arange(length, device=self.committed.device).view(1, -1)
        return cache, {**cache.forward_kwargs(positions), "past_key_values": cache}

    def add_row(self, prefilled: Cache, length: int) -> None:
        """The prompt prefilled by :meth:`begin_row` becomes the last row (committed at once: a policy may compress
        it, and what it dropped counts as evicted)."""
        evicted = 0
        if self.policy is not None:
            prefilled.commit()
            evicted = prefilled.get_seq_length() - prefilled.physical_length(0)
        self.join(prefilled, length + 1, evicted)

    def keep_rows(self, keep: list[int]) -> None:
        """The row protocol's name for :meth:`remove`."""
        self.remove(keep)

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

"""Sliding-window and mixed-attention models on the static engine: a full layer is a plain static buffer, a sliding
layer a ring of its window plus one forward.

Models: Mistral-style (every layer slides over the last ``sliding_window`` positions) and alternating full / sliding
layers (Gemma-2, Gemma-3, Qwen2 / Qwen3 with ``layer_types``, Cohere-2, ...). HF's rule, for sdpa and eager attention
(``transformers.masking_utils.sliding_window_overlay``): a query at position ``q`` of a sliding layer sees the key at
position ``p`` iff ``q - window < p <= q`` — its own last ``window`` positions, itself included.

Layout (:class:`SlidingStaticKV`), per decoder layer one key and one value buffer, addresses fixed:

* **full layer**: ``(rows, kv_heads, capacity, head_dim)``, slot = position, exactly :class:`~toolkit.kv.static.StaticKV`
  with no policy (the same per-row lengths, span and mask);
* **sliding layer**: a ring ``(rows, kv_heads, R, head_dim)`` with ``R = window - 1 + widest`` (the StreamingLLM ring
  of :mod:`toolkit.kv.static` without sinks): position ``p`` goes to slot ``p mod R``. A forward of ``W <= widest``
  tokens from position ``h`` overwrites positions up to ``h + W - 1 - R <= h - window``, none of which any of its
  queries (``>= h``) sees, and entries of rejected draft tokens left in the ring map to positions no later query sees:
  rollback stays exact and free (the per-row lengths move, nothing else). The position a slot holds is computed from
  the forward's newest position (the newest one congruent to the slot), never stored. Where the request's capacity is
  smaller than ``R`` the ring is the capacity (positions then never wrap). HF's own static sliding layer
  (``StaticSlidingWindowLayer``) keeps ``window`` slots for one-token steps; the extra ``widest - 1`` hold a verify
  forward.

Masks: one boolean mask per layer type, built from the per-row lengths alone — causal over the plain slots
(``(B, 1, W, span)``, span rounded up as in :class:`~toolkit.kv.static.StaticKV`) and the ring's window
(``(B, 1, W, R)``: every ring slot, a static size). The model gets them as HF's models take them: a dict keyed by
layer type (``{"full_attention": ..., "sliding_attention": ...}``, which models with ``layer_types`` route to their
layers) when both kinds are present, else the one mask (Mistral-style models pass one mask to every layer). A
prompt is prefilled alone into a ``DynamicCache`` under the same two masks (full layers: causal), and
:meth:`SlidingStaticKV.load_row` copies what each layer keeps (the ring: the last ``R`` positions).

Not held (:func:`unsupported` says why): other layer types (linear attention, chunked attention, ...), attention
sinks (gpt-oss), KV sharing between layers (Gemma-3n), and KV policies on sliding models
(:func:`toolkit.kv.rows.static_why`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from toolkit.kv.static import SPAN_STEP, StaticKV, StaticLayer, kv_geometry, spare_rows, static_buffer

FULL, SLIDING = "full_attention", "sliding_attention"


def layer_kinds(model) -> list[str]:
    """Each decoder layer's attention type, as HF's caches read it: the config's ``layer_types``, else sliding
    everywhere where the config sets a ``sliding_window`` (and does not switch it off with ``use_sliding_window``),
    else full everywhere."""
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False
    return [SLIDING if windowed else FULL] * config.num_hidden_layers


def unsupported(model) -> str | None:
    """Why the static engine cannot hold ``model``'s attention layers (``None``: it can)."""
    config = model.config.get_text_config(decoder=True)
    kinds = layer_kinds(model)
    others = sorted(set(kinds) - {FULL, SLIDING})
    if others:
        return f"layers of type {', '.join(others)} (the static cache holds full-attention and sliding-window " \
               "layers only)"
    if SLIDING in kinds and not getattr(config, "sliding_window", None):
        return "layers of type sliding_attention without a sliding_window in the config"
    if getattr(config, "num_kv_shared_layers", 0):
        return "layers sharing another layer's KV cache (num_kv_shared_layers)"
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        return "attention sinks (learned per-head logits the static attention does not add)"
    return None


def window_visibility(positions: torch.Tensor, ring: int, window: int) -> torch.Tensor:
    """Boolean ``(B, 1, W, ring)``: whether query ``(b, i)`` at ``positions[b, i]`` (consecutive per row) sees ring
    slot ``s``. The slot holds the newest position ``<=`` the forward's last one that is congruent to ``s`` (none
    below 0); visible iff ``q - window < p <= q``."""
    slot = torch.arange(ring, device=positions.device).view(1, 1, -1)
    query = positions[:, :, None]
    newest = positions[:, -1:, None]
    held_at = newest - torch.remainder(newest - slot, ring)
    return ((held_at >= 0) & (held_at <= query) & (held_at > query - window))[:, None]


class RingLayer(StaticLayer):
    """A sliding layer's ring ``(rows, kv_heads, R, head_dim)``: writes at the owner's ring slots, reads every slot."""

    is_sliding = True

    def where(self) -> tuple[torch.Tensor, int]:
        return self.owner.ring_index, self.keys.shape[-2]


class SlidingStaticKV(StaticKV):
    """The static cache of a model with sliding-window layers (see the module docstring).

    Args:
        model / rows / capacity / widest / dtype / device / static_span: as :class:`~toolkit.kv.static.StaticKV`
            (``capacity``: positions per row, prompt + new tokens; it sizes the full layers, and caps the rings).

    Attributes:
        kinds: each layer's type (``full_attention`` / ``sliding_attention``).
        sliding_window: the window of the sliding layers (tokens, the query's own position included).
        ring_size: slots of each ring (``min(sliding_window - 1 + widest, capacity)``).

    Raises:
        ValueError: ``rows`` or ``capacity`` < 1, or a model :func:`unsupported` refuses.
    """

    def __init__(self, model, rows: int, capacity: int, widest: int = 1, dtype=None, device=None,
                 static_span: bool = False):
        if rows < 1 or capacity < 1:
            raise ValueError(f"rows and capacity: must be >= 1, got {rows} and {capacity}")
        why = unsupported(model)
        if why:
            raise ValueError(f"model: the static cache does not hold {why}")
        _, kv_heads, head_dim, dtype, device = kv_geometry(model, dtype, device)
        self.kinds = layer_kinds(model)
        self.sliding_window = model.config.get_text_config(decoder=True).sliding_window
        self.policy = self.window = None
        self.widest, self.sinks, self.ring, self.capacity, self.static_span = widest, 0, 0, capacity, static_span
        self.ring_size = min(self.sliding_window - 1 + widest, capacity)
        spare = spare_rows(rows, static_span)  # as StaticKV: one spare row, one spare SPAN_STEP (full layers)
        plain = (rows + spare, kv_heads, capacity + (0 if static_span else SPAN_STEP), head_dim)
        ring = (rows + spare, kv_heads, self.ring_size, head_dim)
        layers = []
        for kind in self.kinds:
            kind_layer, shape = (RingLayer, ring) if kind == SLIDING else (StaticLayer, plain)
            layers.append(kind_layer(self, static_buffer(shape, dtype, device), static_buffer(shape, dtype, device)))
        self._adopt(layers, rows, static_span, device)
        self.write_index = self.attention_mask = self.ring_index = self.ring_mask = None

    @property
    def bounded(self) -> bool:
        """Rows hold at most :attr:`capacity` positions where a layer is full or a ring is cut to the capacity."""
        return FULL in self.kinds or self.ring_size < self.sliding_window - 1 + self.widest

    @property
    def ringed(self) -> bool:
        return True

    # ------------------------------------------------------------------------------------------------ a forward
    def prepare(self, width: int, rows: range | None = None, span: int | None = None) -> dict:
        """Model inputs of a forward appending ``width`` tokens to each of ``rows`` (default: all): ``position_ids``
        ``(B, width)`` and the boolean masks — ``(B, 1, width, span)`` of the full layers, ``(B, 1, width, R)`` of the
        rings — as a dict keyed by layer type where both kinds are present, else the one mask (see the module
        docstring); sets where the layers write. Reads no device value."""
        rows = rows if rows is not None else range(self.active)
        self.first = rows.start
        self.row_index = torch.arange(rows.start, rows.stop, device=self.lengths.device)
        positions = self.lengths[rows.start:rows.stop, None] + torch.arange(width, device=self.lengths.device)
        if FULL in self.kinds:
            span = span if span is not None else self.span_for(width, rows)
            self.write_index, self.attention_mask = positions, self.visibility(positions, span)
        if SLIDING in self.kinds:
            self.ring_index = torch.remainder(positions, self.ring_size)
            self.ring_mask = window_visibility(positions, self.ring_size, self.sliding_window)
        return {"position_ids": positions, "attention_mask": self._masks(), "past_key_values": self}

    def _masks(self):
        """The model's ``attention_mask``: the masks by layer type where both kinds are present, else the one."""
        masks = {FULL: self.attention_mask} if FULL in self.kinds else {}
        if SLIDING in self.kinds:
            masks[SLIDING] = self.ring_mask
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def tree_view(self, view):
        """Token trees (:mod:`toolkit.kv.static_tree`): ``view`` over the full layers' and the rings' masks."""
        if FULL in self.kinds:
            self.attention_mask, self.write_index = view(self.attention_mask, self.write_index)
        if SLIDING in self.kinds:
            self.ring_mask, self.ring_index = view(self.ring_mask, self.ring_index)
        return self._masks()

    def dynamic_inputs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(masks, write indices)`` of the current forward; only the full layers' span is dynamic."""
        masks = [m for m in (self.attention_mask, self.ring_mask) if m is not None]
        return masks, [i for i in (self.write_index, self.ring_index) if i is not None]

    # ------------------------------------------------------------------------------------------------ rows
    def begin_row(self, length: int) -> tuple[Cache, dict]:
        """Where a new request's prompt of ``length`` tokens is prefilled alone: a ``DynamicCache`` (every position
        of every layer) under the sliding layers' window mask ``(1, 1, length, length)`` (full layers: causal).

        Raises:
            ValueError: every allocated row is in use.
        """
        from transformers import DynamicCache

        if self.active >= self.allocated:
            raise ValueError(f"SlidingStaticKV: all {self.allocated} rows are in use")
        positions = torch.arange(length, device=self.lengths.device)
        query, key = positions[:, None], positions[None, :]
        window = ((key <= query) & (key > query - self.sliding_window))[None, None]
        mask = {FULL: None, SLIDING: window} if FULL in self.kinds else window
        cache = DynamicCache()
        return cache, {"position_ids": positions.view(1, -1), "attention_mask": mask, "past_key_values": cache}

    def load_row(self, row: int, source: Cache, length: int) -> None:
        """Row ``row`` takes a prompt prefilled alone (``source``: batch 1, positions ``0 .. length - 1`` in every
        layer): full layers copy every position, rings the last ``R``."""
        if self.bounded and length + self.widest > self.capacity:
            raise ValueError(f"SlidingStaticKV: a {length}-token prompt leaves no room in capacity {self.capacity} "
                             f"for a {self.widest}-token forward")
        device = self.lengths.device
        every = torch.arange(length, device=device)
        last = torch.arange(max(0, length - self.ring_size), length, device=device)
        for layer, single in zip(self.layers, source.layers):
            kept, slots = (last, torch.remainder(last, self.ring_size)) if layer.is_sliding else (every, every)
            layer.keys[row].index_copy_(1, slots, single.keys[0].index_select(1, kept).to(layer.keys.dtype))
            layer.values[row].index_copy_(1, slots, single.values[0].index_select(1, kept).to(layer.values.dtype))
        self.lengths[row] = length
        self.held[row] = length

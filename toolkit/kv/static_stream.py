"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024) on the static
engine in the modes the ring of :mod:`toolkit.kv.static` cannot hold: reindexed positions (the paper's mode, exact
window or not) and the rolling cache (``exact_window: false``), whose contents depend on when the commit points
compress.

Layout. The fixed-budget buffers of :mod:`toolkit.kv.static_evict` with StreamingLLM's selection: per decoder layer
one tier of every KV head, ``(rows, kv_heads, sink_tokens + window + compress_interval + widest, head_dim)``, written
at per-row fills (``fill[r]``: the entries row ``r`` holds) and compacted in place at commit points. A commit point
where a row holds more than ``sink_tokens + window + compress_interval`` entries keeps its sinks and its last
``window`` (:meth:`~toolkit.kv.streaming.StreamingLLM.kept`, the single-sequence cache's own rule) in the first
``sink_tokens + window`` slots; so slot ``s`` of row ``r`` holds absolute position ``s`` below the sinks and
``s + lengths[r] - fill[r]`` above (``lengths``: the absolute next positions).

A forward of ``W`` tokens writes each row's slots ``fill[r] .. fill[r] + W - 1`` and query ``i`` sees the slots up to
its own, under a boolean mask ``(B, 1, W, slots)`` built on the device from ``fill`` and ``lengths`` alone:

* ``exact_window: false`` — every entry held (the rolling cache; the effective window varies between ``window`` and
  ``window + compress_interval + K`` as on the single-sequence cache);
* ``exact_window: true`` (reindexed positions only; absolute positions with it are the ring) — the sinks and the
  query's own last ``window`` absolute positions.

Positions fed to the model (``position_ids`` ``(B, W)``, an input tensor of the one compiled graph, so rows of a
batch differ): absolute (``lengths[r] + i``), or under ``position_mode: reindex`` slots in the cache (``fill[r] + i``:
the absolute position minus what the row evicted), with the kept window's keys re-rotated at each compaction by
``-evicted`` (:func:`toolkit.kv.rope.shift_positions`). The largest slot position fed is below ``sink_tokens +
window + compress_interval + widest`` (checked against ``max_position_embeddings``: :meth:`StreamingLLM.check_model`),
so generation runs past the model's context. A prompt is prefilled alone at positions ``0 .. length - 1`` (under the
window's mask with the exact window) and compacted as the commit after it compacts
(:meth:`~toolkit.kv.static_evict.StaticEvictKV.load_row`).

This is exactly :class:`~toolkit.kv.streaming.StreamingCache` (same trigger, entries, re-rotations and positions), so
one row decodes as the single-sequence cache does; the forwards keep static shapes and compile, rollback is exact and
free (rejected entries lie past the fill), and the memory is fixed by the window whatever the generation length.
"""

from __future__ import annotations

import torch

from toolkit.kv.rope import find_inv_freq
from toolkit.kv.static_evict import StaticEvictKV


class StaticStreamKV(StaticEvictKV):
    """The static cache of ``rows`` rows under a :class:`~toolkit.kv.streaming.StreamingLLM` ``policy`` with
    reindexed positions or without the exact window (see the module docstring).

    Args:
        model: the HF causal LM (a rotary one under ``position_mode: reindex``).
        rows / capacity / widest / dtype / device / static_span: as :class:`~toolkit.kv.static_evict.StaticEvictKV`
            (``capacity``: positions per row, prompt + new tokens; the buffers hold ``min(capacity, sink_tokens +
            window + compress_interval + widest)`` slots per row).
        policy: the StreamingLLM policy.

    Attributes:
        inv_freq: the model's rotary ``inv_freq`` under ``reindex`` (``None`` with absolute positions).

    Raises:
        ValueError: ``rows`` or ``capacity`` < 1, or the ring's mode (absolute positions, exact window).
        ConfigError: ``reindex`` on a model without rotary embeddings or whose context is shorter than the buffer.
    """

    def __init__(self, model, rows: int, capacity: int, widest: int, policy, dtype=None, device=None,
                 static_span: bool = False):
        if policy.ring:
            raise ValueError("policy: absolute positions with the exact window are the static cache's ring "
                             "(toolkit.kv.static.StaticKV)")
        policy.check_model(model, getattr(policy, "_prefix", "kv"))
        super().__init__(model, rows, capacity, widest, policy, dtype, device, static_span)
        self.inv_freq = find_inv_freq(model) if policy.position_mode == "reindex" else None
        (self.factor,) = self.factors  # one tier per layer, every head: StreamingLLM keeps the same entries in all

    @property
    def dynamic_span(self) -> bool:
        """The mask spans the fixed slots of the buffers: never a dynamic size."""
        return False

    def kept(self, keys: torch.Tensor, values: torch.Tensor, layer: int, budget: int):
        """The sinks and the last ``window`` of a row's entries ``(1, kv_heads, n, head_dim)``, the window's keys
        re-rotated under ``reindex`` (:meth:`~toolkit.kv.streaming.StreamingLLM.kept`)."""
        return self.policy.kept(keys, values, self.inv_freq)

    # ------------------------------------------------------------------------------------------------ a forward
    def begin_row(self, length: int):
        """As :meth:`~toolkit.kv.static.StaticKV.begin_row`, under the window's mask with the exact window."""
        cache, kwargs = super().begin_row(length)
        mask = self.policy.prompt_mask(length, self.lengths.device)
        if mask is not None:
            kwargs["attention_mask"] = mask
        return cache, kwargs

    def prepare(self, width: int, rows: range | None = None, span: int | None = None) -> dict:
        """Model inputs of a forward appending ``width`` tokens to each of ``rows`` (default: all): ``position_ids``
        ``(B, width)`` (absolute, or the slots under ``reindex``) and the boolean ``attention_mask`` ``(B, 1, width,
        slots)`` (``span`` is ignored: the buffers' slots are the span); sets where the layers write. Reads no device
        value.

        Raises:
            ValueError: a row would write past its slots (more than ``pending_limit`` tokens since its last commit
                point).
        """
        rows = rows if rows is not None else range(self.active)
        slots, factor = self.slots_of[self.factor], self.factor
        for r in rows:
            if r < self.allocated and self.fill_held[factor][r] + width > slots:
                raise ValueError(f"StaticStreamKV: row {r} cannot take {width} more tokens before a commit point "
                                 f"(its {slots} slots hold {self.fill_held[factor][r]})")
        device = self.lengths.device
        self.first = rows.start
        self.row_index = torch.arange(rows.start, rows.stop, device=device)
        new = torch.arange(width, device=device)[None, :]
        fill, lengths = self.fill[factor][rows.start:rows.stop, None], self.lengths[rows.start:rows.stop, None]
        index, positions = fill + new, lengths + new  # (B, W): the slots written, the absolute positions
        slot = torch.arange(slots, device=device).view(1, 1, -1)
        visible = slot <= index[:, :, None]
        if self.policy.exact_window:
            held_at = torch.where(slot < self.policy.sink_tokens, slot, slot + (lengths - fill)[:, :, None])
            visible &= self.policy.in_window(held_at, positions[:, :, None])
        self.write_index_of, self.masks = {factor: index}, {factor: visible[:, None]}
        self.write_index, self.attention_mask = index, self.masks[factor]
        fed = index if self.inv_freq is not None else positions
        return {"position_ids": fed, "attention_mask": self.attention_mask, "past_key_values": self}

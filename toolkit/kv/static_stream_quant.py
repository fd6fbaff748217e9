"""StreamingLLM composed with KIVI quantization without the exact window on the static engine: the paper's rolling
cache over KIVI's packed groups (:class:`~toolkit.kv.quantized.QuantizedStreamingLLM` with ``exact_window: false``).

The single-sequence rule (:mod:`toolkit.kv.quantized`): at a commit point of a row of ``n`` tokens holding more than
``sink_tokens + window + compress_interval`` entries, the oldest whole packed groups lying entirely before ``n -
window`` are evicted (after the commit point's packing); a query sees every entry held — fp sinks, the packed groups
not evicted, the fp residual — with KIVI's per-query view of the groups packed during a forward (the shadow).

Static form: :class:`~toolkit.kv.static_quant.StaticQuantKV`'s layout (fp sinks, a ring of packed groups, a fixed
fp residual, packed at commit points) with one more per-row counter, ``evicted[r]``: tokens of packed groups row
``r`` has evicted (``(rows,)`` on the device, mirrored on the host). Packed group ``g`` is visible iff ``g *
G >= evicted[r]``, a mask built on the device from the counters alone, so one compiled graph serves rows that
evicted at different commit points. Eviction moves nothing: it is the counter; a group evicted at the commit point
that packs it is never packed. The ring needs :func:`held_groups` groups: the most a row holds after any commit point.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from toolkit.kv.quantized import boundary
from toolkit.kv.static_quant import StaticQuantKV


def held_groups(policy) -> int:
    """Packed groups a row holds at most after a commit point under ``policy`` (``w`` window, ``c``
    compress_interval, ``G`` group, ``R`` residual), at least 1: ``(w + max(c, G - 1) - max(0, R - G + 1)) // G``.

    With ``e`` tokens evicted and ``n`` committed, the packed tokens held are ``boundary(n) - S - e``, and
    ``boundary(n) <= min(n, n - R + G - 1)``. A commit point that evicts nothing had ``n - e <= S + w + c``: at most
    ``w + c - max(0, R - G + 1)`` tokens. One that evicts leaves ``e > n - w - S - G`` (or nothing packed): at most
    ``w + G - 1 - max(0, R - G + 1)`` tokens (``tests/test_static_stream.py`` checks the bound against the
    single-sequence cache over small sizes)."""
    w, c, g, r = policy.window, policy.compress_interval, policy.quant_group_size, policy.residual_length
    return max(1, (w + max(c, g - 1) - max(0, r - g + 1)) // g)


class StaticStreamQuantKV(StaticQuantKV):
    """The static cache of ``rows`` rows under a :class:`~toolkit.kv.quantized.QuantizedStreamingLLM` without the
    exact window (see the module docstring). Args, attributes and errors as
    :class:`~toolkit.kv.static_quant.StaticQuantKV`, plus ``evicted`` / ``evicted_held``: packed tokens each row
    evicted (device, host)."""

    exact_window = False

    def __init__(self, model, rows: int, capacity: int, widest: int, policy, dtype=None, device=None,
                 static_span: bool = False):
        super().__init__(model, rows, capacity, widest, policy, dtype, device, static_span)
        self.evicted = torch.zeros_like(self.quantized)
        self.evicted_held = [0] * rows

    def ring_size(self) -> int:
        """The most groups a row holds after a commit point (:func:`held_groups`)."""
        return held_groups(self.policy)

    def window_mask(self, at: torch.Tensor, query: torch.Tensor, rows: range) -> torch.Tensor:
        """Whether entries at positions ``at`` ``(B, 1, T)`` are held, for every query ``(B, W, T)``: sinks, and
        everything from the first packed group not evicted on (every query sees all a row holds)."""
        held = (at < self.sinks) | (at >= self.sinks + self.evicted[rows.start:rows.stop, None, None])
        return held.expand(-1, query.shape[1], -1)

    # ------------------------------------------------------------------------------------------------ commit points
    def commit(self) -> None:
        """The commit point: every row packs its residual's whole groups up to ``boundary(n)`` and, when it held more
        than ``sink_tokens + window + compress_interval`` entries, evicts its packed groups lying entirely before
        ``n - window`` (groups packed now and evicted at once are dropped unpacked)."""
        policy, s = self.policy, self.sinks
        changed = False
        for r in range(self.active):
            n, done, gone = self.held[r], self.quantized_held[r], self.evicted_held[r]
            move = max(0, boundary(n, policy) - s - done)
            drop = 0
            if n - gone > s + policy.window + policy.compress_interval:
                drop = min(done + move - gone, max(0, n - policy.window - s - gone)) // self.group * self.group
            if move:
                self._pack_row(r, move, skip=min(move, max(0, gone + drop - done)))
            if drop:
                self.evicted[r] = self.evicted_held[r] = gone + drop
            changed |= bool(move or drop)
        self.compressions += changed

    # ------------------------------------------------------------------------------------------------ rows
    def load_row(self, row: int, source: Cache, length: int) -> None:
        """As :meth:`~toolkit.kv.static_quant.StaticQuantKV.load_row` (the prompt's newest groups packed into the
        ring), then the commit point's eviction: a prompt of more than ``sink_tokens + window + compress_interval``
        tokens evicts its packed groups lying entirely before ``length - window``."""
        super().load_row(row, source, length)
        policy, done, gone = self.policy, self.quantized_held[row], 0
        if length > self.sinks + policy.window + policy.compress_interval:
            gone = min(done, max(0, length - policy.window - self.sinks)) // self.group * self.group
        self.evicted[row] = self.evicted_held[row] = gone

    def row_counters(self) -> tuple[list[torch.Tensor], list[list[int]]]:
        tensors, lists = super().row_counters()
        return [*tensors, self.evicted], [*lists, self.evicted_held]

    def groups_held(self, row: int) -> int:
        """Packed groups row ``row`` holds (not evicted)."""
        return (self.quantized_held[row] - self.evicted_held[row]) // self.group

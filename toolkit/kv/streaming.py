"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024).

The cache keeps the first ``sink_tokens`` tokens (attention sinks) and the most recent ``window`` tokens: budget
``sink_tokens + window`` tokens per layer, identical for every layer and head, so eviction is two slices (no
gather) and positions stay contiguous: cache entry ``c`` holds absolute position ``c`` if ``c < sink_tokens``, else
``c + evicted``.

Position modes (``position_mode``):

* ``absolute`` (default) — cached keys keep the rotary phase of their original position; queries use absolute
  ``position_ids``. Exact w.r.t. a full forward under the same attention pattern; positions grow without bound.
* ``reindex`` — the paper's mode: positions are *slots in the cache*. On eviction the kept recent keys are re-rotated
  by ``-evicted`` (:func:`toolkit.kv.rope.shift_positions`; Llama full rotary and GPT-NeoX partial rotary alike) and
  queries get slot positions, so generation can run far past ``max_position_embeddings``: the largest position ever
  fed is ``sink_tokens + window + compress_interval + K`` (checked against the context by :meth:`check_model`),
  or ``prompt_len - 1`` during the prefill, which sees the whole prompt at positions ``0 .. prompt_len - 1`` (so
  the prompt itself must fit the context: :meth:`toolkit.speculative_lm.SpeculativeLM.check_request`). Needs a RoPE
  model.
  The toolkit decoder passes absolute positions and the cache maps them to slots (:meth:`StreamingCache.forward_kwargs`;
  on the static engine a row's slots are its fill, :mod:`toolkit.kv.static_stream`); ``model.generate`` computes
  its own absolute positions, so use ``absolute`` there.

Window semantics (``exact_window``, default true): every query at absolute position ``p`` attends to exactly the
sinks plus positions ``p - window + 1 .. p`` (its own last ``window`` positions), through a banded additive 4D mask
over ``[cache entries, new tokens]`` — so the amortization slack (``compress_interval``) and the K+1 queries of a
verify forward see the same context as one-token autoregressive decoding, and greedy speculative output equals AR
greedy output under this policy. With ``exact_window: false`` a query attends to everything held (the paper's
rolling cache; the effective window then varies between ``window`` and ``window + compress_interval + K``).

The decoder's form, one row or a batch (:meth:`StreamingLLM.static_cache`): absolute positions with the exact window
are the static cache's ring (:mod:`toolkit.kv.static`), what a query sees being fixed by its position alone; every
other mode holds what its commit points keep, in a fixed buffer of ``sink_tokens + window + compress_interval +
widest`` slots per row compacted in place at commit points (:mod:`toolkit.kv.static_stream`). This module's
:class:`StreamingCache` is the reference it is tested against, and the form of ``model.generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.checks import TOKENS_MAX, check_choice, check_int
from toolkit.errors import ConfigError
from toolkit.kv.registry import register_policy
from toolkit.kv.base import CompressedCache, KVPolicy
from toolkit.kv.rope import find_inv_freq, shift_positions

POSITION_MODES = ("absolute", "reindex")


@register_policy("streaming", summary="StreamingLLM eviction (attention sinks + window)")
@dataclass
class StreamingLLM(KVPolicy):
    """Attention sinks + sliding window.

    Attributes:
        sink_tokens: first tokens always kept (>= 0; the paper uses 4).
        window: most recent tokens kept (>= 1; must be >= K + 1 for speculation with draft length K).
        position_mode: ``absolute`` or ``reindex`` (see the module docstring).
        exact_window: banded mask so every query sees exactly sinks + its own last ``window`` positions.
        compress_interval: tokens the cache may grow past ``sink_tokens + window`` before eviction.

    Raises:
        ConfigError: a field is invalid (named), ``reindex`` on a model without rotary embeddings, or ``window``
            smaller than K + 1 (:meth:`check_compatible`).
    """

    sink_tokens: int = 4
    window: int = 252
    position_mode: str = "absolute"
    exact_window: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sink_tokens", self.sink_tokens, low=0, high=TOKENS_MAX)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError("window", f"must be an integer >= 1 so that the budget sink_tokens + window exceeds "
                              f"sink_tokens, got {self.window!r}")
        check_int("window", self.window, low=1, high=TOKENS_MAX)
        check_choice("position_mode", self.position_mode, POSITION_MODES)
        if not isinstance(self.exact_window, bool):
            raise ConfigError("exact_window", "must be true or false")

    def budget_for(self, length: int = 0) -> int:
        return self.sink_tokens + self.window

    def in_window(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """The exact window: whether a query at absolute ``query_pos`` sees the entry at ``key_pos`` (a sink or one
        of its own last ``window`` positions; causality apart). Tensors broadcast."""
        return (key_pos < self.sink_tokens) | (key_pos > query_pos - self.window)

    def sees(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """Whether a query at absolute ``query_pos`` attends to the entry at ``key_pos`` under the exact window:
        causal (``key_pos <= query_pos``) and :meth:`in_window`. Tensors broadcast."""
        return (key_pos <= query_pos) & self.in_window(key_pos, query_pos)

    @property
    def ring(self) -> bool:
        """Held by the static cache's ring (:mod:`toolkit.kv.static`), one row or a batch: absolute positions and
        the exact window, so what a query sees is fixed by its position alone, whenever the cache compresses."""
        return self.position_mode == "absolute" and self.exact_window

    def check_compatible(self, max_query_tokens: int, prefix: str = "kv") -> None:
        """``window`` must hold a whole verify forward: ``window >= max_query_tokens`` (K + 1 for a chain). The
        width is remembered for :meth:`check_model` (reindexed slots reach ``budget + interval + width - 1``)."""
        if self.window < max_query_tokens:
            raise ConfigError(f"{prefix}.window", f"must be >= num_draft_tokens + 1 = {max_query_tokens} (a verify "
                              f"forward covers K + 1 = {max_query_tokens} positions), got {self.window}")
        self._widest = max_query_tokens

    def check_model(self, model, prefix: str = "kv") -> None:
        if self.position_mode != "reindex":
            return
        if find_inv_freq(model) is None:
            raise ConfigError(f"{prefix}.position_mode", "'reindex' re-rotates cached keys and needs rotary "
                              f"position embeddings; model type {model.config.model_type!r} has none", ["absolute"])
        limit = getattr(model.config, "max_position_embeddings", None)
        widest = getattr(self, "_widest", 1)  # a verify forward's tokens (K + 1), known once planned
        needed = self.budget_for() + self.compress_interval + widest
        if limit is not None and needed > limit:
            raise ConfigError(f"{prefix}.window", f"sink_tokens + window + compress_interval + {widest} (the widest "
                              f"forward) = {needed} exceeds max_position_embeddings={limit}: reindexed slots must "
                              "stay below it")

    def prompt_mask(self, length: int, device) -> torch.Tensor | None:
        """The boolean ``(1, 1, length, length)`` mask of a prompt's forward into an empty cache (positions
        ``0 .. length - 1``): causal under the exact window, ``None`` (plain causal attention) without it."""
        if not self.exact_window:
            return None
        positions = torch.arange(length, device=device)
        query, key = positions[:, None], positions[None, :]
        return self.sees(key, query)[None, None]

    def static_cache(self, model, rows: int, capacity: int, widest: int, static_span: bool = False):
        """The decoder's form, one row or a batch: with absolute positions and the exact window the static cache's
        ring (:class:`~toolkit.kv.static.StaticKV`), else the fixed buffers compacted at commit points
        (:class:`~toolkit.kv.static_stream.StaticStreamKV`; reindexed positions, the rolling cache)."""
        from toolkit.kv.static import StaticKV
        from toolkit.kv.static_stream import StaticStreamKV

        if self.ring:
            return StaticKV(model, rows, capacity, widest, window=self, static_span=static_span)
        return StaticStreamKV(model, rows, capacity, widest, self, static_span=static_span)

    def make_cache(self, model) -> StreamingCache:
        self.check_model(model, getattr(self, "_prefix", "kv"))
        return StreamingCache(self, model)

    def compress_layer(self, cache: StreamingCache, layer_idx: int, layer) -> bool:
        if layer.keys.shape[-2] <= self.budget_for() + self.compress_interval:
            return False
        layer.keys, layer.values = self.kept(layer.keys, layer.values, cache.inv_freq)
        return True

    def kept(self, keys: torch.Tensor, values: torch.Tensor, inv_freq: torch.Tensor | None):
        """What a compression keeps of a layer's ``n`` entries ``keys`` / ``values`` ``(batch, kv_heads, n,
        head_dim)``: the sinks and the last ``window``, ``(batch, kv_heads, sink_tokens + window, head_dim)`` each.
        With ``inv_freq`` (reindex) the kept window's keys are re-rotated down by the ``n - sink_tokens - window``
        slots evicted (:func:`toolkit.kv.rope.shift_positions`)."""
        held, sinks = keys.shape[-2], self.sink_tokens
        recent_keys = keys[:, :, held - self.window:]
        if inv_freq is not None:  # reindex: the kept window moves down by the evicted slots
            recent_keys = shift_positions(recent_keys, inv_freq, -(held - self.budget_for()))
        return (torch.cat((keys[:, :, :sinks], recent_keys), dim=2),
                torch.cat((values[:, :, :sinks], values[:, :, held - self.window:]), dim=2))


class StreamingCache(CompressedCache):
    """The StreamingLLM cache: sinks + recent window, with the band mask and slot positions of its policy."""

    def __init__(self, policy: StreamingLLM, model):
        super().__init__(policy, model)
        self.inv_freq = find_inv_freq(model) if policy.position_mode == "reindex" else None

    def forward_kwargs(self, position_ids: torch.Tensor) -> dict:
        """``position_ids`` ``(1, q)`` absolute -> slot positions (reindex) and the band mask (exact_window).

        Returns ``{"position_ids": (1, q), "attention_mask": (1, 1, q, held + q) additive or None}``.

        Raises:
            ValueError: a reindexed position would reach ``max_position_embeddings`` (a prompt longer than it).
        """
        self._maybe_auto_commit()
        policy: StreamingLLM = self.policy
        held = self.physical_length(0)
        evicted = self._length - held
        positions = position_ids
        if policy.position_mode == "reindex":
            positions = position_ids - evicted
            if self.max_positions is not None and int(positions.max()) >= self.max_positions:
                raise ValueError(f"reindexed position {int(positions.max())} >= max_position_embeddings="
                                 f"{self.max_positions}: the prompt is longer than the model's context")
        mask = None
        if policy.exact_window:
            device = position_ids.device
            slots = torch.arange(held, device=device)
            cached_pos = torch.where(slots < policy.sink_tokens, slots, slots + evicted)
            key_pos = torch.cat((cached_pos, position_ids[0].to(device)))[None, :]
            query_pos = position_ids[0][:, None]
            visible = policy.sees(key_pos, query_pos)
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=device)
            mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[None, None]
        return {"position_ids": positions, "attention_mask": mask}

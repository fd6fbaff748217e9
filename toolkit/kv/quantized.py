"""KIVI-style quantized KV cache with exact rollback (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", ICML 2024), standing alone (``policy: quantized``) or composed with StreamingLLM eviction
(``policy: streaming`` plus the ``quant_*`` fields: evict, then quantize what stays).

Layout of one layer (all layers alike), oldest to newest::

    [ sinks: full precision | quantized groups | residual: full precision, newest tokens ]

* **keys per channel**: each channel of each KV head is quantized in groups of ``quant_group_size`` consecutive
  tokens; **values per token**: each token's vector in groups of ``quant_group_size`` channels. Asymmetric, one
  float16 scale + one float16 zero point (the group minimum) per group, codes packed into ``uint8``
  (:mod:`toolkit.kv.quant_pack`).
* **commit points only**: tokens enter the residual on ``update``; at :meth:`CompressedCache.commit` with ``n``
  committed tokens, the oldest whole key groups move from the residual into the quantized part up to position
  :meth:`QuantizedKVCache.boundary` ``(n) = S + G * min(floor((n - S) / G), ceil((n - S - R) / G))`` (``S`` sinks,
  ``G`` group, ``R`` ``residual_length``; never negative), so after a commit the residual holds at most
  ``max(R, G - 1)`` tokens. Tokens appended since the last commit always sit at the residual's tail, so
  ``crop(-n)`` is an exact slice and quantized data never needs restoring.
* **per-query semantics, exactly as autoregressive decoding**: the prompt (the first forward into an empty cache)
  attends at full precision and is packed at the commit after it, as KIVI and HF's ``QuantizedCache`` prefill; from
  then on a query at absolute position ``p`` sees the tokens before ``boundary(p)`` quantized and the later ones at
  full precision — what it would see if every later token had been decoded one at a time with a commit after each.
  A verify forward over K + 1 positions may straddle a boundary;
  the tokens that become quantized inside it are appended once more as dequantized *shadow* entries and a 4D
  additive mask (:meth:`QuantizedKVCache.forward_kwargs`) shows each query the shadow or the full-precision copy.
  Hence greedy speculative output under this cache equals AR under this cache, as for the other policies.
* **token trees** run on the static form (:mod:`toolkit.kv.static_quant`), with each query's autoregressive view too.
  A quantization group must never hold a tree node below the root (the group's scale would depend on the path):
  that holds when ``residual_length >= tree_depth + quant_group_size - 2`` (:func:`check_quant_tree`, checked by the
  plan) and is verified at every tree forward.
* **attention** dequantizes the quantized part of a layer once per forward (dequantize-then-concat).
* **bytes** (:meth:`CompressedCache.kv_bytes`): packed codes + scales + zero points + sinks + residual, exactly.

The decoder runs this policy on its static form (:mod:`toolkit.kv.static_quant`: fixed per-row buffers, the same
per-query view, compiled forwards, batches, token trees); this cache is the reference it is tested against, and the
form of ``model.generate``.

Composition with StreamingLLM (``sink_tokens`` fp sinks, ``window``): when a layer holds more than
``sink_tokens + window + compress_interval`` entries at a commit, the oldest whole quantized key groups that lie
entirely before the last ``window`` committed tokens are dropped. With ``exact_window`` the band mask makes outputs
independent of when that happens. Only StreamingLLM composes: score-based eviction (L2, head-aware) picks single
tokens per head, which would break the per-channel key groups (a group of G tokens shares one scale per channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from toolkit.checks import TOKENS_MAX, check_choice, check_int
from toolkit.errors import ConfigError
from toolkit.kv.registry import register_composed, register_policy
from toolkit.kv.base import CompressedCache, KVPolicy
from toolkit.kv.quant_pack import BITS
from toolkit.kv.quantized_layer import QuantizedLayer
from toolkit.kv.streaming import StreamingLLM


def check_quant_fields(bits, group, residual) -> None:
    """Field checks shared by :class:`QuantizedKV` and :class:`QuantizedStreamingLLM` (raise :class:`ConfigError`)."""
    check_choice("quant_bits", bits, BITS)
    check_int("quant_group_size", group, low=1, high=4096)
    if (group * bits) % 8:
        raise ConfigError("quant_group_size", f"quant_group_size * quant_bits must be a multiple of 8 (a group "
                          f"fills whole bytes), got {group} * {bits}")
    check_int("residual_length", residual, low=1, high=TOKENS_MAX)


def check_quant_compatible(policy, max_query_tokens: int, prefix: str) -> None:
    """``residual_length >= max_query_tokens`` (K + 1 for a chain): a verify forward's tokens stay full precision."""
    if policy.residual_length < max_query_tokens:
        raise ConfigError(f"{prefix}.residual_length", f"must be >= num_draft_tokens + 1 = {max_query_tokens} (the "
                          f"tokens of a verify forward stay in the full-precision residual), got "
                          f"{policy.residual_length}")


def check_quant_tree(policy, depth: int, prefix: str) -> None:
    """Token trees of ``depth`` levels: ``residual_length >= depth + quant_group_size - 2``. Then for every root
    position ``r`` the boundary of the deepest query, ``boundary(r + depth)``, is at most ``r + 1``: no quantization
    group ever holds a tree node below the root, whose siblings would need other scales (exhaustively checked for
    small sizes in ``tests/test_kv_quantized.py``)."""
    need = depth + policy.quant_group_size - 2
    if depth >= 2 and policy.residual_length < need:
        raise ConfigError(f"{prefix}.residual_length", f"must be >= tree_depth + quant_group_size - 2 = {need} for "
                          f"token trees (no quantization group may hold a tree node), got {policy.residual_length}")


def check_quant_model(policy, model, prefix: str) -> None:
    """``quant_group_size`` must divide the model's head_dim (values are grouped along the channel axis)."""
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % policy.quant_group_size:
        divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0 and (d * policy.quant_bits) % 8 == 0]
        raise ConfigError(f"{prefix}.quant_group_size", f"must divide head_dim={head_dim} of model type "
                          f"{config.model_type!r}, got {policy.quant_group_size}", divisors)


@register_policy("quantized", summary="KIVI-style quantized KV (int keys per channel / values per token)",
                 engine_hint="closest engine option: kv_cache_dtype fp8, a different format; not set here")
@dataclass
class QuantizedKV(KVPolicy):
    """KIVI quantized KV cache (no eviction): keys per channel, values per token, full-precision residual.

    Attributes:
        quant_bits: bits per code: 2, 4 or 8.
        quant_group_size: elements per quantization group (tokens for keys, channels for values); must divide
            head_dim, and ``quant_group_size * quant_bits`` must be a multiple of 8.
        residual_length: newest tokens kept at full precision (R; the residual holds at most ``max(R, G - 1)``
            after a commit); must be >= K + 1.
        sink_tokens: first tokens kept at full precision (attention sinks, Xiao et al. 2024: their keys are
            outliers that would stretch the scale of every per-channel group they fall in; keeping such pivot
            tokens intact is IntactKV's observation, Liu et al. 2024). 0 = plain KIVI. On the embedded model,
            2-bit, 640 prose tokens: +33% PPL without sinks, +6.8% with 4.
        compress_interval: unused here (quantization runs at every commit point that completes a group).

    Raises:
        ConfigError: a field is invalid (named); ``residual_length < K + 1`` (:meth:`check_compatible`);
            ``quant_group_size`` not dividing the model's head_dim (:meth:`check_model`).
    """

    quant_bits: int = 4
    quant_group_size: int = 64
    residual_length: int = 128
    sink_tokens: int = 4

    window = None  # class attributes, not fields: the standalone cache evicts nothing
    exact_window = False

    def static_cache(self, model, rows: int, capacity: int, widest: int, static_span: bool = False):
        """The decoder's form, one row or a batch: packed groups, fp sinks and a fixed fp residual on the static
        engine, packed at commit points (:class:`~toolkit.kv.static_quant.StaticQuantKV`)."""
        from toolkit.kv.static_quant import StaticQuantKV

        return StaticQuantKV(model, rows, capacity, widest, self, static_span=static_span)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_quant_fields(self.quant_bits, self.quant_group_size, self.residual_length)
        check_int("sink_tokens", self.sink_tokens, low=0, high=TOKENS_MAX)

    def check_compatible(self, max_query_tokens: int, prefix: str = "kv") -> None:
        check_quant_compatible(self, max_query_tokens, prefix)

    def check_tree(self, depth: int, prefix: str = "kv") -> None:
        check_quant_tree(self, depth, prefix)

    def check_model(self, model, prefix: str = "kv") -> None:
        check_quant_model(self, model, prefix)

    def new_layers(self, model) -> list[DynamicLayer]:
        return [QuantizedLayer(self.quant_bits, self.quant_group_size)
                for _ in range(model.config.get_text_config(decoder=True).num_hidden_layers)]

    def make_cache(self, model) -> QuantizedKVCache:
        self.check_model(model, getattr(self, "_prefix", "kv"))
        return QuantizedKVCache(self, model)

    def compress_layer(self, cache: QuantizedKVCache, layer_idx: int, layer: QuantizedLayer) -> bool:
        n = cache.get_seq_length()
        evict_before = None
        if self.window is not None and layer.max_length_held() > self.sink_tokens + self.window + \
                self.compress_interval:
            evict_before = n - self.window
        return layer.commit(self.sink_tokens, cache.boundary(n), evict_before)


@register_composed("streaming")
@dataclass
class QuantizedStreamingLLM(StreamingLLM):
    """StreamingLLM eviction composed with KIVI quantization: sinks at full precision, the window quantized except
    its newest ``residual_length`` tokens. Fields: StreamingLLM's plus ``quant_bits``, ``quant_group_size``,
    ``residual_length`` (see :class:`QuantizedKV`).

    Raises:
        ConfigError: as :class:`QuantizedKV` and :class:`~toolkit.kv.streaming.StreamingLLM`; also
            ``position_mode: reindex`` (quantized keys cannot be re-rotated) and ``residual_length > window``.
    """

    quant_bits: int = 4
    quant_group_size: int = 64
    residual_length: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        check_quant_fields(self.quant_bits, self.quant_group_size, self.residual_length)
        if self.position_mode != "absolute":
            raise ConfigError("position_mode", "a quantized window keeps absolute positions (quantized keys "
                              "cannot be re-rotated)", ["absolute"])
        if self.residual_length > self.window:
            raise ConfigError("residual_length", f"must be <= window={self.window} (the full-precision residual "
                              f"is the newest part of the window), got {self.residual_length}")

    def check_compatible(self, max_query_tokens: int, prefix: str = "kv") -> None:
        super().check_compatible(max_query_tokens, prefix)
        check_quant_compatible(self, max_query_tokens, prefix)

    def check_tree(self, depth: int, prefix: str = "kv") -> None:
        check_quant_tree(self, depth, prefix)

    def check_model(self, model, prefix: str = "kv") -> None:
        check_quant_model(self, model, prefix)

    new_layers = QuantizedKV.new_layers
    compress_layer = QuantizedKV.compress_layer

    def static_cache(self, model, rows: int, capacity: int, widest: int, static_span: bool = False):
        """The decoder's form, one row or a batch: KIVI's static form with a ring of packed groups
        (:class:`~toolkit.kv.static_quant.StaticQuantKV`), whose mask is the exact window, or without it the groups
        the commit points have not evicted (:class:`~toolkit.kv.static_stream_quant.StaticStreamQuantKV`)."""
        if self.exact_window:
            return QuantizedKV.static_cache(self, model, rows, capacity, widest, static_span)
        from toolkit.kv.static_stream_quant import StaticStreamQuantKV

        return StaticStreamQuantKV(model, rows, capacity, widest, self, static_span=static_span)

    def make_cache(self, model) -> QuantizedKVCache:
        self.check_model(model, getattr(self, "_prefix", "kv"))
        return QuantizedKVCache(self, model)


def boundary(n, policy):
    """Absolute position before which a query at position ``n`` (or a commit of ``n`` tokens) sees tokens quantized
    (sinks excepted) under ``policy`` (``S`` sinks, ``G`` group, ``R`` residual):
    ``S + G * min(floor((n - S) / G), ceil((n - S - R) / G))``, at least ``S``. ``n`` an int, or a long tensor (then
    elementwise, on its device)."""
    s, g, r = policy.sink_tokens, policy.quant_group_size, policy.residual_length
    if not isinstance(n, torch.Tensor):
        if n - s - r <= 0:
            return s
        return s + g * min((n - s) // g, -(-(n - s - r) // g))
    whole = torch.div(n - s, g, rounding_mode="floor")
    ceil = -torch.div(s + r - n, g, rounding_mode="floor")
    return torch.where(n - s - r > 0, s + g * torch.minimum(whole, ceil), s)


class QuantizedKVCache(CompressedCache):
    """The cache of :class:`QuantizedKV` / :class:`QuantizedStreamingLLM` (see the module docstring)."""

    def __init__(self, policy, model):
        super().__init__(policy, model)
        self._shadow: tuple[int, int] = (0, 0)

    def boundary(self, n: int) -> int:
        """Absolute position before which a query at position ``n`` (or a commit of ``n`` tokens) sees tokens
        quantized (sinks excepted): :func:`boundary`."""
        return boundary(n, self.policy)

    # ------------------------------------------------------------------------------------------------ bookkeeping
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self._maybe_auto_commit()
            q = key_states.shape[-2]
            self._length += q
            self._pending += q
        layer = self.layers[layer_idx]
        layer.shadow = self._shadow
        if layer_idx == len(self.layers) - 1:
            self._shadow = (0, 0)  # the mask of forward_kwargs is for one forward only
        return layer.update(key_states, value_states)

    # ------------------------------------------------------------------------------------------------ masks
    def forward_kwargs(self, position_ids: torch.Tensor) -> dict:
        """``position_ids`` ``(1, q)`` absolute (contiguous, starting at the logical length) -> the additive mask
        ``(1, 1, q, held + shadow + q)`` that gives every query exactly its autoregressive view (see the module
        docstring), or ``None`` when the model's causal mask already does.

        Raises:
            ValueError: ``position_ids`` do not start at the logical length.
        """
        self._maybe_auto_commit()
        policy = self.policy
        start, q = int(position_ids[0, 0]), position_ids.shape[-1]
        if start != self._length:
            raise ValueError(f"position_ids start at {start} but the quantized cache holds {self._length} tokens")
        prompt = self._length == 0  # the prompt attends at full precision (KIVI's prefill)
        first, last = (policy.sink_tokens,) * 2 if prompt else (self.boundary(start), self.boundary(start + q - 1))
        self._shadow = (first, last)
        if last == first and not policy.exact_window:
            return {"position_ids": position_ids, "attention_mask": None}
        return {"position_ids": position_ids, "attention_mask": self._mask(position_ids[0], first, last, prompt)}

    def _mask(self, query_pos: torch.Tensor, first: int, last: int, prompt: bool = False) -> torch.Tensor:
        """The additive mask ``(1, 1, q, keys)`` over ``[sinks, quantized, shadow, residual]`` (see
        :meth:`forward_kwargs`; ``prompt``: every query sees the residual at full precision)."""
        policy, device = self.policy, query_pos.device
        layer: QuantizedLayer = self.layers[0]
        held_pos = [torch.arange(layer.sinks), torch.arange(layer.q_start, layer.q_start + layer.q_len)]
        if not layer.is_initialized:
            held_pos = []
        # the residual: committed and pending entries, then this forward's tokens (one run of positions)
        residual_pos = torch.arange(layer.res_start if layer.is_initialized else 0, self._length + query_pos.numel())
        shadow_pos = torch.arange(first, last)
        key_pos = torch.cat((*held_pos, shadow_pos, residual_pos)).to(device)
        kind = torch.cat((torch.zeros(sum(p.numel() for p in held_pos), dtype=torch.long),
                          torch.ones(shadow_pos.numel(), dtype=torch.long),
                          torch.full((residual_pos.numel(),), 2, dtype=torch.long))).to(device)
        bound = torch.tensor([0 if prompt else self.boundary(int(p)) for p in query_pos.tolist()],
                             device=device)[:, None]
        kp, kd = key_pos[None, :], kind[None, :]
        visible = kp <= query_pos[:, None]
        visible &= (kd != 1) | (kp < bound)  # shadow: quantized copy, seen once the query is past its boundary
        visible &= (kd != 2) | (kp >= bound) | (kp < policy.sink_tokens)  # residual copy: before the boundary
        if policy.exact_window:
            visible &= (kp < policy.sink_tokens) | (kp > query_pos[:, None] - policy.window)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=device)
        return mask.masked_fill(~visible, torch.finfo(self.dtype).min)[None, None]

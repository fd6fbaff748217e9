"""L2-norm key compression (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", EMNLP 2024; kvpress ``KnormPress``).

Keys with a *low* L2 norm attract high attention, so each KV head keeps its ``budget`` lowest-norm keys (norms
computed in float32), plus the ``sink_tokens`` first and ``protect_recent`` last tokens unconditionally. Selection
is per head (different heads keep different tokens, the same number of them), so every layer stays one dense
``(batch, kv_heads, budget, head_dim)`` tensor. Layers in ``skip_layers`` (default ``[0, 1]``, where the paper finds
the norm/attention correlation weakest) are not compressed; because those layers are longer than the others, the
policy installs :mod:`toolkit.kv.attention` on the model (a causal mask per layer length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from toolkit.checks import TOKENS_MAX, check_float, check_int
from toolkit.errors import ConfigError
from toolkit.kv.registry import register_policy
from toolkit.kv.base import KVPolicy


@register_policy("l2norm", summary="L2-norm key eviction")
@dataclass
class L2Norm(KVPolicy):
    """Keep the lowest-L2-norm keys per head.

    Attributes:
        budget: tokens kept per head after a compression (sinks and recent included); set this or ``keep_ratio``.
        keep_ratio: fraction in (0, 1] of the logical sequence length kept per head (the cache then grows at
            ``keep_ratio`` times the uncompressed rate); set this or ``budget``.
        sink_tokens: first tokens always kept.
        protect_recent: most recent tokens always kept.
        skip_layers: layer indices left uncompressed.
        compress_interval: tokens a layer may grow past its budget before it is compressed back to it.

    Raises:
        ConfigError: neither or both of budget / keep_ratio, ``budget <= sink_tokens + protect_recent``,
            ``keep_ratio`` outside (0, 1], or a malformed ``skip_layers`` (the field is named).
    """

    budget: int | None = None
    keep_ratio: float | None = None
    sink_tokens: int = 4
    protect_recent: int = 32
    skip_layers: list[int] = field(default_factory=lambda: [0, 1])

    uses_attention_hook = True

    def static_cache(self, model, rows: int, capacity: int, widest: int, static_span: bool = False):
        """The decoder's form, one row or a batch: fixed-budget tiers on the static engine, compacted at commit
        points (:class:`~toolkit.kv.static_evict.StaticEvictKV`; head-aware too)."""
        from toolkit.kv.static_evict import StaticEvictKV

        return StaticEvictKV(model, rows, capacity, widest, self, static_span=static_span)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sink_tokens", self.sink_tokens, low=0, high=TOKENS_MAX)
        check_int("protect_recent", self.protect_recent, low=0, high=TOKENS_MAX)
        if (self.budget is None) == (self.keep_ratio is None):
            raise ConfigError("budget", "set exactly one of budget (tokens per head) or keep_ratio (fraction)")
        floor = self.sink_tokens + self.protect_recent
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget <= floor:
                raise ConfigError("budget", f"must be an integer > sink_tokens + protect_recent = {floor} (those "
                                  f"are always kept), got {self.budget!r}")
            check_int("budget", self.budget, high=TOKENS_MAX)
        else:
            check_float("keep_ratio", self.keep_ratio, low=0.0, high=1.0, low_open=True)
        if not isinstance(self.skip_layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= TOKENS_MAX for i in self.skip_layers):
            raise ConfigError("skip_layers", f"must be a list of layer indices >= 0, got {self.skip_layers!r}")
        self.skip_layers = list(self.skip_layers)

    def budget_for(self, length: int) -> int:
        """``budget``, or ``ceil(keep_ratio * length)`` but at least ``sink_tokens + protect_recent``."""
        if self.budget is not None:
            return self.budget
        return max(self.sink_tokens + self.protect_recent, math.ceil(self.keep_ratio * length))

    def protected(self) -> tuple[int, int]:
        return self.sink_tokens, self.protect_recent

    def compresses_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.skip_layers

    def score(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``-||k||_2`` in float32: ``(batch, kv_heads, seq)``; the lowest-norm keys score highest."""
        return -keys.float().norm(dim=-1)

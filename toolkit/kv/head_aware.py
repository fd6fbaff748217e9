"""Head-aware KV budgets: per-KV-head budgets from a calibrated head importance, realized in dense tiers.

Budgets (Ada-KV, Feng et al. 2024, redistributes one layer budget across heads; HeadKV, Fu et al. 2024, does it
from offline head scores): every KV head of a compressed layer gets a weight ``w = min_keep + (1 - min_keep) *
importance`` (importance from :mod:`toolkit.kv.calibration`, in [0, 1]; with ``min_keep = 0.5`` this is the
mapping ``0.5 + 0.5 * importance``). Heads are ranked by ``w`` model-wide and split into ``tiers`` equal-size
groups; tier ``t`` keeps ``factor_t * B`` tokens per head, ``factor_t = mean(w in t) / mean(w)``, where ``B`` is the
average budget (``budget`` tokens or ``keep_ratio`` x length). The mean over heads is therefore ``B``: the same
bytes as :class:`~toolkit.kv.l2norm.L2Norm` at the same budget, moved from unimportant to important heads.

Layout (DuoAttention, Xiao et al. 2024, keeps retrieval and streaming heads in separate caches): in each layer the
heads of one tier share one dense ``(batch, heads_in_tier, tier_len, head_dim)`` tensor, so a smaller budget frees
memory (nothing is masked); attention runs once per tier (:mod:`toolkit.kv.attention`). Within a head the kept
tokens are chosen by the L2-norm rule (Devoto et al. 2024), with sinks and recent tokens protected.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import DynamicLayer

from toolkit.checks import TOKENS_MAX, check_float, check_int, check_str_list
from toolkit.errors import ConfigError
from toolkit.kv.registry import register_policy
from toolkit.kv.attention import align_mask, causal_mask
from toolkit.kv.base import gather_seq
from toolkit.kv.l2norm import L2Norm


class TieredLayer(DynamicLayer):
    """One layer's cache as budget tiers: tier ``t`` holds KV heads ``groups[t]`` in its own dense tensors.

    ``update`` returns ``(self, self)``; the model hands that to :func:`toolkit.kv.attention.compressed_attention`,
    which calls :meth:`attend`.
    """

    def __init__(self, groups: list[torch.Tensor], factors: list[float], num_kv_heads: int):
        super().__init__()
        self.groups, self.factors, self.num_kv_heads = groups, factors, num_kv_heads
        self.tier_keys: list[torch.Tensor] = []
        self.tier_values: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``(batch, kv_heads, q, head_dim)`` states to every tier."""
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.groups = [g.to(self.device) for g in self.groups]
            self.tier_keys = [key_states.index_select(1, g) for g in self.groups]
            self.tier_values = [value_states.index_select(1, g) for g in self.groups]
            self.is_initialized = True
            return self, self
        for t, g in enumerate(self.groups):
            self.tier_keys[t] = torch.cat((self.tier_keys[t], key_states.index_select(1, g)), dim=2)
            self.tier_values[t] = torch.cat((self.tier_values[t], value_states.index_select(1, g)), dim=2)
        return self, self

    def attend(self, query: torch.Tensor, scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention ``(batch, q_heads, q, head_dim)`` of ``query`` ``(batch, q_heads, q, head_dim)``, per tier.

        ``mask``: ``None`` (causal) or an additive ``(1, 1, q, t)`` mask over the last ``t`` keys, right-aligned to
        each tier's length (:func:`toolkit.kv.attention.align_mask`).
        """
        groups = query.shape[1] // self.num_kv_heads
        out = query.new_empty(query.shape[:-1] + (self.tier_values[0].shape[-1],))
        offsets = torch.arange(groups, device=query.device)
        for g, keys, values in zip(self.groups, self.tier_keys, self.tier_values):
            heads = (g[:, None] * groups + offsets).flatten()
            tier_mask = (causal_mask(query.shape[-2], keys.shape[-2], query.device) if mask is None
                         else align_mask(mask, keys.shape[-2]))
            out[:, heads] = torch.nn.functional.scaled_dot_product_attention(
                query[:, heads], keys, values, attn_mask=tier_mask, scale=scaling, enable_gqa=groups > 1)
        return out

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        n = abs(tokens_to_remove)
        self.tier_keys = [k[:, :, :-n] for k in self.tier_keys]
        self.tier_values = [v[:, :, :-n] for v in self.tier_values]

    def tensors(self) -> list[torch.Tensor]:
        return self.tier_keys + self.tier_values

    def max_length_held(self) -> int:
        return max(k.shape[-2] for k in self.tier_keys)

    def get_seq_length(self) -> int:
        return self.max_length_held() if self.is_initialized else 0


def _check_importance(value) -> list[list[float]]:
    """``value`` as a list of equal-length rows of finite numbers; raises :class:`ConfigError` (``importance``)."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(r, (list, tuple)) and r for r in value):
        raise ConfigError("importance", f"must be a (num_layers, num_kv_heads) list of lists, got {value!r}")
    if len({len(r) for r in value}) != 1:
        raise ConfigError("importance", "every row (layer) must list the same number of KV heads")
    for i, row in enumerate(value):
        for j, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise ConfigError(f"importance[{i}][{j}]", f"must be a finite number, got {x!r}")
    return [list(r) for r in value]


@register_policy("head_aware", summary="head-aware per-head budgets")
@dataclass
class HeadAware(L2Norm):
    """Per-KV-head budgets from calibrated head importance, stored as dense tiers.

    Attributes (besides :class:`~toolkit.kv.l2norm.L2Norm`'s budget, keep_ratio, sink_tokens, protect_recent,
    skip_layers, compress_interval — here ``budget``/``keep_ratio`` are the *average* over heads):
        tiers: number of budget tiers (>= 1; 1 = uniform budgets).
        min_keep: weight of an importance-0 head relative to an importance-1 head (0 < min_keep <= 1).
        importance: explicit ``(num_layers, num_kv_heads)`` importance (list of lists of finite numbers, one row per
            layer); None = calibrate.
        calibration_files: a list of existing text files for calibration (None =
            :func:`toolkit.kv.calibration.default_files`).
        calibration_tokens: tokens of calibration text.
        calibration_window: local window (tokens) of the long-range attention measure.

    Raises:
        ConfigError: invalid field (named: a ``calibration_files`` that is one string, not a list, or names a missing
            file; a non-finite ``importance`` entry ...); ``importance`` of the wrong shape for the model (at
            ``make_cache``).
    """

    tiers: int = 3
    min_keep: float = 0.5
    importance: list[list[float]] | None = None
    calibration_files: list[str] | None = None
    calibration_tokens: int = 1024
    calibration_window: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        self._plans = weakref.WeakKeyDictionary()  # model -> tier plan (not a field: not configurable)
        check_int("tiers", self.tiers, low=1, high=1024)
        check_int("calibration_tokens", self.calibration_tokens, low=16, high=1 << 20)
        check_int("calibration_window", self.calibration_window, low=1, high=TOKENS_MAX)
        check_float("min_keep", self.min_keep, low=0.0, high=1.0, low_open=True)
        if self.importance is not None:
            self.importance = _check_importance(self.importance)
        if self.calibration_files is not None:
            self.calibration_files = check_str_list("calibration_files", self.calibration_files, "text file paths")
            for i, name in enumerate(self.calibration_files):
                if not Path(name).expanduser().is_file():
                    raise ConfigError(f"calibration_files[{i}]", f"{name} is not a file")

    def head_importance(self, model) -> torch.Tensor:
        """``(num_layers, num_kv_heads)`` importance in [0, 1]: the ``importance`` field, or calibrated.

        Raises:
            ConfigError: the calibration text is shorter than ``calibration_tokens`` (field named).
        """
        if self.importance is not None:
            return torch.tensor(self.importance, dtype=torch.float32)
        from toolkit.kv.calibration import load_or_calibrate

        try:
            return load_or_calibrate(model, self.calibration_files, self.calibration_tokens, self.sink_tokens,
                                     self.calibration_window)
        except ValueError as exc:  # calibration text shorter than calibration_tokens
            raise ConfigError(f"{getattr(self, '_prefix', 'kv')}.calibration_tokens", str(exc)) from None

    def plan(self, model) -> list[tuple[list[torch.Tensor], list[float]] | None]:
        """Per layer: ``(kv-head groups, budget factors)`` of its tiers, or None for a skipped layer."""
        key = model
        if key not in self._plans:
            config = model.config.get_text_config(decoder=True)
            n_layers = config.num_hidden_layers
            n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            importance = self.head_importance(model)
            if tuple(importance.shape) != (n_layers, n_kv):
                raise ConfigError(f"{getattr(self, '_prefix', 'kv')}.importance", f"must have shape (num_layers, "
                                  f"num_kv_heads) = ({n_layers}, {n_kv}), got {tuple(importance.shape)}")
            layers = [i for i in range(n_layers) if self.compresses_layer(i)]
            weight = self.min_keep + (1 - self.min_keep) * importance.clamp(0, 1)
            tier_of = torch.zeros(n_layers, n_kv, dtype=torch.long)
            factor = []
            if layers:
                flat = weight[layers].flatten()
                order = flat.argsort()
                chunks = [c for c in torch.tensor_split(order, min(self.tiers, flat.numel())) if c.numel()]
                ranks = torch.empty_like(order)
                for t, chunk in enumerate(chunks):
                    ranks[chunk] = t
                    factor.append(float(flat[chunk].mean() / flat.mean()))
                tier_of[layers] = ranks.view(len(layers), n_kv)
            plan = []
            for i in range(n_layers):
                if i not in layers:
                    plan.append(None)
                    continue
                tiers = [t for t in range(len(factor)) if (tier_of[i] == t).any()]
                plan.append(([(tier_of[i] == t).nonzero().flatten() for t in tiers], [factor[t] for t in tiers]))
            self._plans[key] = plan
        return self._plans[key]

    def new_layers(self, model) -> list[DynamicLayer]:
        config = model.config.get_text_config(decoder=True)
        n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return [DynamicLayer() if p is None else TieredLayer(p[0], p[1], n_kv) for p in self.plan(model)]

    def compress_layer(self, cache, layer_idx: int, layer: TieredLayer) -> bool:
        base = self.budget_for(cache.get_seq_length())
        floor = self.sink_tokens + self.protect_recent
        done = False
        for t, factor in enumerate(layer.factors):
            keys, values = layer.tier_keys[t], layer.tier_values[t]
            budget = max(floor, round(factor * base))
            if keys.shape[-2] <= budget + self.compress_interval:
                continue
            index = self.select(keys, values, layer_idx, budget)
            layer.tier_keys[t], layer.tier_values[t] = gather_seq(keys, index), gather_seq(values, index)
            done = True
        return done

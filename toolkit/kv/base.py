"""Shared base of the KV-cache compression policies (kvpress-style: a policy is a small dataclass that scores).

A policy subclasses :class:`KVPolicy` and implements ``score(keys, values, layer_idx) -> (batch, kv_heads, seq)``
(higher = keep), or overrides ``select``. The base does the rest:

* **budget** — :meth:`KVPolicy.budget_for` tokens kept per head after a compression (a fixed ``budget`` in tokens, or
  ``keep_ratio`` x the logical sequence length);
* **trigger** — a layer is compressed at a commit point when its physical length exceeds
  ``budget + compress_interval`` (amortized: one gather every ``compress_interval`` tokens), down to the budget;
* **gather** — the kept entries, per head, in their original order (dense ``(batch, kv_heads, budget, head_dim)``);
* **rollback** — compression runs only in :meth:`CompressedCache.commit`, so every entry appended since the last
  commit point sits at the tail of every layer and ``crop(-n)`` is an exact slice.

Lengths: ``get_seq_length()`` is the *logical* length (tokens the cache represents; the next absolute position),
as for HF's ``DynamicSlidingWindowLayer``; :meth:`CompressedCache.physical_length` is the number of entries held.
``get_mask_sizes`` reports ``(physical + q, logical - physical)`` so HF's own causal mask (``model.generate``) lines
up with a physically shorter cache.

With ``model.generate(past_key_values=cache)`` nobody calls ``commit()``; the cache then commits automatically at
the start of each forward (``auto_commit``: everything from earlier forwards is final in plain generation). The
toolkit decoder's :func:`toolkit.kv.contract.new_cache` turns that off, and so does the first explicit ``commit()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from toolkit.checks import TOKENS_MAX, check_int
from toolkit.dtypes import mask_dtype


@dataclass
class KVPolicy:
    """Base class of every compression policy. Subclasses are dataclasses registered with
    ``@register_policy(name, ...)`` (:mod:`toolkit.kv.registry`).

    Attributes:
        compress_interval: tokens (>= 0) a layer may grow past its budget before it is compressed back to it.
    """

    compress_interval: int = 16

    name: ClassVar[str] = "base"
    #: install :mod:`toolkit.kv.attention` on the model (layers or heads of different physical lengths)
    uses_attention_hook: ClassVar[bool] = False
    #: the policy runs on torch targets (``False``: llama.cpp's own KV formats, :mod:`toolkit.kv.ggml_types`)
    torch_form: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int("compress_interval", self.compress_interval, low=0, high=TOKENS_MAX)

    # ------------------------------------------------------------------------------------- what subclasses define
    def budget_for(self, length: int) -> int:
        """Entries (tokens) kept per head after compressing a layer whose logical length is ``length``."""
        raise NotImplementedError

    def protected(self) -> tuple[int, int]:
        """``(sink_tokens, recent_tokens)`` that :meth:`select` always keeps."""
        return 0, 0

    def compresses_layer(self, layer_idx: int) -> bool:
        """False for layers left uncompressed (e.g. L2-norm's ``skip_layers``)."""
        return True

    def score(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Importance of every cached entry: ``(batch, kv_heads, seq)``, higher = keep.

        ``keys`` / ``values``: ``(batch, kv_heads, seq, head_dim)``, committed entries only.
        """
        raise NotImplementedError

    def select(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, budget: int) -> torch.Tensor:
        """Indices ``(batch, kv_heads, budget)`` (ascending) of the entries to keep.

        The protected sinks and recent tokens are kept first, the rest by descending :meth:`score`.
        """
        seq = keys.shape[-2]
        scores = self.score(keys, values, layer_idx).float()
        sinks, recent = self.protected()
        scores[..., : min(sinks, seq)] = float("inf")
        if recent:
            scores[..., max(seq - recent, 0):] = float("inf")
        return scores.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values

    def check_compatible(self, max_query_tokens: int, prefix: str = "kv") -> None:
        """Raise :class:`ConfigError` if the policy cannot hold a forward of ``max_query_tokens`` new tokens.

        ``max_query_tokens`` is the widest verify forward of the recipe (K + 1 for a chain), decided by
        :func:`toolkit.session.plan`; policies never read speculation settings themselves.
        """

    def check_tree(self, depth: int, prefix: str = "kv") -> None:
        """Raise :class:`ConfigError` if the policy cannot verify token trees of ``depth`` levels exactly (every
        policy can, except where a quantized cache needs room; see :class:`toolkit.kv.quantized.QuantizedKV`)."""

    def check_model(self, model, prefix: str = "kv") -> None:
        """Raise :class:`ConfigError` if the policy cannot run on ``model``."""

    # ------------------------------------------------------------------------------------------------ machinery
    def new_layers(self, model) -> list[DynamicLayer]:
        """The storage of every layer of ``model`` (plain ``DynamicLayer``; head-aware policies use tiered layers)."""
        return [DynamicLayer() for _ in range(model.config.get_text_config(decoder=True).num_hidden_layers)]

    def make_cache(self, model) -> CompressedCache:
        """A fresh cache for ``model`` applying this policy. Raises :class:`ConfigError` (see :meth:`check_model`).

        Policies with ``uses_attention_hook`` need the model inside :meth:`attached` while it runs on the cache
        (the toolkit's decoder and evaluator do this; call it yourself around ``model.generate``).
        """
        self.check_model(model, getattr(self, "_prefix", "kv"))
        return CompressedCache(self, model)

    def attached(self, model):
        """Context manager: whatever this policy needs installed on ``model`` while it runs, restored on exit."""
        if not self.uses_attention_hook:
            return contextlib.nullcontext()
        from toolkit.kv.attention import attached

        return attached(model)

    def compress_layer(self, cache: CompressedCache, layer_idx: int, layer: DynamicLayer) -> bool:
        """Compress ``layer`` in place if it is over budget + interval; returns whether it did."""
        budget = self.budget_for(cache.get_seq_length())
        seq = layer.keys.shape[-2]
        if seq <= budget + self.compress_interval:
            return False
        index = self.select(layer.keys, layer.values, layer_idx, budget)
        layer.keys, layer.values = gather_seq(layer.keys, index), gather_seq(layer.values, index)
        return True

    def describe(self) -> dict:
        """The policy's name and fields (for reports)."""
        return {"policy": self.name, **dataclasses.asdict(self)}


def gather_seq(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor`` ``(batch, heads, seq, head_dim)`` gathered along seq at ``index`` ``(batch, heads, kept)``."""
    return tensor.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, tensor.shape[-1])).contiguous()


class CompressedCache(DynamicCache):
    """A ``DynamicCache`` whose layers a :class:`KVPolicy` compresses at commit points.

    Attributes:
        policy: the policy.
        compressions: commit points at which at least one layer was compressed.
        auto_commit: commit at the start of every forward (for ``model.generate``; see the module docstring).
    """

    def __init__(self, policy: KVPolicy, model):
        config = model.config.get_text_config(decoder=True)
        Cache.__init__(self, layers=policy.new_layers(model))
        self.policy = policy
        self.dtype = mask_dtype(model)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.compressions = 0
        self.auto_commit = True
        self._length = 0  # logical tokens represented
        self._pending = 0  # tokens appended since the last commit point (the only ones crop may remove)

    # ------------------------------------------------------------------------------------------------ lengths
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Logical length: tokens this cache represents (= the next absolute position)."""
        return self._length

    def physical_length(self, layer_idx: int | None = None) -> int:
        """Entries held per head: of ``layer_idx``, or the maximum over layers and heads when None."""
        if layer_idx is not None:
            return _layer_len(self.layers[layer_idx])
        return max((_layer_len(layer) for layer in self.layers), default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        self._maybe_auto_commit()
        held = self.physical_length(layer_idx) if layer_idx < len(self.layers) else 0
        return held + query_length, self._length - held

    # ------------------------------------------------------------------------------------------------ protocol
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            self._maybe_auto_commit()
            self._length += key_states.shape[-2]
            self._pending += key_states.shape[-2]
        return self.layers[layer_idx].update(key_states, value_states)

    def crop(self, max_length: int) -> None:
        """Remove the last ``-max_length`` tokens (``max_length < 0``), only tokens appended since the last commit.

        Raises:
            ValueError: ``max_length > 0`` (absolute lengths are meaningless once compressed) or more tokens than
                were appended since the last commit point.
        """
        if max_length == 0:
            return
        if max_length > 0:
            raise ValueError("a compressed cache only supports crop(-n): roll back n tokens since the last commit")
        remove = -max_length
        if remove > self._pending:
            raise ValueError(f"cannot roll back {remove} tokens: only {self._pending} were appended since the last "
                             "commit point (compressed entries cannot be restored)")
        for layer in self.layers:
            layer.crop(-remove)
        self._length -= remove
        self._pending -= remove

    def commit(self) -> None:
        """Commit point: everything in the cache is final; over-budget layers are compressed here."""
        self.auto_commit = False
        self._commit()

    def _commit(self) -> None:
        self._pending = 0
        compressed = False
        for idx, layer in enumerate(self.layers):
            if layer.is_initialized and self.policy.compresses_layer(idx):
                compressed |= self.policy.compress_layer(self, idx, layer)
        if compressed:
            self.compressions += 1
            self.after_compress()

    def _maybe_auto_commit(self) -> None:
        if self.auto_commit and self._pending:
            self._commit()

    def after_compress(self) -> None:
        """Hook for subclasses (bookkeeping after a compression event)."""

    def forward_kwargs(self, position_ids: torch.Tensor) -> dict:
        """Forward kwargs for queries at absolute ``position_ids`` ``(1, q)``: no extra mask by default."""
        return {"position_ids": position_ids, "attention_mask": None}

    def kv_bytes(self) -> int:
        """Exact bytes of every cached key and value tensor (sum of ``nbytes``)."""
        total = 0
        for layer in self.layers:
            for tensor in _layer_tensors(layer):
                total += tensor.nbytes
        return total


def _layer_tensors(layer) -> list[torch.Tensor]:
    tensors = getattr(layer, "tensors", None)
    if tensors is not None:
        return tensors()
    return [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if torch.is_tensor(t)]


def _layer_len(layer) -> int:
    if not layer.is_initialized:
        return 0
    length = getattr(layer, "max_length_held", None)
    if length is not None:
        return length()
    return layer.keys.shape[-2] if layer.keys.dim() == 4 else 0

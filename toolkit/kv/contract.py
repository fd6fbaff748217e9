"""The declared contract between the decode loop and KV caches / KV policies, and the uncompressed cache.

A KV *policy* (:class:`KVPolicyProtocol`) is inert configuration that builds caches; a *cache*
(:class:`CacheProtocol`) is what a generation appends to, rolls back and compresses. The decode loop, the drafters and
the reports rely on exactly these methods, never on which policy runs; ``tests/test_kv_contract.py`` checks every
registered policy and its cache against them.

The decoder never asks which policy it runs. It calls, for the target and for the draft:

* :func:`new_cache` once per generation (and :func:`policy_attached` around the forwards on it);
* ``cache.forward_kwargs(position_ids, tree_mask=None)`` before every forward, to get ``position_ids`` (absolute, or
  slot positions in the StreamingLLM ``reindex`` mode) and an ``attention_mask`` (``None`` = the model's own causal
  mask, or a 4D additive mask for exact window semantics). ``tree_mask`` (token trees): boolean ``(q, t)`` with
  ``t >= q``, the visibility of the *last* ``t`` keys of ``[cache entries, new tokens]`` for each query (True =
  attend); every earlier key stays visible. The mask is additive ``(1, 1, q, held + q)``, or ``(1, 1, q, t)``
  right-aligned for caches whose layers hold different lengths (see :mod:`toolkit.kv.attention`);
* ``cache.crop(-n)`` to roll back the ``n`` rejected tokens of a round (only tokens appended since the last commit);
* ``cache.keep_tail(keep)`` after a token-tree round: of the ``n`` entries appended since the last commit point keep
  only those at offsets ``keep`` (1-D, ascending, values in ``[0, n)``; the accepted path), a gather over the tail;
  the logical length becomes ``committed + len(keep)`` (``ValueError`` for offsets out of range, unsorted or
  repeated; :func:`toolkit.kv.tail.check_keep`);
* ``cache.commit()`` at every commit point (after verification): the only place a policy may compress;
* ``cache.kv_bytes()`` / ``cache.compressions`` for memory reports.

Caches made by :func:`new_cache` compress only at explicit commit points (their ``auto_commit``, used when a cache
is handed to ``model.generate``, is switched off).

:class:`PlainCache` is the uncompressed cache of ``kv: {policy: none}``: a ``transformers.DynamicCache`` that
records its commit point, so token-tree rounds can keep one path of the entries appended since (``keep_tail``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import DynamicCache

from toolkit.dtypes import mask_dtype


@runtime_checkable
class MemoryReport(Protocol):
    """What reports read of any cache (a model's or an EAGLE head's): exact bytes and compression events."""

    compressions: int

    def kv_bytes(self) -> int: ...


@runtime_checkable
class CacheProtocol(MemoryReport, Protocol):
    """A cache the decode loop can drive (shapes ``(batch, kv_heads, seq, head_dim)``, lengths in tokens).

    * ``get_seq_length()`` — logical length: tokens represented (the next absolute position);
    * ``crop(-n)`` — drop the last ``n`` tokens appended since the last commit point (exact rollback);
    * ``keep_tail(keep)`` — of the entries appended since the last commit point keep the offsets ``keep`` (trees);
    * ``commit()`` — a commit point: everything held is final; the only place a policy may compress;
    * ``forward_kwargs(position_ids, tree_mask=None)`` — ``position_ids`` and ``attention_mask`` for a forward;
    * ``kv_bytes()`` / ``compressions`` — exact bytes held and compression events, for reports.
    """

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def crop(self, max_length: int) -> None: ...

    def keep_tail(self, keep) -> None: ...

    def commit(self) -> None: ...

    def forward_kwargs(self, position_ids: torch.Tensor, tree_mask: torch.Tensor | None = None) -> dict: ...


@runtime_checkable
class KVPolicyProtocol(Protocol):
    """A KV compression policy (see :class:`toolkit.kv.base.KVPolicy` for the kvpress-style base class)."""

    name: str

    def check_compatible(self, max_query_tokens: int, prefix: str = "kv") -> None: ...

    def check_tree(self, depth: int, prefix: str = "kv") -> None: ...

    def check_model(self, model, prefix: str = "kv") -> None: ...

    def make_cache(self, model) -> CacheProtocol: ...

    def attached(self, model) -> Any: ...

    def describe(self) -> dict: ...


class PlainCache(DynamicCache):
    """The uncompressed cache (``policy: none``): a ``DynamicCache`` that knows its last commit point."""

    compressions = 0

    def __init__(self, model):
        super().__init__(config=model.config)
        self.committed = 0
        self.dtype = mask_dtype(model)

    def commit(self) -> None:
        self.committed = self.get_seq_length()

    def keep_tail(self, keep) -> None:
        """Keep the entries appended since the last commit point at offsets ``keep`` (ascending, distinct).

        Raises:
            ValueError: offsets out of range, unsorted or repeated.
        """
        from toolkit.kv.tail import check_keep, gather_tail

        pending = self.get_seq_length() - self.committed
        keep = check_keep(keep, pending)
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys = gather_tail(layer.keys, pending, keep)
                layer.values = gather_tail(layer.values, pending, keep)

    def forward_kwargs(self, position_ids: torch.Tensor, tree_mask: torch.Tensor | None = None) -> dict:
        if tree_mask is None:
            return {"position_ids": position_ids}
        from toolkit.kv.tail import tree_additive_mask

        return {"position_ids": position_ids,
                "attention_mask": tree_additive_mask(tree_mask, self.get_seq_length(), self.dtype)}

    def kv_bytes(self) -> int:
        return sum(t.nbytes for layer in self.layers if layer.is_initialized for t in (layer.keys, layer.values))


def new_cache(policy, model) -> CacheProtocol:
    """A fresh cache for ``model``: a :class:`PlainCache` when ``policy`` is None, else ``policy.make_cache(model)``
    (with ``auto_commit`` off: the decode loop commits after verification itself)."""
    if policy is None:
        return PlainCache(model)
    cache = policy.make_cache(model)
    cache.auto_commit = False
    return cache


def policy_attached(policy, model):
    """Context manager scoping whatever ``policy`` installs on ``model`` (nothing for ``None``) to a ``with`` block:
    ``policy.attached(model)``, which for policies with an attention hook is :func:`toolkit.kv.attention.attached`."""
    if policy is None:
        return contextlib.nullcontext()
    return policy.attached(model)

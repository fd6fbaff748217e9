"""The narrow protocol between the decode loop and a KV cache, compressed or not (declared in
:mod:`toolkit.kv.contract`: :class:`~toolkit.kv.contract.CacheProtocol`).

The decoder never asks which policy it runs. It calls, for the target and for the draft:

* :func:`new_cache` once per generation;
* :func:`model_inputs` before every forward, to get ``position_ids`` (absolute, or slot positions in the
  StreamingLLM ``reindex`` mode) and an ``attention_mask`` (``None`` = the model's own causal mask, or a 4D additive
  mask for exact window semantics);
* ``cache.crop(-n)`` to roll back the ``n`` rejected tokens of a round (only tokens appended since the last commit);
* :func:`keep_tail` after a token-tree round: keep only the accepted path's entries among those appended since the
  last commit point (a gather over the tail);
* :func:`commit` at every commit point (after verification): the only place a policy may compress;
* :func:`kv_bytes` for memory reports.

Caches made by :func:`new_cache` compress only at explicit commit points (their ``auto_commit``, used when a cache
is handed to ``model.generate``, is switched off).

Without a policy the cache is a :class:`~toolkit.kv.contract.PlainCache` (a ``DynamicCache`` that records its
commit point).
"""

from __future__ import annotations

import contextlib

import torch

from toolkit.kv.contract import CacheProtocol, MemoryReport, PlainCache
from toolkit.kv.tail import check_keep, gather_tail, tree_additive_mask  # noqa: F401  (re-exported)


def new_cache(policy, model) -> CacheProtocol:
    """A fresh cache for ``model``: a :class:`~toolkit.kv.contract.PlainCache` when ``policy`` is None, else
    ``policy.make_cache(model)`` (with ``auto_commit`` off: this loop commits after verification itself)."""
    if policy is None:
        return PlainCache(model)
    cache = policy.make_cache(model)
    cache.auto_commit = False
    return cache


def attached(policy, model):
    """Context manager scoping whatever ``policy`` installs on ``model`` (nothing for ``None``) to a ``with`` block."""
    if policy is None:
        return contextlib.nullcontext()
    return policy.attached(model)


def model_inputs(cache: CacheProtocol, position_ids: torch.Tensor, tree_mask: torch.Tensor | None = None) -> dict:
    """Forward kwargs for a query at absolute ``position_ids`` (shape ``(1, q)``) against ``cache``.

    ``tree_mask`` (token trees): boolean ``(q, t)`` with ``t >= q``, the visibility of the *last* ``t`` keys of
    ``[cache entries, new tokens]`` for each query (True = attend); every earlier key stays visible. ``None`` = plain
    causal attention.

    Returns a dict with ``position_ids`` and, when needed, ``attention_mask`` (additive ``(1, 1, q, held + q)``, or
    ``(1, 1, q, t)`` right-aligned for caches whose layers hold different lengths, see :mod:`toolkit.kv.attention`).
    """
    return cache.forward_kwargs(position_ids, tree_mask=tree_mask)


def commit(cache: CacheProtocol) -> None:
    """Mark everything now in ``cache`` as committed; a compressed cache may evict entries here."""
    cache.commit()


def keep_tail(cache: CacheProtocol, keep) -> None:
    """After a forward that appended ``n`` entries since the last commit point, keep only the pending entries at
    offsets ``keep`` (1-D, ascending, values in ``[0, n)``) and drop the others; the logical length becomes
    ``committed + len(keep)``.

    Raises:
        ValueError: offsets out of range, unsorted or repeated.
    """
    cache.keep_tail(keep)


def kv_bytes(cache: MemoryReport | None) -> int:
    """Exact bytes held by the cache's key and value tensors (0 for no cache)."""
    return 0 if cache is None else int(cache.kv_bytes())


def compressions(cache: MemoryReport | None) -> int:
    """How many compression events the cache has run (0 for no cache or an uncompressed one)."""
    return 0 if cache is None else int(cache.compressions)

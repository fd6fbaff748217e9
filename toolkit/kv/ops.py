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


def tree_additive_mask(tree_mask: torch.Tensor, held: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``(1, 1, q, held + q)``: 0 where visible, the dtype's minimum elsewhere.

    ``tree_mask`` ``(q, t)`` covers the last ``t`` keys; the ``held + q - t`` keys before them are visible to all.
    """
    q, t = tree_mask.shape
    visible = torch.ones(q, held + q, dtype=torch.bool, device=tree_mask.device)
    visible[:, held + q - t:] = tree_mask
    return torch.zeros(visible.shape, dtype=dtype, device=tree_mask.device).masked_fill(
        ~visible, torch.finfo(dtype).min)[None, None]


def commit(cache: CacheProtocol) -> None:
    """Mark everything now in ``cache`` as committed; a compressed cache may evict entries here."""
    cache.commit()


def check_keep(keep, pending: int) -> list[int]:
    """``keep`` (1-D tensor or list of offsets) as a list; raises ValueError unless ascending, distinct, in range."""
    keep = keep.tolist() if torch.is_tensor(keep) else list(keep)
    if any(not 0 <= k < pending for k in keep) or any(a >= b for a, b in zip(keep, keep[1:])):
        raise ValueError(f"keep must be ascending distinct offsets in [0, {pending}) (entries appended since the "
                         f"last commit point), got {keep}")
    return keep


def gather_tail(tensor: torch.Tensor, pending: int, keep: list[int]) -> torch.Tensor:
    """``tensor`` ``(batch, heads, seq, head_dim)`` with its last ``pending`` entries along seq reduced to ``keep``."""
    held = tensor.shape[-2]
    if keep == list(range(len(keep))):  # a prefix of the tail: a slice, no gather
        return tensor[..., : held - pending + len(keep), :]
    index = torch.tensor([held - pending + k for k in keep], device=tensor.device)
    return torch.cat((tensor[..., : held - pending, :], tensor.index_select(-2, index)), dim=-2)


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

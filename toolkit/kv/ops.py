"""The narrow protocol between the decode loop and a KV cache, compressed or not.

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

A plain ``transformers.DynamicCache`` satisfies the protocol with no compression.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache


def new_cache(policy, model) -> DynamicCache:
    """A fresh cache for ``model``: a ``DynamicCache`` when ``policy`` is None, else ``policy.make_cache(model)``."""
    if policy is None:
        return DynamicCache(config=model.config)
    cache = policy.make_cache(model)
    cache.auto_commit = False  # this loop calls commit() itself, after verification
    return cache


def attached(policy, model):
    """Context manager scoping whatever ``policy`` installs on ``model`` (nothing for ``None``) to a ``with`` block."""
    if policy is None:
        return contextlib.nullcontext()
    return policy.attached(model)


def model_inputs(cache, position_ids: torch.Tensor, tree_mask: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> dict:
    """Forward kwargs for a query at absolute ``position_ids`` (shape ``(1, q)``) against ``cache``.

    ``tree_mask`` (token trees): boolean ``(q, t)`` with ``t >= q``, the visibility of the *last* ``t`` keys of
    ``[cache entries, new tokens]`` for each query (True = attend); every earlier key stays visible. ``None`` = plain
    causal attention. ``dtype``: the model's float dtype (of the additive mask).

    Returns a dict with ``position_ids`` and, when needed, ``attention_mask`` (additive ``(1, 1, q, held + q)``, or
    ``(1, 1, q, t)`` right-aligned for caches whose layers hold different lengths, see :mod:`toolkit.kv.attention`).
    """
    hook = getattr(cache, "forward_kwargs", None)
    if hook is None:
        if tree_mask is None:
            return {"position_ids": position_ids}
        return {"position_ids": position_ids,
                "attention_mask": tree_additive_mask(tree_mask, cache.get_seq_length(), dtype)}
    if tree_mask is None:
        return hook(position_ids)
    return hook(position_ids, tree_mask=tree_mask)


def tree_additive_mask(tree_mask: torch.Tensor, held: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``(1, 1, q, held + q)``: 0 where visible, the dtype's minimum elsewhere.

    ``tree_mask`` ``(q, t)`` covers the last ``t`` keys; the ``held + q - t`` keys before them are visible to all.
    """
    q, t = tree_mask.shape
    visible = torch.ones(q, held + q, dtype=torch.bool, device=tree_mask.device)
    visible[:, held + q - t:] = tree_mask
    return torch.zeros(visible.shape, dtype=dtype, device=tree_mask.device).masked_fill(
        ~visible, torch.finfo(dtype).min)[None, None]


def commit(cache) -> None:
    """Mark everything now in ``cache`` as committed; a compressed cache may evict entries here.

    A cache without a ``commit`` hook (plain ``DynamicCache``) gets its commit point recorded (the length now
    held), which :func:`keep_tail` needs to know which entries are pending.
    """
    hook = getattr(cache, "commit", None)
    if hook is not None:
        hook()
    elif cache is not None:
        cache._toolkit_committed = cache.get_seq_length()


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


def keep_tail(cache, keep) -> None:
    """After a forward that appended ``n`` entries since the last commit point, keep only the pending entries at
    offsets ``keep`` (1-D, ascending, values in ``[0, n)``) and drop the others; the logical length becomes
    ``committed + len(keep)``.

    A cache with its own ``keep_tail(keep)`` (every :class:`~toolkit.kv.base.CompressedCache`) does it itself; a plain
    ``DynamicCache`` is gathered layer by layer (its commit point is recorded by :func:`commit`).

    Raises:
        ValueError: offsets out of range, unsorted or repeated.
    """
    hook = getattr(cache, "keep_tail", None)
    if hook is not None:
        hook(keep)
        return
    committed = getattr(cache, "_toolkit_committed", 0)
    pending = cache.get_seq_length() - committed
    keep = check_keep(keep, pending)
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True) and torch.is_tensor(getattr(layer, "keys", None)):
            layer.keys = gather_tail(layer.keys, pending, keep)
            layer.values = gather_tail(layer.values, pending, keep)


def kv_bytes(cache) -> int:
    """Exact bytes held by the cache's key and value tensors (sum of ``nbytes``)."""
    hook = getattr(cache, "kv_bytes", None)
    if hook is not None:
        return int(hook())
    total = 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def compressions(cache) -> int:
    """How many compression events the cache has run (0 for an uncompressed cache)."""
    return int(getattr(cache, "compressions", 0))

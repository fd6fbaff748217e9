"""The narrow protocol between the decode loop and a KV cache, compressed or not.

The decoder never asks which policy it runs. It calls, for the target and for the draft:

* :func:`new_cache` once per generation;
* :func:`model_inputs` before every forward, to get ``position_ids`` (absolute, or slot positions in the
  StreamingLLM ``reindex`` mode) and an ``attention_mask`` (``None`` = the model's own causal mask, or a 4D additive
  mask for exact window semantics);
* ``cache.crop(-n)`` to roll back the ``n`` rejected tokens of a round (only tokens appended since the last commit);
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


def model_inputs(cache, position_ids: torch.Tensor) -> dict:
    """Forward kwargs for a query at absolute ``position_ids`` (shape ``(1, q)``) against ``cache``.

    Returns a dict with ``position_ids`` and, when the cache needs one, ``attention_mask``
    (additive, shape ``(1, 1, q, cache_len + q)``).
    """
    hook = getattr(cache, "forward_kwargs", None)
    if hook is None:
        return {"position_ids": position_ids}
    return hook(position_ids)


def commit(cache) -> None:
    """Mark everything now in ``cache`` as committed; a compressed cache may evict entries here."""
    hook = getattr(cache, "commit", None)
    if hook is not None:
        hook()


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

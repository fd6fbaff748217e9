"""The declared contract between the decode loop and KV caches / KV policies, and the uncompressed cache.

A KV *policy* (:class:`KVPolicyProtocol`) is inert configuration that builds caches; a *cache*
(:class:`CacheProtocol`) is what a generation appends to, rolls back and compresses. The decode loop, the drafters and
the reports rely on exactly these methods, never on which policy runs; ``tests/test_kv_contract.py`` checks every
registered policy and its cache against them.

The decoder never asks which policy it runs. It calls, for the target and for the draft:

* :func:`new_cache` once per generation (and :func:`policy_attached` around the forwards on it);
* ``cache.forward_kwargs(position_ids)`` before every forward, to get ``position_ids`` (absolute, or slot positions in
  the StreamingLLM ``reindex`` mode) and an ``attention_mask`` (``None`` = the model's own causal mask, or a 4D
  additive mask for exact window semantics);
* ``cache.crop(-n)`` to roll back the ``n`` rejected tokens of a round (only tokens appended since the last commit);
* ``cache.commit()`` at every commit point (after verification): the only place a policy may compress;
* ``cache.kv_bytes()`` / ``cache.compressions`` for memory reports.

Caches made by :func:`new_cache` compress only at explicit commit points (their ``auto_commit``, used when a cache
is handed to ``model.generate``, is switched off). These single-sequence caches are each policy's reference
semantics (the evaluator, ``model.generate``, equality tests); the decoder runs every policy with a static form on
its static cache (:mod:`toolkit.kv.rows`), token trees included.

:class:`PlainCache` is the uncompressed cache of ``kv: {policy: none}``: a ``transformers.DynamicCache``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import DynamicCache



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
    * ``commit()`` — a commit point: everything held is final; the only place a policy may compress;
    * ``forward_kwargs(position_ids)`` — ``position_ids`` and ``attention_mask`` for a forward;
    * ``kv_bytes()`` / ``compressions`` — exact bytes held and compression events, for reports.
    """

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def crop(self, max_length: int) -> None: ...

    def commit(self) -> None: ...

    def forward_kwargs(self, position_ids: torch.Tensor) -> dict: ...


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
    """The uncompressed cache (``policy: none``): a ``DynamicCache`` with the contract's calls."""

    compressions = 0

    def __init__(self, model):
        super().__init__(config=model.config)

    def commit(self) -> None:
        """A commit point: nothing to compress."""

    def forward_kwargs(self, position_ids: torch.Tensor) -> dict:
        return {"position_ids": position_ids}

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

"""The one cache protocol of the decoder: rows of sequences, each accepting its own number of tokens per forward.

The decoder (:mod:`toolkit.engine.decoder`) drives the target's cache through exactly these calls, whatever the KV
policy, for one row or a batch::

    begin_row(length)        -> (cache, kwargs)   where a new request's prompt of `length` tokens is prefilled alone
    add_row(cache, length)                        that prefill becomes the last row
    prepare(width[, rows])   -> kwargs            position_ids, attention_mask and past_key_values of a forward
                                                  appending `width` tokens to every row
    accept(kept, kept_host)                       row r keeps the first kept[r] of them (rollback of the rest)
    commit()                                      a commit point: the only place a policy may compress
    keep_rows(keep)                               only the rows `keep` stay (in that order)
    kv_bytes() / compressions / rows / static     reports; whether compiled forwards may run on it

Between forwards row ``r`` represents the tokens committed so far but its last one (the next forward's first input).
Token trees (one row) add ``prepare_tree`` / ``keep_tree``, which only the static cache has
(:mod:`toolkit.kv.static_tree`).

Which cache a policy gets (:func:`rows_cache`): a static cache wherever the model's layers allow — the plain
:class:`~toolkit.kv.static.StaticKV` (no policy), :class:`~toolkit.kv.static_sliding.SlidingStaticKV` (no policy, a
model with sliding-window layers) or the policy's own ``static_cache`` (StreamingLLM in every mode: the ring or
:mod:`toolkit.kv.static_stream`; L2-norm and head-aware eviction: :mod:`toolkit.kv.static_evict`; KIVI quantization,
alone or composed with StreamingLLM: :mod:`toolkit.kv.static_quant`, :mod:`toolkit.kv.static_stream_quant`); else,
one sequence at a time, the policy's single-sequence cache behind :class:`SingleRowCache`. No ``isinstance``: each
policy declares its forms.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from toolkit.kv.contract import new_cache
from toolkit.kv.static import StaticKV, static_form
from toolkit.kv.static_sliding import SLIDING, SlidingStaticKV, layer_kinds, unsupported


@runtime_checkable
class RowCache(Protocol):
    """What the decoder calls on the target's cache (see the module docstring)."""

    compressions: int
    static: bool

    @property
    def rows(self) -> int: ...

    def begin_row(self, length: int) -> tuple[object, dict]: ...

    def add_row(self, prefilled, length: int) -> None: ...

    def prepare(self, width: int, rows: range | None = None) -> dict: ...

    def accept(self, kept: torch.Tensor, kept_host: list[int]) -> None: ...

    def commit(self) -> None: ...

    def keep_rows(self, keep: list[int]) -> None: ...

    def kv_bytes(self) -> int: ...

    def needed_bytes(self) -> int: ...


class SingleRowCache:
    """One sequence on a policy's single-sequence cache (:class:`~toolkit.kv.contract.CacheProtocol`: ``crop``,
    ``commit``, ``forward_kwargs``): the form of policies on models the static cache does not hold
    (:func:`static_why`); chains only (token trees run on the static cache).

    Args:
        policy: the KV policy (``None``: an uncompressed ``DynamicCache``; the decoder uses the static cache there).
        model: the HF causal LM.
    """

    static = False

    def __init__(self, policy, model):
        self.policy, self.model = policy, model
        self.cache = None  # the policy's cache of the current (or, once it left, the last) sequence
        self.in_use = False
        self.length = 0  # tokens represented (the next position)
        self._width = 0

    @property
    def rows(self) -> int:
        return 1 if self.in_use else 0

    @property
    def compressions(self) -> int:
        return 0 if self.cache is None else self.cache.compressions

    def begin_row(self, length: int) -> tuple[object, dict]:
        """The prompt is prefilled straight into the cache (a second row is a ``ValueError``)."""
        if self.in_use:
            raise ValueError("SingleRowCache: holds one sequence; batches need a policy with a per-row form")
        self.cache, self.in_use = new_cache(self.policy, self.model), True
        device = next(self.model.parameters()).device
        kwargs = self.cache.forward_kwargs(torch.arange(length, device=device).view(1, -1))
        return self.cache, {**kwargs, "past_key_values": self.cache}

    def add_row(self, prefilled, length: int) -> None:
        self.cache.commit()
        self.length = length

    def prepare(self, width: int, rows: range | None = None) -> dict:
        """Inputs of a forward of ``width`` tokens at the next positions."""
        self._width = width
        device = next(self.model.parameters()).device
        positions = torch.arange(self.length, self.length + width, device=device).view(1, -1)
        return {**self.cache.forward_kwargs(positions), "past_key_values": self.cache}

    def accept(self, kept: torch.Tensor, kept_host: list[int]) -> None:
        """Keep the first ``kept_host[0]`` of the forward's tokens: ``crop`` the rest (exact rollback)."""
        rejected = self._width - kept_host[0]
        if rejected > 0:
            self.cache.crop(-rejected)
        self.length += kept_host[0]

    def commit(self) -> None:
        self.cache.commit()

    def keep_rows(self, keep: list[int]) -> None:
        """``[]``: the sequence left (its cache stays readable, for reports, until the next ``begin_row``)."""
        if not keep:
            self.in_use = False

    def kv_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.kv_bytes()

    def needed_bytes(self) -> int:
        """What the sequence holds: its cache grows with it, so the bytes it has (:meth:`kv_bytes`)."""
        return self.kv_bytes()


def rows_cache(policy, model, rows: int, capacity: int, widest: int, static_span: bool = False) -> RowCache:
    """The target's cache for ``rows`` rows of requests of up to ``capacity`` positions (prompt + new tokens) and
    forwards of up to ``widest`` tokens, under ``policy`` (see the module docstring).

    Raises:
        ValueError: ``rows > 1`` with a policy or model the static cache does not hold (the caller decodes one at a
            time).
    """
    if static_why(policy, model) is None:
        if policy is not None and getattr(policy, "static_cache", None) is not None:
            return policy.static_cache(model, rows, capacity, widest, static_span=static_span)
        if SLIDING in layer_kinds(model):
            return SlidingStaticKV(model, rows, capacity, widest, static_span=static_span)
        return StaticKV(model, rows, capacity, widest, static_span=static_span)
    if rows == 1:
        return SingleRowCache(policy, model)
    raise ValueError(f"batch_size: requests cannot share a batch here ({static_why(policy, model)}); decode them one "
                     "at a time")


def static_why(policy, model) -> str | None:
    """Why no static cache holds ``policy`` on ``model`` (``None``: one does), which is also why requests under it
    cannot share a batch (only the static cache holds rows): the policy has no static form
    (:func:`~toolkit.kv.static.static_form`), the model has layers the static cache does not hold
    (:func:`supports_static`), or a policy on a model with sliding-window layers (its static forms hold full
    attention only)."""
    why = static_form(policy) or supports_static(model)
    if why is None and policy is not None and SLIDING in layer_kinds(model):
        why = f"the {policy.name} policy on a model with sliding-window layers (the static forms of KV policies " \
              "hold full-attention layers only)"
    return why


def supports_static(model) -> str | None:
    """Why ``model`` cannot run on the static cache (``None`` when it can): full-attention and sliding-window layers
    are held (:mod:`toolkit.kv.static_sliding`); linear attention, chunked attention, attention sinks and shared KV
    layers keep their own cache semantics (:func:`toolkit.kv.static_sliding.unsupported`)."""
    return unsupported(model)

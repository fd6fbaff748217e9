"""Attention for caches whose layers or heads hold different numbers of entries.

HF models build *one* causal mask per forward, sized for one reference layer. A compressed cache whose layers have
different physical lengths (L2-norm ``skip_layers``) or whose KV heads are split into budget tiers of different
lengths (head-aware, DuoAttention-style layout) needs a mask per layer and per tier. :func:`attached` registers
:func:`compressed_attention` under the name ``toolkit_kv`` in transformers' ``AttentionInterface`` and switches the
model to it (``model.set_attn_implementation``) for the duration of a ``with`` block only, like a kvpress press:
the model's own implementation is restored on exit, also after an exception. With a non-standard implementation name transformers builds no
mask at all, and this function derives the causal mask from the shapes: every cached entry is in the past, the
last ``q`` keys are the current queries, so key ``j`` is visible to query ``i`` iff ``j <= i + kv_len - q``.

Supported: batch inputs without padding (the decoder's batch size 1, ``model.generate`` on one prompt); a 4D
additive mask passed explicitly is honoured; one narrower than a layer's keys covers the *last* keys and is
right-aligned (:func:`align_mask`: the keys before it are visible). The math is
``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

NAME = "toolkit_kv"
#: the static engine's attention (:func:`static_attention`)
STATIC_NAME = "toolkit_static"
#: a prompt's forward under an explicit boolean mask at least this long is attended in chunks (:func:`chunked_sdpa`)
CHUNKED_MIN = 1024
#: queries per chunk of :func:`chunked_sdpa`: a chunk of C queries under a window of W keys attends to ~W + C keys of
#: which each query sees W, so smaller chunks waste less; at a 4,096-token prompt under a StreamingLLM window of
#: 4 + 508, one layer (9 query heads, 3 KV heads, fp32, 2 CPU cores) took 53-62 ms at 128 against 56-67 at 256 and
#: 78-80 at 512, and 57-76 at 64 (the calls' own cost)
CHUNK = 128
_registered = False
#: (weak reference to the last mask :func:`chunk_plan` planned, its plan)
_last_plan: tuple = (None, [])


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """Boolean ``(q_len, kv_len)`` mask (True = attend), right-aligned; None when ``q_len == 1`` (sees all)."""
    if q_len == 1:
        return None
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


def align_mask(mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """An additive ``(..., q, t)`` mask over the last ``t`` keys widened to ``kv_len`` keys (earlier keys visible)."""
    missing = kv_len - mask.shape[-1]
    if missing <= 0:
        return mask
    return torch.cat((mask.new_zeros(mask.shape[:-1] + (missing,)), mask), dim=-1)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, scaling) -> torch.Tensor:
    """Attention of ``query`` ``(b, q_heads, q, d)`` over ``key``/``value`` ``(b, kv_heads, kv, d)`` (GQA aware);
    ``mask`` ``None`` means causal, right-aligned.

    A prompt's forward (as many queries as keys, no mask) runs SDPA's own causal kernel (``is_causal``) rather than
    an explicit ``(q, kv)`` mask: it skips the masked half and never materializes the mask. At a 4,096-token prompt
    on this CPU one layer's attention took 175 ms that way against 398 ms under an explicit boolean mask (fp32)."""
    gqa = query.shape[1] != key.shape[1]
    if mask is None and query.shape[-2] == key.shape[-2] > 1:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    if mask is None:
        mask = causal_mask(query.shape[-2], key.shape[-2], query.device)
    elif mask.dtype == torch.bool and query.shape[-2] == key.shape[-2] >= CHUNKED_MIN:
        return chunked_sdpa(query, key, value, mask, scaling)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def chunked_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                 scaling) -> torch.Tensor:
    """:func:`sdpa` of a long prompt under a boolean ``mask`` ``(b | 1, 1, q, kv)``, :data:`CHUNK` queries at a time,
    each chunk over only the keys some query of it sees (gathered; the mask's columns with them). Exact for any mask;
    fast where the mask is sparse: a StreamingLLM window over a 4,096-token prompt (4 sinks + 508) leaves each chunk
    of 128 queries ~640 keys, against the whole prompt under a dense ``(q, kv)`` mask. Eager only (host reads: which
    keys each chunk sees, found once per mask by :func:`chunk_plan`); a prompt's forward is eager. Returns ``(b,
    q_heads, q, d)``."""
    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty(query.shape[:-1] + value.shape[-1:])
    for start, seen, rows in chunk_plan(mask):
        out[:, :, start:start + CHUNK] = F.scaled_dot_product_attention(
            query[:, :, start:start + CHUNK], key.index_select(-2, seen), value.index_select(-2, seen),
            attn_mask=rows, scale=scaling, enable_gqa=gqa)
    return out


def chunk_plan(mask: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each chunk of :data:`CHUNK` queries of a boolean ``mask`` ``(b | 1, 1, q, kv)``: ``(first query, the
    keys some query of the chunk sees (k,), the chunk's rows of the mask over those keys (b | 1, 1, <= CHUNK, k))``.

    Every layer of a forward attends under the same mask object, so the plan of the last mask is kept (by weak
    reference: a mask that is gone is never matched) and the layers after the first reuse it: on a 4,096-token
    prompt under a StreamingLLM window, finding the keys and gathering the mask's columns again in each of the
    embedded model's 30 layers cost ~0.5 s of a ~5.5 s prefill. A mask changed in place would not be noticed; the
    toolkit builds a new mask for every forward."""
    global _last_plan
    ref, plan = _last_plan
    if ref is not None and ref() is mask:
        return plan
    plan = []
    for start in range(0, mask.shape[-2], CHUNK):
        rows = mask[..., start:start + CHUNK, :]
        seen = rows.any(-2).flatten(0, -2).any(0).nonzero().flatten()
        plan.append((start, seen, rows.index_select(-1, seen)))
    _last_plan = (weakref.ref(mask), plan)
    return plan


def compressed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function: returns ``(output (b, q, q_heads, d), None)``.

    ``key`` is a tensor ``(b, kv_heads, kv, d)`` or a tiered layer (anything with ``attend(query, scaling)``, see
    :class:`toolkit.kv.head_aware.TieredLayer`), which computes attention per budget tier.
    """
    if hasattr(key, "attend"):
        out = key.attend(query, scaling, attention_mask)
    else:
        mask = attention_mask
        if mask is not None and mask.shape[-1] > key.shape[-2]:
            raise ValueError(f"attention mask covers {mask.shape[-1]} keys but layer {module.layer_idx} holds "
                             f"{key.shape[-2]}; pass no mask (causal) to a cache with per-layer lengths")
        if mask is not None:  # a mask over the last t keys is right-aligned: earlier keys visible
            mask = align_mask(mask, key.shape[-2])
        out = sdpa(query, key, value, mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def static_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function of the static engine (:mod:`toolkit.kv.static`): SDPA of ``query``
    ``(b, q_heads, q, d)`` over ``key``/``value`` ``(b, kv_heads, span, d)`` under the boolean mask
    ``(b, 1, q, span)`` (``None``: causal), or over the tiers of an evicting static cache (``key`` a
    :class:`~toolkit.kv.static_evict.TierKeys`, each tier with its own mask, or of a KIVI cache, a
    :class:`~toolkit.kv.quant_attention.QuantKeys`). Returns ``(output (b, q, q_heads, d),
    None)``.

    On CPU, half-precision queries are attended in float32 (the static cache holds its keys and values in float32
    there): PyTorch's bf16 flash-attention kernel for CPU is built for long query blocks, and with the few queries of
    a decode or verify forward it measured 5x slower than the float32 one here (514 vs 100 us at one query over 512
    keys); the result is cast back.
    """
    dtype = query.dtype
    if query.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        query = query.float()
        if attention_mask is not None and attention_mask.dtype.is_floating_point:
            # an additive mask of a cache that is not the static one (a `self` draft sharing the target's modules
            # runs inside the target's attention switch) follows the query to float32
            attention_mask = attention_mask.to(query.dtype)
    if kwargs.get("s_aux") is not None:
        raise ValueError("static_attention: attention sinks (s_aux) are not supported; such models run eager")
    if hasattr(key, "attend"):  # tiers of an evicting static cache, each with its own mask (toolkit.kv.static_evict)
        out = key.attend(query, scaling)
    elif kwargs.get("softcap") is not None:
        out = softcapped(query, key.to(query.dtype), value.to(query.dtype), attention_mask, scaling, kwargs["softcap"])
    else:
        out = sdpa(query, key.to(query.dtype), value.to(query.dtype), attention_mask, scaling)
    return out.to(dtype).transpose(1, 2).contiguous(), None


def softcapped(query, key, value, mask, scaling, softcap: float) -> torch.Tensor:
    """Attention with logit soft-capping (Gemma-2: ``softcap * tanh(scores / softcap)`` before the mask and the
    softmax, as HF's eager attention computes it; SDPA has no such step): ``query`` ``(b, q_heads, q, d)`` over
    ``key``/``value`` ``(b, kv_heads, kv, d)`` under a boolean or additive mask (``None``: causal); the softmax in
    float32. Returns ``(b, q_heads, q, d)``."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.tanh(query @ key.transpose(-1, -2) * scaling / softcap) * softcap
    if mask is None:
        mask = causal_mask(query.shape[-2], key.shape[-2], query.device)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype) @ value


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, compressed_attention)
        AttentionInterface.register(STATIC_NAME, static_attention)
        _registered = True


@contextlib.contextmanager
def attached(model, name: str = NAME) -> Iterator[None]:
    """Run ``model`` with the attention function ``name`` (:func:`compressed_attention` by default,
    :data:`STATIC_NAME` for the static engine) inside the block; its own implementation is restored after.

    Re-entrant: a nested block (target and a ``self`` draft sharing modules) leaves the switch to the outer one.
    """
    _register()
    previous = model.config._attn_implementation
    if previous == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)

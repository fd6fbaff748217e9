"""Rotary position embedding (RoPE, Su et al. 2021) helpers for re-indexing cached keys.

HF rotary models (Llama, Mistral, Qwen, GPT-NeoX/Pythia, ...) rotate the first ``rotary_dim`` channels of each
head in the "rotate_half" layout: angle ``position * inv_freq`` applied to channel pairs ``(i, i + rotary_dim/2)``.
Llama rotates the whole head (``rotary_dim = head_dim``); GPT-NeoX rotates ``rotary_pct`` of it (Pythia: 25%), and
the remaining channels carry no position. Because ``R(p + d) = R(d) R(p)``, a key cached at position ``p`` is moved
to ``p + d`` by rotating its rotary channels by ``d`` — no recomputation of the key projection.
"""

from __future__ import annotations

import torch


def find_inv_freq(model) -> torch.Tensor | None:
    """The ``inv_freq`` buffer ``(rotary_dim / 2,)`` of ``model``'s rotary embedding, or None without RoPE."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if torch.is_tensor(inv_freq) and "rotary" in type(module).__name__.lower():
            return inv_freq
    return None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def shift_positions(keys: torch.Tensor, inv_freq: torch.Tensor, delta: int) -> torch.Tensor:
    """Keys ``(batch, kv_heads, seq, head_dim)`` rotated as if cached ``delta`` positions later (``delta`` may be < 0).

    Computed in float32 and cast back to ``keys.dtype``; channels past ``rotary_dim = 2 * len(inv_freq)`` are
    returned unchanged (partial rotary, GPT-NeoX).
    """
    rotary_dim = 2 * inv_freq.numel()
    angle = delta * inv_freq.to(device=keys.device, dtype=torch.float64)
    cos = torch.cat((angle.cos(), angle.cos())).float()
    sin = torch.cat((angle.sin(), angle.sin())).float()
    rot = keys[..., :rotary_dim].float()
    rot = (rot * cos + rotate_half(rot) * sin).to(keys.dtype)
    return torch.cat((rot, keys[..., rotary_dim:]), dim=-1)

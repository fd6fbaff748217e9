"""Tensor helpers for the entries a forward appended to a KV cache since its last commit point (the *tail*):
tree attention masks over it and keeping some of its entries (token trees keep one path)."""

from __future__ import annotations

import torch


def tree_additive_mask(tree_mask: torch.Tensor, held: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``(1, 1, q, held + q)``: 0 where visible, the dtype's minimum elsewhere.

    ``tree_mask`` ``(q, t)`` covers the last ``t`` keys; the ``held + q - t`` keys before them are visible to all.
    """
    q, t = tree_mask.shape
    visible = torch.ones(q, held + q, dtype=torch.bool, device=tree_mask.device)
    visible[:, held + q - t:] = tree_mask
    return torch.zeros(visible.shape, dtype=dtype, device=tree_mask.device).masked_fill(
        ~visible, torch.finfo(dtype).min)[None, None]


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

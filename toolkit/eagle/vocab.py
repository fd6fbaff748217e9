"""Reduced draft vocabulary (FR-Spec, Zhao et al. 2025; EAGLE-3's ``d2t`` / ``t2d``): the N most frequent target
tokens. ``d2t[i]`` is the *offset* of draft id ``i`` (target id = ``i + d2t[i]``), ``t2d`` ``(vocab,)`` bool marks
target ids in the draft vocabulary — EAGLE-3's published encoding."""

from __future__ import annotations

import torch


def frequent_tokens(counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """The ``size`` target ids with the highest ``counts`` ``(vocab,)`` (``always`` ids forced in, those outside the
    vocabulary ignored: a config may name an EOS id its embedding does not have), sorted ascending."""
    counts = counts.clone().double()
    for token in always:
        if 0 <= token < counts.numel():
            counts[token] = float("inf")
    ids = torch.topk(counts, size).indices
    return ids.sort().values


def to_d2t(draft_to_target: torch.Tensor) -> torch.Tensor:
    """Draft->target id map ``(draft_vocab,)`` -> EAGLE-3 offsets ``d2t``."""
    return draft_to_target - torch.arange(draft_to_target.numel(), device=draft_to_target.device)


def from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 offsets -> draft->target id map."""
    return d2t.long() + torch.arange(d2t.numel(), device=d2t.device)


def to_t2d(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[draft_to_target.cpu()] = True
    return mask

"""Prompt lookup decoding (Saxena, 2023): the n-gram drafter, no model."""

from __future__ import annotations

import torch

from toolkit.speculative.drafters.base import Drafter


class NGramDrafter(Drafter):
    """Prompt lookup decoding: propose the continuation of the most recent earlier match of the last n tokens.

    Args:
        max_ngram / min_ngram: n-gram sizes tried, longest first (a longer match is a better predictor).

    Proposes nothing (k = 0) when no n-gram matches; the decode loop then runs a plain target step.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, input_ids: torch.Tensor, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = input_ids[0]
        length = ids.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            pattern = ids[length - n:]
            windows = ids[: length - 1].unfold(0, n, 1)  # every earlier n-gram that has a continuation
            hits = (windows == pattern).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                proposal = ids[start: start + num_draft_tokens]
                return proposal.view(1, -1), None
        return input_ids.new_empty((1, 0)), None

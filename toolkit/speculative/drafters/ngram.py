"""Prompt lookup decoding (Saxena, 2023): the n-gram drafter, no model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.checks import check_int
from toolkit.speculative.drafters.base import Drafter
from toolkit.speculative.drafters.registry import DrafterConfig, register_drafter


@dataclass
class NgramConfig(DrafterConfig):
    """``drafter: ngram`` — prompt lookup decoding.

    Attributes:
        max_ngram / min_ngram: n-gram sizes tried, longest first (tokens), 1 <= min_ngram <= max_ngram.
    """

    name = "ngram"
    batch = True
    hf_baseline = "prompt_lookup"
    vllm_method = "ngram"
    sglang_algorithm = "NGRAM"
    max_ngram: int = 3
    min_ngram: int = 1

    def validate(self, prefix: str) -> None:
        check_int(f"{prefix}.min_ngram", self.min_ngram, low=1, high=64)
        check_int(f"{prefix}.max_ngram", self.max_ngram, low=self.min_ngram, high=64)

    def engine_params(self, engine: str) -> dict:
        if engine == "vllm":
            return {"prompt_lookup_max": self.max_ngram, "prompt_lookup_min": self.min_ngram}
        return {}  # SGLang's NGRAM matches through a trie: no n-gram size setting (engine_gaps)

    def engine_gaps(self, engine: str) -> list[tuple[str, str]]:
        if engine != "sglang":
            return []
        trie = "(SGLang's NGRAM matches through a trie, --speculative-ngram-max-trie-depth)"
        return [("max_ngram", f"{self.max_ngram} — the longest n-gram matched {trie}"),
                ("min_ngram", f"{self.min_ngram} — the shortest n-gram matched {trie}")]


@register_drafter(NgramConfig)
class NGramDrafter(Drafter):
    """Prompt lookup decoding: propose the continuation of the most recent earlier match of the last n tokens.

    Args:
        max_ngram / min_ngram: n-gram sizes tried, longest first (a longer match is a better predictor).

    Proposes nothing (k = 0) when no n-gram matches; the decode loop then runs a plain target step.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    @classmethod
    def from_config(cls, config: NgramConfig, context) -> NGramDrafter:
        return cls(config.max_ngram, config.min_ngram)

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

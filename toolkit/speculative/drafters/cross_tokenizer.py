"""A draft LM whose tokenizer differs from the target's (HF's universal assisted decoding; Timor et al., "Accelerating
LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies", ICML 2025).

``drafter: draft_model`` builds this drafter by itself when the draft's vocabulary is not the target's. Each round:

1. the committed target tokens are decoded to text and re-encoded with the draft's tokenizer; the draft's KV cache
   keeps the longest prefix it already holds of that (``crop``) and is fed the rest;
2. the draft proposes greedily, in its own tokens, until its text holds about K target tokens;
3. the draft's text is appended to the committed text and encoded with the target's tokenizer (so the merges at the
   boundary are the target's own); the target tokens after the committed ones, at most K, are the proposal.

The target verifies them as usual, so greedy output is exactly target AR. The proposal is a deterministic function of
the committed text, so under sampling it is verified as a one-hot draft (``draft_logits = None``): speculative
sampling stays exact (Leviathan et al. with q = the indicator of the proposed token), at a lower acceptance than a
token-level distribution would give. Acceptance is counted in target tokens.
"""

from __future__ import annotations

import torch

from toolkit.engine.forward import model_kwargs
from toolkit.errors import ConfigError
from toolkit.kv.contract import new_cache
from toolkit.speculative.drafters.base import Drafter

#: draft tokens drafted per target token asked (tokenizers differ in granularity)
DRAFT_PER_TARGET = 2


class CrossTokenizerDrafter(Drafter):
    """Draft with ``model`` / ``draft_tokenizer`` for a target using ``target_tokenizer`` (see the module docstring).

    Args:
        model: the draft causal LM (its own vocabulary).
        draft_tokenizer / target_tokenizer: the two tokenizers (HF, with ``decode`` and ``__call__``).
        policy: must be ``None``: the draft cache is re-synchronized by text every round, which a compressed cache
            cannot follow (raises :class:`ConfigError` naming ``draft_kv.policy``).
    """

    def __init__(self, model, draft_tokenizer, target_tokenizer, policy=None):
        if policy is not None:
            raise ConfigError("draft_kv.policy", "a draft with another tokenizer keeps an uncompressed cache (it is "
                              "re-synchronized by text every round)", ["none"])
        self.model, self.draft_tokenizer, self.target_tokenizer = model, draft_tokenizer, target_tokenizer
        self.device = next(model.parameters()).device
        self.cache = None
        self.fed: list[int] = []  # draft ids whose entries the draft cache holds, in order

    def reset(self) -> None:
        super().reset()
        self.cache = new_cache(None, self.model)
        self.fed = []

    # ------------------------------------------------------------------------------------------------ text
    def _draft_ids(self, text: str) -> list[int]:
        ids = self.draft_tokenizer(text, add_special_tokens=False).input_ids
        bos = self.draft_tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + ids

    def _sync(self, draft_ids: list[int]) -> None:
        """Keep the cached prefix shared with ``draft_ids`` (at least one token left to feed), drop the rest."""
        common = 0
        for a, b in zip(self.fed, draft_ids):
            if a != b:
                break
            common += 1
        common = min(common, len(draft_ids) - 1)
        if common < len(self.fed):
            self.cache.crop(common - len(self.fed))
            self.fed = self.fed[:common]

    def _forward(self, ids: list[int]) -> torch.Tensor:
        positions = torch.arange(len(self.fed), len(self.fed) + len(ids), device=self.device).unsqueeze(0)
        out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True, logits_to_keep=1,
                         **model_kwargs(self.model, {"past_key_values": self.cache,
                                                     **self.cache.forward_kwargs(positions)}))
        self.fed += ids
        self.forwards += 1
        return out.logits[0, -1]

    def draft_text(self, text: str, num_tokens: int) -> str:
        """The draft's greedy continuation of ``text``, ``num_tokens`` draft tokens, as text."""
        draft_ids = self._draft_ids(text)
        self._sync(draft_ids)
        logits = self._forward(draft_ids[len(self.fed):])
        new: list[int] = []
        for step in range(num_tokens):
            new.append(int(logits.argmax()))
            if step + 1 < num_tokens:
                logits = self._forward(new[-1:])
        return self.draft_tokenizer.decode(new, skip_special_tokens=True)

    @torch.inference_mode()
    def propose(self, input_ids: torch.Tensor, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """At most ``num_draft_tokens`` target tokens continuing ``input_ids`` ``(1, n)`` (target ids)."""
        committed = input_ids[0].tolist()
        text = self.target_tokenizer.decode(committed)
        continuation = self.draft_text(text, DRAFT_PER_TARGET * num_draft_tokens)
        translated = self.to_target(committed, text, continuation)
        if 1 < len(translated) <= num_draft_tokens:  # its last token may be a word the draft stopped inside of
            translated = translated[:-1]
        proposal = translated[:num_draft_tokens]
        return torch.tensor([proposal], dtype=torch.long).view(1, -1), None

    def to_target(self, committed: list[int], text: str, continuation: str) -> list[int]:
        """The target tokens of ``continuation`` after ``committed`` (whose text is ``text``): the target's
        tokenization of the whole text, when it starts with the committed tokens, else of the continuation alone."""
        whole = self.target_tokenizer(text + continuation, add_special_tokens=False).input_ids
        start = len(committed) - self._special_prefix(committed)
        if whole[:start] == committed[len(committed) - start:] or start == 0:
            return whole[start:]
        return self.target_tokenizer(continuation, add_special_tokens=False).input_ids

    def _special_prefix(self, committed: list[int]) -> int:
        """Leading BOS tokens of ``committed`` that ``add_special_tokens=False`` does not produce."""
        bos = self.target_tokenizer.bos_token_id
        count = 0
        while count < len(committed) and bos is not None and committed[count] == bos:
            count += 1
        return count

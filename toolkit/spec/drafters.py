"""Drafters: cheap proposers of the next K tokens, behind one narrow interface (HF's CandidateGenerator shape).

The decode loop only calls:

* ``reset()`` at the start of a generation;
* ``propose(input_ids, num_draft_tokens) -> (tokens, draft_logits | None)`` with ``input_ids`` of shape ``(1, n)``
  (every committed token, prompt included). ``tokens`` has shape ``(1, k)`` with ``0 <= k <= num_draft_tokens``;
  ``draft_logits`` has shape ``(k, vocab)`` (raw logits, processed by the verifier exactly like the target's), or
  ``None`` for a deterministic drafter (a one-hot q under sampling);
* ``commit(num_accepted)`` after verification, so a stateful drafter rolls back what the target rejected.

Drafters here:

* :class:`DraftModel` — any HF causal LM at any precision (also the target's own weights at int8/int4, the
  ``self`` drafter), with a persistent KV cache that is rolled back with ``crop``, never rebuilt.
* :class:`NGramDrafter` — prompt lookup decoding (Saxena, 2023; HF ``prompt_lookup_num_tokens``): find the most
  recent earlier occurrence of the last n tokens (n from ``max_ngram`` down to ``min_ngram``) in prompt + output
  and propose what followed it. No model.
"""

from __future__ import annotations

import torch

from toolkit.kv import ops as kv_ops
from toolkit.spec.verify import process_logits, sample_token


class Drafter:
    """Base class: a drafter with no state. Subclasses implement :meth:`propose`."""

    #: model forwards run by this drafter since the last reset (0 for model-free drafters)
    forwards: int = 0

    def reset(self) -> None:
        self.forwards = 0

    def propose(self, input_ids: torch.Tensor, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def commit(self, num_accepted: int) -> None:
        pass


class DraftModel(Drafter):
    """A small causal LM proposing tokens autoregressively from its own persistent KV cache.

    Args:
        model: HF causal LM sharing the target's vocabulary (any precision, any device).
        policy: KV compression policy of the draft cache (``None`` = uncompressed).
        do_sample / temperature / top_k / top_p: how draft tokens are chosen (greedy argmax or a sample from the
            processed distribution q).
        confidence_threshold: stop the round early once the draft's top probability falls below it (HF dynamic
            speculation); ``None`` drafts all K.
        generator: ``torch.Generator`` on the draft's device used for sampling.

    Cache bookkeeping: ``cached`` is the number of sequence tokens represented in the draft cache. ``propose`` feeds
    the committed tokens the cache has not seen (one or two per round), then drafts; ``commit`` crops the cache
    back to the committed prefix (``crop(-n)``), so a rejection costs no recomputation.
    """

    def __init__(self, model, policy=None, *, do_sample=False, temperature=1.0, top_k=0, top_p=1.0,
                 confidence_threshold=None, generator=None):
        self.model = model
        self.policy = policy
        self.do_sample = do_sample
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.confidence_threshold = confidence_threshold
        self.generator = generator
        self.device = next(model.parameters()).device
        self.cache = None
        self.cached = 0
        self._proposed_until = 0

    def reset(self) -> None:
        super().reset()
        self.cache = kv_ops.new_cache(self.policy, self.model)
        self.cached = 0
        self._proposed_until = 0

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the draft over ``tokens`` ``(1, m)`` at the next positions; returns last-position logits ``(vocab,)``."""
        positions = torch.arange(self.cached, self.cached + tokens.shape[1], device=self.device).unsqueeze(0)
        out = self.model(input_ids=tokens, past_key_values=self.cache, use_cache=True, logits_to_keep=1,
                         **kv_ops.model_inputs(self.cache, positions))
        self.cached += tokens.shape[1]
        self.forwards += 1
        return out.logits[0, -1]

    @torch.no_grad()
    def propose(self, input_ids: torch.Tensor, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        committed = input_ids.shape[1]
        self._committed_before = committed
        if num_draft_tokens == 0:
            return input_ids.new_empty((1, 0)), None
        logits = self._forward(input_ids[:, self.cached:].to(self.device))
        tokens, all_logits = [], []
        for step in range(num_draft_tokens):
            all_logits.append(logits)
            needs_probs = self.do_sample or self.confidence_threshold is not None
            probs = process_logits(logits, self.temperature, self.top_k, self.top_p) if needs_probs else None
            token = sample_token(probs.unsqueeze(0), self.generator)[0] if self.do_sample else logits.argmax()
            tokens.append(token)
            if self.confidence_threshold is not None and probs.max().item() < self.confidence_threshold:
                break
            if step + 1 < num_draft_tokens:
                logits = self._forward(token.view(1, 1))
        return torch.stack(tokens).view(1, -1), torch.stack(all_logits)

    def commit(self, num_accepted: int) -> None:
        """Roll the draft cache back to the committed prefix: everything after ``committed - 1`` tokens goes."""
        committed = self._committed_before + num_accepted + 1
        keep = min(self.cached, committed - 1)
        if keep < self.cached:
            self.cache.crop(keep - self.cached)
            self.cached = keep
        kv_ops.commit(self.cache)


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

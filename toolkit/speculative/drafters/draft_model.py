"""A small causal LM as drafter (also the target's own weights at low precision: the ``self`` drafter)."""

from __future__ import annotations

import contextlib

import torch

from toolkit.kv import ops as kv_ops
from toolkit.speculative.drafters.base import Drafter
from toolkit.speculative.verify import process_logits, sample_token


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
        self.close()
        self._scope = contextlib.ExitStack()
        self._scope.enter_context(kv_ops.attached(self.policy, self.model))
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

    def close(self) -> None:
        """Undo what :meth:`reset` installed on the draft model (the policy's attention hook, if any)."""
        scope, self._scope = getattr(self, "_scope", None), None
        if scope is not None:
            scope.close()

    def commit(self, num_accepted: int) -> None:
        """Roll the draft cache back to the committed prefix: everything after ``committed - 1`` tokens goes."""
        committed = self._committed_before + num_accepted + 1
        keep = min(self.cached, committed - 1)
        if keep < self.cached:
            self.cache.crop(keep - self.cached)
            self.cached = keep
        kv_ops.commit(self.cache)

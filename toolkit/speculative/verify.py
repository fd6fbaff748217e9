"""Verification rules: which draft tokens the target accepts, and the token committed after them.

Both rules look at all K draft positions at once (no Python loop over positions) and return device tensors, so the
decode loop needs a single host synchronization per round.

* :func:`greedy_accept` — accept the longest prefix of draft tokens equal to the target's argmax, then take the
  target's argmax at the first mismatch (or after the last draft token) as the bonus token.
* :func:`speculative_sample` — lossless speculative sampling (Leviathan et al., 2023, Alg. 1; Chen et al., 2023):
  accept draft token x with probability min(1, p(x)/q(x)); at the first rejection sample from norm(max(0, p - q));
  if all K are accepted, sample the bonus token from p. The committed tokens are distributed exactly as samples
  from the target.
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Turn logits ``(..., vocab)`` into a probability distribution (float32) after temperature, top-k, top-p.

    The same function is applied to target and draft logits so that p and q are comparable, as the lossless
    guarantee requires. ``top_k = 0`` and ``top_p = 1.0`` disable the filters (HF semantics: top-p keeps the smallest
    set of most likely tokens whose mass reaches ``top_p``, always at least one token).
    """
    scores = logits.float() / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        remove_sorted = cumulative - sorted_scores.softmax(-1) >= top_p  # mass before this token already >= top_p
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(-1)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    Args:
        draft_tokens: ``(K,)`` proposed token ids (K may be 0).
        target_logits: ``(K + 1, vocab)`` target logits; row i predicts the token after draft position i - 1.

    Returns:
        ``(num_accepted, next_token)``: 0-dim long tensors; ``next_token`` is the target's argmax at position
        ``num_accepted`` (the correction on a rejection, the bonus token when all K are accepted).
    """
    target_tokens = target_logits.argmax(dim=-1)
    num_draft = draft_tokens.shape[0]
    matches = (target_tokens[:num_draft] == draft_tokens).long()
    num_accepted = matches.cumprod(0).sum()
    return num_accepted, target_tokens[num_accepted]


def speculative_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al., 2023, Algorithm 1).

    Args:
        draft_tokens: ``(K,)`` draft token ids, each sampled from the matching row of ``draft_probs``.
        draft_probs: ``(K, vocab)`` the draft distribution q after :func:`process_logits`; ``None`` for a
            deterministic drafter (n-gram), which is a one-hot q.
        target_probs: ``(K + 1, vocab)`` the target distribution p after the same processing.
        generator: source of randomness (seeded by the caller for reproducible runs).

    Returns:
        ``(num_accepted, next_token)`` as 0-dim long tensors on the target's device.
    """
    num_draft = draft_tokens.shape[0]
    device = target_probs.device
    if draft_probs is None:
        draft_probs = torch.zeros(num_draft, target_probs.shape[-1], device=device)
        draft_probs.scatter_(1, draft_tokens.view(-1, 1), 1.0)
    draft_probs = draft_probs.to(device=device, dtype=torch.float32)
    rows = torch.arange(num_draft, device=device)
    p_x = target_probs[rows, draft_tokens]
    q_x = draft_probs[rows, draft_tokens]
    uniform = torch.rand(num_draft, device=device, generator=generator)
    accepted = (uniform * q_x < p_x).long()  # r < p/q without dividing by q
    num_accepted = accepted.cumprod(0).sum()
    # One candidate for every possible stopping point: the residual norm(max(0, p - q)) at each draft position,
    # and p itself after the last one. Sampling all rows and picking row `num_accepted` avoids a host sync.
    residual = (target_probs[:num_draft] - draft_probs).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs[:num_draft])
    candidates = torch.cat([residual, target_probs[num_draft:]], dim=0)
    samples = torch.multinomial(candidates, 1, generator=generator).squeeze(-1)
    return num_accepted, samples[num_accepted]


def sample_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id from each row of ``probs`` ``(n, vocab)``; returns ``(n,)``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

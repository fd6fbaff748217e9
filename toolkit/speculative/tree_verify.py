"""Lossless multi-candidate sampling over a token tree scored in one target forward (greedy trees are verified on the
device: :func:`toolkit.engine.accept.accept_tree`).

* :func:`tree_speculative_sample` — recursive rejection sampling over the tree (SpecInfer's multi-step speculative
  sampling, Miao et al. 2024, Alg. 2; Jeon et al. 2024 for candidates drawn without replacement): at the current
  node with target distribution p, try its children in order; child token x drawn from q is accepted with
  probability min(1, p(x)/q(x)); on a rejection p becomes norm(max(0, p - q)) and the next sibling is tried; when a
  child is accepted the walk descends to it (with the target's distribution at that node); when every child is
  rejected, the next token is sampled from the current p. The committed tokens are distributed exactly as the
  target's samples.

Rows of ``target_logits`` / ``target_probs`` follow the verify forward: row 0 = the root (last committed token),
row ``i + 1`` = node ``i``; each row predicts the token *after* its node.
"""

from __future__ import annotations

import torch

from toolkit.speculative.tree import TokenTree


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` over ``(vocab,)``; ``p`` itself when ``p <= q`` everywhere (nothing left to correct)."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum()
    return r / mass if float(mass) > 0 else p


def tree_speculative_sample(tree: TokenTree, target_probs: torch.Tensor,
                            generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Lossless sampling over a token tree (recursive rejection sampling; see the module docstring).

    Args:
        tree: the round's tree; ``tree.draft_probs`` ``(n, vocab)`` or ``None`` (one-hot drafts: deterministic
            candidates such as top-k children or suffix-tree continuations).
        target_probs: ``(n + 1, vocab)`` target distributions after :func:`~toolkit.speculative.verify.process_logits`.
        generator: source of randomness (seeded by the caller).

    Returns:
        ``(path, next_token)``: accepted node indices from the root's child down (possibly ``[]``), and the token
        sampled after the last accepted node.
    """
    device = target_probs.device
    tokens = tree.token_list()
    children = tree.children()
    draft = None if tree.draft_probs is None else tree.draft_probs.to(device=device, dtype=torch.float32)
    node, path = -1, []
    while True:
        p = target_probs[node + 1].float()
        accepted = None
        for child in children[node]:
            x = tokens[child]
            q_x = 1.0 if draft is None else float(draft[child, x])
            u = float(torch.rand((), device=device, generator=generator))
            if u * q_x < float(p[x]):
                accepted = child
                break
            if draft is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = draft[child]
            p = residual(p, q)
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(accepted)
        node = accepted

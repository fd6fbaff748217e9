"""Lossless multi-candidate sampling over a token tree scored in one target forward, on the device (greedy trees:
:func:`toolkit.engine.accept.accept_tree`).

* :func:`tree_speculative_sample` — recursive rejection sampling over the tree (SpecInfer's multi-step speculative
  sampling, Miao et al. 2024, Alg. 2; Jeon et al. 2024 for candidates drawn without replacement): at the current
  node with target distribution p, try its children in order; child token x drawn from q is accepted with
  probability min(1, p(x)/q(x)); on a rejection p becomes norm(max(0, p - q)) and the next sibling is tried; when a
  child is accepted the walk descends to it (with the target's distribution at that node); when every child is
  rejected, the next token is sampled from the current p. The committed tokens are distributed exactly as the
  target's samples.

The walk runs as tensor operations with no read of the device: every node is tried at most once (as a child of its
parent), so ``n`` steps of one try each cover any walk over ``n`` nodes; a step past the walk's end (no untried
child left) changes nothing. The uniform draws are taken up front, one per node (a node's own draw judges it), so the
round reads the device once, with the accepted path and the next token, as a greedy tree's round does.

Rows of ``target_probs`` follow the verify forward: row 0 = the root (last committed token), row ``i + 1`` = node
``i``; each row predicts the token *after* its node.
"""

from __future__ import annotations

import torch

from toolkit.speculative.tree import TokenTree


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` over ``(vocab,)``; ``p`` itself when ``p <= q`` everywhere (nothing left to correct).
    Reads nothing from the device."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum()
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def children_table(tree: TokenTree, device) -> torch.Tensor:
    """``(n + 1, widest + 1)`` long: row ``e`` lists entry ``e``'s children as entries (node ``i`` is entry ``i + 1``;
    the root is entry 0) in the order they are tried, then ``-1``s (at least one: the end of every list)."""
    children = tree.children()
    widest = max(len(kids) for kids in children.values())
    rows = [[kid + 1 for kid in children[node]] + [-1] * (widest + 1 - len(children[node]))
            for node in range(-1, len(tree))]
    return torch.tensor(rows, dtype=torch.long, device=device)


def tree_speculative_sample(tree: TokenTree, target_probs: torch.Tensor,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """Lossless sampling over a token tree (recursive rejection sampling; see the module docstring), on the device of
    ``target_probs``, with no read of it.

    Args:
        tree: the round's tree of ``n`` nodes; ``tree.draft_probs`` ``(n, vocab)`` or ``None`` (one-hot drafts:
            deterministic candidates such as top-k children or suffix-tree continuations).
        target_probs: ``(n + 1, vocab)`` target distributions after :func:`~toolkit.speculative.verify.process_logits`.
        generator: source of randomness (seeded by the caller), on ``target_probs``' device.

    Returns:
        ``(2,)`` long on the device: the deepest accepted entry (0: no node accepted; node ``i`` is entry ``i + 1``;
        its path is ``tree.path_to(entry - 1)``) and the token sampled after it.
    """
    device, n = target_probs.device, len(tree)
    probs = target_probs.float()
    kids = children_table(tree, device)
    tokens = torch.tensor([0] + tree.token_list(), dtype=torch.long, device=device)
    draft = None if tree.draft_probs is None else tree.draft_probs.to(device=device, dtype=torch.float32)
    uniform = torch.rand(n + 1, device=device, generator=generator)  # entry e's draw judges entry e
    node = torch.zeros((), dtype=torch.long, device=device)
    slot = torch.zeros_like(node)
    p = probs[0]
    for _ in range(n):
        kid = kids[node, slot]
        tried = kid > 0  # -1: the node has no untried child left (the walk ended)
        entry = kid.clamp_min(1)
        x = tokens[entry]
        if draft is None:
            q = torch.nn.functional.one_hot(x, p.shape[-1]).to(p.dtype)
        else:
            q = draft[entry - 1]
        accept = tried & (uniform[entry] * q[x] < p[x])
        reject = tried & ~accept
        p = torch.where(accept, probs[entry], torch.where(reject, residual(p, q), p))
        node = torch.where(accept, entry, node)
        slot = torch.where(accept, 0, slot + reject.long())
    next_token = torch.multinomial(p, 1, generator=generator)[0]
    return torch.stack([node, next_token])

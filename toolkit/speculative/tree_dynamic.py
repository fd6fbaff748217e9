"""EAGLE-2 dynamic draft trees (Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees", EMNLP 2024), for any drafter that gives next-token log-probabilities for a batch of tree nodes.

Expansion: level 1 is the top-``topk`` tokens of the root distribution. At every further level the ``topk`` nodes of
the previous level with the highest *joint* draft log-probability (the sum of log q along the path, EAGLE-2's
confidence proxy for the acceptance probability) are expanded in one draft forward, each into its top-``topk``
children. Rerank: of all candidates the ``budget`` with the highest joint log-probability form the tree. A child's
joint score never exceeds its parent's, so the kept set contains every kept node's ancestors (ties go to the
shallower node).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from toolkit.speculative.tree import TokenTree, TreeShape


def build_dynamic_tree(root_logprobs: torch.Tensor, expand: Callable[[list[int], list[int], list[int], list[int]], torch.Tensor],
                       shape: TreeShape, depth: int) -> tuple[TokenTree, list[int]]:
    """Grow and rerank a draft tree.

    Args:
        root_logprobs: ``(vocab,)`` draft log-probabilities of the token after the last committed token.
        expand: ``expand(nodes, tokens, parents, depths)`` runs the drafter on candidate nodes ``nodes`` (indices
            into the candidate list; their ``tokens``, candidate-list ``parents`` (-1 = root; every parent was
            itself expanded at an earlier call) and ``depths``) and returns their next-token log-probabilities
            ``(len(nodes), vocab)``. Called once per level below the first, with at most ``topk`` nodes.
        shape: budget / topk (``shape.depth`` is superseded by ``depth``).
        depth: most levels (>= 1).

    Returns:
        ``(tree, kept)``: the reranked :class:`TokenTree` (nodes in creation order, parents before children) and,
        for each tree node, its index in the candidate list (so a drafter can map tree nodes to its own state).
    """
    k = shape.topk
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    depths: list[int] = []
    top = root_logprobs.float().topk(min(k, root_logprobs.shape[-1]))
    level = []
    for value, token in zip(top.values.tolist(), top.indices.tolist()):
        level.append(len(tokens))
        tokens.append(token), parents.append(-1), scores.append(value), depths.append(1)
    for d in range(2, depth + 1):
        chosen = sorted(level, key=lambda i: -scores[i])[:k]
        logprobs = expand(chosen, [tokens[i] for i in chosen], [parents[i] for i in chosen],
                          [depths[i] for i in chosen]).float()
        top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        values, indices = top.values.tolist(), top.indices.tolist()
        level = []
        for row, node in enumerate(chosen):
            for value, token in zip(values[row], indices[row]):
                level.append(len(tokens))
                tokens.append(token), parents.append(node), scores.append(scores[node] + value), depths.append(d)
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[: shape.budget]
    kept = sorted(order)
    new_index = {old: new for new, old in enumerate(kept)}
    tree = TokenTree(torch.tensor([tokens[i] for i in kept], dtype=torch.long),
                     torch.tensor([-1 if parents[i] < 0 else new_index[parents[i]] for i in kept], dtype=torch.long))
    return tree, kept

"""Token-tree rounds (SpecInfer, Miao et al. 2024; EAGLE-2 dynamic trees, Li et al. 2024): the decoder's one
exception to the shared chain path — one row, on the policy's single-sequence cache.

A round: the row's drafter proposes a :class:`~toolkit.speculative.tree.TokenTree` of ``n`` nodes below the last
committed token; ONE target forward scores ``[x_last, nodes]`` under the tree attention mask at positions
``committed - 1 + depth``; verification accepts one root-to-node path (:mod:`toolkit.speculative.tree_verify`); the
cache keeps exactly the root's and the path's entries (a gather over the forward's tail: why trees stay off the
static cache) and the drafter is told the path (``commit_tree_row``, with the forward's hidden states where it asks for
them: an EAGLE head).
"""

from __future__ import annotations

import time

import torch

from toolkit.engine.forward import model_kwargs, select_hidden
from toolkit.speculative.tree_verify import greedy_tree_accept, tree_speculative_sample
from toolkit.speculative.verify import process_logits


def tree_round(decoder, row, gen, limit: int, drafting) -> list[int] | None:
    """One tree round of ``row`` (see the module docstring); returns its committed ids (path tokens + the next
    token), or ``None`` when no tree fits (the limit is one token away, or the drafter proposed no tree: the
    decoder then runs a chain round)."""
    room = limit - len(row.new_ids) - 1
    shape = decoder.tree
    depth = min(shape.depth, room)
    if depth <= 0:
        return None
    start = time.perf_counter()
    stats, cache, device = row.stats, decoder.cache, decoder.device
    committed = len(row.ids)
    sequence = torch.tensor([row.ids], device=device)
    tree = drafting.propose_tree_row(row, shape.budget, depth, shape.topk)
    drafted_at = time.perf_counter()
    n = len(tree)
    verify_input = torch.cat([sequence[:, -1:], tree.tokens.to(device).view(1, -1)], dim=1)
    kwargs = cache.prepare(n + 1, positions=tree.positions(committed - 1, device), tree_mask=tree.mask(device))
    out = decoder.target(input_ids=verify_input, use_cache=True, logits_to_keep=n + 1,
                         output_hidden_states=bool(drafting.features), **model_kwargs(decoder.target, kwargs))
    logits = out.logits[0]
    features = select_hidden(out, drafting.features) if drafting.features else None
    stats.target_forwards += 1
    if gen.do_sample:
        p = process_logits(logits, gen.temperature, gen.top_k, gen.top_p)
        path, next_id = tree_speculative_sample(tree, p, row.generator)
    else:
        path, next_id = greedy_tree_accept(tree, logits)
    verified_at = time.perf_counter()
    cache.keep_path([0] + [i + 1 for i in path])
    cache.commit()
    drafting.commit_tree_row(row, path, features)
    stats.record_round(n, len(path))
    tokens = tree.token_list()
    stats.record_time((drafted_at - start) * 1000, (verified_at - drafted_at) * 1000,
                      (time.perf_counter() - start) * 1000, n + 1)
    return [tokens[i] for i in path] + [next_id]

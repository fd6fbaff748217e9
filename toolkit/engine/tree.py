"""Token-tree rounds of the decoder (SpecInfer, Miao et al. 2024; EAGLE-2 dynamic trees, Li et al. 2024): one row, on
the decoder's row cache (the static cache) through the target's forward, compiled where chain rounds are.

A round: the row's drafter proposes a :class:`~toolkit.speculative.tree.TokenTree` of ``n`` nodes below the last
committed token (the root); ONE target forward (``decoder.forward``) scores ``[root, nodes]``, written at the row's
next ``n + 1`` slots in node order, at positions ``committed - 1 + depth`` under the tree mask
(:mod:`toolkit.kv.static_tree`); verification accepts one root-to-node path; the cache gathers the root's and the
path's entries into the row's next slots in place (``keep_tree``), then ``accept`` and the commit point run as after a
chain round (rollback of the rest: they lie past the row's length); the drafter is told the path
(``commit_tree_row``, with the forward's hidden states where it asks for them: an EAGLE head).

Verification runs on the device — greedy trees by :func:`toolkit.engine.accept.accept_tree`, sampled ones by
recursive rejection sampling (:func:`~toolkit.speculative.tree_verify.tree_speculative_sample`, ``n`` steps of tensor
operations) — and the round reads the device once: the deepest accepted node and the next token.

Where trees run (:func:`check_tree_support`): the static cache must hold the target's KV policy and model, and a
draft model's; elsewhere ``spec.tree`` is refused when the recipe is planned (policies) or built (models).
"""

from __future__ import annotations

import time

import torch

from toolkit.engine.accept import accept_tree
from toolkit.errors import ConfigError
from toolkit.kv.static_tree import TreeInputs
from toolkit.speculative.tree_verify import tree_speculative_sample
from toolkit.speculative.verify import process_logits


def check_tree_support(policy, model, owner: str) -> None:
    """Raise :class:`ConfigError` (field ``spec.tree``) where token trees cannot run: they run on the static cache
    only, so it must hold ``policy`` (the KV policy of the ``owner``'s cache: ``target`` or ``draft``) and, where
    given, ``model`` (``None``: planning, before any model loads, checks the policy alone)."""
    from toolkit.engine.capabilities import tree_refusal
    from toolkit.kv.rows import static_why
    from toolkit.kv.static import static_form

    why = static_form(policy) if model is None else static_why(policy, model)
    if why:
        raise ConfigError("spec.tree", tree_refusal(owner, why), [False])


def tree_round(decoder, row, gen, limit: int, drafting) -> list[int] | None:
    """One tree round of ``row`` (see the module docstring); returns its committed ids (path tokens + the next
    token), or ``None`` when no tree fits (the limit is one token away: the decoder then runs a chain round)."""
    shape = decoder.tree
    depth = min(shape.depth, limit - len(row.new_ids) - 1)
    if depth <= 0:
        return None
    start, stats, cache, forward = time.perf_counter(), row.stats, decoder.cache, decoder.forward
    compiled = drafting.compile_ms
    tree = drafting.propose_tree_row(row, shape.budget, depth, shape.topk)
    drafted_at = time.perf_counter()
    draft_compile_ms, compiled = drafting.compile_ms - compiled, forward.compile_ms
    inputs, region, parents = _verify_inputs(decoder, row, tree)
    out = forward(cache, inputs, drafting.features, tree=region)
    logits, features = out if drafting.features else (out, None)
    if gen.do_sample:
        result = tree_speculative_sample(tree, process_logits(logits[0], gen.temperature, gen.top_k, gen.top_p),
                                         row.generator)
        keep = region.ancestors[result[0]]
    else:
        result, keep = accept_tree(logits[0], inputs[0], parents, region.depth, region.ancestors)
    cache.keep_tree(torch.argsort((~keep).to(torch.uint8), stable=True))  # the kept entries first, in order
    kept = keep.sum().view(1)
    deepest, next_id = result.tolist()  # the round's one device-to-host read
    path = tree.path_to(deepest - 1)
    verified_at = time.perf_counter()
    compile_ms = forward.compile_ms - compiled  # a first call compiled: not the forward's cost
    cache.accept(kept, [len(path) + 1])
    cache.commit()
    drafting.commit_tree_row(row, path, features)
    stats.record_round(len(tree), len(path))
    stats.target_forwards += 1
    row.compile_ms += compile_ms + draft_compile_ms
    stats.record_time((drafted_at - start) * 1000 - draft_compile_ms, (verified_at - drafted_at) * 1000 - compile_ms,
                      (time.perf_counter() - start) * 1000 - compile_ms - draft_compile_ms, len(tree) + 1)
    tokens = tree.token_list()
    return [tokens[i] for i in path] + [next_id]


def _verify_inputs(decoder, row, tree) -> tuple[torch.Tensor, TreeInputs, torch.Tensor]:
    """The verify forward's tokens ``(1, n + 1)`` (the root, then the nodes), its region
    (:class:`~toolkit.kv.static_tree.TreeInputs`: depths and the tree mask) and each entry's parent's query index
    ``(n + 1,)`` (the root's: 0), on the device in the round's one upload."""
    parents = [0] + [p + 1 for p in tree.parent_list()]
    staged, _ = decoder._stage([[row.ids[-1]] + tree.token_list(), [0] + tree.depth_list(), parents,
                                *tree.mask_rows()], [])
    region = TreeInputs(staged[1], staged[3:].bool(), len(tree) + 1, tree.max_depth, rooted=True)
    return staged[:1], region, staged[2]

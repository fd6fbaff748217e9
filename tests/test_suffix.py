"""The suffix-tree drafter (toolkit/speculative/drafters/suffix*.py): trie counts, bounded memory, proposals, the
recipe fields, and one drafter per SpeculativeLM (memory across ``generate`` calls)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_llama
from test_decoder import hf_greedy
from test_generator import word_tokenizer

import toolkit
from toolkit.errors import ConfigError
from toolkit.recipe import GenerationSpec, Recipe, SpeculationSpec
from toolkit.speculative.drafters.suffix import SuffixDrafter
from toolkit.speculative.drafters.suffix_trie import PROMPT_CONTEXT, SuffixTrie


def path(trie: SuffixTrie, tokens: list[int]):
    node = trie.root
    for t in tokens:
        node = node.children.get(t)
        if node is None:
            return None
    return node


def shape_of(node) -> dict:
    return {t: (c.count, shape_of(c)) for t, c in sorted(node.children.items())}


# ------------------------------------------------------------------------------------------------ the trie
def test_trie_counts_every_substring_up_to_the_depth():
    trie = SuffixTrie(depth=3)
    trie.insert([1, 2, 1, 2, 3])
    assert path(trie, [1]).count == 2 and path(trie, [2]).count == 2 and path(trie, [3]).count == 1
    assert path(trie, [1, 2]).count == 2 and path(trie, [2, 1]).count == 1 and path(trie, [2, 3]).count == 1
    assert path(trie, [1, 2, 1]).count == 1 and path(trie, [1, 2, 3]).count == 1
    assert path(trie, [1, 2, 1, 2]) is None  # deeper than the trie
    # nodes: 1,2,3 | 12,21,23 | 121,212,123
    assert trie.nodes == 9


def test_trie_remove_undoes_insert_exactly():
    trie, alone = SuffixTrie(depth=4), SuffixTrie(depth=4)
    trie.insert([5, 6, 7, 5, 6])
    trie.insert([6, 7, 8])
    alone.insert([6, 7, 8])
    trie.remove([5, 6, 7, 5, 6])
    assert shape_of(trie.root) == shape_of(alone.root) and trie.nodes == alone.nodes
    trie.remove([6, 7, 8])
    assert trie.root.children == {} and trie.nodes == 0
    with pytest.raises(KeyError):
        trie.remove([1])


def test_matcher_finds_the_longest_suffix_with_a_continuation():
    trie = SuffixTrie(depth=8)
    trie.insert([1, 2, 3, 4, 9, 2, 3, 5])
    cursor = trie.matcher()
    for t in [7, 7, 2, 3]:
        cursor.append(t)
    node, length = cursor.longest_match(max_length=4)
    assert length == 2 and sorted(node.children) == [4, 5]
    node, length = cursor.longest_match(max_length=1)
    assert length == 1 and sorted(node.children) == [4, 5]


# ------------------------------------------------------------------------------------------------ the drafter
def ids(tokens: list[int]) -> torch.Tensor:
    return torch.tensor([tokens])


def test_request_trie_proposes_the_earlier_continuation_scaled_by_match_length():
    drafter = SuffixDrafter(max_spec_factor=1.0, min_token_prob=0.0, depth=16)
    drafter.reset()
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 1, 2, 3]
    tokens, logits = drafter.propose(ids(seq), 10)
    assert logits is None
    assert tokens[0].tolist() == [4, 5, 6]  # match length 3 -> ceil(1.0 * 3) tokens
    drafter.max_spec_factor = 2.0
    tokens, _ = drafter.propose(ids(seq), 10)
    assert tokens[0].tolist() == [4, 5, 6, 7, 8, 20]
    tokens, _ = drafter.propose(ids(seq), 2)
    assert tokens[0].tolist() == [4, 5]
    tokens, _ = drafter.propose(ids(seq + [99]), 4)  # nothing after 99: no proposal
    assert tokens.shape == (1, 0)


def test_tree_branches_by_frequency_and_prunes_rare_paths():
    drafter = SuffixDrafter(max_spec_factor=4.0, min_token_prob=0.2, depth=16)
    drafter.reset()
    # after "7 8": 1 twice, 2 once, 3 once (probabilities 1/2, 1/4, 1/4); then the current "7 8"
    seq = [7, 8, 1, 0, 7, 8, 1, 0, 7, 8, 2, 0, 7, 8, 3, 0, 9, 7, 8]
    tree = drafter.propose_tree(ids(seq), budget=5, depth=3)
    tokens, parents = tree.token_list(), tree.parent_list()
    assert tokens[0] == 1 and parents[0] == -1  # the most frequent continuation first
    assert sorted(tokens[i] for i in range(len(tokens)) if parents[i] == -1) == [1, 2, 3]
    # best first: "1" (1/2), "1 0" (1/2), "1 0 7" (1/2, depth 3 = the limit), then "2" and "3" (1/4 each)
    assert tokens == [1, 0, 7, 2, 3] and parents == [-1, 0, 1, -1, -1]
    drafter.min_token_prob = 0.3  # the 1/4 paths are pruned
    tree = drafter.propose_tree(ids(seq), budget=5, depth=3)
    assert tree.token_list() == [1, 0, 7]


def test_memory_across_requests_is_bounded_and_oldest_first():
    drafter = SuffixDrafter(max_spec_factor=4.0, min_token_prob=0.0, max_cached_requests=2, depth=16)
    requests = [[50 + r] * 3 + [10 + r, 11 + r, 12 + r, 13 + r, 14 + r, 15 + r] for r in range(3)]
    outputs = [[60 + r, 61 + r, 62 + r, 63 + r, 64 + r, 65 + r] for r in range(3)]
    for prompt, out in zip(requests, outputs):
        drafter.reset()
        drafter.propose(ids(prompt + out[:1]), 4)
        drafter.propose(ids(prompt + out), 4)
    drafter.reset()  # archives the third request
    assert len(drafter.cached_requests) == 2
    expected = SuffixTrie(16)
    for prompt, out in list(zip(requests, outputs))[1:]:
        expected.insert(prompt[-PROMPT_CONTEXT:] + out)
    assert shape_of(drafter.global_trie.root) == shape_of(expected.root)
    # a new request whose prompt ends like request 2's: its earlier output is proposed
    tokens, _ = drafter.propose(ids([1, 2] + requests[2][-4:] + outputs[2][:2]), 3)
    assert tokens[0].tolist() == outputs[2][2:5]


# ------------------------------------------------------------------------------------------------ recipe + generator
def test_recipe_fields_are_validated_with_named_errors():
    Recipe(name="t", draft=None, spec=SpeculationSpec(drafter="suffix", tree=True)).validate()
    cases = [({"drafter": "ngram", "tree": True}, "spec.tree"), ({"drafter": "suffix", "tree_budget": 0},
             "spec.tree_budget"), ({"drafter": "suffix", "tree_depth": 65}, "spec.tree_depth"),
             ({"drafter": "suffix", "tree_topk": "4"}, "spec.tree_topk"),
             ({"drafter": "suffix", "max_spec_factor": 0}, "spec.max_spec_factor"),
             ({"drafter": "suffix", "min_token_prob": 1.5}, "spec.min_token_prob"),
             ({"drafter": "suffix", "max_cached_requests": -1}, "spec.max_cached_requests"),
             ({"drafter": "suffix", "tree": "yes"}, "spec.tree")]
    for fields, name in cases:
        with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
            Recipe(name="t", draft=None, spec=SpeculationSpec(**fields)).validate()


def test_generator_keeps_one_suffix_drafter_and_stays_greedy_exact():
    target, tokenizer = tiny_llama(seed=0, initializer_range=0.2), word_tokenizer()
    spec = SpeculationSpec(drafter="suffix", tree=True, tree_budget=8, tree_depth=6, max_spec_factor=2.0,
                    min_token_prob=0.05)
    recipe = Recipe(name="t", draft=None, spec=spec, generation=GenerationSpec(max_new_tokens=30, ignore_eos=True))
    gen = toolkit.build(recipe, target=target, tokenizer=tokenizer)
    prompt = "you may not use this file except in compliance with the license"
    first = gen.generate(prompt)
    drafter = gen._persistent_drafter
    second = gen.generate(prompt)
    assert gen._persistent_drafter is drafter and len(drafter.cached_requests) == 2  # archived as each one ends
    reference = hf_greedy(target, tokenizer(prompt, return_tensors="pt").input_ids, 30)
    assert first.token_ids == reference and second.token_ids == reference
    assert second.stats.rounds < first.stats.rounds
    linear = toolkit.build(dataclasses.replace(recipe, spec=dataclasses.replace(spec, tree=False,
                                                                                num_draft_tokens=6)),
                           target=target, tokenizer=tokenizer)
    assert linear.generate(prompt).token_ids == reference

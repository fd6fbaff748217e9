"""The lookup drafter: longest match (most recent on ties), periodic continuation, memory across requests, and a
confidence that rises with the match length; greedy output through the SpeculativeLM is AR's."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from test_decoder import INIT, hf_greedy

import toolkit
from toolkit.recipe import GenerationSpec, ModelSpec, Recipe, SpeculationSpec
from toolkit.speculative.drafters import LookupDrafter


def propose(drafter: LookupDrafter, ids: list[int], k: int) -> list[int]:
    tokens, logits = drafter.propose(torch.tensor([ids]), k)
    assert logits is None
    return tokens[0].tolist()


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    d = LookupDrafter(max_cached_requests=0)
    d.reset()
    #       older: 5 6 7 -> 8        newer: 6 7 -> 9          now: ... 5 6 7
    assert propose(d, [1, 5, 6, 7, 8, 2, 6, 7, 9, 3, 5, 6, 7], 2) == [8, 2]


def test_the_most_recent_of_equally_long_matches_wins():
    d = LookupDrafter(max_cached_requests=0)
    d.reset()
    assert propose(d, [1, 6, 7, 8, 2, 6, 7, 9, 3, 6, 7], 1) == [9]


def test_a_match_running_into_the_present_reads_on_through_its_own_draft():
    d = LookupDrafter(max_cached_requests=0)
    d.reset()
    assert propose(d, [1, 2, 3, 1, 2, 3, 1, 2], 7) == [3, 1, 2, 3, 1, 2, 3]


def test_no_match_proposes_nothing_and_confidence_rises_with_the_match():
    d = LookupDrafter(max_cached_requests=0)
    d.reset()
    assert propose(d, [1, 2, 3, 4], 4) == []
    d.reset()
    propose(d, [9, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5], 3)
    long = d.confidence()
    d.reset()
    propose(d, [7, 5, 6, 8, 5], 3)
    short = d.confidence()
    assert len(long) == len(short) == 3
    assert short[0] < long[0] and all(a < b for a, b in zip(long, long[1:]))  # each accepted token extends it
    assert 0.0 < short[0] < 0.5 < long[0] < 1.0


def test_memory_of_earlier_requests_is_bounded_and_used():
    d = LookupDrafter(max_cached_requests=1)
    d.reset()
    propose(d, [50, 51, 52, 53, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], 1)  # request 1 (+ its last 8 prompt tokens)
    d.reset()  # archived: its output is remembered
    assert propose(d, list(range(60, 69)) + [10, 11, 12], 3) == [13, 14, 15]
    d.reset()  # request 2 replaces request 1 in a memory of one
    assert len(d.cached_requests) == 1
    assert propose(d, [70, 10, 11, 12], 3) == []  # request 1 is forgotten; request 2 saw no continuation of 12
    assert d.memory_nodes() > 0


@pytest.mark.parametrize("adaptive", ["constant", "cost"])
def test_generator_with_lookup_is_greedy_exact(adaptive):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    target = tiny_llama(seed=0, **INIT)
    vocab = {f"t{i}": i for i in range(128)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    recipe = Recipe(name="lookup", target=ModelSpec(device="cpu"), draft=None,
                    spec=SpeculationSpec(drafter="lookup", num_draft_tokens=6, adaptive=adaptive),
                    generation=GenerationSpec(max_new_tokens=40, ignore_eos=True))
    generator = toolkit.build(recipe, target=target, tokenizer=tokenizer)
    prompt = " ".join(f"t{i}" for i in [5, 9, 13, 2, 5, 9, 13, 2, 5, 9])
    ids = generator.encode(prompt)
    for _ in range(2):  # the second call also drafts from the memory of the first
        out = generator.generate(prompt)
        assert out.token_ids == hf_greedy(target, ids, 40)
    assert out.stats.accepted > 0

"""Evaluator metrics: perplexity protocols, acceptance invariants, fidelity, peak memory."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import perturbed_copy, tiny_llama

from eval import metrics as M
from toolkit.recipe import Recipe
from toolkit.speculative.stats import GenerationStats

pytestmark = pytest.mark.usefixtures("one_thread")


def _hf_loss_ppl(model, ids):
    """Independent reference: HF's own shifted cross-entropy loss over one full forward."""
    x = torch.tensor([ids])
    with torch.no_grad():
        return math.exp(float(model(input_ids=x, labels=x).loss))


def _ids(n, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# ------------------------------------------------------------------------------------------------ perplexity
def test_ppl_through_cache_uncompressed_equals_full_forward():
    model, ids = tiny_llama(), _ids(60)
    ref = _hf_loss_ppl(model, ids)
    for chunk in (1, 5):
        got = M.perplexity_through_cache(model, ids, None, chunk=chunk)
        assert got["tokens"] == len(ids) - 1
        assert got["value"] == pytest.approx(ref, rel=1e-4)


def test_ppl_sliding_window_full_window_equals_full_forward_and_scores_every_token_once():
    model, ids = tiny_llama(), _ids(150)
    full = M.perplexity_sliding_window(model, ids, window=150, stride=150)
    assert full["value"] == pytest.approx(_hf_loss_ppl(model, ids), rel=1e-4)
    slid = M.perplexity_sliding_window(model, ids, window=64, stride=32)
    assert slid["tokens"] == len(ids) - 1
    assert slid["protocol"]["window"] == 64 and slid["protocol"]["stride"] == 32
    # less context than the full forward: a different (finite) number
    assert math.isfinite(slid["value"]) and slid["value"] != pytest.approx(full["value"], rel=1e-6)


def test_ppl_through_streaming_cache_differs_and_holds_fewer_bytes():
    from toolkit.kv import POLICIES, make_policy
    from toolkit.recipe import KVSpec

    make_policy(KVSpec())  # loads the built-in policies
    if "streaming" not in POLICIES:
        pytest.skip("toolkit.kv has no 'streaming' policy yet")
    model, ids = tiny_llama(), _ids(200)
    policy = make_policy(KVSpec("streaming", {"sink_tokens": 4, "window": 32}))
    full = M.perplexity_through_cache(model, ids, None, chunk=5)
    streamed = M.perplexity_through_cache(model, ids, policy, chunk=5)
    assert streamed["peak_kv_bytes"] < full["peak_kv_bytes"]
    assert streamed["value"] != pytest.approx(full["value"], rel=1e-6)
    assert streamed["protocol"]["kv_policy"] == "streaming"


@pytest.mark.slow
def test_ppl_embedded_matches_independent_computation(embedded):
    """Embedded SmolLM2 (fp32, uncompressed) on real held-out prose: both protocols vs HF's own loss, 1e-3 rel."""
    from eval.data import heldout_ids

    model, tokenizer = embedded
    ids = heldout_ids(tokenizer, "prose", 128)
    ref = _hf_loss_ppl(model, ids)
    assert 5 < ref < 100  # a real text, a real model
    cached = M.perplexity_through_cache(model, ids, None, chunk=5)
    window = M.perplexity_sliding_window(model, ids, window=128, stride=64)
    assert cached["value"] == pytest.approx(ref, rel=1e-3)
    assert window["value"] == pytest.approx(ref, rel=1e-3)


# ------------------------------------------------------------------------------------------------ acceptance
def _generate(draft, k=3, max_new=30, prompt_len=10):
    from toolkit.speculative_lm import build

    target = tiny_llama()
    recipe = Recipe.from_dict({"name": "t", "target": {"device": "cpu"}, "draft": {"device": "cpu"},
                               "spec": {"drafter": "draft_model", "num_draft_tokens": k},
                               "generation": {"max_new_tokens": max_new, "ignore_eos": True}})
    gen = build(recipe, target=target, draft_model=draft if draft is not None else tiny_llama())
    spec = recipe.generation
    stats = GenerationStats()
    ids = [t for chunk in gen.decoder(spec).decode(torch.tensor([_ids(prompt_len, 5)]), spec, stats, [], None)
           for t in chunk]
    return ids, stats


def test_acceptance_counters_consistent_with_imperfect_draft():
    ids, stats = _generate(perturbed_copy(tiny_llama(), scale=0.5))
    agg = M.acceptance([stats])
    assert agg["consistent"], agg["problems"]
    assert 0 < agg["accepted"] <= agg["drafted"]
    assert agg["committed"] == agg["accepted"] + agg["rounds"]
    assert agg["target_forwards"] == agg["rounds"] + 1
    assert all(0 <= c <= 1 for c in agg["curve"])
    assert len(ids) == stats.new_tokens == 30


def test_bonus_token_counted_once_with_perfect_draft():
    """Draft == target: every draft token is accepted, each round commits K + 1 (K accepted + one bonus)."""
    ids, stats = _generate(tiny_llama(), k=3, max_new=33)
    agg = M.acceptance([stats])
    assert agg["acceptance_rate"] == 1.0
    assert agg["committed"] == agg["rounds"] * 4  # K accepted + exactly one bonus per round
    assert agg["tokens_per_round"] == 4.0
    assert stats.new_tokens == 1 + agg["committed"]  # prefill token + rounds (33 = 1 + 8 * 4)


def test_check_acceptance_flags_broken_counters():
    stats = GenerationStats(rounds=2, drafted=6, accepted=4, committed=6, accepted_at=[2, 2, 0],
                            drafted_at=[2, 2, 2], target_forwards=3, new_tokens=7)
    assert M.check_acceptance(stats) == []
    bad = GenerationStats(**{**stats.__dict__, "accepted": 7, "committed": 9})
    assert any("accepted 7 > drafted 6" in p for p in M.check_acceptance(bad))
    double_bonus = GenerationStats(**{**stats.__dict__, "committed": 8})
    assert any("committed 8" in p for p in M.check_acceptance(double_bonus))
    assert not M.acceptance([double_bonus])["consistent"]


# ------------------------------------------------------------------------------------------------ fidelity, memory
def test_fidelity():
    assert M.fidelity([1, 2, 3], [1, 2, 3]) == {"match_rate": 1.0, "first_divergence": None, "prefix_match": 1.0,
                                                "compared_tokens": 3}
    f = M.fidelity([1, 9, 3, 4], [1, 2, 3, 4])
    assert f["first_divergence"] == 1 and f["match_rate"] == 0.75 and f["prefix_match"] == 0.25
    assert M.fidelity([1, 2], [1, 2, 3])["first_divergence"] == 2
    s = M.fidelity_summary([([1, 2], [1, 2]), ([5, 6], [5, 7])])
    assert s["match_rate"] == 0.75 and s["first_divergence"] == [None, 1] and not s["identical"]


def test_peak_memory_sees_an_allocation():
    import mmap

    with M.PeakMemory("cpu") as meter:  # 64 MiB of fresh pages (mmap: never memory the allocator freed earlier)
        block = mmap.mmap(-1, 64 * 1024 * 1024)
        for offset in range(0, len(block), 4096):
            block[offset] = 1
        block.close()
    r = meter.result
    assert r["device"] == "cpu" and r["peak_rss_bytes"] > 0
    assert r["peak_rss_growth_bytes"] >= 32 * 1024 * 1024, r


def test_kv_bytes_per_token():
    model = tiny_llama()
    with warnings.catch_warnings():  # the cache goes in as `cache=` where transformers takes it (5.24 deprecates
        warnings.simplefilter("error", FutureWarning)  # `past_key_values=`, removed in 5.40)
        # 2 layers x (keys + values) x 2 kv heads x head_dim 16 x 4 bytes
        assert M.kv_bytes_per_token(model) == 2 * 2 * 2 * 16 * 4

"""StreamingLLM: exact window semantics (speculative == AR == full forward under a banded mask, on the static cache's
ring and on the policy's own compressing cache) and reindexing (on the policy's own cache and on its static form,
toolkit/kv/static_stream.py; their token-for-token equality is tests/test_static_stream.py's)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_forward, perturbed_copy, tiny_llama, tiny_neox

from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.planner import ConstantK
from toolkit.kv import make_policy, window_prefill
from toolkit.kv.rows import SingleRowCache
from toolkit.recipe import GenerationSpec, KVSpec
from toolkit.speculative.drafters import DraftModel, NGramDrafter
from toolkit.speculative.stats import GenerationStats

SINKS, WINDOW = 4, 16


def streaming(**params):
    return make_policy(KVSpec("streaming", {"sink_tokens": SINKS, "window": WINDOW, "compress_interval": 4,
                                            **params}))


def run(model, drafter, policy, prompt, new_tokens, k=3, own_cache=False):
    """Decode; ``own_cache``: the target on the policy's own single-sequence cache (physical eviction at commit
    points) instead of the policy's static form the decoder picks (the static cache's ring for absolute positions +
    exact window, else buffers compacted at commit points)."""
    stats = GenerationStats()
    decoder = SpeculativeDecoder(model, drafter, ConstantK(k), policy)
    if own_cache:
        decoder._new_cache = lambda prompts, gen: SingleRowCache(policy, model)
    ids = [t for chunk in decoder.decode(prompt, GenerationSpec(max_new_tokens=new_tokens, ignore_eos=True), stats)
           for t in chunk]
    return ids, stats


def banded_greedy(model, prompt, new_tokens):
    """Reference: greedy decoding by full forwards (no cache) where each query sees sinks + its last WINDOW."""
    seq = prompt[0].tolist()
    for _ in range(new_tokens):
        n = len(seq)
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        visible = (k <= q) & ((k < SINKS) | (k > q - WINDOW))
        mask = torch.zeros(n, n).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]
        logits = model(input_ids=torch.tensor([seq]), attention_mask=mask, use_cache=False).logits
        seq.append(int(logits[0, -1].argmax()))
    return seq[prompt.shape[1]:]


@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
def test_speculative_equals_ar_under_window(make):
    torch.manual_seed(0)
    target = make()
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    ar, ar_stats = run(target, None, streaming(), prompt, 90)
    draft_model = perturbed_copy(target, scale=0.3)
    draft = DraftModel(draft_model, streaming())  # the draft cache has its own policy
    spec, stats = run(target, draft, streaming(), prompt, 90)  # the target on the ring
    assert spec == ar
    assert draft.cache.window is not None  # the draft on a static ring of its own: it drops by overwriting
    assert stats.compressions_draft == stats.compressions_target == ar_stats.compressions_target == 0
    assert 1.0 < stats.tokens_per_round  # some drafts were accepted: the K+1 verify path really ran
    assert ar == banded_greedy(target, prompt, 90)  # and the window semantics are the banded full forward's
    # the same on the policy's own cache, which compresses
    own_ar, own_ar_stats = run(target, None, streaming(), prompt, 90, own_cache=True)
    own, own_stats = run(target, DraftModel(draft_model, streaming()), streaming(), prompt, 90, own_cache=True)
    assert own == own_ar == ar
    assert own_stats.compressions_target >= 3 and own_ar_stats.compressions_target >= 3
    assert 1.0 < own_stats.tokens_per_round


def test_without_exact_window_the_context_differs():
    """Control: with exact_window off, a query may see up to interval + K extra tokens, so outputs can differ."""
    target = tiny_llama()
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    loose, _ = run(target, None, streaming(exact_window=False), prompt, 90)
    assert loose != banded_greedy(target, prompt, 90)


@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
def test_reindex_runs_past_max_positions(make):
    limit = 32
    target = make(max_positions=limit)
    draft_model = perturbed_copy(target, scale=0.3)
    fed, finite = [], []
    for model in (target, draft_model):
        model.register_forward_pre_hook(lambda m, a, kw: fed.append(int(kw["position_ids"].max())),
                                        with_kwargs=True)
        model.register_forward_hook(lambda m, a, out: finite.append(bool(torch.isfinite(out.logits).all())))

    def policy():
        return make_policy(KVSpec("streaming", {"sink_tokens": 4, "window": 12, "compress_interval": 4,
                                                "position_mode": "reindex"}))

    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    ids, stats = run(target, DraftModel(draft_model, policy()), policy(), prompt, 4 * limit)
    assert len(ids) == 4 * limit and stats.compressions_target >= 3 and stats.compressions_draft >= 3
    assert max(fed) < limit and all(finite)


@pytest.mark.parametrize("own_cache", [True, False], ids=["own_cache", "static"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
def test_reindexed_keys_equal_keys_computed_at_their_slots(make, own_cache):
    """Re-rotation is exact: layer-0 keys (context-free) equal a fresh forward of the kept tokens at slots 0..n-1,
    on the policy's own cache and in the static form's buffers."""
    from toolkit.kv.static_stream import StaticStreamKV

    target = make()
    policy = make_policy(KVSpec("streaming", {"sink_tokens": 4, "window": 12, "compress_interval": 4,
                                              "position_mode": "reindex"}))
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    decoder = SpeculativeDecoder(target, None, ConstantK(1), policy)
    if own_cache:
        decoder._new_cache = lambda prompts, gen: SingleRowCache(policy, target)
    ids = []
    for chunk in decoder.decode(prompt, GenerationSpec(max_new_tokens=50, ignore_eos=True), GenerationStats()):
        ids += chunk
        cache = decoder.cache  # as the last round left it (the row leaves once done)
        assert isinstance(cache, SingleRowCache if own_cache else StaticStreamKV)
        if own_cache:
            cache = cache.cache
            compressions, held = cache.compressions, cache.physical_length(0)
            keys, values = cache.layers[0].keys, cache.layers[0].values
        else:
            compressions, held = cache.compressions, cache.fill_held[cache.factor][0]
            tier = cache.layers[0].tiers[0]
            keys, values = tier.keys[:1, :, :held].clone(), tier.values[:1, :, :held].clone()
    assert compressions >= 3
    sequence = prompt[0].tolist() + ids[:-1]  # the last token is not in the cache yet
    kept = sequence[:4] + sequence[len(sequence) - (held - 4):]
    from transformers import DynamicCache

    fresh = DynamicCache()
    hf_forward(target, input_ids=torch.tensor([kept]), position_ids=torch.arange(held)[None], past_key_values=fresh)
    torch.testing.assert_close(keys, fresh.layers[0].keys, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(values, fresh.layers[0].values)


# the ring on the embedded model (12 s): tiny-model tests prove the path; make test-system runs it
@pytest.mark.slow
@pytest.mark.heavy
def test_speculative_equals_ar_on_embedded(embedded):
    model, tokenizer = embedded
    text = open("/usr/share/common-licenses/Apache-2.0").read()[:600]
    prompt = tokenizer(text, return_tensors="pt").input_ids
    policy = make_policy(KVSpec("streaming", {"sink_tokens": 4, "window": 64, "compress_interval": 8}))
    ar, _ = run(model, None, policy, prompt, 72)  # more new tokens than the window: the ring turns over in full
    spec, _ = run(model, NGramDrafter(3, 1), policy, prompt, 72, k=4)  # on the static cache's ring
    own, stats = run(model, NGramDrafter(3, 1), policy, prompt, 72, k=4, own_cache=True)  # the compressing cache
    assert stats.compressions_target >= 3
    assert spec == ar == own


def test_a_long_prompt_is_attended_in_chunks_exactly(monkeypatch):
    """A prompt's forward under a boolean mask at least CHUNKED_MIN long runs chunked_sdpa (each chunk over only the
    keys it sees): equal to SDPA under the dense mask for the window and for an arbitrary mask (fp64, GQA), and the
    ring decodes a 1,100-token prompt as the banded full forward does."""
    from toolkit.kv import attention

    n = attention.CHUNKED_MIN + 76  # a last chunk shorter than CHUNK
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2))
    pos = torch.arange(n)
    window = ((pos[None] <= pos[:, None]) & ((pos[None] < SINKS) | (pos[None] > pos[:, None] - 300)))[None, None]
    arbitrary = torch.rand(1, 1, n, n, generator=g) < 0.3
    arbitrary[..., pos, pos] = True  # every query sees a key
    for mask in (window, arbitrary):
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.allclose(attention.sdpa(q, k, v, mask, None), dense, atol=1e-12)
    plan = attention.chunk_plan(window)  # the layers of one forward share a mask: planned once, reused after
    assert attention.chunk_plan(window) is plan and attention.chunk_plan(window.clone()) is not plan
    flipped = window.clone()
    flipped[..., -1, 0] = ~flipped[..., -1, 0]  # another mask (a new object) is planned afresh, exactly
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=flipped, enable_gqa=True)
    assert torch.allclose(attention.sdpa(q, k, v, flipped, None), dense, atol=1e-12)
    chunked, calls = attention.chunked_sdpa, []
    monkeypatch.setattr(attention, "chunked_sdpa", lambda *args: calls.append(1) or chunked(*args))
    torch.manual_seed(0)
    target = tiny_llama(max_positions=2048)
    prompt = torch.randint(0, 128, (1, 1100), generator=torch.Generator().manual_seed(3))
    reference = banded_greedy(target, prompt, 6)
    monkeypatch.setitem(window_prefill.CHUNK_TOKENS, "cpu", 10**6)  # the ring's prompt in one masked forward
    ar, _ = run(target, None, streaming(), prompt, 6)
    assert len(calls) == 2 and ar == reference  # the prompt's forward, once per layer
    monkeypatch.setitem(window_prefill.CHUNK_TOKENS, "cpu", 512)  # in chunks (toolkit/kv/window_prefill.py)
    ar, _ = run(target, None, streaming(), prompt, 6)
    assert len(calls) == 2 and ar == reference  # no forward as long as CHUNKED_MIN under a mask

"""L2-norm and head-aware eviction on the static engine (toolkit/kv/static_evict.py): one row equals the policy's
single-sequence cache (the kvpress-style form) token for token, eager and compiled; autoregressive rows of a batch
(the same commit points as alone) equal each prompt decoded alone, with uncompressed skip layers next to compressed
ones; speculative rows keep the policy's budget per row in fixed-size buffers, and a compacted row holds exactly the
entries the policy selects from that row's own keys."""

from __future__ import annotations

import pytest
import torch
from conftest import batch_decoder, hf_forward, tiny_llama
from test_batch import prompts
from test_decoder import INIT

import toolkit
from toolkit.recipe import Recipe

# Selection by key norm is discontinuous: a last-bit difference between a batched and a single fp32 forward can flip
# a near-tie between two keys (it does for one head-aware row here), so the equality tests run the tiny target in
# float64, where batched and single forwards agree far past any tie.
DTYPE = torch.float64

# head-aware: 2 KV heads per layer ranked by explicit importance into 2 budget tiers (no calibration)
HEAD_AWARE = {"policy": "head_aware", "tiers": 2, "importance": [[0.5, 0.5], [0.1, 0.9]]}


def l2_recipe(drafter: str, policy: str = "l2norm", interval: int = 3, new: int = 40) -> Recipe:
    kv = {"policy": "l2norm", "budget": 12, "sink_tokens": 2, "protect_recent": 4, "skip_layers": [0],
          "compress_interval": interval} | (HEAD_AWARE if policy == "head_aware" else {})
    return Recipe.from_dict({"name": "l2-batch", "target": {"device": "cpu"}, "draft": None, "kv": kv,
                             "spec": {"drafter": drafter, "num_draft_tokens": 4},
                             "generation": {"max_new_tokens": new, "ignore_eos": True}})


@pytest.mark.parametrize("policy", ["l2norm", "head_aware"])
def test_eviction_per_row_equals_each_prompt_alone_when_rounds_commit_alike(policy):
    target = tiny_llama(seed=0, **INIT).to(DTYPE)
    generator = toolkit.build(l2_recipe("none", policy), target=target, tokenizer=None)
    assert generator.batchable
    batch = prompts(5)  # 12..20 tokens + 40: every row compresses many times, at its own tokens
    alone = [generator.generate(p).token_ids for p in batch]
    rows = generator.generate_batch(batch, batch_size=3)
    assert [r.token_ids for r in rows] == alone
    plain = toolkit.build(l2_recipe("none", policy).replace(kv=toolkit.recipe.KVSpec()), target=target,
                          tokenizer=None)
    assert [r.token_ids for r in plain.generate_batch(batch, batch_size=3)] != alone  # eviction changes the text


def test_speculative_rows_keep_the_budget_and_the_policys_selection():
    from toolkit.kv.l2norm import L2Norm
    from toolkit.recipe import GenerationSpec
    from toolkit.kv.static_evict import StaticEvictKV
    from toolkit.speculative.cost_model import VerifyCost
    from toolkit.speculative.drafters import LookupDrafter

    target = tiny_llama(seed=0, **INIT)
    policy = L2Norm(budget=12, sink_tokens=2, protect_recent=4, skip_layers=[0], compress_interval=3)
    checked = []

    class Watch(StaticEvictKV):
        def commit(self):
            skipped, compressed = (layer.tiers[0] for layer in self.layers)  # layer 0 is skipped
            before = [(t.keys.clone(), t.values.clone()) for t in (skipped, compressed)]
            lengths, full = self.fill_held[1.0][:self.active], self.held[:self.active]
            super().commit()
            for r, (n, m) in enumerate(zip(lengths, self.fill_held[1.0][:self.active])):
                if m < n:  # row r compressed: layer 1 keeps what L2Norm.select picks from its n entries
                    keys, values = before[1][0][r:r + 1, :, :n], before[1][1][r:r + 1, :, :n]
                    keep = policy.select(keys, values, 1, m)
                    expected = torch.gather(keys, 2, keep[..., None].expand(-1, -1, -1, keys.shape[-1]))
                    assert torch.equal(compressed.keys[r:r + 1, :, :m], expected)
                    assert torch.equal(skipped.keys[r, :, :full[r]], before[0][0][r, :, :full[r]])  # untouched
                    checked.append(m)

    decoder = batch_decoder(target, lambda: LookupDrafter(max_cached_requests=0), VerifyCost([1.0] * 64, learn=False),
                            num_draft_tokens=4, batch_size=3, policy=policy)
    decoder._new_cache = lambda prompts, gen: Watch(target, 3, 128, decoder._widest(), policy)
    with policy.attached(target):
        rows = decoder.decode_batch(prompts(5), GenerationSpec(max_new_tokens=40, ignore_eos=True))
    assert checked and set(checked) == {12}
    assert decoder.cache.slots_of == {1.0: 12 + 3 + 5, None: 128}  # budget + interval + the widest forward (K 4 + 1)
    assert all(len(ids) == 40 for ids, _ in rows) and sum(s.accepted for _, s in rows) > 0


@pytest.mark.parametrize("policy", ["l2norm", "head_aware"])
def test_speculative_rows_over_prefill_compressed_caches_equal_each_prompt_alone(policy):
    """Prompts past budget + interval are compressed by their prefill's commit and then decode 10 tokens without
    another compression: speculative rows (verify forwards of up to 5 tokens over compressed and skipped layers —
    and head tiers — of different lengths) equal each prompt decoded alone."""
    from test_decoder import make_prompt

    target = tiny_llama(seed=0, **INIT).to(DTYPE)
    generator = toolkit.build(l2_recipe("lookup", policy, interval=10, new=10), target=target, tokenizer=None)
    assert generator.batchable
    batch = []
    # 30..54 tokens with repeats inside (lookup drafts are accepted and rejected): past every tier's budget +
    # interval (head-aware budgets 9 and 15), so the prefill compresses every tier and 10 new tokens fit after it
    for seed in range(5):
        base = make_prompt(50 + seed, length=10 + 2 * seed)[0]
        batch.append(torch.cat([base, base, base]).view(1, -1))
    alone = [generator.generate(p) for p in batch]
    rows = generator.generate_batch(batch, batch_size=3)
    assert [r.token_ids for r in rows] == [a.token_ids for a in alone]
    assert sum(r.stats.accepted for r in rows) > 0
    assert any(r.stats.verify_tokens > r.stats.rounds for r in rows)  # some verify forwards were wider than 1


def decode_one(target, policy, prompt, forward=None, single=False, drafter=True, new=40):
    """Greedy ids of one prompt under ``policy`` (K = 4 drafts of a slightly perturbed copy of the target: most are
    accepted, some rejected), on the static form or (``single``) on the policy's single-sequence cache; returns
    ``(ids, stats, decoder)``."""
    from conftest import perturbed_copy

    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.engine.planner import ConstantK
    from toolkit.kv.rows import SingleRowCache
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.drafters import DraftModel
    from toolkit.speculative.stats import GenerationStats

    draft = DraftModel(perturbed_copy(target, scale=0.05)) if drafter else None
    decoder = SpeculativeDecoder(target, draft, ConstantK(4), policy, forward=forward)
    if single:
        decoder._new_cache = lambda prompts, gen: SingleRowCache(policy, target)
    stats = GenerationStats()
    gen = GenerationSpec(max_new_tokens=new, ignore_eos=True)
    return [t for chunk in decoder.decode(prompt, gen, stats) for t in chunk], stats, decoder


@pytest.mark.parametrize("policy,drafter", [("l2norm", False), ("head_aware", False), ("head_aware", True),
                                            pytest.param("l2norm", True, marks=pytest.mark.heavy)],  # ~10 s
                         ids=["l2norm-ar", "head_aware-ar", "head_aware-draft_model", "l2norm-draft_model"])
def test_one_row_equals_the_single_sequence_policy_eager_and_compiled(policy, drafter):
    """The static form's tokens equal the policy's own single-sequence cache (which kvpress-equality tests pin) with
    compactions along the way; compiled (dynamo traces; CPU's dynamic shapes and CUDA's buckets) equal to eager."""
    from test_decoder import make_prompt

    from toolkit.engine.forward import TargetForward
    from toolkit.kv import make_policy
    from toolkit.kv.static_evict import StaticEvictKV
    from toolkit.recipe import KVSpec

    target = tiny_llama(seed=0, **INIT).to(DTYPE)
    kv = l2_recipe("lookup", policy).kv
    spec = make_policy(KVSpec(kv.policy, dict(kv.params)))
    base = make_prompt(7, length=9)[0]
    prompt = torch.cat([base, base, base[:5]]).view(1, -1)
    reference, ref_stats, _ = decode_one(target, spec, prompt, single=True, drafter=drafter)
    ids, stats, decoder = decode_one(target, spec, prompt, drafter=drafter)
    assert isinstance(decoder.cache, StaticEvictKV) and stats.compressions_target == ref_stats.compressions_target > 3
    assert ids == reference
    if drafter:
        assert stats.tokens_per_round > 1.5 and stats.accepted < stats.drafted
    if not drafter:
        return
    torch._dynamo.reset()
    for buckets in (False, True):
        forward = TargetForward(target, compile=True, backend="eager", buckets=buckets)
        assert decode_one(target, spec, prompt, forward=forward, drafter=drafter)[0] == reference
        assert forward.compile_s  # the forwards ran compiled
    torch._dynamo.reset()


def test_fixed_budget_buffers_hold_exact_bytes_and_refuse_what_they_cannot_hold():
    """Tier buffers are sized by the budget (budget + interval + widest slots, whatever the request's length), the
    skipped layer by the request; kv_bytes is what is allocated, needed_bytes what the row holds."""
    from toolkit.kv.l2norm import L2Norm
    from toolkit.kv.static_evict import StaticEvictKV

    target = tiny_llama(seed=0, **INIT)  # 2 layers, 2 KV heads of 16 dims, fp32
    policy = L2Norm(budget=12, sink_tokens=2, protect_recent=4, skip_layers=[0], compress_interval=3)
    cache = StaticEvictKV(target, 1, 512, 5, policy)
    assert cache.slots_of == {1.0: 12 + 3 + 5, None: 512}
    per_slot = 2 * 2 * 16 * 4  # keys and values, 2 heads x 16 dims x 4 bytes
    assert cache.kv_bytes() == per_slot * ((20) + (512 + 64))  # the skipped layer's span padding: SPAN_STEP
    prefilled, kwargs = cache.begin_row(30)
    hf_forward(target, input_ids=torch.arange(1, 31).view(1, -1), **{k: v for k, v in kwargs.items()})
    cache.add_row(prefilled, 30)  # 30 > 12 + 3: the prefill is compacted to the budget at once
    assert cache.fill_held[1.0] == [12] and cache.held == [30]
    assert cache.needed_bytes() == per_slot * (12 + 30)
    with pytest.raises(ValueError, match="no room in capacity 512"):
        cache.load_row(0, prefilled, 510)

"""StreamingLLM with reindexed positions or without the exact window, alone and composed with KIVI, on the static
engine (toolkit/kv/static_stream.py, toolkit/kv/static_stream_quant.py): one row equals the policy's
single-sequence cache token for token with as many compactions, AR and with drafts; reindexed generation runs past
the model's context; compiled forwards equal eager ones; rows of a batch equal each prompt alone; the buffers are
fixed by the window (exact bytes, whatever the generation length) and the quantized ring holds every group a row
keeps."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_forward, perturbed_copy, tiny_llama, tiny_neox
from test_decoder import INIT, make_prompt
from test_static_evict import decode_one

from toolkit.kv import make_policy
from toolkit.kv.static_stream import StaticStreamKV
from toolkit.kv.static_stream_quant import StaticStreamQuantKV, held_groups
from toolkit.recipe import KVSpec

# fp64: the static forms attend over their slots in another order than the single-sequence caches
DTYPE = torch.float64
WINDOW = {"sink_tokens": 2, "window": 12, "compress_interval": 3}
MODES = {"rolling": WINDOW | {"exact_window": False},
         "reindex": WINDOW | {"position_mode": "reindex"},
         "reindex_rolling": WINDOW | {"position_mode": "reindex", "exact_window": False}}
QUANT = {"sink_tokens": 2, "window": 20, "compress_interval": 3, "quant_group_size": 8, "residual_length": 6,
         "exact_window": False}


def policy_of(params: dict):
    return make_policy(KVSpec("streaming", params))


def repeated_prompt(seed: int = 7) -> torch.Tensor:
    base = make_prompt(seed, length=9)[0]
    return torch.cat([base, base, base[:5]]).view(1, -1)  # 23 tokens: the prefill is compacted at once


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, **INIT).to(DTYPE)


@pytest.mark.parametrize("drafter", [False, True], ids=["ar", "draft_model"])
@pytest.mark.parametrize("mode", list(MODES))
def test_one_row_equals_the_single_sequence_cache(target, mode, drafter):
    """The static form's tokens equal StreamingCache's (kvpress-equal: tests/test_kv_cache.py) with as many commit
    points compacting; a draft model's K = 4 drafts are partly accepted."""
    policy = policy_of(MODES[mode])
    reference, ref_stats, _ = decode_one(target, policy, repeated_prompt(), single=True, drafter=drafter)
    ids, stats, decoder = decode_one(target, policy, repeated_prompt(), drafter=drafter)
    assert isinstance(decoder.cache, StaticStreamKV) and ids == reference
    assert stats.compressions_target == ref_stats.compressions_target >= 8
    if drafter:
        assert stats.tokens_per_round > 1.1 and 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_rolling_window_equals_the_single_sequence_cache(target, bits, monkeypatch):
    """KIVI under the rolling window: packed groups evicted at commit points (the ring turns over several times),
    verify forwards straddling group boundaries; tokens and packing commit points equal the single-sequence
    cache's, and the rolling window is not the exact one."""
    policy = policy_of(QUANT | {"quant_bits": bits})
    evicted = []
    commit = StaticStreamQuantKV.commit

    def watched(cache):
        commit(cache)
        evicted.append(cache.evicted_held[0])
        assert cache.groups_held(0) <= cache.ring_groups

    monkeypatch.setattr(StaticStreamQuantKV, "commit", watched)
    reference, ref_stats, _ = decode_one(target, policy, repeated_prompt(), single=True)
    ids, stats, decoder = decode_one(target, policy, repeated_prompt())
    assert isinstance(decoder.cache, StaticStreamQuantKV) and ids == reference
    assert stats.compressions_target == ref_stats.compressions_target >= 5
    assert 0 < stats.accepted < stats.drafted and stats.tokens_per_round > 1.1
    assert max(evicted) > decoder.cache.ring_groups * 8  # evicted past a whole turn of the ring
    if bits == 4:
        exact = policy_of(QUANT | {"quant_bits": bits, "exact_window": True})
        assert decode_one(target, exact, repeated_prompt())[0] != ids


@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
def test_reindex_runs_past_the_context_as_the_single_sequence_cache_does(make):
    """A 32-position model generates 128 tokens under reindex (full and partial rotary): never fed a position past
    its context, on the static form of target and draft alike, token for token as on the single-sequence cache."""
    limit = 32
    target = make(max_positions=limit).to(DTYPE)
    fed = []

    def record(module, args, kwargs):  # the target's positions (its draft, a copy, has no window)
        if module is target:
            fed.append(int(kwargs["position_ids"].max()))

    target.register_forward_pre_hook(record, with_kwargs=True)
    policy = policy_of({"sink_tokens": 4, "window": 12, "compress_interval": 4, "position_mode": "reindex"})
    prompt = make_prompt(0, length=8)
    reference, ref_stats, _ = decode_one(target, policy, prompt, single=True, new=4 * limit)
    fed.clear()
    ids, stats, decoder = decode_one(target, policy, prompt, new=4 * limit)
    assert isinstance(decoder.cache, StaticStreamKV) and ids == reference and len(ids) == 4 * limit
    assert stats.compressions_target == ref_stats.compressions_target >= 8 and stats.accepted > 0
    assert max(fed) < limit


@pytest.mark.parametrize("params, buckets", [(MODES["reindex"], False), (MODES["rolling"], True),
                                             (QUANT | {"quant_bits": 4}, False)],
                         ids=["reindex", "rolling", "quantized"])
def test_compiled_forwards_equal_eager(target, params, buckets):
    """Dynamo traces the forwards (slot positions and masks from the per-row counters, inside the graph): CPU's
    dynamic widths and CUDA's buckets give the eager tokens."""
    from toolkit.engine.forward import TargetForward

    policy = policy_of(params)
    reference, ref_stats, _ = decode_one(target, policy, repeated_prompt(), new=24)
    torch._dynamo.reset()
    forward = TargetForward(target, compile=True, backend="eager", buckets=buckets)
    ids, stats, _ = decode_one(target, policy, repeated_prompt(), forward=forward, new=24)
    assert ids == reference and stats.compressions_target == ref_stats.compressions_target > 2
    assert forward.compile_s  # the forwards ran compiled
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["reindex", "reindex_rolling", "quantized"])
def test_rows_of_a_batch_equal_each_prompt_alone(target, mode):
    """Five prompts, three rows at a time (rows leave and join with their counters), lookup drafts under a constant
    K (every row commits what it would alone): each row's tokens are the prompt's own."""
    from test_batch import prompts

    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.engine.planner import ConstantK
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.drafters import LookupDrafter, RowDrafters
    from toolkit.speculative.stats import GenerationStats

    policy = policy_of(QUANT | {"quant_bits": 4} if mode == "quantized" else MODES[mode])
    gen = GenerationSpec(max_new_tokens=40, ignore_eos=True)

    def decoder(rows: int):
        lookup = RowDrafters(lambda: LookupDrafter(max_cached_requests=0))
        return SpeculativeDecoder(target, lookup, ConstantK(4), policy, batch_size=rows)

    batch = prompts(5)
    alone = []
    for prompt in batch:
        stats = GenerationStats()
        alone.append(([t for chunk in decoder(1).decode(prompt, gen, stats) for t in chunk], stats))
    rows = decoder(3).decode_batch(batch, gen)
    assert [ids for ids, _ in rows] == [ids for ids, _ in alone]
    assert all(s.compressions_target > 0 for _, s in alone) and sum(s.accepted for _, s in rows) > 0


def test_buffers_are_fixed_by_the_window_with_exact_bytes():
    """Allocated bytes: StreamingLLM's sinks + window + interval + widest slots, KIVI's ring of held_groups packed
    groups + fp sinks and residual — the same for a request of 512 or 8,192 positions."""
    model = tiny_llama(seed=0, **INIT)  # 2 layers, 2 KV heads of 16 dims, fp32
    heads, dim, layers = 2, 16, 2
    for capacity in (512, 8192):
        cache = StaticStreamKV(model, 1, capacity, 5, policy_of(MODES["reindex"]))
        assert cache.slots_of[cache.factor] == 2 + 12 + 3 + 5
        assert cache.kv_bytes() == layers * 2 * heads * dim * 4 * (2 + 12 + 3 + 5)
        quant = StaticStreamQuantKV(model, 1, capacity, 5, policy_of(QUANT | {"quant_bits": 4}))
        # (20 + max(3, 7) - max(0, 6 - 7)) // 8 = 3 groups; fp: 2 sinks + max(6, 7) + 5
        assert quant.ring_groups == 3 and quant.fp_slots == 2 + 7 + 5
        # codes of keys and values, float16 scales and zero points of keys (per channel) and values (per token)
        packed_group = 2 * heads * dim * 8 * 4 // 8 + heads * dim * 2 * 2 + heads * 8 * (dim // 8) * 2 * 2
        assert quant.kv_bytes() == layers * (3 * packed_group + 2 * heads * quant.fp_slots * dim * 4)
    prefilled, kwargs = cache.begin_row(30)
    hf_forward(model, input_ids=torch.arange(1, 31).view(1, -1), **kwargs)
    cache.add_row(prefilled, 30)  # 30 > 2 + 12 + 3: compacted to the sinks and the window at once
    assert cache.fill_held[cache.factor] == [14] and cache.held == [30] and cache.compressions == 1
    assert cache.needed_bytes() == layers * 2 * heads * dim * 4 * 14
    with pytest.raises(ValueError, match="cannot take 9 more tokens before a commit point"):
        cache.prepare(9)
    with pytest.raises(ValueError, match="the static cache's ring"):
        StaticStreamKV(model, 1, 512, 5, policy_of(WINDOW))


def test_the_quantized_ring_holds_every_group_the_single_sequence_cache_keeps():
    """held_groups bounds the packed groups the single-sequence cache holds after any commit point (its own
    QuantizedLayer and commit rule, random commit sizes up to the widest forward), and is reached: the ring is as
    small as it can be."""
    from toolkit.kv.quantized import QuantizedStreamingLLM, boundary
    from toolkit.kv.quantized_layer import QuantizedLayer

    class Length:
        def __init__(self, policy):
            self.n, self.policy = 0, policy

        def get_seq_length(self):
            return self.n

        def boundary(self, n):
            return boundary(n, self.policy)

    rng, reached = random.Random(0), 0
    cases = [(g, w, r, c, widest) for g in (2, 4) for w in range(2, 10) for r in range(1, w + 1) for c in (0, 3)
             for widest in sorted({1, r})]
    for g, w, r, c, widest in cases:
        policy = QuantizedStreamingLLM(sink_tokens=2, window=w, compress_interval=c, quant_bits=8,
                                       quant_group_size=g, residual_length=r, exact_window=False)
        layer, length, most = QuantizedLayer(8, g), Length(policy), 0
        for step in range(40):
            new = rng.randint(1, 3 * w) if step == 0 else rng.randint(1, widest)  # a prompt, then rounds
            layer.update(torch.zeros(1, 1, new, 4), torch.zeros(1, 1, new, 4))
            length.n += new
            policy.compress_layer(length, 0, layer)
            most = max(most, layer.q_len // g)
        assert most <= held_groups(policy), (g, w, r, c, widest)
        reached += most == held_groups(policy)
    assert reached > 0.9 * len(cases)


@pytest.mark.parametrize("name,params", [("l2norm", {"budget": 12, "sink_tokens": 2, "protect_recent": 4,
                                                     "skip_layers": [], "compress_interval": 3}),
                                         ("streaming", MODES["reindex"])], ids=["l2norm", "reindex"])
def test_a_compacted_draft_cache_catches_up_after_plain_rounds(target, name, params):
    """A draft model on a fixed-budget static form (budget + interval + widest slots) falls 25 tokens behind during
    plain rounds, then catches up in forwards of at most the widest, each a commit point; the target's output is its
    own greedy output."""
    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.engine.planner import ConstantK
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.drafters import DraftModel
    from toolkit.speculative.stats import GenerationStats

    class Pause(ConstantK):  # K = 4, but no drafting in rounds 3 .. 27
        rounds = 0

        def next_k(self) -> int:
            self.rounds += 1
            return 0 if 3 <= self.rounds < 28 else self.num_draft_tokens

    drafter = DraftModel(perturbed_copy(target, scale=0.05), make_policy(KVSpec(name, params)))
    decoder = SpeculativeDecoder(target, drafter, Pause(4))
    stats, gen = GenerationStats(), GenerationSpec(max_new_tokens=50, ignore_eos=True)
    ids = [t for chunk in decoder.decode(repeated_prompt(), gen, stats) for t in chunk]
    assert ids == decode_one(target, None, repeated_prompt(), drafter=False, new=50)[0]
    assert type(drafter.cache).__name__ == ("StaticEvictKV" if name == "l2norm" else "StaticStreamKV")
    assert stats.compressions_draft > 3 and stats.drafted > 30  # drafting resumed after the pause


@pytest.mark.slow
def test_reindexed_rolling_window_on_the_embedded_model(embedded):
    """llama.cpp's context shift (reindex, no exact window) on the embedded model, fp32: n-gram drafts over a
    ~150-token prompt, the window turning over, token for token as on the single-sequence cache."""
    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.engine.planner import ConstantK
    from toolkit.kv.rows import SingleRowCache
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.drafters import NGramDrafter
    from toolkit.speculative.stats import GenerationStats

    model, tokenizer = embedded
    prompt = tokenizer(open("/usr/share/common-licenses/Apache-2.0").read()[:600], return_tensors="pt").input_ids
    policy = policy_of({"sink_tokens": 4, "window": 32, "compress_interval": 8, "position_mode": "reindex",
                        "exact_window": False})
    runs = []
    for single in (True, False):
        decoder = SpeculativeDecoder(model, NGramDrafter(3, 1), ConstantK(4), policy)
        if single:
            decoder._new_cache = lambda prompts, gen: SingleRowCache(policy, model)
        stats = GenerationStats()
        gen = GenerationSpec(max_new_tokens=40, ignore_eos=True)
        runs.append(([t for chunk in decoder.decode(prompt, gen, stats) for t in chunk], stats.compressions_target))
        assert isinstance(decoder.cache, SingleRowCache if single else StaticStreamKV) and stats.accepted > 0
    assert runs[0] == runs[1] and runs[1][1] >= 3

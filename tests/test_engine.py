"""The one engine (toolkit/engine, toolkit/kv/static.py): the static cache is exact (a forward on it equals one on a
DynamicCache, rollback included), its StreamingLLM ring decodes exactly like the single-sequence policy, and the
compiled paths — CPU's dynamic shapes and CUDA's bucketed shapes, traced on CPU with the ``eager`` backend — give
HF's greedy output for one row and for batches."""

from __future__ import annotations

import pytest
import torch
from conftest import batch_decoder, hf_forward, perturbed_copy, tiny_llama, tiny_neox
from test_decoder import INIT, hf_greedy, make_prompt
from transformers import DynamicCache

from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.forward import TargetForward
from toolkit.engine.planner import ConstantK
from toolkit.kv.rows import SingleRowCache
from toolkit.kv.static import SPAN_STEP, StaticKV
from toolkit.kv.streaming import StreamingLLM
from toolkit.recipe import GenerationSpec
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import DraftModel, LookupDrafter, NGramDrafter
from toolkit.speculative.stats import GenerationStats

GREEDY = GenerationSpec(max_new_tokens=40, ignore_eos=True)


def repetitive(seed: int, length: int = 10) -> torch.Tensor:
    base = make_prompt(seed, length=length)[0]
    return torch.cat([base, base, base[:4]]).view(1, -1)


def decode(target, prompt, drafter=None, k=4, policy=None, forward=None, gen=GREEDY):
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, drafter, ConstantK(k), policy, forward=forward)
    ids = [t for chunk in decoder.decode(prompt, gen, stats) for t in chunk]
    return ids, stats, decoder


@pytest.mark.parametrize("build", [tiny_llama, tiny_neox], ids=["llama", "neox"])
def test_a_forward_on_the_static_cache_equals_one_on_a_dynamic_cache_and_rolls_back_exactly(build):
    target = build(seed=0, **INIT)
    prompt = make_prompt(3, length=20)
    forward = TargetForward(target)
    cache = StaticKV(target, rows=1, capacity=64, widest=8)
    reference = DynamicCache()
    with torch.no_grad(), forward.attached():
        prefilled, kwargs = cache.begin_row(20)
        forward.prefill(prompt, kwargs)
        cache.add_row(prefilled, 20)
        hf_forward(target, input_ids=prompt, past_key_values=reference, use_cache=True)
        assert cache.held == [20] and cache.lengths.tolist() == [20]
        for width, keep in ((5, 2), (3, 3), (8, 1), (1, 1)):
            tokens = make_prompt(width, length=width)
            ours = forward(cache, tokens)[0]
            theirs = hf_forward(target, input_ids=tokens, past_key_values=reference, use_cache=True).logits[0]
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
            cache.accept(torch.tensor([keep]), [keep])  # the rest rolled back: never read again
            if keep < width:
                reference.crop(keep - width)
        assert cache.held == [reference.get_seq_length()]
    # every slot in use, plus the slack that keeps the attended span a dynamic size
    layers = target.config.num_hidden_layers
    kv_heads = getattr(target.config, "num_key_value_heads", target.config.num_attention_heads)
    head_dim = target.config.hidden_size // target.config.num_attention_heads
    assert cache.kv_bytes() == layers * 2 * kv_heads * (64 + SPAN_STEP) * head_dim * 4
    assert cache.needed_bytes() == layers * 2 * kv_heads * cache.held[0] * head_dim * 4  # what the row holds


@pytest.mark.parametrize("drafter", [None, "draft_model"])
def test_the_streaming_ring_decodes_exactly_like_the_single_sequence_policy(drafter):
    target = tiny_llama(seed=0, max_positions=1024, **INIT)
    draft = perturbed_copy(target, scale=0.05, seed=1)
    policy = StreamingLLM(sink_tokens=2, window=12, compress_interval=4)
    prompt = repetitive(1, length=9)  # longer than the window: the prefill already wraps the ring
    gen = GenerationSpec(max_new_tokens=60, ignore_eos=True)
    make = (lambda: None) if drafter is None else (lambda: DraftModel(draft))
    ours, stats, decoder = decode(target, prompt, make(), policy=policy, gen=gen)
    assert isinstance(decoder.cache, StaticKV)
    assert decoder.cache.capacity == 2 + 12 + (5 if drafter else 1)  # sinks + window + the widest forward
    # the reference: the policy's own single-sequence cache (physical eviction, banded mask)
    single = SpeculativeDecoder(target, make(), ConstantK(4), policy)
    single._new_cache = lambda prompts, gen: SingleRowCache(policy, target)
    theirs = [t for chunk in single.decode(prompt, gen, GenerationStats()) for t in chunk]
    assert ours == theirs
    if drafter:
        assert stats.accepted > 0 and stats.accepted < stats.drafted  # rollback inside the ring was exercised


# buckets: ~12 s more; test_static_stream's rolling ring and test_static_quant's streaming case trace that form here
@pytest.mark.parametrize("buckets", [False, pytest.param(True, marks=pytest.mark.heavy)],
                         ids=["cpu-dynamic", "cuda-buckets"])
def test_compiled_forwards_give_hf_greedy_for_one_row_and_a_batch(buckets):
    target = tiny_llama(seed=0, **INIT)
    graphs = []  # what dynamo hands the backend: one entry per compile

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    forward = TargetForward(target, compile=True, backend=counting_backend, buckets=buckets)
    prompts = [repetitive(seed) for seed in range(3)]
    alone = [hf_greedy(target, p, GREEDY.max_new_tokens) for p in prompts]
    ids, stats, decoder = decode(target, prompts[0], NGramDrafter(), k=3, forward=forward)
    assert ids == alone[0] and stats.accepted > 0
    assert decoder.cache.static_span == buckets  # CUDA graphs attend to every slot
    batch = batch_decoder(target, lambda: LookupDrafter(max_cached_requests=0), VerifyCost([1.0] * 64, learn=False),
                          num_draft_tokens=5, batch_size=3, forward=forward)
    rows = batch.decode_batch(prompts, GREEDY)
    assert [r for r, _ in rows] == alone
    if buckets:  # every forward padded to a (batch, width) bucket; padding never committed
        assert all(r in forward.batch_sizes and w in forward.widths for r, w in forward.compile_s)
        assert len(forward.compile_s) > 6  # several buckets ran ...
    else:  # dynamic sizes: one graph per (rows == 1, width == 1) class, whatever the widths and lengths
        assert set(forward.compile_s) <= {(1, 1), (1, 2), (2, 1), (2, 2)}
    # ... from the same compiled graphs on both paths: rows and width are dynamic past 1 (four shape classes), and
    # the batch's cache (other rows and capacity) recompiles two of them. Buckets are CUDA-graph captures, not compiles
    assert len(graphs) <= 6


def test_a_static_cache_is_reused_across_requests_and_grows_only():
    target = tiny_llama(seed=0, **INIT)
    forward = TargetForward(target, compile=True, backend="eager")
    short = decode(target, make_prompt(0, length=8), forward=forward)[2].cache
    again = decode(target, make_prompt(1, length=12), forward=forward)[2].cache
    assert again is short  # same buffers: compiled graphs and CUDA graphs keep their addresses
    longer = decode(target, make_prompt(2, length=300), forward=forward)[2].cache
    assert longer is not short and longer.capacity > short.capacity
    assert decode(target, make_prompt(3, length=8), forward=forward)[2].cache is longer


def test_rows_leave_and_join_without_touching_the_others():
    target = tiny_llama(seed=0, **INIT)
    prompts = [repetitive(seed, length=6 + seed) for seed in range(5)]
    alone = [hf_greedy(target, p, 20) for p in prompts]
    gen = GenerationSpec(max_new_tokens=20, ignore_eos=True)
    decoder = batch_decoder(target, NGramDrafter, VerifyCost([1.0] * 64, learn=False), num_draft_tokens=4,
                            batch_size=2)
    rows = decoder.decode_batch(prompts, gen)
    assert [r for r, _ in rows] == alone
    assert isinstance(decoder.cache, StaticKV) and decoder.cache.allocated == 2 and decoder.cache.rows == 0

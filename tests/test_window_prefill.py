"""A prompt under StreamingLLM's exact window prefilled in chunks (toolkit/kv/window_prefill.py): the ring it loads
and the logits equal those of one masked forward, the prompt's cache never holds more than the sinks, the ring's tail
and one chunk, and decoding after it equals the single-sequence policy's, drafts accepted."""

from __future__ import annotations

import torch
from conftest import perturbed_copy, tiny_llama
from test_decoder import INIT, make_prompt
from test_engine import decode

from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.forward import TargetForward
from toolkit.engine.planner import ConstantK
from toolkit.kv import window_prefill
from toolkit.kv.rows import SingleRowCache
from toolkit.kv.static import StaticKV
from toolkit.kv.streaming import StreamingLLM
from toolkit.kv.window_prefill import WindowedPrompt
from toolkit.recipe import GenerationSpec
from toolkit.speculative.drafters import DraftModel
from toolkit.speculative.stats import GenerationStats

POLICY = dict(sink_tokens=2, window=12, compress_interval=4)


def prefill_ring(target, prompt, chunk: int, monkeypatch, seen: list | None = None):
    """``(logits, cache)``: ``prompt`` prefilled into a one-row ring with chunks of ``chunk`` tokens on the CPU."""
    monkeypatch.setitem(window_prefill.CHUNK_TOKENS, "cpu", chunk)
    forward = TargetForward(target)
    cache = StaticKV(target, rows=1, capacity=1, widest=5, window=StreamingLLM(**POLICY))
    with torch.no_grad(), forward.attached():
        prefilled, kwargs = cache.begin_row(prompt.shape[1])
        if seen is not None:
            assert isinstance(prefilled, WindowedPrompt)
            run_chunk = forward._prefill_once
            monkeypatch.setattr(forward, "_prefill_once", lambda ids, kw, hidden: (
                seen.append(prefilled.get_seq_length() + ids.shape[1]), run_chunk(ids, kw, hidden))[1])
        logits = forward.prefill(prompt, kwargs)
        cache.add_row(prefilled, prompt.shape[1])
    return logits, cache


def test_chunks_load_the_ring_as_one_masked_forward_does_holding_at_most_sinks_tail_and_a_chunk(monkeypatch):
    target = tiny_llama(seed=0, max_positions=1024, **INIT)
    prompt = make_prompt(4, length=100)
    whole_logits, whole = prefill_ring(target, prompt, 10**6, monkeypatch)
    seen = []
    chunked_logits, chunked = prefill_ring(target, prompt, 8, monkeypatch, seen)
    torch.testing.assert_close(chunked_logits, whole_logits, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(chunked.layers, whole.layers):
        torch.testing.assert_close(ours.keys[0], theirs.keys[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values[0], theirs.values[0], atol=1e-5, rtol=1e-5)
    assert chunked.lengths.tolist() == [100] and chunked.held == [100]
    tail = 12 + 5  # the ring: window + widest
    assert len(seen) == 13 and max(seen) == 2 + tail + 8  # entries a chunk attends: sinks + tail + itself


def test_short_prompts_and_other_policies_run_as_one_forward():
    window = StreamingLLM(**POLICY)
    assert not WindowedPrompt.pays(window, 2 + 17 + 8, 17, 8) and WindowedPrompt.pays(window, 2 + 17 + 9, 17, 8)
    assert not WindowedPrompt.pays(None, 1000, 17, 8)
    assert not WindowedPrompt.pays(StreamingLLM(**POLICY, exact_window=False), 1000, 17, 8)


def test_decoding_after_a_chunked_prefill_equals_the_single_sequence_policy(monkeypatch):
    monkeypatch.setitem(window_prefill.CHUNK_TOKENS, "cpu", 16)
    target = tiny_llama(seed=0, max_positions=1024, **INIT)
    draft = perturbed_copy(target, scale=0.01, seed=1)
    policy = StreamingLLM(**POLICY)
    base = make_prompt(1, length=30)[0]
    prompt = torch.cat([base] * 3).view(1, -1)  # 90 tokens: five chunks of 16 past the sinks and the ring
    gen = GenerationSpec(max_new_tokens=50, ignore_eos=True)
    began = []
    original = StaticKV.begin_row
    monkeypatch.setattr(StaticKV, "begin_row", lambda self, n: began.append(original(self, n)) or began[-1])
    ours, stats, decoder = decode(target, prompt, DraftModel(draft, StreamingLLM(**POLICY)), policy=policy, gen=gen)
    assert all(isinstance(b[0], WindowedPrompt) for b in began)  # the target's prompt and the draft's: chunks
    single = SpeculativeDecoder(target, DraftModel(draft, StreamingLLM(**POLICY)), ConstantK(4), policy)
    single._new_cache = lambda prompts, gen: SingleRowCache(policy, target)
    theirs = [t for chunk in single.decode(prompt, gen, GenerationStats()) for t in chunk]
    assert ours == theirs
    assert stats.tokens_per_round > 1.5 and stats.accepted < stats.drafted  # drafts accepted, rollback exercised

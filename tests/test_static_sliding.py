"""Sliding-window and mixed-attention models on the static engine (toolkit/kv/static_sliding.py): a Mistral-style model
(every layer slides) and alternating sliding / full layers (Gemma-2, with attention-logit soft-capping; Qwen2 with
``layer_types``) decode token-identical to HF ``generate`` greedy past the window, with lookup drafts accepted and
rejected, eager and compiled, one row and batches; the rings hold exactly ``window - 1 + widest`` slots."""

from __future__ import annotations

import pytest
import torch
from conftest import batch_decoder, hf_forward
from test_decoder import hf_greedy
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.forward import TargetForward
from toolkit.engine.planner import ConstantK
from toolkit.kv.rows import SingleRowCache, rows_cache, static_why, supports_static
from toolkit.kv.static_sliding import SlidingStaticKV
from toolkit.recipe import GenerationSpec
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import LookupDrafter, RowDrafters
from toolkit.speculative.stats import GenerationStats

WINDOW, NEW = 16, 40
#: per family: its config overrides (window 16; Gemma-2 and Qwen2 alternate sliding and full layers)
FAMILIES = {
    "mistral": {"sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 16},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": ["sliding_attention",
                                                                                   "full_attention"]},
}
#: per family a repetitive 12-token prompt (seed, period) after which lookup drafts are accepted and rejected
PROMPTS = {"mistral": (2, 3), "gemma2": (3, 3), "qwen2": (1, 4)}


def tiny(arch: str):
    """A random 2-layer model of ``arch`` (hidden 64, 4 heads / 2 KV heads of 16 dims, vocab 128), fp32, eager."""
    config = AutoConfig.for_model(arch, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, initializer_range=0.2, **FAMILIES[arch])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def repetitive(seed: int, period: int = 5, length: int = 12) -> torch.Tensor:
    base = torch.randint(1, 128, (period,), generator=torch.Generator().manual_seed(seed))
    return base.repeat(-(-length // period))[:length].view(1, -1)


@pytest.fixture(scope="module")
def models():
    """{arch: (model, prompt (12 tokens), HF greedy 40 tokens)}."""
    out = {}
    for arch in FAMILIES:
        model = tiny(arch)
        prompt = repetitive(*PROMPTS[arch])
        out[arch] = (model, prompt, hf_greedy(model, prompt, NEW))
    return out


def decode(model, prompt, drafter: bool, forward=None):
    """Greedy ids of ``prompt`` (K = 4 lookup drafts, or AR); returns ``(ids, stats, decoder)``."""
    lookup = RowDrafters(lambda: LookupDrafter(max_cached_requests=0)) if drafter else None
    decoder = SpeculativeDecoder(model, lookup, ConstantK(4), forward=forward)
    stats = GenerationStats()
    gen = GenerationSpec(max_new_tokens=NEW, ignore_eos=True)
    return [t for chunk in decoder.decode(prompt, gen, stats) for t in chunk], stats, decoder


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_static_engine_equals_hf_greedy_past_the_window(models, arch):
    model, prompt, reference = models[arch]
    assert supports_static(model) is None and static_why(None, model) is None
    ids, _, decoder = decode(model, prompt, drafter=False)
    assert isinstance(decoder.cache, SlidingStaticKV) and ids == reference
    ids, stats, decoder = decode(model, prompt, drafter=True)
    assert isinstance(decoder.cache, SlidingStaticKV) and ids == reference
    assert stats.tokens_per_round > 1 and stats.accepted < stats.drafted  # drafts accepted, and some rejected
    assert hf_greedy(unwindowed(model), prompt, NEW) != reference  # the window matters here


def unwindowed(model):
    """``model``'s weights with a window wider than the sequence (every layer sees every position)."""
    import copy

    config = copy.deepcopy(model.config)
    config.sliding_window = 1024
    full = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    full.load_state_dict(model.state_dict())
    return full


@pytest.mark.parametrize("arch, buckets", [("gemma2", False), ("mistral", True)], ids=["dynamic", "buckets"])
def test_compiled_equals_eager(models, arch, buckets):
    """Dynamo traces the forwards — CPU's dynamic widths and full-layer span with the masks in a dict per layer type
    (Gemma-2), CUDA's buckets over static spans with one ring mask (Mistral): the rings' masks and write indices are
    graph inputs."""
    torch._dynamo.reset()
    try:
        model, prompt, reference = models[arch]
        forward = TargetForward(model, compile=True, backend="eager", buckets=buckets)
        ids, stats, decoder = decode(model, prompt, drafter=True, forward=forward)
        assert ids == reference and forward.compile_s and isinstance(decoder.cache, SlidingStaticKV)
        assert stats.tokens_per_round > 1
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_batched_rows_equal_each_prompt_alone(models, arch):
    """Three prompts (12, 9 and 20 tokens: one prefilled past the window) over 2 rows (continuous batching: the
    third joins when the first leaves), lookup drafts per row."""
    model, prompt, reference = models[arch]
    others = [repetitive(2, period=3, length=9), repetitive(3, period=7, length=20)]
    decoder = batch_decoder(model, lambda: LookupDrafter(max_cached_requests=0), VerifyCost([1.0] * 64, learn=False),
                            num_draft_tokens=4, batch_size=2)
    rows = decoder.decode_batch([prompt, *others], GenerationSpec(max_new_tokens=NEW, ignore_eos=True))
    assert isinstance(decoder.cache, SlidingStaticKV) and decoder.cache.allocated == 2
    assert [ids for ids, _ in rows] == [reference, *(hf_greedy(model, p, NEW) for p in others)]
    assert sum(s.accepted for _, s in rows) > 0


def test_rings_hold_the_window_plus_one_forward_and_exact_bytes(models):
    per_slot = 2 * 2 * 16 * 4  # keys and values, 2 KV heads x 16 dims x 4 bytes
    mistral, gemma = models["mistral"][0], models["gemma2"][0]
    cache = rows_cache(None, mistral, 1, 256, 5)  # every layer a ring of 16 - 1 + 5
    assert isinstance(cache, SlidingStaticKV) and cache.ring_size == 20 and not cache.bounded and cache.fits(10 ** 6)
    assert cache.kv_bytes() == 2 * per_slot * 20
    cache = rows_cache(None, gemma, 2, 256, 5)  # a ring and a full layer (+ SPAN_STEP), 2 rows + 1 spare
    assert cache.kinds == ["sliding_attention", "full_attention"] and cache.bounded and not cache.fits(257)
    assert cache.kv_bytes() == 3 * per_slot * (20 + 256 + 64)
    assert SlidingStaticKV(mistral, 1, 8, 5).ring_size == 8  # a short request: the ring never wraps
    # the prefill keeps the last ring_size positions of a sliding layer, at slot p mod R
    cache = SlidingStaticKV(mistral, 1, 256, 5)
    prefilled, kwargs = cache.begin_row(30)
    with torch.no_grad():
        hf_forward(mistral, input_ids=torch.arange(1, 31).view(1, -1), **kwargs)
    cache.add_row(prefilled, 30)
    for p in (10, 29):
        assert torch.equal(cache.layers[1].keys[0, :, p % 20], prefilled.layers[1].keys[0, :, p])


def test_what_the_static_cache_still_refuses(models):
    from toolkit.kv import make_policy
    from toolkit.recipe import KVSpec

    model = tiny("qwen2")
    model.config.layer_types = ["linear_attention", "full_attention"]
    assert "layers of type linear_attention" in supports_static(model)
    model.config.layer_types = ["chunked_attention", "full_attention"]
    assert "layers of type chunked_attention" in supports_static(model)
    with pytest.raises(ValueError, match="chunked_attention"):
        SlidingStaticKV(model, 1, 256)
    gemma = models["gemma2"][0]
    streaming = make_policy(KVSpec("streaming", {"sink_tokens": 2, "window": 12}))
    assert "streaming policy on a model with sliding-window layers" in static_why(streaming, gemma)
    assert isinstance(rows_cache(streaming, gemma, 1, 256, 5), SingleRowCache)  # one sequence: the policy's cache

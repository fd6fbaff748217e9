"""KIVI quantization on the static engine (toolkit/kv/static_quant.py): one row equals the policy's single-sequence
cache (QuantizedKVCache) token for token at 2, 4 and 8 bits, standalone and composed with StreamingLLM, with verify
forwards straddling quantization boundaries (the shadow); a quantized draft cache proposes what the draft proposes on
its single-sequence cache; compiled forwards equal eager ones; buffers are allocated once with exact bytes."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_forward, perturbed_copy, tiny_llama
from test_decoder import INIT, make_prompt
from test_static_evict import decode_one

from toolkit.errors import ConfigError
from toolkit.kv import make_policy
from toolkit.kv.attention import STATIC_NAME, attached
from toolkit.kv.static_quant import StaticQuantKV
from toolkit.recipe import KVSpec

# fp64: the static form attends over [packed | fp slots | shadow] in another order than the single-sequence cache;
# in float64 the sums agree far past any near-tie of two logits
DTYPE = torch.float64
QUANT = {"quant_group_size": 8, "residual_length": 6, "sink_tokens": 2}
STREAMING = {"sink_tokens": 2, "window": 20, "compress_interval": 3, "quant_bits": 4, "quant_group_size": 8,
             "residual_length": 6}


def repeated_prompt(seed: int = 7) -> torch.Tensor:
    base = make_prompt(seed, length=9)[0]
    return torch.cat([base, base, base[:5]]).view(1, -1)  # 23 tokens: the prefill packs two groups at once


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, **INIT).to(DTYPE)


@pytest.mark.parametrize("name,params", [("quantized", QUANT | {"quant_bits": 2}),
                                         ("quantized", QUANT | {"quant_bits": 4}),
                                         ("quantized", QUANT | {"quant_bits": 8}),
                                         ("streaming", STREAMING)], ids=["2bit", "4bit", "8bit", "streaming"])
def test_one_row_equals_the_single_sequence_policy(target, name, params):
    """A draft model's K = 4 drafts (most accepted, some rejected): verify forwards of 5 positions straddle group
    boundaries; the static form's tokens equal the single-sequence cache's, with as many commit points packing."""
    policy = make_policy(KVSpec(name, params))
    reference, ref_stats, _ = decode_one(target, policy, repeated_prompt(), single=True)
    ids, stats, decoder = decode_one(target, policy, repeated_prompt())
    assert isinstance(decoder.cache, StaticQuantKV) and ids == reference
    assert stats.tokens_per_round > 1.2 and stats.accepted < stats.drafted
    if name == "quantized":
        assert stats.compressions_target == ref_stats.compressions_target >= 5
    if params["quant_bits"] == 2:  # 2-bit keys change the tiny model's greedy output: the cache is really quantized
        assert ids != decode_one(target, None, repeated_prompt())[0]


def test_a_quantized_draft_cache_proposes_what_its_single_sequence_cache_proposes(target):
    """The draft model's own cache quantized: on the static form (catch-up in forwards of the widest, each a commit
    point; one-token steps past the last commit's boundary carry the shadow) the draft proposes exactly what it
    proposes on the policy's single-sequence cache: same tokens, same acceptance round by round."""
    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.engine.planner import ConstantK
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.drafters import DraftModel
    from toolkit.speculative.stats import GenerationStats

    from toolkit.kv.rows import SingleRowCache
    from toolkit.speculative.drafters.draft_model import CATCH_UP_CHUNK

    class SingleSequenceDraft(DraftModel):
        def start(self, rows, capacity, widest, gen, tree=None):
            super().start(rows, capacity, widest, gen, tree)
            self.cache, self._chunk = SingleRowCache(self.policy, self.model), CATCH_UP_CHUNK  # the policy's own

    policy = make_policy(KVSpec("quantized", QUANT | {"quant_bits": 2}))
    draft_model = perturbed_copy(target, scale=0.05)
    runs = []
    for make in (DraftModel, SingleSequenceDraft):
        drafter = make(draft_model, policy)
        stats = GenerationStats()
        decoder = SpeculativeDecoder(target, drafter, ConstantK(4), policy)
        gen = GenerationSpec(max_new_tokens=40, ignore_eos=True)
        ids = [t for chunk in decoder.decode(repeated_prompt(), gen, stats) for t in chunk]
        runs.append((ids, stats.accepted, stats.drafted, stats.rounds, stats.compressions_draft))
        assert isinstance(drafter.cache, StaticQuantKV) == (make is DraftModel)
    assert runs[0] == runs[1] and runs[0][1] > 0 and runs[0][4] >= 5


@pytest.mark.parametrize("name,params", [pytest.param("quantized", QUANT | {"quant_bits": 2}, marks=pytest.mark.heavy),
                                         ("streaming", STREAMING)],  # standalone ~10 s; test_static_stream's
                         ids=["standalone", "streaming"])            # quantized case compiles KIVI alone too
def test_compiled_forwards_equal_eager(target, name, params):
    """Dynamo traces the forwards (dequantization and the shadow inside the graph): CPU's dynamic widths, spans and
    packed groups (standalone) and CUDA's buckets (the ring) give the eager tokens."""
    from toolkit.engine.forward import TargetForward

    policy = make_policy(KVSpec(name, params))
    reference = decode_one(target, policy, repeated_prompt(), new=24)[0]
    torch._dynamo.reset()
    forward = TargetForward(target, compile=True, backend="eager", buckets=name == "streaming")
    assert decode_one(target, policy, repeated_prompt(), forward=forward, new=24)[0] == reference
    assert forward.compile_s  # the forwards ran compiled
    torch._dynamo.reset()


def test_buffers_are_allocated_once_with_exact_bytes():
    """kv_bytes is what is allocated (packed codes, float16 scales and zero points, fp sinks + residual), whatever
    the row holds; needed_bytes is what the row holds; prompts and forwards past the room, and groups that do not
    divide the head size, are refused."""
    model = tiny_llama(seed=0, **INIT)  # 2 layers, 2 KV heads of 16 dims, fp32
    policy = make_policy(KVSpec("quantized", QUANT | {"quant_bits": 4}))
    cache = StaticQuantKV(model, 1, 256, 5, policy)
    # (256 - 2 sinks) // 8 = 31 groups, rounded up to 64 tokens (8 groups): 32, and one step more allocated
    assert (cache.groups, cache.fp_slots, cache.shadow_slots) == (32, 2 + 7 + 5, 8)
    heads, dim = 2, 16
    packed_group = 2 * heads * dim * 8 * 4 // 8 + heads * dim * 2 * 2 + heads * 8 * (dim // 8) * 2 * 2
    fp = 2 * heads * (2 + 7 + 5) * dim * 4
    assert cache.kv_bytes() == 2 * (packed_group * 40 + fp)
    prefilled, kwargs = cache.begin_row(30)
    with torch.no_grad(), attached(model, STATIC_NAME):
        hf_forward(model, input_ids=torch.arange(1, 31).view(1, -1), **kwargs)
    cache.add_row(prefilled, 30)  # boundary(30) = 2 + 8 * min(3, ceil(22 / 8)) = 26: three groups packed
    assert cache.quantized_held == [24] and cache.held == [30] and cache.compressions == 1
    assert cache.needed_bytes() == 2 * (3 * packed_group + 2 * heads * dim * 4 * (2 + 4))
    with pytest.raises(ValueError, match="cannot take 9 more tokens before a commit point"):
        cache.prepare(9)
    with pytest.raises(ValueError, match="no room in capacity 256"):
        cache.load_row(0, prefilled, 252)
    with pytest.raises(ConfigError, match="must divide head_dim=16"):
        StaticQuantKV(model, 1, 256, 5, make_policy(KVSpec("quantized", QUANT | {"quant_group_size": 32})))

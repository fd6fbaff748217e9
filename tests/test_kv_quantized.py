"""KIVI quantized KV cache: packing, layout, exact bytes, exact rollback, config errors, spec == AR, for chains and
for token trees (target and draft caches quantized, standalone and composed with StreamingLLM; trees on the static
form)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_forward, perturbed_copy, tiny_llama, tiny_neox

from toolkit.errors import ConfigError
from toolkit.kv import make_policy
from toolkit.kv.contract import new_cache
from toolkit.kv.quant_pack import dequantize, quantize
from toolkit.kv.quantized import QuantizedKVCache, QuantizedLayer
from toolkit.kv.static_quant import StaticQuantKV
from toolkit.recipe import GenerationSpec, KVSpec, Recipe
from toolkit.session import plan
from toolkit.engine.planner import ConstantK
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.speculative.drafters import DraftModel, NGramDrafter
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.tree import TreeShape

HEADS, DIM, LAYERS = 2, 16, 2  # tiny_llama: 2 KV heads of head_dim 16, 2 layers


def policy(name="quantized", **params):
    return make_policy(KVSpec(name, params))


def token_kv(position: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic (key, value) ``(1, HEADS, 1, DIM)`` per layer, a function of the position."""
    gen = torch.Generator().manual_seed(position)
    return [(torch.randn(1, HEADS, 1, DIM, generator=gen) * (1 + position % 5),
             torch.randn(1, HEADS, 1, DIM, generator=gen)) for _ in range(LAYERS)]


def append(cache, start: int, count: int) -> None:
    for p in range(start, start + count):
        cache.forward_kwargs(torch.tensor([[p]]))
        for layer, (k, v) in enumerate(token_kv(p)):
            cache.update(k, v, layer)


def state(cache) -> dict:
    return {"len": cache.get_seq_length(), "held": cache.physical_length(), "bytes": cache.kv_bytes(),
            "tensors": [t.clone() for layer in cache.layers for t in layer.tensors()]}


# ---------------------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip_error_is_at_most_half_a_step(bits):
    x = torch.randn(2, 3, 7, 64) * 3
    packed = quantize(x, bits, 16)
    assert packed.data.dtype == torch.uint8 and packed.data.shape == (2, 3, 7, 64 * bits // 8)
    assert packed.scale.shape == packed.zero.shape == (2, 3, 7, 4)
    assert packed.nbytes() == 2 * 3 * 7 * (64 * bits // 8 + 4 * 2 * 2)  # codes + fp16 scale + fp16 zero
    err = (dequantize(packed) - x).abs().view(2, 3, 7, 4, 16)
    step = packed.scale.float().unsqueeze(-1)
    assert bool((err <= step / 2 + 1e-3 * step + 1e-3).all())
    assert float(err.max()) > 0  # it is lossy: the test can fail if nothing is quantized


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_is_planar_within_a_group(bits):
    """Byte j of a group of G codes holds codes j, j + G*bits/8, ... in rising bit fields (quant_pack's layout)."""
    group, levels = 16, (1 << bits) - 1
    codes = torch.arange(32) % (levels + 1)  # two groups of 16 known codes: 0..levels repeating
    x = codes.float().view(1, 32)
    x[0, 0], x[0, 16] = 0.0, float(levels)  # every group spans [0, levels]: the step is exactly 1
    x[0, 15], x[0, 31] = float(levels), 0.0
    packed = quantize(x, bits, group)
    assert torch.equal(packed.scale.float(), torch.ones(1, 2)) and torch.equal(packed.zero.float(), torch.zeros(1, 2))
    stored = x.round().long().view(2, 8 // bits, group * bits // 8)  # per group: the planes, byte j down each
    expect = sum(stored[:, i] << (i * bits) for i in range(8 // bits)).flatten()
    assert packed.data.flatten().tolist() == expect.tolist()
    assert torch.equal(dequantize(packed), x)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_folded_matmul_equals_the_matmul_of_the_dequantized_tensor(bits):
    """Scales folded into the other operand, codes unpacked plane by plane: keys (groups along the tokens) and
    values (groups along the channels), exact to fp64 rounding; float32 at least for a bf16 operand."""
    from toolkit.kv.quant_attention import folded_matmul

    torch.manual_seed(bits)
    keys = quantize(torch.randn(2, 3, 40, 16).transpose(-1, -2), bits, 8)  # (B, h, head_dim 16, 40 tokens)
    values = quantize(torch.randn(2, 3, 40, 16), bits, 8)  # (B, h, 40 tokens, head_dim 16)
    for packed, reduced in ((keys, 16), (values, 40)):
        a = torch.randn(2, 3, 5, reduced, dtype=torch.float64)
        got = folded_matmul(a, packed)
        assert got.dtype == torch.float64 and got.shape == (2, 3, 5, packed.length if reduced == 16 else 16)
        assert torch.allclose(got, a @ dequantize(packed, torch.float64), rtol=0, atol=1e-12)
        assert folded_matmul(a.to(torch.bfloat16), packed).dtype == torch.float32


@pytest.mark.parametrize("width,dtype,compiled", [(1, torch.float32, False), (5, torch.float32, False),
                                                  (3, torch.bfloat16, False), (1, torch.float32, True),
                                                  (5, torch.float32, True)])
def test_quant_keys_attend_equals_sdpa_over_the_concatenated_parts(width, dtype, compiled):
    """QuantKeys (part by part, one softmax) computes what SDPA computes over [dequantized groups | fp parts];
    compiled (dynamo traces it), a one-token forward folds the scales instead of dequantizing (width 1) and wider
    ones dequantize (width 5)."""
    from toolkit.kv.quant_attention import QuantKeys

    torch.manual_seed(0)
    rows, kv_heads, q_heads, dim, packed = 2, 2, 6, 16, 64
    qk = quantize(torch.randn(rows, kv_heads, packed, dim).transpose(-1, -2), 4, 16)
    qv = quantize(torch.randn(rows, kv_heads, packed, dim), 4, 16)
    keys = [torch.randn(rows, kv_heads, n, dim) for n in (7, 16)]
    values = [torch.randn(rows, kv_heads, n, dim) for n in (7, 16)]
    mask = torch.rand(rows, 1, width, packed + 23) < 0.7
    mask[..., packed] = True  # every query sees a key
    query = torch.randn(rows, q_heads, width, dim).to(dtype)
    attend = lambda q: QuantKeys(qk, qv, keys, values, mask).attend(q, 0.3)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(attend, backend="eager", fullgraph=True)
    got = attend(query)
    k = torch.cat([dequantize(qk).transpose(-1, -2)] + keys, -2)
    v = torch.cat([dequantize(qv)] + values, -2)
    want = torch.nn.functional.scaled_dot_product_attention(query.float(), k, v, attn_mask=mask, scale=0.3,
                                                            enable_gqa=True)
    assert got.shape == (rows, q_heads, width, dim) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    assert float((got.float() - want).abs().max()) < tolerance


def test_pack_rejects_bad_bits_and_groups():
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.zeros(4, 16), 3, 8)
    with pytest.raises(ValueError, match="multiple of group"):
        quantize(torch.zeros(4, 12), 4, 8)


# ---------------------------------------------------------------------------------------------------- layout
def test_kivi_layout_keys_per_channel_values_per_token_and_exact_bytes():
    cache = new_cache(policy(quant_bits=4, quant_group_size=8, residual_length=10, sink_tokens=0), tiny_llama())
    append(cache, 0, 30)
    cache.commit()  # boundary(30) = 8 * min(3, ceil(20 / 8) = 3) = 24 -> 24 quantized, 6 residual
    layer: QuantizedLayer = cache.layers[0]
    assert (layer.q_len, layer.residual, cache.physical_length(), cache.get_seq_length()) == (24, 6, 30, 30)
    assert layer.qkeys.scale.shape == (1, HEADS, DIM, 24 // 8)  # per channel, groups of 8 tokens
    assert layer.qvalues.scale.shape == (1, HEADS, 24, DIM // 8)  # per token, groups of 8 channels
    codes = 2 * HEADS * 24 * DIM // 2  # k + v, 4 bits
    meta = HEADS * DIM * 3 * 4 + HEADS * 24 * 2 * 4  # key (scale, zero) per channel-group, value per token-group
    residual = 2 * HEADS * 6 * DIM * 4  # fp32
    assert cache.kv_bytes() == LAYERS * (codes + meta + residual)
    full = torch.cat([token_kv(p)[0][0] for p in range(30)], dim=2)
    keys, _ = layer.update(*token_kv(30)[0])  # what attention reads: dequantized + residual + the new token
    assert keys.shape == (1, HEADS, 31, DIM)
    assert torch.equal(keys[:, :, 24:30], full[:, :, 24:])  # residual exact
    err = (keys[:, :, :24] - full[:, :, :24]).abs()
    assert 0 < float(err.max()) < 0.5 * float(full.abs().max())


def test_quantization_only_at_commit_points():
    cache = new_cache(policy(quant_bits=2, quant_group_size=8, residual_length=8), tiny_llama())  # 4 sinks
    append(cache, 0, 40)
    assert cache.layers[0].q_len == 0 and cache.compressions == 0  # nothing before a commit
    cache.commit()  # boundary(40) = 4 + 8 * min(4, ceil(28 / 8) = 4) = 36
    layer = cache.layers[0]
    assert (layer.sinks, layer.q_len, layer.residual, cache.compressions) == (4, 32, 4, 1)
    full = torch.cat([token_kv(p)[0][0] for p in range(41)], dim=2)
    keys, _ = layer.update(*token_kv(40)[0])
    assert torch.equal(keys[:, :, :4], full[:, :, :4]) and torch.equal(keys[:, :, 36:], full[:, :, 36:])
    fp32_sinks_and_residual = 2 * HEADS * (4 + 5) * DIM * 4
    assert sum(t.nbytes for t in layer.tensors()) == fp32_sinks_and_residual + 2 * HEADS * 32 * DIM // 4 + \
        HEADS * DIM * 4 * 4 + HEADS * 32 * 2 * 4


# ---------------------------------------------------------------------------------------------------- rollback
@pytest.mark.parametrize("name,params", [
    ("quantized", dict(quant_bits=4, quant_group_size=8, residual_length=6, sink_tokens=0)),
    ("quantized", dict(quant_bits=2, quant_group_size=16, residual_length=20)),
    ("streaming", dict(sink_tokens=3, window=24, compress_interval=4, quant_bits=4, quant_group_size=8,
                       residual_length=8)),
])
def test_rollback_is_exact(name, params):
    """Rounds of append K+1 / crop(-rejected) / commit equal a cache that only ever saw the accepted tokens."""
    model = tiny_llama()
    seen, clean = new_cache(policy(name, **params), model), new_cache(policy(name, **params), model)
    for cache in (seen, clean):
        append(cache, 0, 10)
        cache.commit()
    pos, rng = 10, torch.Generator().manual_seed(0)
    for _ in range(40):
        k = 4
        accepted = int(torch.randint(0, k + 1, (1,), generator=rng))
        append(seen, pos, k + 1)
        seen.crop(accepted - k)
        append(clean, pos, accepted + 1)
        pos += accepted + 1
        seen.commit()
        clean.commit()
        a, b = state(seen), state(clean)
        assert (a["len"], a["held"], a["bytes"]) == (b["len"], b["held"], b["bytes"]) and a["len"] == pos
        assert len(a["tensors"]) == len(b["tensors"])
        assert all(torch.equal(x, y) for x, y in zip(a["tensors"], b["tensors"]))
    assert seen.compressions >= 5 and seen.layers[0].q_len > 0


def test_crop_past_commit_point_raises():
    cache = new_cache(policy(quant_bits=4, quant_group_size=8, residual_length=8), tiny_llama())
    append(cache, 0, 20)
    cache.commit()
    append(cache, 20, 3)
    with pytest.raises(ValueError, match="since the last commit"):
        cache.crop(-4)
    cache.crop(-3)
    assert cache.get_seq_length() == 20


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("params,field", [
    (dict(quant_bits=3), "kv.quant_bits"),
    (dict(quant_bits=16), "kv.quant_bits"),
    (dict(quant_group_size=0), "kv.quant_group_size"),
    (dict(quant_bits=2, quant_group_size=2), "kv.quant_group_size"),
    (dict(residual_length=0), "kv.residual_length"),
    (dict(sink_tokens=-1), "kv.sink_tokens"),
])
def test_bad_fields_name_the_field(params, field):
    with pytest.raises(ConfigError) as exc:
        make_policy(KVSpec("quantized", params))
    assert exc.value.field == field


def test_group_must_divide_head_dim():
    with pytest.raises(ConfigError) as exc:
        policy(quant_group_size=12).make_cache(tiny_llama())  # head_dim 16
    assert exc.value.field == "kv.quant_group_size" and 8 in exc.value.allowed and 16 in exc.value.allowed


@pytest.mark.parametrize("section", ["kv", "draft_kv"])
def test_residual_must_hold_a_verify_forward(section):
    kv = {"policy": "quantized", "quant_bits": 4, "residual_length": 4}
    base = {"target": {"source": "embedded"}, "spec": {"drafter": "draft_model", "num_draft_tokens": 4}}
    with pytest.raises(ConfigError) as exc:
        plan(Recipe.from_dict({**base, section: kv}))  # a cross-section check: made when the recipe is planned
    assert exc.value.field == f"{section}.residual_length" and "5" in str(exc.value)
    plan(Recipe.from_dict({**base, section: {**kv, "residual_length": 5}}))  # K + 1 is enough


def test_composition_errors():
    with pytest.raises(ConfigError) as exc:
        make_policy(KVSpec("l2norm", {"keep_ratio": 0.5, "quant_bits": 4}))
    assert exc.value.field == "kv.quant_bits" and "streaming" in exc.value.allowed
    with pytest.raises(ConfigError) as exc:
        make_policy(KVSpec("streaming", {"window": 64, "quant_bits": 4, "position_mode": "reindex"}))
    assert exc.value.field == "kv.position_mode"
    with pytest.raises(ConfigError) as exc:
        make_policy(KVSpec("streaming", {"window": 64, "quant_bits": 4, "residual_length": 128}), "draft_kv")
    assert exc.value.field == "draft_kv.residual_length"
    composed = make_policy(KVSpec("streaming", {"window": 64, "quant_bits": 2, "residual_length": 32}))
    assert composed.describe()["policy"] == "streaming" and composed.describe()["quant_bits"] == 2


# ---------------------------------------------------------------------------------------------------- decoding
def run(model, drafter, pol, prompt, new_tokens, k=3, tree=None, single=False):
    """``(new ids, stats, the target's cache as the last round left it)``: the static form, or (``single``, chains)
    the policy's single-sequence cache."""
    from toolkit.kv.rows import SingleRowCache

    stats = GenerationStats()
    decoder = SpeculativeDecoder(model, drafter, ConstantK(k), pol, tree=tree)
    if single:  # the policy's single-sequence cache instead of its static form
        decoder._new_cache = lambda prompts, gen: SingleRowCache(pol, model)
    ids, cache = [], None
    for chunk in decoder.decode(prompt, GenerationSpec(max_new_tokens=new_tokens, ignore_eos=True), stats):
        ids += chunk
        cache = getattr(decoder.cache, "cache", decoder.cache)
    return ids, stats, cache


QUANT_POLICIES = [
    ("quantized", dict(quant_bits=2, quant_group_size=8, residual_length=12, sink_tokens=0)),
    ("quantized", dict(quant_bits=4, quant_group_size=16, residual_length=4, sink_tokens=3)),  # R < G, R = K + 1
    ("streaming", dict(sink_tokens=4, window=24, compress_interval=4, quant_bits=2, quant_group_size=8,
                       residual_length=8)),
]


@pytest.mark.slow
@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
@pytest.mark.parametrize("name,params", QUANT_POLICIES)
def test_speculative_equals_ar_under_quantized_cache(make, name, params):
    target = make()
    prompt = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    ar, ar_stats, _ = run(target, None, policy(name, **params), prompt, 90)
    draft = DraftModel(perturbed_copy(target, scale=0.3), policy(name, **params))  # quantized draft cache too
    spec, stats, cache = run(target, draft, policy(name, **params), prompt, 90)
    assert spec == ar
    assert 1.0 < stats.tokens_per_round  # drafts were accepted: K+1 verify forwards straddled boundaries
    assert stats.compressions_target >= 3 and stats.compressions_draft >= 3 and ar_stats.compressions_target >= 3
    plain, _, _ = run(target, None, None, prompt, 90)
    assert plain != ar or params["quant_bits"] > 2  # 2-bit keys change a random model's greedy output
    assert isinstance(cache, StaticQuantKV)  # the static form (toolkit/kv/static_quant.py)
    if name == "streaming":  # a ring of packed groups: the same bytes whatever the request's length
        assert cache.kv_bytes() == StaticQuantKV(target, 1, 4096, cache.widest, policy(name, **params)).kv_bytes()


TREE_POLICIES = [
    ("quantized", dict(quant_bits=2, quant_group_size=8, residual_length=12, sink_tokens=0)),
    ("quantized", dict(quant_bits=4, quant_group_size=4, residual_length=6, sink_tokens=3)),  # R = depth + G - 2
    ("streaming", dict(sink_tokens=4, window=24, compress_interval=4, quant_bits=2, quant_group_size=8,
                       residual_length=12)),
]


@pytest.mark.slow
@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
@pytest.mark.parametrize("name,params", TREE_POLICIES)
def test_tree_speculation_equals_ar_under_quantized_cache(make, name, params):
    """EAGLE-2 dynamic trees of a draft model (its cache quantized too) reproduce AR under the same policy exactly:
    tree verify forwards straddle quantization boundaries (the root in the shadow), with acceptances, rejections
    and many compressions, standalone and composed with StreamingLLM."""
    target = make()
    prompt = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    shape = TreeShape(budget=8, depth=4, topk=2)
    policy(name, **params).check_tree(shape.depth)  # what the plan checks
    ar, _, _ = run(target, None, policy(name, **params), prompt, 90)
    draft = DraftModel(perturbed_copy(target, scale=0.3), policy(name, **params))
    spec, stats, cache = run(target, draft, policy(name, **params), prompt, 90, tree=shape)
    assert spec == ar and isinstance(cache, StaticQuantKV) and isinstance(draft.cache, StaticQuantKV)
    assert stats.rounds >= 2 and 0 < stats.accepted < stats.drafted
    assert stats.compressions_target >= 3 and stats.compressions_draft >= 3


def test_tree_bound_keeps_every_tree_node_out_of_quantization_groups():
    """check_quant_tree, exhaustively for small sizes: it accepts (depth, residual_length, group, sinks) exactly when
    for every root position r the deepest query's boundary(r + depth) stays at most r + 1 (or in the sinks)."""
    model = tiny_llama()
    for sinks in (0, 3):
        for group in (1, 2, 4, 8):
            for residual in range(1, 22):
                pol = policy(quant_bits=8, quant_group_size=group, residual_length=residual, sink_tokens=sinks)
                cache = pol.make_cache(model)
                for depth in range(1, 8):
                    exact = all(cache.boundary(r + depth) <= max(r + 1, sinks) for r in range(160))
                    try:
                        pol.check_tree(depth)
                        accepted = True
                    except ConfigError as exc:
                        assert exc.field == "kv.residual_length"
                        accepted = False
                    assert accepted == exact, (sinks, group, residual, depth)


def test_shadow_mask_gives_each_query_its_autoregressive_view():
    """After the prompt (one forward at full precision, as KIVI prefills), one forward over many positions == the
    same positions fed one at a time with a commit after each."""
    model = tiny_llama()
    pol = policy(quant_bits=2, quant_group_size=8, residual_length=8)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(5))
    cache = new_cache(pol, model)
    hf_forward(model, input_ids=ids[:, :20], past_key_values=cache, **cache.forward_kwargs(torch.arange(20)[None]))
    cache.commit()
    logits_one = [None] * 20
    for p in range(20, 60):
        out = hf_forward(model, input_ids=ids[:, p:p + 1], past_key_values=cache,
                    **cache.forward_kwargs(torch.tensor([[p]])))
        logits_one.append(out.logits[0, -1])
        cache.commit()
    cache = new_cache(pol, model)
    hf_forward(model, input_ids=ids[:, :20], past_key_values=cache, **cache.forward_kwargs(torch.arange(20)[None]))
    cache.commit()
    out = hf_forward(model, input_ids=ids[:, 20:60], past_key_values=cache, **cache.forward_kwargs(torch.arange(20, 60)[None]))
    torch.testing.assert_close(out.logits[0], torch.stack(logits_one[20:]), atol=1e-4, rtol=1e-4)
    assert isinstance(cache, QuantizedKVCache) and cache._shadow == (0, 0)


@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
def test_same_cache_in_hf_generate(make):
    """model.generate(past_key_values=cache) quantizes too (auto-commit) and matches the toolkit's AR loop."""
    model = make()
    params = dict(quant_bits=4, quant_group_size=8, residual_length=8)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))  # prompt < residual
    cache = policy(**params).make_cache(model)
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=60, min_new_tokens=60, do_sample=False)
    assert cache.compressions >= 3 and cache.layers[0].q_len >= 48
    ours, _, _ = run(model, None, policy(**params), prompt, 60, k=1)
    assert out[0, 6:].tolist() == ours


def test_8bit_is_close_to_full_precision():
    """Held-out PPL through the cache: 8-bit within 1% of uncompressed on a tiny model, 2-bit measurably worse."""
    from eval.metrics import perplexity_through_cache

    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(7)).tolist()
    base = perplexity_through_cache(model, ids, None)["value"]
    q8 = perplexity_through_cache(model, ids, policy(quant_bits=8, quant_group_size=8, residual_length=8))
    q2 = perplexity_through_cache(model, ids, policy(quant_bits=2, quant_group_size=8, residual_length=8))
    assert abs(q8["value"] / base - 1) < 0.01
    assert q2["value"] != q8["value"] and q8["peak_kv_bytes"] < 200 * 2 * 2 * HEADS * DIM * 4 * 0.5


@pytest.mark.slow
@pytest.mark.heavy  # ~8 s each on the embedded model; the tiny-model tests above prove the same path
@pytest.mark.parametrize("bits", [4, 2])
def test_speculative_equals_ar_on_embedded(embedded, bits):
    model, tokenizer = embedded
    text = open("/usr/share/common-licenses/Apache-2.0").read()[:1500]
    prompt = tokenizer(text, return_tensors="pt").input_ids
    pol = lambda: policy(quant_bits=bits, quant_group_size=64, residual_length=32)  # noqa: E731
    # AR on the single-sequence cache, speculation on the static form: a 298-token prompt, a group quantized while
    # decoding too
    ar, _, _ = run(model, None, pol(), prompt, 48, single=True)
    spec, stats, cache = run(model, NGramDrafter(3, 1), pol(), prompt, 48, k=4)
    assert isinstance(cache, StaticQuantKV) and stats.compressions_target >= 2  # the prefill's and a decode's
    assert spec == ar


@pytest.mark.parametrize("name", ["memory-kvquant", "quantspec"])
def test_shipped_quantized_recipes_validate(name):
    from pathlib import Path

    recipe = Recipe.load(Path(__file__).resolve().parents[1] / "recipes" / f"{name}.yaml")
    section = recipe.kv if name == "memory-kvquant" else recipe.draft_kv
    built = make_policy(section)
    assert built.quant_bits == 4 and built.residual_length >= recipe.spec.num_draft_tokens + 1
    assert isinstance(built.make_cache(tiny_llama(head_dim=64)), QuantizedKVCache)

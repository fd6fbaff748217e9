"""Cache invariants of the compressed KV caches: lengths, kept entries, bytes, exact rollback, HF generate."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_neox

from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.planner import ConstantK
from toolkit.kv import contract, make_policy
from toolkit.kv.rows import SingleRowCache
from toolkit.kv.static import SPAN_STEP, StaticKV
from toolkit.recipe import GenerationSpec, KVSpec
from toolkit.speculative.stats import GenerationStats

HEADS, DIM = 2, 16  # tiny_llama: 2 KV heads of head_dim 16, 2 layers


def policy(name, **params):
    return make_policy(KVSpec(name, params))


def new_cache(name, model=None, **params):
    """A cache as the decoder makes it (explicit commit points, no auto-commit)."""
    return contract.new_cache(policy(name, **params), model if model is not None else tiny_llama())


def token_kv(position: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic (key, value) of one token per layer, ``(1, HEADS, 1, DIM)``, a function of its position."""
    gen = torch.Generator().manual_seed(position)
    return [(torch.randn(1, HEADS, 1, DIM, generator=gen) * (1 + position % 7),
             torch.randn(1, HEADS, 1, DIM, generator=gen)) for _ in range(layers)]


def append(cache, start: int, count: int) -> None:
    for p in range(start, start + count):
        for layer, (k, v) in enumerate(token_kv(p)):
            cache.update(k, v, layer)


def snapshot(cache, position: int) -> dict:
    tensors = [t.clone() for layer in cache.layers for t in (getattr(layer, "tensors", None) or
                                                              (lambda la=layer: [la.keys, la.values]))()]
    kwargs = cache.forward_kwargs(torch.tensor([[position]]))
    return {"len": cache.get_seq_length(), "held": cache.physical_length(), "tensors": tensors,
            "pos": kwargs["position_ids"], "mask": kwargs["attention_mask"], "bytes": cache.kv_bytes()}


POLICIES = [
    ("streaming", dict(sink_tokens=4, window=20, compress_interval=4)),
    ("streaming", dict(sink_tokens=4, window=20, compress_interval=4, position_mode="reindex")),
    ("l2norm", dict(budget=16, protect_recent=4, skip_layers=[], compress_interval=4)),
    ("l2norm", dict(keep_ratio=0.5, protect_recent=4, skip_layers=[1], compress_interval=3)),
    ("head_aware", dict(budget=16, protect_recent=4, skip_layers=[], compress_interval=4,
                        importance=[[1.0, 0.0], [0.3, 0.8]])),
]


@pytest.mark.parametrize("name,params", POLICIES)
def test_rollback_is_exact(name, params):
    """Rounds of append K+1 / crop(-rejected) / commit equal a cache that only ever saw the accepted tokens."""
    model = tiny_llama()
    seen, clean = new_cache(name, model, **params), new_cache(name, model, **params)
    for cache in (seen, clean):
        append(cache, 0, 10)
        cache.commit()
    pos, rng = 10, torch.Generator().manual_seed(0)
    for _ in range(30):
        k = 4
        accepted = int(torch.randint(0, k + 1, (1,), generator=rng))
        append(seen, pos, k + 1)
        assert seen.get_seq_length() == pos + k + 1
        seen.crop(accepted - k)
        append(clean, pos, accepted + 1)
        pos += accepted + 1
        for cache in (seen, clean):
            assert cache.get_seq_length() == pos
            cache.commit()
        a, b = snapshot(seen, pos), snapshot(clean, pos)
        assert (a["len"], a["held"], a["bytes"]) == (b["len"], b["held"], b["bytes"])
        assert all(torch.equal(x, y) for x, y in zip(a["tensors"], b["tensors"]))
        assert torch.equal(a["pos"], b["pos"])
        assert (a["mask"] is None) == (b["mask"] is None) and (a["mask"] is None or torch.equal(a["mask"], b["mask"]))
    assert seen.compressions >= 3


def test_crop_past_commit_point_raises():
    cache = new_cache("streaming", sink_tokens=2, window=8, compress_interval=2)
    append(cache, 0, 5)
    cache.commit()
    append(cache, 5, 3)
    with pytest.raises(ValueError, match="since the last commit"):
        cache.crop(-4)
    cache.crop(-3)
    assert cache.get_seq_length() == 5


def test_streaming_lengths_and_bytes():
    cache = new_cache("streaming", sink_tokens=4, window=20, compress_interval=4)
    append(cache, 0, 28)
    cache.commit()  # 28 <= 24 + 4: nothing yet
    assert (cache.physical_length(), cache.compressions) == (28, 0)
    append(cache, 28, 1)
    cache.commit()  # 29 > 24 + 4: evict down to 24
    assert (cache.get_seq_length(), cache.physical_length(), cache.compressions) == (29, 24, 1)
    assert cache.kv_bytes() == 2 * 2 * HEADS * 24 * DIM * 4  # layers * (k, v) * heads * tokens * dim * fp32
    keys = cache.layers[0].keys
    expected = torch.cat([token_kv(p)[0][0] for p in [*range(4), *range(9, 29)]], dim=2)
    assert torch.equal(keys, expected)  # sinks + the 20 most recent, in order
    append(cache, 29, 4)
    cache.commit()  # 28 <= 24 + 4: no compression yet
    assert (cache.physical_length(), cache.compressions) == (28, 1)
    append(cache, 33, 3)
    cache.crop(-2)
    assert (cache.get_seq_length(), cache.physical_length()) == (34, 29)


def test_l2norm_keeps_lowest_norm_keys():
    """After compression each head holds sinks + recent + the lowest-norm keys of the rest, nothing else."""
    cache = new_cache("l2norm", budget=14, sink_tokens=2, protect_recent=3, skip_layers=[0], compress_interval=2)
    append(cache, 0, 40)
    cache.commit()
    assert (cache.physical_length(0), cache.physical_length(1)) == (40, 14)  # layer 0 skipped
    full = torch.cat([token_kv(p)[1][0] for p in range(40)], dim=2)  # layer 1 keys (1, H, 40, D)
    norms = full.float().norm(dim=-1)[0]
    kept = cache.layers[1].keys[0]
    for h in range(HEADS):
        middle = torch.arange(2, 37)
        best = middle[norms[h, middle].argsort()[:14 - 5]]
        expected = torch.cat([torch.arange(2), best.sort().values, torch.arange(37, 40)])
        assert torch.equal(kept[h], full[0, h, expected])
    full_bytes = 2 * HEADS * 40 * DIM * 4
    assert cache.kv_bytes() == full_bytes + full_bytes * 14 // 40


def test_head_aware_tiers_shrink_memory():
    """Per-head budgets live in separate dense tensors: bytes are the sum of the tier budgets, mean = budget."""
    cache = new_cache("head_aware", budget=20, sink_tokens=2, protect_recent=2, skip_layers=[], compress_interval=2,
                      tiers=2, importance=[[1.0, 0.0], [0.9, 0.1]])
    append(cache, 0, 60)
    cache.commit()
    layer = cache.layers[0]
    lengths = sorted(k.shape[-2] for k in layer.tier_keys)
    assert len(layer.tier_keys) == 2 and lengths[0] < 20 < lengths[1]
    assert sum(lengths) == 2 * 20  # one head per tier: mean budget 20
    assert cache.kv_bytes() == 2 * 2 * sum(lengths) * DIM * 4
    important = layer.groups[[k.shape[-2] for k in layer.tier_keys].index(lengths[1])]
    assert important.tolist() == [0]  # head 0 has importance 1.0 in layer 0


@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
@pytest.mark.parametrize("name,params", [
    ("streaming", dict(sink_tokens=4, window=16, compress_interval=4, exact_window=False)),
    ("l2norm", dict(budget=16, protect_recent=4, skip_layers=[0], compress_interval=4)),
    ("head_aware", dict(budget=16, protect_recent=4, skip_layers=[0], compress_interval=4, tiers=2)),
])
def test_same_cache_in_hf_generate(make, name, params, tmp_path, monkeypatch):
    """model.generate(past_key_values=cache) compresses too, and matches the toolkit's AR loop token for token."""
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    model = make()
    if name == "head_aware":
        n_kv = model.config.num_key_value_heads if hasattr(model.config, "num_key_value_heads") else 4
        params = dict(params, importance=torch.rand(2, n_kv, generator=torch.Generator().manual_seed(0)).tolist())
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    built = policy(name, **params)
    cache = built.make_cache(model)
    implementation = model.config._attn_implementation
    with built.attached(model):
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=60, min_new_tokens=60, do_sample=False)
    assert model.config._attn_implementation == implementation  # the shared model is left as it was
    assert cache.compressions >= 3 and cache.physical_length(1) < cache.get_seq_length() / 2
    decoder = SpeculativeDecoder(model, None, ConstantK(1), policy(name, **params))
    ours = [t for chunk in decoder.decode(prompt, GenerationSpec(max_new_tokens=60, ignore_eos=True),
                                          GenerationStats()) for t in chunk]
    assert out[0, 8:].tolist() == ours


def test_plain_dynamic_cache_protocol():
    cache = contract.new_cache(None, tiny_llama())
    assert cache.kv_bytes() == 0 and cache.compressions == 0


@pytest.mark.parametrize("name,params", [
    ("streaming", dict(sink_tokens=4, window=28, compress_interval=4)),
    ("l2norm", dict(budget=32, protect_recent=4, skip_layers=[], compress_interval=4)),
])
def test_kv_bytes_stay_bounded_over_4x_budget(name, params):
    """Generating 4x the budget: once reached, bytes return to exactly the budget's after every compression (the
    policy's own cache); StreamingLLM's static ring holds sinks + window + the widest forward from the start."""
    model = tiny_llama()
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    per_token = 2 * 2 * HEADS * DIM * 4  # layers * (k, v) * heads * dim * fp32
    built = policy(name, **params)
    decoder = SpeculativeDecoder(model, None, ConstantK(1), built)
    decoder._new_cache = lambda prompts, gen: SingleRowCache(built, model)  # the policy's own cache
    history = []
    for _ in decoder.decode(prompt, GenerationSpec(max_new_tokens=4 * 32, ignore_eos=True), GenerationStats()):
        history.append((decoder.cache.compressions, decoder.cache.kv_bytes()))
    assert history[-1][0] >= 3
    after = [b for (c, b), (c0, _) in zip(history[1:], history) if c > c0]
    assert after and all(b == 32 * per_token for b in after)
    assert max(b for _, b in history) <= (32 + 4) * per_token
    if name == "streaming":  # the decoder's own choice: the ring, fixed bytes whatever the length
        ring = SpeculativeDecoder(model, None, ConstantK(1), policy(name, **params))
        stats = GenerationStats()
        sizes = {ring.cache.kv_bytes() for _ in ring.decode(prompt, GenerationSpec(max_new_tokens=4 * 32,
                                                                                   ignore_eos=True), stats)}
        assert isinstance(ring.cache, StaticKV) and ring.cache.compressions == 0
        assert sizes == {(4 + 28 + 1 + SPAN_STEP) * per_token}  # sinks + window + one AR token (+ span slack)
        assert stats.peak_kv_bytes_needed_target == (4 + 28 + 1) * per_token  # held: the ring's slots, once wrapped

"""Head-aware policy: calibration storage, tier plan, per-tier attention equals the dense path."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_forward, tiny_llama, tiny_neox

from toolkit.kv import calibration, make_policy
from toolkit.kv.contract import new_cache, policy_attached
from toolkit.recipe import GenerationSpec, KVSpec
from toolkit.engine.planner import ConstantK
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.speculative.stats import GenerationStats


def decode(model, kv: KVSpec, new_tokens=80):
    stats = GenerationStats()
    decoder = SpeculativeDecoder(model, None, ConstantK(1), make_policy(kv))
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    ids = [t for c in decoder.decode(prompt, GenerationSpec(max_new_tokens=new_tokens, ignore_eos=True), stats)
           for t in c]
    return ids, stats, decoder.cache


def test_calibration_is_stored_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    model = tiny_llama()
    importance = calibration.load_or_calibrate(model, num_tokens=256, local_window=16)
    assert importance.shape == (2, 2) and float(importance.max()) == pytest.approx(1.0)
    assert float(importance.min()) >= 0.0
    files = list((tmp_path / "kv-calibration").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["importance"] == importance.tolist()
    monkeypatch.setattr(calibration, "measure_importance", lambda *a, **k: pytest.fail("should read the JSON"))
    assert torch.equal(calibration.load_or_calibrate(model, num_tokens=256, local_window=16), importance)


def test_long_range_mass_separates_local_from_global_heads():
    """A head whose keys are all equal attends uniformly (mass far away); the measure ranks it above others."""
    model = tiny_llama(layers=1)
    with torch.no_grad():
        k_proj = model.model.layers[0].self_attn.k_proj
        k_proj.weight[:16] = 0  # KV head 0: constant (zero) keys -> uniform attention over the past
        k_proj.weight[16:] *= 20  # KV head 1: sharp, content-dependent attention
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    importance = calibration.measure_importance(model, ids, sink_tokens=4, local_window=16)
    assert importance[0, 0] == 1.0 and importance[0, 1] < importance[0, 0]


def test_long_range_mass_builds_its_indices_on_the_query_device():
    """The H100 run of 2026-11-27 stopped the head-aware calibration with 'mask on cpu and self on cuda:0'; tensors on
    the meta device fail the same way when an index is built on the CPU, so this runs without a GPU."""
    query, key = torch.empty(1, 4, 40, 8, device="meta"), torch.empty(1, 2, 40, 8, device="meta")
    out, mass = calibration.long_range_mass(query, key, key, 0.35, sink_tokens=4, local_window=8)
    assert out.device.type == mass.device.type == "meta"
    assert out.shape == (1, 40, 4, 8) and mass.shape == (2,)


@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
def test_one_tier_equals_l2norm(make):
    """With one tier the tiered layout is the L2-norm policy: identical tokens and bytes (per-tier attention ok)."""
    common = {"budget": 24, "protect_recent": 4, "compress_interval": 4, "skip_layers": [0]}
    model = make()
    n_kv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    l2_ids, l2_stats, l2_cache = decode(model, KVSpec("l2norm", common))
    ha_ids, ha_stats, ha_cache = decode(model, KVSpec("head_aware", {**common, "tiers": 1,
                                                                     "importance": [[0.5] * n_kv] * 2}))
    assert l2_stats.compressions_target >= 3
    assert ha_ids == l2_ids and ha_cache.kv_bytes() == l2_cache.kv_bytes()


def test_tiers_before_compression_equal_uncompressed():
    """Before any eviction the per-tier attention reproduces the plain model's logits."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    reference = model(input_ids=ids).logits
    policy = make_policy(KVSpec("head_aware", {"budget": 64, "protect_recent": 4, "skip_layers": [], "tiers": 2,
                                               "importance": [[1.0, 0.0], [0.2, 0.7]]}))
    cache = new_cache(policy, model)
    with policy_attached(policy, model):  # per-tier attention, installed for this block only
        first = hf_forward(model, input_ids=ids[:, :12], past_key_values=cache, **cache.forward_kwargs(torch.arange(12)[None]))
        cache.commit()
        rest = hf_forward(model, input_ids=ids[:, 12:], past_key_values=cache,
                     **cache.forward_kwargs(torch.arange(12, 20)[None]))
    assert model.config._attn_implementation == "sdpa"  # restored
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), reference, atol=1e-5, rtol=1e-5)


def test_head_aware_matches_l2_bytes_at_the_same_ratio():
    common = {"keep_ratio": 0.5, "protect_recent": 4, "compress_interval": 4, "skip_layers": []}
    model = tiny_llama()
    _, _, l2 = decode(model, KVSpec("l2norm", common), 120)
    _, _, ha = decode(model, KVSpec("head_aware", {**common, "tiers": 2, "importance": [[1.0, 0.0], [0.1, 0.6]]}),
                      120)
    _, _, full = decode(model, KVSpec(), 120)  # allocated bytes, the same request uncompressed (the static cache)
    assert full.kv_bytes() == 2 * 2 * 2 * (256 + 64) * 16 * 4  # capacity 256 + the span step, 2 layers x 2 heads
    assert ha.kv_bytes() < 0.5 * full.kv_bytes()
    assert abs(ha.kv_bytes() - l2.kv_bytes()) <= 0.05 * l2.kv_bytes()

"""The compiled static engine: a static KV cache written by position, forwards padded to width buckets and rolled
back exactly, token-identical to HF greedy AR with and without drafts; what it refuses."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed_copy, tiny_llama
from test_decoder import hf_greedy

from toolkit.kv import make_policy
from toolkit.kv.static import StaticKVCache, capacity_for
from toolkit.recipe import GenerationSpec, KVSpec
from toolkit.speculative.adaptive import ConstantK
from toolkit.speculative.compiled import CompiledTarget, supports_static
from toolkit.speculative.cost_model import VerifyCost, measure_verify_cost
from toolkit.speculative.decoder import SpeculativeDecoder
from toolkit.speculative.drafters import DraftModel, LookupDrafter
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.verify_length import Calibrator, CostAwareK

NEW = 20


@pytest.fixture(scope="module")
def setup():
    torch._dynamo.reset()
    target = tiny_llama(seed=0, initializer_range=0.2)
    base = torch.randint(1, 128, (7,), generator=torch.Generator().manual_seed(2))
    prompt = torch.cat([base, base, base[:4]]).view(1, -1)  # repeats: the lookup drafter finds matches
    engine = CompiledTarget(target, widths=(2, 4, 8), backend="eager")  # dynamo traces, no code generation
    yield target, prompt, hf_greedy(target, prompt, NEW), engine
    torch._dynamo.reset()


def run(target, drafter, prompt, engine, controller=None, **gen):
    spec = GenerationSpec(max_new_tokens=NEW, ignore_eos=True, **gen)
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, drafter, controller or ConstantK(3), engine=engine)
    ids = [t for chunk in decoder.decode(prompt, spec, stats) for t in chunk]
    return ids, stats, decoder


@pytest.mark.parametrize("drafter", ["none", "lookup", "draft_model"])
def test_engine_is_token_identical_to_hf_greedy(setup, drafter):
    target, prompt, reference, engine = setup
    make = {"none": lambda: None, "lookup": lambda: LookupDrafter(max_cached_requests=0),
            "draft_model": lambda: DraftModel(perturbed_copy(target, scale=0.1))}[drafter]
    ids, stats, decoder = run(target, make(), prompt, engine, ConstantK(5))
    assert ids == reference
    if drafter != "none":  # drafts were verified through padded buckets
        assert stats.drafted > 0 and (stats.accepted > 0 or drafter == "lookup")
    capacity = capacity_for(prompt.shape[1] + NEW + 8)  # no longer request has run on this engine
    assert isinstance(decoder.cache, StaticKVCache) and decoder.cache.capacity == capacity == engine.capacity
    layers, heads, dim = 2, 2, 16
    assert stats.kv_bytes_target == layers * 2 * heads * capacity * dim * 4  # fp32 key + value buffers, all slots


def test_cost_aware_verify_length_on_the_engine_is_identical_and_reads_a_step_curve(setup):
    target, prompt, reference, engine = setup
    curve = measure_verify_cost(target, max_tokens=8, context=32, repeats=1, engine=engine)
    assert curve.max_tokens == 8 and len(curve.step_ms) == 8 and all(ms > 0 for ms in curve.step_ms)
    cost = CostAwareK(VerifyCost([10.0, 10.0, 12.0, 12.0, 15.0, 15.0, 15.0, 15.0]), Calibrator(), 7, 8)
    ids, _, _ = run(target, LookupDrafter(max_cached_requests=0), prompt, engine, cost)
    assert ids == reference


def test_padding_is_rolled_back_and_appends_exactly_the_query(setup):
    target, prompt, _, engine = setup
    cache = engine.new_cache(64)
    with torch.inference_mode():
        engine.forward(cache, prompt, 0, 1)
        n = prompt.shape[1]
        logits = engine.forward(cache, prompt[:, :3], n, 3)  # 3 tokens run in the width-4 graph
        assert logits.shape == (3, 128)
        assert int(cache.get_seq_length()) == n + 3
        cache.crop(-3)
        assert int(cache.get_seq_length()) == n
        eager = target(input_ids=prompt[:, :3], past_key_values=None, position_ids=torch.arange(3).view(1, -1))
    assert engine.bucket(1) == 2 and engine.bucket(5) == 8
    assert engine.new_cache(600).capacity == 1024 and engine.new_cache(10).capacity == 1024  # capacity only grows
    with pytest.raises(ValueError, match="past the widest"):
        engine.bucket(9)
    assert eager.logits.shape[1] == 3


def test_engine_refuses_kv_policies_trees_and_sliding_windows(setup):
    target, _, _, engine = setup
    policy = make_policy(KVSpec("streaming", {"sink_tokens": 4, "window": 32}))
    with pytest.raises(ValueError, match="uncompressed caches and chains only"):
        SpeculativeDecoder(target, None, ConstantK(1), target_policy=policy, engine=engine)
    windowed = tiny_llama(seed=0)
    windowed.config.layer_types = ["sliding_attention", "full_attention"]
    assert "sliding_attention" in supports_static(windowed)
    with pytest.raises(ValueError, match="compile: the target has layers of type sliding_attention"):
        CompiledTarget(windowed)
    with pytest.raises(ValueError, match="widths"):
        CompiledTarget(target, widths=(4, 2))
    with pytest.raises(ValueError, match="tokens"):
        capacity_for(0)


@pytest.mark.slow
def test_inductor_compiled_engine_matches_hf_greedy():
    """The real compiler (inductor, C++ code generation) on a one-layer model and one bucket."""
    torch._dynamo.reset()
    target = tiny_llama(seed=5, layers=1, initializer_range=0.2)
    prompt = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    engine = CompiledTarget(target, widths=(4,))
    ids, _, _ = run(target, LookupDrafter(max_cached_requests=0), prompt, engine, ConstantK(3))
    assert ids == hf_greedy(target, prompt, NEW)
    assert set(engine.compile_s) == {4}
    torch._dynamo.reset()


def test_inductor_cache_goes_to_the_toolkit_cache_unless_the_user_chose_one(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from toolkit.speculative import compiled

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "toolkit"))
    for before in (None, default_cache_dir()):  # unset, or the default inductor wrote in on its first use
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        compiled._inductor_cache()
        assert compiled.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "toolkit" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    compiled._inductor_cache()
    assert compiled.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")

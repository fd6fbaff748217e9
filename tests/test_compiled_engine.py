"""The compiled static engine (toolkit/engine/forward.py on toolkit/kv/static.py): a static KV cache written by
position, forwards padded to width buckets and rolled back exactly, token-identical to HF greedy AR with and without
drafts; the cache's capacity only grows; what it refuses (forward_for's notes) runs eager."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_forward, perturbed_copy, tiny_llama
from test_decoder import hf_greedy
from transformers import DynamicCache

from toolkit.engine.cost import measure_verify_cost
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.forward import TargetForward, forward_for
from toolkit.engine.planner import ConstantK, CostAwareK
from toolkit.kv import make_policy
from toolkit.kv.rows import SingleRowCache, supports_static
from toolkit.kv.static import StaticKV, capacity_for
from toolkit.recipe import GenerationSpec, KVSpec, Recipe, SpeculationSpec
from toolkit.session import plan
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import DraftModel, LookupDrafter
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.verify_length import Calibrator

NEW = 20


@pytest.fixture(scope="module")
def setup():
    torch._dynamo.reset()
    target = tiny_llama(seed=0, initializer_range=0.2)
    base = torch.randint(1, 128, (7,), generator=torch.Generator().manual_seed(2))
    prompt = torch.cat([base, base, base[:4]]).view(1, -1)  # repeats: the lookup drafter finds matches
    # dynamo traces, no code generation; CUDA's bucketed shapes (padded widths, every slot attended) on the CPU
    engine = TargetForward(target, compile=True, backend="eager", buckets=True)
    yield target, prompt, hf_greedy(target, prompt, NEW), engine
    torch._dynamo.reset()


def run(target, drafter, prompt, engine, controller=None, policy=None, **gen):
    spec = GenerationSpec(max_new_tokens=NEW, ignore_eos=True, **gen)
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, drafter, controller or ConstantK(3), policy, forward=engine)
    ids = [t for chunk in decoder.decode(prompt, spec, stats) for t in chunk]
    return ids, stats, decoder


@pytest.mark.parametrize("drafter", ["none", "lookup", "draft_model"])
def test_engine_is_token_identical_to_hf_greedy(setup, drafter):
    target, prompt, reference, engine = setup
    make = {"none": lambda: None, "lookup": lambda: LookupDrafter(max_cached_requests=0),
            "draft_model": lambda: DraftModel(perturbed_copy(target, scale=0.1))}[drafter]
    ids, stats, decoder = run(target, make(), prompt, engine, ConstantK(5))
    assert ids == reference
    if drafter != "none":  # drafts were verified through padded buckets (6 tokens in the width-8 graph)
        assert stats.drafted > 0 and (stats.accepted > 0 or drafter == "lookup")
    assert all(width in engine.widths for _, width in engine.compile_s)  # only bucket widths were compiled
    capacity = capacity_for(prompt.shape[1] + NEW + 8)  # no longer request has run on this engine
    assert isinstance(decoder.cache, StaticKV) and decoder.cache.capacity == capacity
    assert decoder.cache.static_span  # bucketed shapes attend to every slot: the buffers have no span slack
    layers, heads, dim = 2, 2, 16
    assert stats.kv_bytes_target == layers * 2 * heads * capacity * dim * 4  # fp32 key + value buffers, all slots


def test_cost_aware_verify_length_on_the_engine_is_identical_and_reads_a_step_curve(setup):
    target, prompt, reference, engine = setup
    curve = measure_verify_cost(target, max_tokens=8, context=32, repeats=1, forward=engine)
    assert curve.max_tokens == 8 and len(curve.step_ms) == 8 and all(ms > 0 for ms in curve.step_ms)
    cost = CostAwareK(VerifyCost([10.0, 10.0, 12.0, 12.0, 15.0, 15.0, 15.0, 15.0]), Calibrator(), 7, 8)
    ids, _, _ = run(target, LookupDrafter(max_cached_requests=0), prompt, engine, cost)
    assert ids == reference


def test_padding_is_rolled_back_and_appends_exactly_the_query(setup):
    target, prompt, _, engine = setup
    n = prompt.shape[1]
    cache = StaticKV(target, rows=1, capacity=64, widest=8, static_span=True)
    reference = DynamicCache()
    with torch.inference_mode(), engine.attached():
        prefilled, kwargs = cache.begin_row(n)
        engine.prefill(prompt, kwargs)
        cache.add_row(prefilled, n)
        hf_forward(target, input_ids=prompt, past_key_values=reference, use_cache=True)
        logits = engine(cache, prompt[:, :3])  # 3 tokens run in the width-4 graph
        assert logits.shape == (1, 3, 128)
        eager = hf_forward(target, input_ids=prompt[:, :3], past_key_values=reference, use_cache=True).logits
        torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)  # the padding changed nothing
        cache.accept(torch.tensor([1]), [1])  # keep 1 of the 3: the rest and the padding are never read again
        reference.crop(-2)
        assert cache.held == [n + 1] and cache.lengths.tolist() == [n + 1]
        logits = engine(cache, prompt[:, 5:10])  # 5 tokens in the width-8 graph, over the rolled-back slots
        eager = hf_forward(target, input_ids=prompt[:, 5:10], past_key_values=reference, use_cache=True).logits
        torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)
        cache.accept(torch.tensor([5]), [5])
        assert cache.held == [n + 6] == [reference.get_seq_length()]
    assert (1, 4) in engine.compile_s and (1, 8) in engine.compile_s
    assert engine.width_for(1) == 1 and engine.width_for(3) == 4 and engine.width_for(5) == 8
    with pytest.raises(ValueError, match="past the largest bucket"):
        engine.width_for(engine.widths[-1] + 1)


def test_the_static_cache_is_reused_and_its_capacity_only_grows(setup):
    target, _, _, _ = setup
    engine = TargetForward(target, compile=True, backend="eager", buckets=True)
    big = engine.cache_for(None, 1, capacity_for(600), 8)
    assert big.capacity == 768
    small = engine.cache_for(None, 1, capacity_for(10), 8)
    assert small is big and small.capacity == 768  # a shorter request reuses the buffers (fixed addresses)
    assert engine.cache_for(None, 1, capacity_for(900), 8).capacity == 1024
    with pytest.raises(ValueError, match="tokens"):
        capacity_for(0)


def test_what_the_static_cache_does_not_hold_runs_eager(setup):
    """forward_for compiles only where the static cache holds the recipe (every KV policy has a static form; token
    trees too, within the widest CUDA graph bucket; layers the static cache holds, full-attention ones under a policy);
    elsewhere it names why and the decoder runs eager on the policy's cache."""
    target = setup[0]
    base = Recipe.from_dict({"name": "compiled", "target": {"device": "cpu"}, "draft": None, "compile": "on",
                             "spec": {"drafter": "lookup", "num_draft_tokens": 4},
                             "generation": {"max_new_tokens": NEW, "ignore_eos": True}})

    def engine(recipe, model=target) -> tuple[bool, str]:
        forward, why = forward_for(recipe, model, plan(recipe))
        return forward.compiled, why

    def kv(params: dict) -> Recipe:
        return base.replace(kv=KVSpec.from_dict(params, "kv"))

    assert engine(base)[0] and "compiled static engine" in engine(base)[1]
    assert engine(kv({"policy": "streaming", "sink_tokens": 4, "window": 32}))[0]  # the ring
    for mode in ({"position_mode": "reindex"}, {"exact_window": False}):  # buffers compacted at commit points
        assert engine(kv({"policy": "streaming", "sink_tokens": 4, "window": 32, **mode}))[0]
    assert engine(kv({"policy": "l2norm", "budget": 16, "sink_tokens": 2, "protect_recent": 4}))[0]  # static tiers
    assert engine(kv({"policy": "quantized", "quant_bits": 4, "quant_group_size": 16}))[0]  # packed groups
    for exact in (True, False):  # a ring of packed groups: the window's, or those not evicted
        assert engine(kv({"policy": "streaming", "sink_tokens": 4, "window": 32, "quant_bits": 4,
                          "quant_group_size": 16, "residual_length": 8, "exact_window": exact}))[0]
    assert engine(base.replace(spec=SpeculationSpec(drafter="suffix", tree=True)))[0]  # trees on the static engine
    wide = base.replace(spec=SpeculationSpec(drafter="suffix", tree=True, tree_budget=100))
    with pytest.MonkeyPatch.context() as patch:  # a 101-token tree verify is past the widest CUDA graph (64 tokens)
        patch.setattr("toolkit.engine.forward.bucketed", lambda device: True)  # CUDA's bucketed shapes, on the CPU
        forward, why = forward_for(wide, target, plan(wide))
    assert not forward.compiled and "past the widest CUDA graph bucket, 64 tokens" in why
    chunked = tiny_llama(seed=0)
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    assert "chunked_attention" in supports_static(chunked)
    compiled, why = engine(base, chunked)
    assert not compiled and "layers of type chunked_attention" in why
    assert engine(base.replace(compile="off")) == (False, "eager (compile: off)")
    compiled, why = engine(base.replace(compile="max"))
    assert compiled and "frozen weights, C++ wrapper" in why
    compiled, why = engine(base.replace(compile="auto"))  # fp32 weights on the CPU: compiling pays (~1.3x a step)
    assert compiled and "compile: auto" in why
    with pytest.raises(ValueError, match="the ring holds StreamingLLM with absolute positions and the exact window"):
        StaticKV(target, 1, 64, window=make_policy(KVSpec("streaming", {"position_mode": "reindex"})))
    # a compiled forward handed a policy the static cache does not hold (on a model with sliding-window layers) runs
    # eager on the policy's own cache
    from test_static_sliding import tiny

    mistral = tiny("mistral")
    policy = make_policy(KVSpec("streaming", {"sink_tokens": 2, "window": 12, "position_mode": "reindex",
                                              "compress_interval": 3}))
    compiled_forward = TargetForward(mistral, compile=True, backend="eager")
    ids, stats, decoder = run(mistral, LookupDrafter(max_cached_requests=0), setup[1], compiled_forward,
                              policy=policy)
    eager_ids, _, _ = run(mistral, LookupDrafter(max_cached_requests=0), setup[1], TargetForward(mistral),
                          policy=policy)
    assert ids == eager_ids and isinstance(decoder.cache, SingleRowCache) and stats.compressions_target > 0
    assert compiled_forward.compile_s == {}  # nothing was compiled


@pytest.mark.slow
@pytest.mark.parametrize("tuned", [False, pytest.param(True, marks=pytest.mark.heavy)],  # max: ~17 s more, cold
                         ids=["auto", "max"])
def test_inductor_compiled_engine_matches_hf_greedy(tuned):
    """The real compiler (inductor, C++ code generation) on a one-layer model: CPU's dynamic widths and spans; with
    ``compile: max``'s frozen weights and C++ wrapper too."""
    torch._dynamo.reset()
    target = tiny_llama(seed=5, layers=1, initializer_range=0.2)
    prompt = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    engine = TargetForward(target, compile=True, tuned=tuned)
    ids, _, _ = run(target, LookupDrafter(max_cached_requests=0), prompt, engine, ConstantK(3))
    assert ids == hf_greedy(target, prompt, NEW)
    assert set(engine.compile_s) <= {(1, 1), (1, 2)}  # one graph per class of widths, whatever the widths
    torch._dynamo.reset()


def test_inductor_cache_goes_to_the_toolkit_cache_unless_the_user_chose_one(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from toolkit import resources

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "toolkit"))
    for before in (None, default_cache_dir()):  # unset, or the default inductor wrote in on its first use
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        resources.inductor_cache()
        assert resources.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "toolkit" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    resources.inductor_cache()
    assert resources.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_first_call_reports_its_compile_apart_and_announces_it(monkeypatch, caplog):
    """A compiled recipe's first call through the Python API compiles the target's graphs: it says so on the
    ``toolkit`` logger before and after, and reports the wait as ``stats.compile_ms``, outside ``total_ms`` (so
    throughput and TPOT describe decoding); the second call compiles nothing. ``warm_up`` validates its input."""
    import logging
    import time

    import toolkit
    from toolkit.errors import ConfigError
    from toolkit.speculative_lm import SpeculativeLM

    def eager_backend(recipe, target, plan, caps=None):  # dynamo traces as inductor would, without code generation (fast)
        return TargetForward(target, compile=True, backend="eager"), "compiled static engine (test: eager backend)"

    monkeypatch.setattr("toolkit.speculative_lm.forward_for", eager_backend)
    torch._dynamo.reset()
    target = tiny_llama(seed=0, initializer_range=0.2)
    recipe = Recipe.from_dict({"name": "compiled-api", "target": {"device": "cpu"}, "draft": None, "compile": "on",
                               "spec": {"drafter": "lookup", "num_draft_tokens": 3},
                               "generation": {"max_new_tokens": NEW, "ignore_eos": True}})
    lm: SpeculativeLM = toolkit.build(recipe, target=target, tokenizer=None)
    prompt = torch.randint(1, 128, (1, 11), generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.INFO, logger="toolkit"):
        began = time.perf_counter()
        first = lm.generate(prompt).stats
        wall_ms = (time.perf_counter() - began) * 1000
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("toolkit")]
    assert any(m.startswith("compiling the target's 1x1") and "on-disk cache" in m for m in messages), messages
    assert any(m.startswith("compiled the target's 1x1") for m in messages)
    assert first.new_tokens == NEW and first.compile_ms > 0
    assert first.total_ms + first.compile_ms <= wall_ms  # disjoint: the compile is not inside total_ms
    assert first.throughput == pytest.approx(NEW / (first.total_ms / 1000))
    assert first.tpot_ms == pytest.approx((first.total_ms - first.ttft_ms) / (NEW - 1))
    assert first.target_ms + first.draft_ms + first.overhead_ms <= first.total_ms
    again = lm.generate(prompt).stats
    assert again.compile_ms == 0 and lm.generate(prompt).token_ids == hf_greedy(target, prompt, NEW)
    with pytest.raises(ConfigError, match="tokens"):
        lm.warm_up(0)
    torch._dynamo.reset()

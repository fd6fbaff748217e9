"""A recipe is planned once (policies, cross-section checks) before any model loads; models are loaded once;
nothing the toolkit does leaves a shared model changed."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import perturbed_copy, tiny_llama

from toolkit.errors import ConfigError
from toolkit.measure.baselines import hf_generate
from toolkit.recipe import GenerationSpec, ModelSpec, Recipe
from toolkit.session import ModelPool, plan
from toolkit.speculative_lm import build


def _recipe(**sections) -> Recipe:
    data = {"name": "t", "target": {"device": "cpu"}, "draft": {"device": "cpu"},
            "spec": {"drafter": "draft_model", "num_draft_tokens": 3},
            "generation": {"max_new_tokens": 24, "ignore_eos": True}}
    data.update(sections)
    return Recipe.from_dict(data)


def test_plan_builds_each_policy_once_and_applies_the_self_rule(monkeypatch):
    from toolkit.kv import l2norm

    built = []
    original = l2norm.L2Norm.__post_init__
    monkeypatch.setattr(l2norm.L2Norm, "__post_init__", lambda self: (built.append(1), original(self)))
    recipe = _recipe(kv={"policy": "l2norm", "budget": 64}, spec={"drafter": "self", "num_draft_tokens": 3},
                     draft={"precision": "int4", "source": "elsewhere"}, target={"source": "/models/t"})
    built.clear()
    p = plan(recipe)
    assert len(built) == 1 and p.target_policy.budget == 64 and p.draft_policy is None
    assert p.draft_spec.source == "/models/t" and p.draft_spec.precision == "int4"  # self = target's weights
    assert p.max_query_tokens == 4


def test_invalid_combination_is_rejected_before_any_model_loads(monkeypatch):
    import toolkit.models

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded for an invalid recipe")

    monkeypatch.setattr(toolkit.models, "load_model", no_loading)
    recipe = _recipe(kv={"policy": "streaming", "sink_tokens": 4, "window": 3})
    with pytest.raises(ConfigError) as info:
        build(recipe)
    assert info.value.field == "kv.window"


def test_pool_loads_each_spec_once(monkeypatch):
    import toolkit.models

    loads = []
    monkeypatch.setattr(toolkit.models, "load_model", lambda spec, field: (loads.append(spec), (object(), None))[1])
    pool = ModelPool()
    a = pool.get(ModelSpec(source="x", precision="bf16"))
    b = pool.get(ModelSpec(source="x", precision="bf16"))
    c = pool.get(ModelSpec(source="x", precision="fp32"))
    assert a is b and a is not c and len(loads) == 2 and len(pool) == 2


def _fingerprint(model) -> tuple:
    return (model.config._attn_implementation, model.generation_config.to_json_string(),
            len(model._forward_hooks), len(model._forward_pre_hooks))


def test_nothing_leaves_a_shared_model_changed():
    """Head-aware target cache (static tiers) and L2 (per-layer lengths) draft cache install attention functions for
    one generation; HF assisted generation sets the assistant's schedule for one call. Afterwards both models are as
    before."""
    target = tiny_llama()
    draft = perturbed_copy(target, scale=0.3)
    before = (_fingerprint(target), _fingerprint(draft))
    recipe = _recipe(kv={"policy": "head_aware", "budget": 16, "protect_recent": 4, "skip_layers": [0],
                         "compress_interval": 4, "tiers": 2, "importance": [[1.0, 0.0], [0.2, 0.7]]},
                     draft_kv={"policy": "l2norm", "budget": 16, "protect_recent": 4, "skip_layers": [0],
                               "compress_interval": 4})
    generator = build(recipe, target=target, draft_model=draft)
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    stream = generator.decoder(recipe.generation).decode(prompt, recipe.generation, _stats())
    next(stream)
    assert target.config._attn_implementation == "toolkit_static"  # the static tiers' attention, while generating ...
    stream.close()  # ... and removed when the caller stops early
    assert (_fingerprint(target), _fingerprint(draft)) == before
    ids = [t for chunk in generator.decoder(recipe.generation).decode(prompt, recipe.generation, _stats())
           for t in chunk]
    assert len(ids) == 24
    hf_generate(target, prompt, GenerationSpec(max_new_tokens=8, ignore_eos=True), [], method="assisted",
                assistant_model=draft, num_draft_tokens=5)
    assert (_fingerprint(target), _fingerprint(draft)) == before


def _stats():
    from toolkit.speculative.stats import GenerationStats

    return GenerationStats()


def test_recipe_is_inert_data():
    recipe = _recipe(kv={"policy": "streaming", "sink_tokens": 4, "window": 3})  # fine on its own
    assert Recipe.from_yaml(recipe.to_yaml()) == recipe and copy.deepcopy(recipe) == recipe


def test_a_chain_recipe_pads_its_rounds_only_within_the_room_its_caches_hold():
    """A constant-K chain reads the verify cost curve and may pad a round up to PAD_ROOM tokens on uncompressed
    caches (a cheaper width: the AVX2 fp32 curve's 3 tokens cost more than 6); under a compressing policy its room stays
    K + 1, its window's size; a token tree reads no curve (its width is the tree's)."""
    from toolkit.engine.planner import PAD_ROOM

    target = tiny_llama()
    draft = perturbed_copy(target, scale=0.3)
    gen = GenerationSpec(max_new_tokens=8)
    plain = build(_recipe(), target=target, draft_model=draft).decoder(gen).controller
    assert plain.cost is not None and plain.widest == PAD_ROOM
    streaming = build(_recipe(kv={"policy": "streaming", "sink_tokens": 4, "window": 24}), target=target,
                      draft_model=draft).decoder(gen).controller
    assert streaming.cost is not None and streaming.widest == 4
    tree = _recipe(spec={"drafter": "draft_model", "num_draft_tokens": 3, "tree": True, "tree_budget": 8,
                         "tree_depth": 3, "tree_topk": 2})
    assert build(tree, target=target, draft_model=draft).decoder(gen).controller.cost is None

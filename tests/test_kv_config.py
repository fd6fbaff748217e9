"""Bad KV configurations raise one clear ConfigError naming the field; the shipped recipes validate."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_llama

from toolkit.errors import ConfigError
from toolkit.kv import POLICIES, make_policy
from toolkit.recipe import KVSpec, Recipe
from toolkit.session import plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("policy,params,field", [
    ("streaming", {"sink_tokens": 4, "window": 0}, "kv.window"),  # budget = sink_tokens + window <= sink_tokens
    ("l2norm", {"budget": 4, "sink_tokens": 4, "protect_recent": 0}, "kv.budget"),
    ("l2norm", {"budget": 30, "protect_recent": 32}, "kv.budget"),
    ("head_aware", {"budget": 2, "sink_tokens": 4}, "kv.budget"),
    ("l2norm", {"keep_ratio": 0.0}, "kv.keep_ratio"),
    ("l2norm", {"keep_ratio": 1.5}, "kv.keep_ratio"),
    ("head_aware", {"keep_ratio": -0.1}, "kv.keep_ratio"),
    ("l2norm", {}, "kv.budget"),  # neither budget nor keep_ratio
    ("l2norm", {"keep_ratio": 0.5, "skip_layers": [-1]}, "kv.skip_layers"),
    ("streaming", {"position_mode": "relative"}, "kv.position_mode"),
    ("streaming", {"windw": 8}, "kv.windw"),
    ("snapkv", {}, "kv.policy"),
])
def test_bad_policy_fields(policy, params, field):
    with pytest.raises(ConfigError) as info:
        make_policy(KVSpec(policy, params), "kv")
    assert info.value.field == field and field in str(info.value)


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ConfigError) as info:
        make_policy(KVSpec("snapkv"), "draft_kv")
    assert info.value.field == "draft_kv.policy"
    assert set(info.value.allowed) == {"none", *POLICIES} >= {"none", "streaming", "l2norm", "head_aware"}


@pytest.mark.parametrize("section", ["kv", "draft_kv"])
def test_window_smaller_than_a_verify_forward(section):
    data = {"draft": {"source": "embedded", "precision": "int4"}, "spec": {"num_draft_tokens": 6},
            section: {"policy": "streaming", "sink_tokens": 4, "window": 6}}
    recipe = Recipe.from_dict(data)  # each section is valid on its own ...
    with pytest.raises(ConfigError) as info:
        plan(recipe)  # ... the combination is not: checked once, when the recipe is planned, before any model loads
    assert info.value.field == f"{section}.window" and "num_draft_tokens + 1 = 7" in str(info.value)
    data[section]["window"] = 7
    plan(Recipe.from_dict(data))  # K + 1 fits


def test_window_check_uses_k_max_with_adaptive_k():
    with pytest.raises(ConfigError, match="kv.window"):
        plan(Recipe.from_dict({"spec": {"num_draft_tokens": 2, "adaptive": "ema", "k_max": 8},
                               "kv": {"policy": "streaming", "window": 8}}))


def test_reindex_needs_rotary_embeddings():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    policy = make_policy(KVSpec("streaming", {"window": 16, "position_mode": "reindex"}), "kv")
    with pytest.raises(ConfigError) as info:
        policy.make_cache(gpt2)
    assert info.value.field == "kv.position_mode" and "rotary" in str(info.value)
    make_policy(KVSpec("streaming", {"window": 16, "position_mode": "absolute"})).make_cache(gpt2)  # fine


def test_reindex_budget_must_fit_the_context():
    policy = make_policy(KVSpec("streaming", {"window": 60, "position_mode": "reindex"}), "kv")
    with pytest.raises(ConfigError, match="kv.window.*max_position_embeddings=64"):
        policy.make_cache(tiny_llama(max_positions=64))


def test_head_aware_importance_shape_is_checked():
    policy = make_policy(KVSpec("head_aware", {"budget": 64, "importance": [[1.0]]}), "kv")
    with pytest.raises(ConfigError, match="kv.importance"):
        policy.make_cache(tiny_llama())


@pytest.mark.parametrize("name", ["long", "memory"])
def test_shipped_recipes_validate(name):
    recipe = Recipe.load(ROOT / "recipes" / f"{name}.yaml")
    assert recipe.prompts == name
    policy = make_policy(recipe.kv, "kv")
    assert policy is not None
    if name == "long":
        assert recipe.kv.policy == "streaming" and recipe.generation.max_new_tokens >= 2000
    else:
        assert recipe.target.precision in ("bf16", "int8", "int4")
    assert Recipe.from_yaml(recipe.to_yaml()) == recipe

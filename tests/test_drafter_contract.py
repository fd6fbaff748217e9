"""Every registered drafter honours the decoder's one row-drafter protocol (and single-sequence drafters the
DrafterProtocol / TreeDrafterProtocol), decodes greedily
token-identical to AR through the loop, and reports its cache; the recipe format round-trips through the registry."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed_copy, tiny_llama
from test_decoder import hf_greedy, make_prompt

from toolkit.distill.eagle_train import build_head
from toolkit.errors import ConfigError
from toolkit.recipe import ModelSpec, Recipe, SpeculationSpec
from toolkit.engine.planner import ConstantK
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.speculative.drafters import (
    DrafterContext,
    DrafterProtocol,
    NgramConfig,
    RowDrafter,
    TreeDrafterProtocol,
    build_drafter,
    config_type,
    drafter_names,
)
from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD, DRAFT_UNUSED, config_types
from toolkit.speculative.params import DecodeParams  # noqa: F401  (the loop's view of generation settings)
from toolkit.speculative.stats import GenerationStats, check_acceptance
from toolkit.speculative.tree import TreeShape


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=3)


def _context(config, target) -> DrafterContext:
    draft = None
    if config.uses_draft_model:
        draft = perturbed_copy(target, scale=0.05)
    elif config.draft == DRAFT_EAGLE_HEAD:
        draft = build_head(target, 96, torch.ones(128), seed=0).eval().requires_grad_(False)
    return DrafterContext(target, draft)


class _Greedy:
    max_new_tokens, do_sample, temperature, top_k, top_p, ignore_eos, seed = 24, False, 1.0, 0, 1.0, True, 0


def _decode(target, drafter, tree=None) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    loop = SpeculativeDecoder(target, drafter, ConstantK(3), tree=tree)
    ids = [t for chunk in loop.decode(make_prompt(1), _Greedy, stats) for t in chunk]
    return ids, stats


@pytest.mark.parametrize("name", drafter_names())
def test_registered_drafter_keeps_the_contract_and_is_greedy_exact(name, target):
    config = config_type(name)()
    config.validate("spec")
    drafter = build_drafter(config, _context(config, target))
    if not config.speculates:
        assert drafter is None
        return
    assert isinstance(drafter, RowDrafter)  # the decoder's one protocol, whatever the config
    assert config.tree == drafter.trees
    if not drafter.batches:  # a single-sequence drafter also keeps the per-sequence contract
        assert isinstance(drafter, DrafterProtocol) and config.tree == isinstance(drafter, TreeDrafterProtocol)
    reference = hf_greedy(target, make_prompt(1), 24)
    ids, stats = _decode(target, drafter)
    assert ids == reference
    assert check_acceptance(stats) == []
    if config.draft != DRAFT_UNUSED:  # a model or head drafter keeps a KV cache, and its bytes are reported
        assert stats.kv_bytes_draft == drafter.cache.kv_bytes() > 0
    if config.tree:
        ids, _ = _decode(target, build_drafter(config, _context(config, target)), TreeShape(6, 3, 2))
        assert ids == reference


def test_tree_shape_with_a_chain_only_drafter_is_refused(target):
    drafter = build_drafter(NgramConfig(), DrafterContext(target))
    with pytest.raises(TypeError, match="tree"):
        SpeculativeDecoder(target, drafter, tree=TreeShape(4, 2, 2))


@pytest.mark.parametrize("kind", config_types(), ids=lambda c: c.name)
def test_every_config_round_trips_through_the_flat_yaml_form(kind):
    spec = SpeculationSpec(kind(), num_draft_tokens=3)
    draft = None if kind.draft == DRAFT_UNUSED else ModelSpec(precision="bf16")
    recipe = Recipe(name="r", draft=draft, spec=spec)
    again = Recipe.from_yaml(recipe.to_yaml())
    assert again == recipe and type(again.spec.config) is kind
    assert again.spec.drafter == kind.name and again.to_dict()["spec"]["drafter"] == kind.name


def test_another_drafters_field_is_an_error_unless_it_is_that_drafters_default():
    # the flat form Recipe.to_dict wrote before drafters had configs: defaults of other drafters are dropped
    old = Recipe.from_dict({"draft": None, "spec": {"drafter": "suffix", "max_ngram": 3, "min_ngram": 1,
                                                    "confidence_threshold": None, "max_spec_factor": 2.0}})
    assert old.spec.config.max_spec_factor == 2.0 and "max_ngram" not in old.to_dict()["spec"]
    with pytest.raises(ConfigError) as excinfo:
        Recipe.from_dict({"draft": None, "spec": {"drafter": "suffix", "max_ngram": 5}})
    assert excinfo.value.field == "spec.max_ngram" and "ngram" in str(excinfo.value)
    with pytest.raises(ConfigError) as excinfo:
        Recipe.from_dict({"draft": None, "spec": {"drafter": "ngram", "config": {}}})
    assert excinfo.value.field == "spec.config"


def test_config_fields_read_through_the_spec_as_before():
    spec = SpeculationSpec(drafter="ngram", max_ngram=5)
    assert spec.max_ngram == 5 == spec.config.max_ngram
    with pytest.raises(AttributeError):
        spec.max_spec_factor  # noqa: B018  (a suffix field: not part of an ngram spec)

"""Recipes: validation errors name the field and the allowed values; YAML round trip; unknown keys are errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from toolkit.errors import ConfigError
from toolkit.recipe import DRAFTERS, PRECISIONS, GenerationSpec, KVSpec, ModelSpec, Recipe, SpeculationSpec

REPO = Path(__file__).resolve().parents[1]


def full_recipe() -> Recipe:
    """A recipe with a non-default value in every section."""
    return Recipe(
        name="roundtrip",
        description="every section set",
        target=ModelSpec(source="/models/target", precision="bf16", device="cpu", int8_threshold=4.0,
                         int4_compute_dtype="bf16", int4_double_quant=False, attn_implementation="eager"),
        draft=ModelSpec(source="embedded", precision="int8", device="cpu"),
        kv=KVSpec(),
        draft_kv=KVSpec(),
        spec=SpeculationSpec(drafter="self", num_draft_tokens=6, adaptive="ema", k_min=2, k_max=10, ema_decay=0.5,
                      confidence_threshold=0.3),
        generation=GenerationSpec(max_new_tokens=77, do_sample=True, temperature=0.7, top_k=40, top_p=0.9,
                                  ignore_eos=True, eos_token_id=[2, 7], stop_strings=["\n\n", "END"], seed=5),
        prompts="long",
    )


def assert_config_error(excinfo, field: str, allowed=None) -> None:
    err = excinfo.value
    assert err.field == field
    assert str(err).startswith(f"{field}:")
    if allowed is not None:
        assert err.allowed == list(allowed)
        for value in allowed:
            assert str(value) in str(err)


# ------------------------------------------------------------------------------------------------------ round trip
def test_yaml_round_trip_is_equal():
    recipe = full_recipe()
    text = recipe.to_yaml()
    again = Recipe.from_yaml(text)
    assert again == recipe
    assert again.to_yaml() == text
    assert again.config_hash() == recipe.config_hash()


def test_save_and_load_round_trip(tmp_path):
    recipe = full_recipe()
    path = tmp_path / "sub" / "r.yaml"
    recipe.save(path)
    assert Recipe.load(path) == recipe
    assert not [p for p in path.parent.iterdir() if p.name != "r.yaml"]  # no temp files left behind


def test_defaults_round_trip_and_draft_none():
    assert Recipe.from_yaml(Recipe().to_yaml()) == Recipe()
    ar = Recipe(draft=None, spec=SpeculationSpec(drafter="none"))
    assert Recipe.from_yaml(ar.to_yaml()) == ar
    assert Recipe.from_yaml("") == Recipe()


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")) + sorted((REPO / "recipes" / "found").glob(
    "*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_recipes_load_and_round_trip(path):
    from toolkit.session import plan

    recipe = Recipe.load(path)
    assert Recipe.from_yaml(recipe.to_yaml()) == recipe
    plan(recipe)  # the cross-section checks pass too (found recipes are written by the search)


def test_config_hash_ignores_name_but_not_settings():
    a = full_recipe()
    assert a.replace(name="other", description="x").config_hash() == a.config_hash()
    assert a.replace(spec=SpeculationSpec(num_draft_tokens=3)).config_hash() != a.config_hash()


def test_eos_token_id_int_is_normalized_to_a_list():
    recipe = Recipe(generation=GenerationSpec(eos_token_id=5))
    assert recipe.generation.eos_token_id == [5]


# ------------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("section", ["target", "draft"])
def test_unknown_precision_names_field_and_allowed_values(section):
    with pytest.raises(ConfigError) as excinfo:
        Recipe(**{section: ModelSpec(precision="int3")})
    assert_config_error(excinfo, f"{section}.precision", PRECISIONS)
    assert "int3" in str(excinfo.value)


def test_unknown_device_names_field_and_allowed_values():
    with pytest.raises(ConfigError) as excinfo:
        Recipe(target=ModelSpec(device="tpu"))
    assert_config_error(excinfo, "target.device", ["auto", "cpu", "cuda"])


def test_unknown_drafter_names_field_and_allowed_values():
    with pytest.raises(ConfigError) as excinfo:
        Recipe(spec=SpeculationSpec(drafter="medusa"))
    assert_config_error(excinfo, "spec.drafter", DRAFTERS)


@pytest.mark.parametrize("value", [0, -1, 65, "4", 2.5, True, None])
def test_invalid_num_draft_tokens(value):
    with pytest.raises(ConfigError) as excinfo:
        Recipe(spec=SpeculationSpec(num_draft_tokens=value))
    assert_config_error(excinfo, "spec.num_draft_tokens")


def test_invalid_num_draft_tokens_from_yaml():
    with pytest.raises(ConfigError, match=r"^spec\.num_draft_tokens: must be >= 1"):
        Recipe.from_yaml("spec: {num_draft_tokens: 0}")


@pytest.mark.parametrize("text, field", [
    ("tempreature: 0.5", "tempreature"),
    ("spec: {drafter: ngram, num_draft: 4}", "spec.num_draft"),
    ("target: {source: embedded, dtype: fp16}", "target.dtype"),
    ("generation: {max_tokens: 10}", "generation.max_tokens"),
])
def test_unknown_yaml_field_is_an_error_naming_it(text, field):
    with pytest.raises(ConfigError) as excinfo:
        Recipe.from_yaml(text)
    assert excinfo.value.field == field
    assert excinfo.value.allowed  # the known fields are listed
    assert "unknown" in str(excinfo.value)


@pytest.mark.parametrize("text, field", [
    ("target: {precision: fp8}", "target.precision"),
    ("target: {device: mps}", "target.device"),
    ("spec: {drafter: medusa}", "spec.drafter"),
    ("spec: {adaptive: linear}", "spec.adaptive"),
    ("target: {attn_implementation: flash}", "target.attn_implementation"),
])
def test_bad_choice_from_yaml_lists_allowed_values(text, field):
    with pytest.raises(ConfigError) as excinfo:
        Recipe.from_yaml(text)
    assert excinfo.value.field == field
    assert excinfo.value.allowed and "allowed:" in str(excinfo.value)


@pytest.mark.parametrize("kwargs, field", [
    ({"spec": SpeculationSpec(k_min=4, k_max=2)}, "spec.k_max"),
    ({"spec": SpeculationSpec(confidence_threshold=1.5)}, "spec.confidence_threshold"),
    ({"spec": SpeculationSpec(drafter="ngram", min_ngram=3, max_ngram=2)}, "spec.max_ngram"),
    ({"generation": GenerationSpec(max_new_tokens=0)}, "generation.max_new_tokens"),
    ({"generation": GenerationSpec(temperature=0)}, "generation.temperature"),
    ({"generation": GenerationSpec(top_p=0.0)}, "generation.top_p"),
    ({"generation": GenerationSpec(stop_strings=[""])}, "generation.stop_strings"),
    ({"generation": GenerationSpec(eos_token_id=[-1])}, "generation.eos_token_id[0]"),
    ({"target": ModelSpec(source="")}, "target.source"),
    ({"draft": None, "spec": SpeculationSpec(drafter="self")}, "draft"),
    ({"name": ""}, "name"),
])
def test_other_invalid_fields(kwargs, field):
    with pytest.raises(ConfigError) as excinfo:
        Recipe(**kwargs)
    assert excinfo.value.field == field


def test_not_yaml_and_not_a_mapping():
    with pytest.raises(ConfigError, match="^recipe: not valid YAML"):
        Recipe.from_yaml("spec: [unclosed")
    with pytest.raises(ConfigError, match="^recipe: must be a mapping"):
        Recipe.from_yaml("- a\n- b")
    with pytest.raises(ConfigError, match=r"^spec: must be a mapping"):
        Recipe.from_yaml("spec: 4")


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        Recipe(target=ModelSpec(precision="int3"))


def test_yaml_is_plain_data():
    data = yaml.safe_load(full_recipe().to_yaml())
    assert data["spec"]["num_draft_tokens"] == 6
    assert data["kv"] == {"policy": "none"}
    assert data["generation"]["stop_strings"] == ["\n\n", "END"]


def test_batch_size_is_checked_round_trips_and_leaves_older_hashes_alone():
    from toolkit.errors import ConfigError

    plain = Recipe()
    assert "batch_size" not in plain.to_dict() and plain.rows_per_forward == 8  # unset: the default for lists
    batched = Recipe(batch_size=4)
    assert Recipe.from_yaml(batched.to_yaml()) == batched and batched.rows_per_forward == 4
    assert batched.config_hash() != plain.config_hash()
    for bad in (0, 257, 2.5, True, "8"):
        with pytest.raises(ConfigError) as excinfo:
            Recipe(batch_size=bad)
        assert excinfo.value.field == "batch_size"

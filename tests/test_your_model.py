"""A user's own model: --target / --draft on the commands, a search space adapted to the model (no embedded-only
EAGLE head, KV groups that divide its head dimension), the held-out comparisons retargeted."""

from __future__ import annotations

import pytest
from conftest import tiny_llama
from test_models import word_tokenizer
from typer.testing import CliRunner

from toolkit.errors import ConfigError, ModelLoadError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("your-model")
    tiny_llama(seed=0, initializer_range=0.2).save_pretrained(path)  # head_dim 16
    word_tokenizer(128).save_pretrained(path)
    return path


def _space() -> dict:
    return {"scenario": "short", "trials": 2,
            "base": {"target": {"source": "embedded"}, "draft": None, "spec": {"drafter": "ngram"},
                     "kv": {"policy": "none"}},
            "space": {"drafter": {"choices": {"ngram": {"spec": {"drafter": "ngram"}, "draft": None},
                                              "eagle": {"spec": {"drafter": "eagle"},
                                                        "draft": {"source": "embedded", "precision": "bf16"}},
                                              "draft": {"spec": {"drafter": "draft_model"},
                                                        "draft": {"source": "embedded"}}}},
                      "kv_policy": {"choices": {"none": {"kv": {"policy": "none"}},
                                                "quantized": {"kv": {"policy": "quantized"}}}},
                      "group": {"path": "kv.quant_group_size", "choices": [8, 16, 48],
                                "when": {"kv_policy": ["quantized"]}}},
            "seeds": {"head": {"drafter": "eagle", "kv_policy": "none"},
                      "lookup": {"drafter": "ngram", "kv_policy": "none"}}}


def test_search_space_adapts_to_your_model(model_dir, tmp_path):
    from eval.space_file import load_space

    sp = load_space(_space())
    sp.for_model(str(model_dir), draft=str(tmp_path / "draft"))
    assert sp.base["target"]["source"] == str(model_dir) and sp.target == str(model_dir)
    dims = {d.name: d for d in sp.dimensions}
    assert "eagle" not in dims["drafter"].searched  # the shipped head belongs to the embedded model
    assert dims["drafter"].fragments["draft"]["draft"]["source"] == str(tmp_path / "draft")
    assert dims["group"].searched == [8, 16]  # 48 does not divide head_dim 16
    assert set(sp.seeds) == {"lookup"}  # the seed that used the head is gone
    recipe = sp.recipe({"drafter": "ngram", "kv_policy": "none"})
    assert recipe.target.source == str(model_dir)
    with pytest.raises((ConfigError, ModelLoadError), match="--target"):
        load_space(_space()).for_model(str(tmp_path / "nowhere"))


def test_commands_take_target_and_draft(model_dir):
    from toolkit.recipe import Recipe
    from toolkit.resources import resolve
    from toolkit_cli.app import _retarget, app

    moved = _retarget(Recipe.load(resolve("short-draft", "", "recipe")), str(model_dir), None)
    assert moved.target.source == str(model_dir)
    with pytest.raises(ConfigError, match="--draft"):  # the shipped head belongs to the embedded model
        _retarget(Recipe.load(resolve("short-eagle", "", "recipe")), str(model_dir), None)
    result = CliRunner().invoke(app, ["generate", "t5 t9 t13 t5 t9", "--no-chat", "--recipe", "short-ngram",
                                      "--target", str(model_dir), "--max-new-tokens", "6", "--no-stream"])
    assert result.exit_code == 0, result.output
    assert "6 tokens" in result.output  # the round statistics line
    # a compiled recipe says why the first call waits, and how long compiling took apart from the decode's numbers
    assert "decoding path: compiled static engine" in result.output and "after compiling for" in result.output


def test_draft_flag_follows_the_drafter(model_dir, tmp_path):
    """--draft replaces a draft LM (at native where the file carries its own blocks, like --target) or an EAGLE head
    (its dtype kept), and is refused, naming the flag, where the drafter runs no draft model — before, a lookup recipe
    copied the target's `native` precision onto the draft and failed on draft.precision, and a `self` recipe ignored
    the flag."""
    from toolkit.recipe import Recipe
    from toolkit.resources import resolve
    from toolkit_cli.app import _retarget

    def load(name):
        return Recipe.load(resolve(name, "", "recipe"))

    drafted = _retarget(load("short-draft"), None, str(model_dir))
    assert (drafted.draft.source, drafted.draft.precision) == (str(model_dir), "int4")
    gguf = str(tmp_path / "draft.Q4_0.gguf")
    assert _retarget(load("short-draft"), None, gguf).draft.precision == "native"  # a GGUF on CPU: its own blocks
    head = _retarget(load("short-eagle"), str(model_dir), str(tmp_path / "head"))
    assert (head.draft.source, head.draft.precision) == (str(tmp_path / "head"), "bf16")
    for name, drafter in (("short", "lookup"), ("short-ngram", "ngram"), ("quantspec", "self")):
        with pytest.raises(ConfigError, match=f"^--draft: recipe '{name}' drafts with '{drafter}'"):
            _retarget(load(name), None, str(model_dir))
    selfed = _retarget(load("quantspec"), str(model_dir), None)  # a self drafter's draft follows the target
    assert selfed.draft.source == selfed.target.source == str(model_dir)
    assert selfed.draft.precision == load("quantspec").draft.precision


def test_search_draft_needs_a_searched_draft_model(tmp_path):
    """search --draft on a space whose draft_model label is off in its file says how to turn it on (before, the draft
    went into a label no trial could pick, and the search ran without it)."""
    from eval.space_file import load_space

    sp = load_space("long")
    with pytest.raises(ConfigError, match=r"^--draft: .*--enable drafter\.draft_model"):
        sp.for_model(None, draft=str(tmp_path / "draft"))
    sp = load_space("long")
    sp.enable(["drafter.draft_model"])
    sp.for_model(None, draft=str(tmp_path / "draft"))
    assert {d.name: d for d in sp.dimensions}["drafter"].fragments["draft_model"]["draft"]["source"] == \
        str(tmp_path / "draft")

"""`toolkit run`: the runner's results on a tiny model that shares the embedded tokenizer, and CLI bad input."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from eval.run import markdown_table, run_recipe, write_results
from tests.conftest import perturbed_copy, tiny_llama
from toolkit.measure.prompts import load_suite
from toolkit.recipe import GenerationSpec, ModelSpec, Recipe, SpeculationSpec
from toolkit.speculative_lm import SpeculativeLM, build
from toolkit_cli import app


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer, read straight from the shipped GGUF (no model conversion)."""
    from transformers import AutoTokenizer

    from toolkit.models import embedded_gguf_path

    path = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _generator(tokenizer, drafter: str) -> SpeculativeLM:
    target = tiny_llama(vocab=len(tokenizer), layers=2)
    draft = perturbed_copy(target, scale=0.05) if drafter == "draft_model" else None
    recipe = Recipe(name=f"tiny-{drafter}", target=ModelSpec(device="cpu"), draft=ModelSpec(device="cpu"),
                    spec=SpeculationSpec(drafter=drafter, num_draft_tokens=3),
                    generation=GenerationSpec(max_new_tokens=12, ignore_eos=True))
    return build(recipe, target=target, tokenizer=tokenizer, draft_model=draft)


@pytest.mark.parametrize("drafter,baselines", [("draft_model", {"ar", "ar_static", "assisted"}),
                                               ("ngram", {"ar", "ar_static", "prompt_lookup", "prompt_lookup_10"})])
def test_compare_run_matches_ar_and_writes_results(tokenizer, tmp_path, drafter, baselines):
    generator = _generator(tokenizer, drafter)
    prompts = load_suite("short")[:2]
    typed = run_recipe(generator.recipe, compare=True, repeats=2, prompts=prompts, generator=generator,
                       progress=False)
    results = typed.to_dict()
    assert {f"speedup_vs_{m}" for m in baselines - {"ours"}} <= set(results["summary"]["ours"])
    assert typed.speedup("ar") == results["summary"]["ours"]["speedup_vs_ar"]
    methods = {row["method"] for row in results["rows"]}
    assert methods == {"ours"} | baselines
    assert len(results["rows"]) == len(prompts) * len(methods)
    for row in results["rows"]:
        assert row["new_tokens"] == 12
        assert len(row["throughput"]["values"]) == 2 and row["throughput"]["min"] <= row["throughput"]["median"]
        if not generator.recipe.generation.do_sample:
            assert row["identical_to_ar"] is True, row  # greedy: every method reproduces AR exactly
    ours = results["summary"]["ours"]
    assert ours["identical_to_ar"] is True
    assert set(ours) >= {f"speedup_vs_{m}" for m in baselines}
    path = write_results(typed, tmp_path)
    assert json.loads(path.read_text())["config_hash"] == generator.recipe.config_hash()
    table = path.with_suffix(".md").read_text()
    assert table == markdown_table(results) and table.count("| ours |") == len(prompts) + 1
    other = write_results(typed, tmp_path, prompts_source="../my prompts")  # a run over other prompts: its own file
    assert other.name == f"{path.stem}-my_prompts.json" and path.exists()


def test_cli_prompts_alone_run_one_request_at_a_time_over_them(tmp_path, monkeypatch):
    """``toolkit run RECIPE --prompts SUITE`` is the recipe's run (and --compare's baselines) over other prompts,
    written beside the suite's results; only --batch-size (or a recipe's batch_size) batches."""
    import importlib

    import eval.run

    cli = importlib.import_module("toolkit_cli.app")  # the module (the package's ``app`` is the Typer app)
    seen = {}

    def fake_run(recipe, **kwargs):
        seen.update(kwargs)
        return "result"

    monkeypatch.setattr(eval.run, "run_recipe", fake_run)
    monkeypatch.setattr(eval.run, "write_results", lambda r, out, source: seen.update(source=source) or out / "x.json")
    monkeypatch.setattr(eval.run, "markdown_table", lambda r: "table")
    monkeypatch.setattr(cli, "_run_batch", lambda *a, **k: pytest.fail("--prompts alone batched"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nspec: {drafter: ngram}\ndraft: null\n")
    result = CliRunner().invoke(app, ["run", str(recipe), "--compare", "--prompts", "short-heldout", "--out",
                                      str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert [p.id for p in seen["prompts"]] == [p.id for p in load_suite("short-heldout")]
    assert seen["compare"] is True and seen["source"] == "short-heldout"


def test_cli_reports_bad_recipe_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ntarget: {precision: int3}\n")
    result = CliRunner().invoke(app, ["run", str(bad)])
    assert result.exit_code == 2
    assert "target.precision" in result.output and "int4" in result.output


def test_cli_reports_unknown_suite(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nspec: {drafter: ngram}\ndraft: null\nprompts: nonexistent\n")
    result = CliRunner().invoke(app, ["run", str(bad)])
    assert result.exit_code == 2 and "prompts" in result.output and "short" in result.output


def test_plain_text_gives_a_base_model_the_suites_prompts(tokenizer):
    from toolkit.errors import ConfigError
    from toolkit.measure.prompts import plain_text
    from toolkit.requests import encode

    prompts = {p.id: p.prompt for p in load_suite("short")}
    messages = prompts["instruct-explain"]
    assert plain_text(messages) == "".join(m["content"] + "\n\n" for m in messages) and "user" not in plain_text(
        messages)
    assert plain_text(prompts["code-textwrap"]) is prompts["code-textwrap"]  # plain text already
    base = copy.deepcopy(tokenizer)
    base.chat_template = None  # a base model's tokenizer
    with pytest.raises(ConfigError, match="prompts.instruct-explain.*no chat template"):
        encode(base, "base.gguf", messages, "prompts.instruct-explain")
    ids = encode(base, "base.gguf", plain_text(messages), "prompts.instruct-explain")
    assert ids[0].tolist() == base(plain_text(messages)).input_ids

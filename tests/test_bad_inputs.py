"""Bad inputs, each answered by one clear error naming the field (issue 24): on the CLI one ``error:`` line on stderr,
exit status 2, no traceback; through the Python API one :class:`ToolkitError`.

Every probe runs in-process (``CliRunner``) on tiny random models saved to a temporary directory with a
character-level tokenizer, so a probe that regresses into accepting its input finishes in a second instead of
loading the embedded model.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import tiny_llama
from toolkit.errors import ToolkitError
from toolkit_cli import app

MAX_POSITIONS = 64  # the tiny target's context


def char_tokenizer():
    """A character-level fast tokenizer with 99 entries (fits tiny_llama's vocab of 128); no chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "</s>", "\n", "\t"] + [chr(c) for c in range(32, 127)]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Model directories: ``tiny`` (vocab 128, context 64), ``wide`` (same tokenizer, vocab 160), ``nocfg`` (a
    directory without config.json) and ``fake`` (a text file named .gguf)."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = char_tokenizer()
    for name, vocab in (("tiny", 128), ("wide", 160)):
        tiny_llama(vocab=vocab, max_positions=MAX_POSITIONS).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "nocfg").mkdir()
    (root / "nocfg" / "weights.bin").write_bytes(b"\0" * 16)
    (root / "fake.gguf").write_text("this is not a GGUF file\n" * 8)
    return {"tiny": root / "tiny", "wide": root / "wide", "nocfg": root / "nocfg", "fake": root / "fake.gguf",
            "root": root}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Converted models and calibration results of a probe go to a throwaway cache; the working directory too."""
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def nothing_heavy(monkeypatch):
    """For probes whose input must be refused before any model loads or any trial runs: a regression that accepts
    the input fails at once instead of loading the embedded model or starting a search."""
    import eval.search.study
    import toolkit.models

    def refuse(*args, **kwargs):
        raise AssertionError("the bad input was accepted: a model load or a search started")

    monkeypatch.setattr(toolkit.models, "load_model", refuse)
    monkeypatch.setattr(eval.search.study.Run, "open_study", refuse)


def base_recipe(models) -> dict:
    return {"name": "probe", "target": {"source": str(models["tiny"]), "device": "cpu"}, "draft": None,
            "spec": {"drafter": "none"}, "generation": {"max_new_tokens": 2}, "prompts": "short"}


def merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def cli(*args: str, stdin: str | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], input=stdin)


def assert_one_line_error(result, field: str) -> str:
    """Exit status 2, no traceback, exactly one ``error:`` line (the last line of stderr) naming ``field``."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == errors[0], result.output
    assert field in errors[0], errors[0]
    assert result.exit_code == 2, result.output
    return errors[0]


# ------------------------------------------------------------------------------------------------- recipe fields
#: (probe id, recipe overrides (deep-merged into the base recipe), field named in the error)
RECIPE_PROBES = [
    ("nan-temperature", {"generation": {"do_sample": True, "temperature": float("nan")}}, "generation.temperature"),
    ("inf-temperature", {"generation": {"temperature": float("inf")}}, "generation.temperature"),
    ("underflowing-temperature", {"generation": {"do_sample": True, "temperature": 1e-300}}, "generation.temperature"),
    ("minus-inf-top-p", {"generation": {"top_p": float("-inf")}}, "generation.top_p"),
    ("underflowing-top-p", {"generation": {"do_sample": True, "top_p": 1e-300}}, "generation.top_p"),
    ("seed-2**64", {"generation": {"seed": 2**64}}, "generation.seed"),
    ("seed-2**63", {"generation": {"seed": 2**63}}, "generation.seed"),
    ("negative-seed", {"generation": {"seed": -1}}, "generation.seed"),
    ("huge-max-new-tokens", {"generation": {"max_new_tokens": 10**12}}, "generation.max_new_tokens"),
    ("zero-max-new-tokens", {"generation": {"max_new_tokens": 0}}, "generation.max_new_tokens"),
    ("huge-top-k", {"generation": {"top_k": 10**15}}, "generation.top_k"),
    ("float-eos-scalar", {"generation": {"eos_token_id": 1.5}}, "generation.eos_token_id"),
    ("float-eos-in-list", {"generation": {"eos_token_id": [1, 2.5]}}, "generation.eos_token_id[1]"),
    ("eos-outside-vocab", {"generation": {"eos_token_id": [1, 100000]}}, "generation.eos_token_id[1]"),
    ("stop-strings-a-string", {"generation": {"stop_strings": "END"}}, "generation.stop_strings"),
    ("nan-int8-threshold", {"target": {"int8_threshold": float("nan")}}, "target.int8_threshold"),
    ("nan-ema-decay", {"spec": {"ema_decay": float("nan")}}, "spec.ema_decay"),
    ("nan-max-spec-factor", {"spec": {"drafter": "suffix", "max_spec_factor": float("nan")}},
     "spec.max_spec_factor"),
    ("inf-prior-bias", {"spec": {"drafter": "lookup", "prior_bias": float("inf")}}, "spec.prior_bias"),
    ("nan-confidence-threshold", {"draft": {"source": "TINY", "device": "cpu"},
                                  "spec": {"drafter": "draft_model", "confidence_threshold": float("nan")}},
     "spec.confidence_threshold"),
    ("inf-window", {"kv": {"policy": "streaming", "window": float("inf")}}, "kv.window"),
    ("huge-window", {"kv": {"policy": "streaming", "window": 10**12}}, "kv.window"),
    ("huge-sink-tokens", {"kv": {"policy": "streaming", "sink_tokens": 10**12}}, "kv.sink_tokens"),
    ("nan-keep-ratio", {"kv": {"policy": "l2norm", "keep_ratio": float("nan")}}, "kv.keep_ratio"),
    ("nan-min-keep", {"kv": {"policy": "head_aware", "budget": 64, "min_keep": float("nan")}}, "kv.min_keep"),
    ("nan-importance", {"kv": {"policy": "head_aware", "budget": 64, "importance": [[float("nan"), 0.5]] * 2}},
     "kv.importance"),
    ("importance-not-a-matrix", {"kv": {"policy": "head_aware", "budget": 64, "importance": "high"}},
     "kv.importance"),
    ("calibration-files-a-string", {"kv": {"policy": "head_aware", "budget": 64, "calibration_files": "/etc/hosts"}},
     "kv.calibration_files"),
    ("calibration-file-missing", {"kv": {"policy": "head_aware", "budget": 64,
                                         "calibration_files": ["/nonexistent/calibration.txt"]}},
     "kv.calibration_files[0]"),
    ("policy-a-list", {"kv": {"policy": ["streaming"]}}, "kv.policy"),
    ("kv-parameter-not-a-name", {"kv": {"policy": "streaming", 5: 1}}, "kv.5"),
    ("spec-field-not-a-name", {"spec": {"drafter": "none", 5: 1}}, "spec.5"),
    ("name-parent-dirs", {"name": "../../escaped"}, "name"),
    ("name-absolute", {"name": "/tmp/escaped"}, "name"),
    ("name-hidden", {"name": ".hidden"}, "name"),
    ("name-with-space", {"name": "two words"}, "name"),
    ("description-a-list", {"description": ["a"]}, "description"),
    ("source-with-control-character", {"target": {"source": "model\x01dir"}}, "target.source"),
    ("missing-local-dir", {"target": {"source": "./no/such/model"}}, "target.source"),
    ("missing-home-dir", {"target": {"source": "~/no-such-model-dir-for-toolkit"}}, "target.source"),
    ("missing-gguf", {"target": {"source": "/nonexistent/model.gguf"}}, "target.source"),
    ("missing-draft-dir", {"draft": {"source": "./no/such/draft", "device": "cpu"}, "spec": {"drafter": "draft_model"}},
     "draft.source"),
    ("dir-without-config", {"target": {"source": "NOCFG"}}, "target.source"),
    ("draft-other-vocab-size", {"draft": {"source": "WIDE", "device": "cpu"}, "spec": {"drafter": "draft_model"}},
     "draft.source"),
]


def _paths(value, models):
    """Replace the placeholders TINY / WIDE / NOCFG by the fixture's directories."""
    if isinstance(value, dict):
        return {k: _paths(v, models) for k, v in value.items()}
    return {"TINY": str(models["tiny"]), "WIDE": str(models["wide"]), "NOCFG": str(models["nocfg"])}.get(value, value) \
        if isinstance(value, str) else value


@pytest.mark.parametrize("overrides,field", [p[1:] for p in RECIPE_PROBES], ids=[p[0] for p in RECIPE_PROBES])
def test_recipe_probe(models, tmp_path, overrides, field):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(merge(base_recipe(models), _paths(overrides, models))))
    result = cli("generate", "--recipe", path, "--no-chat", "--max-new-tokens", 2, "hello")
    assert_one_line_error(result, field)


# ------------------------------------------------------------------------------------------------- recipe files
@pytest.mark.parametrize("text,field", [
    ("- a list\n- not a mapping\n", "recipe"),
    ("name: [unclosed\n", "recipe"),
    (b"name: caf\xe9\n", "recipe"),
    ("target: {precision: int3}\n", "target.precision"),
    ("spec: null\n", "spec"),
    ("unknown_section: 1\n", "unknown_section"),
    ('prompts: "a\\0b"\nspec: {drafter: none}\ndraft: null\n', "prompts"),
], ids=["yaml-list", "yaml-syntax", "not-utf8", "unknown-precision", "null-section", "unknown-section", "nul-in-suite"])
def test_recipe_file_probe(tmp_path, text, field):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_one_line_error(cli("run", path), field)


def test_unknown_recipe_name_and_directory(tmp_path):
    message = assert_one_line_error(cli("run", "no-such-recipe"), "recipe")
    assert "short" in message  # the shipped names are listed
    assert_one_line_error(cli("eval", tmp_path), "recipe")  # a directory is not a recipe


# ------------------------------------------------------------------------------------------------- models
def test_fake_gguf_gives_one_error_and_leaves_no_lock(models, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(merge(base_recipe(models), {"target": {"source": str(models["fake"])}})))
    message = assert_one_line_error(cli("generate", "--recipe", path, "--no-chat", "hello"), "target.source")
    assert "GGUF" in message
    cache = tmp_path / "cache"
    assert not cache.exists() or not [p.name for p in cache.iterdir()], list(cache.iterdir())


def test_hub_ids_are_not_mistaken_for_paths():
    from toolkit.models.embedded import looks_like_path

    assert not looks_like_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not looks_like_path("gpt2")
    for value in ("./model", "../model", "~/model", "/abs/model", "model.gguf", "a/b/c", "dir\\model"):
        assert looks_like_path(value), value


# ------------------------------------------------------------------------------------------------- prompts
def _generate(models, tmp_path, prompt: str, max_new: int = 2, kv: dict | None = None, chat: bool = False,
              stdin: str | None = None):
    recipe = base_recipe(models)
    if kv is not None:
        recipe["kv"] = kv
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return cli("generate", "--recipe", path, "--chat" if chat else "--no-chat", "--max-new-tokens", max_new,
               "--no-stream", prompt, stdin=stdin)


REINDEX = {"policy": "streaming", "sink_tokens": 4, "window": 16, "compress_interval": 4, "position_mode": "reindex"}
ABSOLUTE = {"policy": "streaming", "sink_tokens": 4, "window": 16, "compress_interval": 4}


@pytest.mark.parametrize("prompt,max_new,kv,chat,field", [
    ("", 2, None, False, "prompt"),
    ("-", 2, None, False, "prompt"),  # '-' reads stdin, which is empty
    ("x" * (MAX_POSITIONS + 10), 2, None, False, "prompt"),
    ("x" * (MAX_POSITIONS + 10), 2, REINDEX, False, "prompt"),  # reindexing starts after the prefill
    ("x" * 40, 40, None, False, "generation.max_new_tokens"),
    ("x" * 40, 40, ABSOLUTE, False, "generation.max_new_tokens"),  # absolute positions grow past the context
    ("hello", 2, None, True, "prompt"),  # a chat prompt on a tokenizer without a chat template
], ids=["empty", "empty-stdin", "longer-than-context", "longer-than-context-reindex", "past-context",
        "past-context-streaming-absolute", "chat-without-template"])
def test_prompt_probe(models, tmp_path, prompt, max_new, kv, chat, field):
    result = _generate(models, tmp_path, prompt, max_new, kv, chat, stdin="" if prompt == "-" else None)
    assert_one_line_error(result, field)


def test_reindex_may_run_past_the_context(models, tmp_path):
    """StreamingLLM with position_mode: reindex feeds slot positions: generation past the context is valid."""
    result = _generate(models, tmp_path, "x" * 40, 2 * MAX_POSITIONS, REINDEX)
    assert result.exit_code == 0, result.output


def test_reindex_window_must_leave_room_for_a_verify_forward(models, tmp_path):
    """Reindexed slots reach sink_tokens + window + compress_interval + K: a window that fits only without the K
    draft tokens was an internal error (a ValueError in the middle of the generation)."""
    recipe = merge(base_recipe(models), {"spec": {"drafter": "ngram", "num_draft_tokens": 8},
                                         "kv": {**REINDEX, "window": 40, "compress_interval": 19}})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = cli("generate", "--recipe", path, "--no-chat", "--no-stream", "--max-new-tokens", 150, "ab" * 10)
    assert_one_line_error(result, "kv.window")


# ------------------------------------------------------------------------------------------------- prompt suites
SUITE_PROBES = [
    ("suite-a-list", "- a\n- b\n", "prompts"),
    ("suite-no-prompts", "name: x\n", "prompts"),
    ("suite-yaml-syntax", "prompts: [unclosed\n", "prompts"),
    ("entry-not-a-mapping", "prompts: [just text]\n", "prompts[0]"),
    ("bad-kind", "prompts: [{kind: poem}]\n", "prompts[0].kind"),
    ("messages-a-string", "prompts: [{kind: chat, messages: hello}]\n", "prompts[0].messages"),
    ("message-without-content", "prompts: [{kind: chat, messages: [{role: user}]}]\n", "prompts[0].messages[0]"),
    ("files-a-string", "prompts: [{kind: code, source: {files: a.py}}]\n", "prompts[0].source.files"),
    ("start-line-a-word", "prompts: [{kind: code, source: {files: ['stdlib:os.py'], start_line: first}}]\n",
     "prompts[0].source.start_line"),
    ("start-line-zero", "prompts: [{kind: code, source: {files: ['stdlib:os.py'], start_line: 0}}]\n",
     "prompts[0].source.start_line"),
    ("num-lines-negative", "prompts: [{kind: code, source: {files: ['stdlib:os.py'], num_lines: -3}}]\n",
     "prompts[0].source.num_lines"),
    ("start-line-past-the-end", "prompts: [{kind: code, source: {files: ['stdlib:os.py'], start_line: 999999}}]\n",
     "prompts[0].source.start_line"),
    ("template-other-field", "prompts: [{kind: text, template: 'hi {name}'}]\n", "prompts[0].template"),
    ("unknown-entry-field", "prompts: [{kind: text, template: hi, colour: red}]\n", "prompts[0].colour"),
    ("id-a-list", "prompts: [{kind: text, template: hi, id: [1]}]\n", "prompts[0].id"),
    ("reference-empty", "prompts: [{kind: text, template: hi, reference: '  '}]\n", "prompts[0].reference"),
    ("reference-a-list", "prompts: [{kind: text, template: hi, reference: [an answer]}]\n", "prompts[0].reference"),
]


@pytest.mark.parametrize("text,field", [p[1:] for p in SUITE_PROBES], ids=[p[0] for p in SUITE_PROBES])
def test_prompt_suite_probe(models, tmp_path, text, field):
    suite = tmp_path / "suite.yaml"
    suite.write_text(text)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(merge(base_recipe(models), {"prompts": str(suite)})))
    assert_one_line_error(cli("run", recipe, "--out", tmp_path / "out"), field)


# ------------------------------------------------------------------------------------------------- search spaces
def _space(**changes) -> dict:
    space = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes/search/short.yaml").read_text())
    for key, value in changes.items():
        if value is None:
            space.pop(key, None)
        else:
            space[key] = value
    return space


SPACE_PROBES = [
    ("space-a-list", "- a\n", "search"),
    ("space-yaml-syntax", "space: [unclosed\n", "search"),
    ("choices-a-string", {"space": {"x": {"path": "target.precision", "choices": "fp32"}}}, "search.space.x.choices"),
    ("path-not-a-string", {"space": {"x": {"path": 5, "choices": ["fp32"]}}}, "search.space.x.path"),
    ("when-a-list", {"space": {"a": {"path": "target.precision", "choices": ["fp32"]},
                               "b": {"path": "generation.seed", "choices": [0], "when": ["a"]}}},
     "search.space.b.when"),
    ("disabled-a-string", {"space": {"x": {"path": "target.precision", "choices": ["fp32", "bf16"],
                                           "disabled": "bf16"}}}, "search.space.x.disabled"),
    ("fragment-not-a-mapping", {"space": {"x": {"choices": {"a": "fp32"}}}}, "search.space.x.choices.a"),
    ("space-not-a-mapping", {"space": ["x"]}, "search.space"),
    ("nan-constraint", {"constraints": {"ppl_ratio_max": float("nan")}}, "search.constraints.ppl_ratio_max"),
    ("unknown-constraint", {"constraints": {"speed": 1}}, "search.constraints.speed"),
    ("rouge-l-above-one", {"constraints": {"min_rouge_l": 1.5}}, "search.constraints.min_rouge_l"),
    ("inf-timeout", {"timeout_s": float("inf")}, "search.timeout_s"),
    ("huge-trials", {"trials": 10**9}, "search.trials"),
    ("unknown-eval-setting", {"eval": {"num_prompt": 2}}, "search.eval.num_prompt"),
    ("bad-eval-setting", {"eval": {"repeats": 0}}, "search.eval.repeats"),
    ("scenario-a-list", {"scenario": ["short"]}, "search.scenario"),
    ("seed-not-a-mapping", {"seeds": {"a": "fp32"}}, "search.seeds"),
    ("heldout-num-prompts-a-word", {"heldout": {"prompts": "short-heldout", "num_prompts": "four"}},
     "search.heldout.num_prompts"),
]


@pytest.mark.parametrize("content,field", [p[1:] for p in SPACE_PROBES], ids=[p[0] for p in SPACE_PROBES])
def test_search_space_probe(tmp_path, nothing_heavy, content, field):
    path = tmp_path / "space.yaml"
    if isinstance(content, str):
        path.write_text(content)
    else:
        space = _space(**{k: v for k, v in content.items() if k != "space"})
        if "space" in content:
            space["space"] = content["space"]
            space["seeds"] = {}
        path.write_text(yaml.safe_dump(space, sort_keys=False))
    result = cli("search", "--scenario", "short", "--space", path, "--out", tmp_path / "found", "--no-finalize")
    assert_one_line_error(result, field)


@pytest.mark.parametrize("args,field", [
    (["--budget-mb", "nan"], "--budget-mb"),
    (["--budget-mb", "-5"], "--budget-mb"),
    (["--timeout", "inf"], "--timeout"),
    (["--workers", "100000"], "--workers"),
], ids=["nan-budget", "negative-budget", "inf-timeout", "too-many-workers"])
def test_search_option_probe(tmp_path, nothing_heavy, args, field):
    assert_one_line_error(cli("search", "--scenario", "short", "--out", tmp_path / "found", *args), field)


@pytest.mark.parametrize("args,field", [
    (["run"], "recipe"),
    (["frobnicate"], "frobnicate"),
    (["run", "short", "--repeats", "0"], "--repeats"),
    (["draft", "distill", "--layers", "two"], "--layers"),
    (["export", "vllm", "/nonexistent/recipe.yaml"], "recipe"),
], ids=["missing-argument", "unknown-command", "option-out-of-range", "option-not-an-int", "missing-file-argument"])
def test_usage_error_probe(nothing_heavy, args, field):
    """Errors of the command line itself are one line too (not click's usage panel)."""
    assert_one_line_error(cli(*args), field)


@pytest.mark.parametrize("command", [["run", "short"], ["eval", "short"], ["search", "--scenario", "short"]],
                         ids=["run", "eval", "search"])
def test_out_that_is_a_file(tmp_path, nothing_heavy, command):
    (tmp_path / "file").write_text("x")
    assert_one_line_error(cli(*command, "--out", tmp_path / "file" / "sub"), "--out")


def test_no_arguments_still_prints_the_help():
    result = cli()
    assert "Usage" in result.output and "error:" not in result.output


@pytest.mark.parametrize("url", ["bogus://x", "postgresql://user:s3cr3t@127.0.0.1:1/db"], ids=["scheme", "refused"])
def test_storage_that_cannot_be_opened(tmp_path, monkeypatch, url):
    import eval.search.study

    monkeypatch.setattr(eval.search.study.Run, "optimize", lambda *a, **k: pytest.fail("the search started"))
    result = cli("search", "--scenario", "short", "--out", tmp_path / "found", "--storage", url, "--no-finalize")
    assert_one_line_error(result, "--storage")
    assert "s3cr3t" not in result.output


def test_unknown_scenario(tmp_path, nothing_heavy):
    assert_one_line_error(cli("search", "--scenario", "fast", "--out", tmp_path / "found"), "scenario")


# ------------------------------------------------------------------------------------------------- CLI options
@pytest.mark.parametrize("value", ["nan", "-1"])
def test_bad_temperature_option_refused_before_loading(models, tmp_path, nothing_heavy, value):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(base_recipe(models)))
    result = cli("generate", "--recipe", path, "--no-chat", "--do-sample", "--temperature", value, "hello")
    assert_one_line_error(result, "generation.temperature")


def test_huge_max_new_tokens_option(models, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(base_recipe(models)))
    assert_one_line_error(cli("run", path, "--max-new-tokens", 10**12), "generation.max_new_tokens")


@pytest.mark.parametrize("args,field", [
    (["--temperature", "nan"], "temperature"),
    (["--lr", "inf"], "lr"),
    (["--max-minutes", "inf"], "max_minutes"),
    (["--seed", str(2**64)], "seed"),
    (["--tokens", "99999999999999G"], "tokens"),
], ids=["nan-temperature", "inf-lr", "inf-minutes", "huge-seed", "huge-tokens"])
def test_distill_option_probe(tmp_path, nothing_heavy, args, field):
    result = cli("draft", "distill", "--out", tmp_path / "draft", *args)
    assert_one_line_error(result, field)


@pytest.mark.parametrize("args,field", [
    (["--minutes", "nan"], "minutes"),
    (["--reg-weight", "inf"], "reg_weight"),
    (["--seed", str(2**64)], "seed"),
], ids=["nan-minutes", "inf-reg-weight", "huge-seed"])
def test_eagle_option_probe(tmp_path, nothing_heavy, args, field):
    assert_one_line_error(cli("draft", "eagle", "--out", tmp_path / "head", *args), field)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="probes cuda on a machine without CUDA")
def test_cuda_without_cuda(models, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(merge(base_recipe(models), {"target": {"device": "cuda"}})))
    assert_one_line_error(cli("generate", "--recipe", path, "--no-chat", "hello"), "target.device")


def test_eagle_draft_vocab_larger_than_the_target(tmp_path):
    from toolkit.distill.eagle_train import EagleTrainConfig, train_head
    from toolkit.errors import ConfigError

    config = EagleTrainConfig(out=tmp_path / "head", draft_vocab=1000, data=["/nonexistent/*.txt"])
    with pytest.raises(ConfigError, match="draft_vocab"):
        train_head(config, target=tiny_llama(vocab=128), tokenizer=char_tokenizer(), progress=False)
    assert not (tmp_path / "head").exists()  # refused before anything was written


# ------------------------------------------------------------------------------------------------- --force
@pytest.mark.parametrize("command", [["draft", "distill", "--tokens", "1k"], ["draft", "eagle"]],
                         ids=["distill", "eagle"])
@pytest.mark.parametrize("where", ["foreign", "cwd", "home"])
def test_force_deletes_only_what_the_toolkit_created(tmp_path, monkeypatch, nothing_heavy, command, where):
    target = {"foreign": tmp_path / "mine", "cwd": tmp_path, "home": tmp_path / "home"}[where]
    target.mkdir(exist_ok=True)
    (target / "precious.txt").write_text("keep me")
    if where == "home":
        monkeypatch.setenv("HOME", str(target))
    if where == "cwd":
        from toolkit.outdirs import MARKER

        (target / MARKER).write_text("{}")  # even a marked directory is refused when it is the working directory
    result = cli(*command, "--out", "." if where == "cwd" else target, "--force")
    assert_one_line_error(result, "out")
    assert (target / "precious.txt").read_text() == "keep me"


def test_force_deletes_a_directory_the_toolkit_created(tmp_path):
    from toolkit.outdirs import MARKER, make_output_dir, remove_output_dir

    out = tmp_path / "run"
    make_output_dir(out, "out")
    assert (out / MARKER).is_file()
    (out / "checkpoint").write_text("x")
    remove_output_dir(out, "out")
    assert not out.exists()


# ------------------------------------------------------------------------------------------------- the CLI itself
def test_internal_errors_say_so_and_debug_shows_the_traceback(models, tmp_path, monkeypatch):
    import toolkit.speculative_lm

    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(toolkit.speculative_lm.SpeculativeLM, "generate", broken)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(base_recipe(models)))
    result = cli("generate", "--recipe", path, "--no-chat", "--no-stream", "hello")
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("internal error:") and "simulated bug" in line and "--debug" in line
    result = cli("--debug", "generate", "--recipe", path, "--no-chat", "--no-stream", "hello")
    assert isinstance(result.exception, RuntimeError)  # re-raised: the traceback is printed by the interpreter


def test_debug_shows_the_traceback_of_a_user_error(tmp_path):
    result = cli("--debug", "run", "no-such-recipe")
    assert result.exit_code != 0 and isinstance(result.exception, ToolkitError)


# ------------------------------------------------------------------------------------------------- Python API
def test_api_probes(models):
    """The same checks reached through the Python API raise one ToolkitError naming the field."""
    from toolkit.recipe import GenerationSpec, ModelSpec, Recipe, SpeculationSpec
    from toolkit.speculative_lm import build

    recipe = Recipe(name="api", target=ModelSpec(source=str(models["tiny"]), device="cpu"), draft=None,
                    spec=SpeculationSpec("none"), generation=GenerationSpec(max_new_tokens=2))
    generator = build(recipe)
    for kwargs, field in (({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"),
                          ({"prompt": [{"role": "user"}]}, "prompt"),
                          ({"prompt": "hi", "temperature": float("nan")}, "generation.temperature"),
                          ({"prompt": "hi", "seed": 2**64}, "generation.seed"),
                          ({"prompt": "hi", "eos_token_id": [128]}, "generation.eos_token_id[0]"),
                          ({"prompt": "hi", "colour": 1}, "generation.colour")):
        with pytest.raises(ToolkitError, match=field.replace("[", r"\[").replace("]", r"\]")):
            generator.generate(**kwargs)
    with pytest.raises(ToolkitError, match="name"):
        Recipe(name="a/b")
    assert os.environ["TOOLKIT_CACHE_DIR"]  # the autouse fixture's cache, not the user's

"""Export of recipes to vLLM / SGLang: exact keys for what the engines express, a warning naming the recipe field for
everything they cannot, and the ``toolkit export`` command writing what it prints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.errors import ConfigError
from toolkit.export import export
from toolkit.export.common import EMBEDDED_HUB_ID
from toolkit.recipe import Recipe


def _recipe(**sections) -> Recipe:
    base = {"name": "t", "target": {"source": "models/target", "precision": "fp32"},
            "draft": {"source": "models/draft", "precision": "fp32"}, "kv": {"policy": "none"},
            "draft_kv": {"policy": "none"}, "spec": {"drafter": "draft_model", "num_draft_tokens": 5},
            "generation": {"max_new_tokens": 64}}
    base.update(sections)
    return Recipe.from_dict(base)


def test_draft_model_recipe_maps_exactly_and_without_warnings():
    r = _recipe()
    v = export(r, "vllm")
    assert v.warnings == []
    assert v.config == {"model": "models/target", "dtype": "float32", "kv_cache_dtype": "auto",
                        "speculative_config": {"method": "draft_model", "model": "models/draft",
                                               "num_speculative_tokens": 5}}
    assert v.sampling["temperature"] == 0.0 and v.sampling["max_tokens"] == 64
    assert "--speculative-config" in v.command and '"num_speculative_tokens":5' in v.command
    s = export(r, "sglang")
    assert s.warnings == []
    assert s.config == {"model_path": "models/target", "dtype": "float32", "kv_cache_dtype": "auto",
                        "speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "models/draft",
                        "speculative_num_steps": 5, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 6}
    assert "--speculative-algorithm STANDALONE" in s.command and "--speculative-num-steps 5" in s.command


def test_ngram_and_quantized_target():
    r = _recipe(target={"source": "models/target", "precision": "int4"}, draft=None,
                spec={"drafter": "ngram", "num_draft_tokens": 3, "max_ngram": 4, "min_ngram": 2})
    v = export(r, "vllm")
    assert v.config["quantization"] == "bitsandbytes" and v.config["dtype"] == "auto"
    assert v.config["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    s = export(r, "sglang")
    assert s.config["speculative_algorithm"] == "NGRAM" and s.config["quantization"] == "bitsandbytes"
    assert s.config["speculative_num_draft_tokens"] == 3 and not any("ngram" in k for k in s.config)
    assert any(w.startswith("spec.max_ngram: 4") for w in s.warnings)  # a trie there: listed as gaps
    assert any(w.startswith("spec.min_ngram: 2") for w in s.warnings)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_everything_an_engine_cannot_express_is_a_warning_naming_the_field(engine):
    r = _recipe(draft={"source": "models/draft", "precision": "int4"},
                kv={"policy": "l2norm", "budget": 128},
                draft_kv={"policy": "streaming", "sink_tokens": 4, "window": 60},
                spec={"drafter": "draft_model", "num_draft_tokens": 4, "adaptive": "ema", "k_max": 8,
                      "confidence_threshold": 0.3},
                target={"source": "embedded", "precision": "int8"},
                generation={"max_new_tokens": 32, "ignore_eos": True})
    warnings = export(r, engine).warnings
    for field in ("kv.policy: l2norm", "draft_kv.policy: streaming", "spec.adaptive: ema",
                  "spec.confidence_threshold", "draft.precision: int4", "target.precision: int8", "target.source",
                  "generation.ignore_eos"):
        assert sum(w.startswith(field) for w in warnings) == 1, (field, warnings)
    assert len(warnings) == 8
    # the draft cache policy is irrelevant (and not warned about) when no draft model runs
    r2 = _recipe(draft=None, draft_kv={"policy": "streaming", "sink_tokens": 4, "window": 60},
                 spec={"drafter": "ngram", "num_draft_tokens": 4})
    assert not any(w.startswith("draft_kv") for w in export(r2, engine).warnings)


def test_unknown_engine_is_a_config_error():
    with pytest.raises(ConfigError, match="engine"):
        export(_recipe(), "tgi")


def test_shipped_recipes_export(tmp_path):
    from toolkit.resources import shipped

    for path in sorted(shipped("").glob("*.yaml")):
        r = Recipe.load(path)
        for engine in ("vllm", "sglang"):
            e = export(r, engine)
            assert e.command and all(isinstance(w, str) and w for w in e.warnings)
            if r.kv.policy != "none":
                assert any(w.startswith("kv.policy") for w in e.warnings)


def test_cli_prints_and_writes_with_warnings(tmp_path):
    from typer.testing import CliRunner

    from toolkit_cli import app

    recipe = tmp_path / "r.yaml"
    _recipe(kv={"policy": "streaming", "sink_tokens": 4, "window": 60}).save(recipe)
    runner = CliRunner()
    res = runner.invoke(app, ["export", "vllm", str(recipe), "--out", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["config"]["speculative_config"]["method"] == "draft_model"
    assert len(written["warnings"]) == 1 and written["warnings"][0].startswith("kv.policy: streaming")
    assert '"speculative_config"' in res.stdout
    res = runner.invoke(app, ["export", "sglang", str(recipe), "--out", str(tmp_path / "r.sh")])
    assert res.exit_code == 0, res.output
    script = (tmp_path / "r.sh").read_text()
    assert "# WARNING: kv.policy: streaming" in script and "--speculative-algorithm STANDALONE" in script
    assert script in res.stdout


def test_cli_exports_a_shipped_recipe_by_name_and_names_the_field_of_an_unknown_one(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from toolkit_cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["export", "vllm", "short-draft"])  # as `toolkit run short-draft` takes it
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "short-draft.vllm.json").read_text())["config"]["speculative_config"]
    res = runner.invoke(app, ["export", "sglang", "no-such-recipe"])
    assert res.exit_code == 2 and "recipe: no file or shipped name 'no-such-recipe'" in res.output
    assert not list(tmp_path.glob("no-such-recipe*"))


@pytest.mark.parametrize("config, vllm_method, sglang_algorithm", [
    ({"architectures": ["LlamaForCausalLM"], "toolkit_eagle": {"variant": "eagle1"}}, "eagle", "EAGLE"),
    ({"architectures": ["LlamaForCausalLMEagle3"]}, "eagle3", "EAGLE3"),  # a published EAGLE-3 head
    ({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}, "eagle3", "EAGLE3"),  # speculators
    (None, "eagle", "EAGLE"),  # no readable head here: EAGLE-1, the common layout
])
def test_eagle_method_follows_the_heads_layout(tmp_path, config, vllm_method, sglang_algorithm):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    r = _recipe(draft={"source": str(tmp_path), "precision": "bf16"}, spec={"drafter": "eagle", "num_draft_tokens": 3})
    assert export(r, "vllm").config["speculative_config"]["method"] == vllm_method
    assert export(r, "sglang").config["speculative_algorithm"] == sglang_algorithm


# ------------------------------------------------------------------------------------------------ hostile values
def _fake_engine(bin_dir: Path, name: str, record: Path) -> None:
    """An executable ``name`` on PATH that records its argv as JSON and runs nothing else."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    tool.chmod(0o755)


def _run_script(script: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path)}
    return subprocess.run(["sh", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_hostile_recipe_values_never_run_as_shell_commands(tmp_path, engine):
    """Model sources with ``$(...)``, backticks and ``;``, stop strings with newlines, a recipe name with ``;``, a
    KV parameter list with a newline: the generated script parses (``bash -n``), and run with a fake engine on PATH
    it starts the engine with exactly the recipe's values as arguments and nothing else runs."""
    from toolkit.export import render

    marker = tmp_path / "pwned"
    m = str(marker)
    target = f"x$(touch {m}1)"
    draft = f"d`touch {m}2`;touch {m}3"
    recipe = _recipe(target={"source": "t", "precision": "fp32"}, draft={"source": "d", "precision": "fp32"},
                     kv={"policy": "head_aware", "budget": 64},
                     generation={"max_new_tokens": 8, "stop_strings": [f"\ntouch {m}5\n", f"$(touch {m}6)'\"",
                                                                        "\u2028touch x"]})
    # set after validation (which refuses most of them): the exporter must not rely on it
    recipe.target.source, recipe.draft.source = target, draft
    recipe.kv.params["calibration_files"] = [f"a\ntouch {m}4\n"]
    recipe.name = f"r;touch {m}7\ntouch {m}8"
    exp = export(recipe, engine)
    text, _ = render(exp)
    script = tmp_path / "serve.sh"
    if engine == "vllm":
        script.write_text("#!/bin/sh\n" + json.loads(text)["command"] + "\n")
    else:
        script.write_text(text)
        assert all(line.startswith(("#", "exec ")) for line in text.splitlines() if line), text
    if shutil.which("bash"):
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
    record = tmp_path / "argv.json"
    _fake_engine(tmp_path / "bin", "vllm" if engine == "vllm" else "python", record)
    result = _run_script(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob("pwned*")), "a recipe value ran as a shell command"
    argv = json.loads(record.read_text())
    if engine == "vllm":
        assert argv[:2] == ["serve", target] and json.loads(argv[argv.index("--speculative-config") + 1])["model"] == draft
    else:
        assert argv[:2] == ["-m", "sglang.launch_server"]
        assert argv[argv.index("--model-path") + 1] == target
        assert argv[argv.index("--speculative-draft-model-path") + 1] == draft


@pytest.mark.parametrize("section, value", [
    ("target", "models/t\nrm -rf ~"), ("target", "models/t\rx"), ("draft", "d\x1b[2J"), ("draft", "--trust-remote-code"),
    ("target", "-x"), ("draft", "a\u2028b"),
])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_control_characters_and_option_like_sources_are_refused(engine, section, value):
    with pytest.raises(ConfigError) as info:  # by the recipe's validation or, at the latest, by the exporter
        export(_recipe(**{section: {"source": value, "precision": "fp32"}}), engine)
    assert info.value.field == f"{section}.source"
    if section == "draft":
        with pytest.raises(ConfigError) as info:
            export(_recipe(draft={"source": value, "precision": "bf16"},
                           spec={"drafter": "eagle", "num_draft_tokens": 3}), engine)
        assert info.value.field == "draft.source"


def test_comment_lines_escape_every_line_break():
    from toolkit.export import Export, render

    exp = Export("sglang", {}, {"stop": ["\n"]}, "python -m sglang.launch_server", ["a\nb", "c\rd\x1b[31m", "e\u2029f"],
                 recipe="n\nx")
    text, _ = render(exp)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh" and lines[-1].startswith("exec ") and all(x.startswith("# ") for x in lines[1:-1])
    assert "# WARNING: a\\nb" in text and "c\\rd\\x1b[31m" in text and "e\\u2029f" in text


# ------------------------------------------------------------------------------------------------ engine schema
#: vLLM's ``SpeculativeConfig`` (vllm/config/speculative.py, vLLM main at commit 002e77c1, Nov 2026): the fields an
#: export may set and their types, and the ``SpeculativeMethod`` values among those this toolkit emits. vLLM does not
#: install on a CPU-only machine, so the exports are held against this table, written from that source.
VLLM_SPECULATIVE_FIELDS = {
    "method": str, "model": str, "num_speculative_tokens": int, "quantization": str,
    "prompt_lookup_max": int, "prompt_lookup_min": int,
    "suffix_decoding_max_tree_depth": int, "suffix_decoding_max_cached_requests": int,
    "suffix_decoding_max_spec_factor": float, "suffix_decoding_min_token_prob": float,
}
VLLM_METHODS = {"ngram", "draft_model", "suffix", "eagle", "eagle3"}


def _every_drafter_recipe():
    from toolkit.resources import shipped

    recipes = [Recipe.load(p) for p in sorted(shipped("").glob("*.yaml"))]
    recipes += [_recipe(spec={"drafter": name, "num_draft_tokens": 3})
                for name in ("draft_model", "self", "ngram", "suffix", "lookup")]
    return recipes


def test_vllm_speculative_config_matches_the_engines_schema():
    seen = set()
    for r in _every_drafter_recipe():
        spec = export(r, "vllm").config.get("speculative_config")
        if spec is None:
            continue
        unknown = set(spec) - set(VLLM_SPECULATIVE_FIELDS)
        assert not unknown, (r.name, unknown)
        for key, value in spec.items():
            kind = VLLM_SPECULATIVE_FIELDS[key]
            assert isinstance(value, kind) and not isinstance(value, bool), (r.name, key, value)
        assert spec["method"] in VLLM_METHODS and spec["num_speculative_tokens"] >= 1
        assert spec.get("prompt_lookup_min", 1) <= spec.get("prompt_lookup_max", 1 << 30)
        assert 0.0 <= spec.get("suffix_decoding_min_token_prob", 0.0) <= 1.0
        seen.add(spec["method"])
    assert {"ngram", "draft_model", "suffix"} <= seen


def test_suffix_knobs_reach_vllm_suffix_decoding():
    r = _recipe(draft=None, spec={"drafter": "suffix", "num_draft_tokens": 6, "max_spec_factor": 2.5,
                                  "min_token_prob": 0.2, "max_cached_requests": 0, "suffix_depth": 32})
    spec = export(r, "vllm").config["speculative_config"]
    assert spec == {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_spec_factor": 2.5,
                    "suffix_decoding_min_token_prob": 0.2, "suffix_decoding_max_cached_requests": 0,
                    "suffix_decoding_max_tree_depth": 32}


def test_lookup_to_vllm_warns_of_what_suffix_decoding_cannot_express():
    """lookup -> vLLM suffix decoding: its memory and depth carry over; the longest-match search and the match-length
    prior do not, and the warnings say so with our values."""
    r = _recipe(draft=None, spec={"drafter": "lookup", "num_draft_tokens": 8, "max_match": 24})
    exp = export(r, "vllm")
    assert exp.config["speculative_config"]["method"] == "suffix"
    gaps = [w for w in exp.warnings if w.startswith(("spec.max_match", "spec.prior_"))]
    assert len(gaps) == 2 and "24 — the longest match" in gaps[0] and "-1.79 / 1.22 / 1.3" in gaps[1]


#: SGLang's launch flags as its parser defines them (python/sglang/srt/server_args.py, generated from the
#: ServerArgs dataclass by arg_groups/arg_utils.py; rules from arg_groups/speculative_hook.py), sgl-project/sglang
#: at commit 001067ff, Nov 2026: the flags an export may set, their types and choices. SGLang does not install on a
#: CPU-only machine, so the exports are held against this table, written from that source.
SGLANG_FLAGS = {
    "model_path": str, "dtype": ("auto", "half", "float16", "bfloat16", "float", "float32"),
    "quantization": ("awq", "fp8", "gptq", "marlin", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf"),
    "kv_cache_dtype": ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16",
                       "fp4_e2m1"),
    "speculative_algorithm": ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK"),
    "speculative_draft_model_path": str, "speculative_num_steps": int, "speculative_eagle_topk": int,
    "speculative_num_draft_tokens": int,
}


def test_sglang_flags_match_the_engines_parser():
    """Every exported flag exists in SGLang's parser with its type / choices, and the speculative settings obey its
    hook: the EAGLE family (EAGLE, EAGLE3, STANDALONE) gives steps, topk and draft tokens together, with draft
    tokens = steps + 1 when topk is 1, and a draft model path; NGRAM takes only the draft-token count."""
    seen = set()
    for r in _every_drafter_recipe():
        exp = export(r, "sglang")
        config = exp.config
        assert not set(config) - set(SGLANG_FLAGS), (r.name, set(config) - set(SGLANG_FLAGS))
        for key, value in config.items():
            kind = SGLANG_FLAGS[key]
            if isinstance(kind, tuple):
                assert value in kind, (r.name, key, value)
            else:
                assert isinstance(value, kind) and not isinstance(value, bool), (r.name, key, value)
        algorithm = config.get("speculative_algorithm")
        seen.add(algorithm)
        if algorithm in ("EAGLE", "EAGLE3", "STANDALONE"):
            steps, topk, tokens = (config[k] for k in ("speculative_num_steps", "speculative_eagle_topk",
                                                       "speculative_num_draft_tokens"))
            assert min(steps, topk, tokens) >= 1 and (topk > 1 or tokens == steps + 1), (r.name, config)
            assert config["speculative_draft_model_path"] not in ("", "embedded"), r.name  # a path or a hub id
        elif algorithm == "NGRAM":
            assert {k for k in config if k.startswith("speculative_")} == {"speculative_algorithm",
                                                                          "speculative_num_draft_tokens"}
        args = exp.command.split()
        assert args[:3] == ["python", "-m", "sglang.launch_server"] and len(args[3:]) == 2 * len(config)
    assert {"STANDALONE", "NGRAM", "EAGLE", None} <= seen


def test_an_eagle_head_in_our_layout_is_exported_by_path_with_a_warning():
    from toolkit.eagle.checkpoint import SHIPPED
    from toolkit.resources import resolve

    r = Recipe.load(resolve("short-eagle", "", "recipe"))
    for engine, key in (("vllm", ("speculative_config", "model")), ("sglang", ("speculative_draft_model_path",))):
        exp = export(r, engine)
        value = exp.config[key[0]] if len(key) == 1 else exp.config[key[0]][key[1]]
        assert value == str(SHIPPED["embedded"]), engine  # not the word "embedded"
        assert any("this toolkit's layout" in w and
                   "toolkit draft export-head embedded --target embedded --layout eagle --out DIR" in w
                   for w in exp.warnings), engine


def test_a_speculators_head_is_served_by_vllm_and_converted_for_sglang(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Eagle3Speculator"],
                                                      "speculators_model_type": "eagle3"}))
    r = _recipe(draft={"source": str(tmp_path), "precision": "bf16"}, spec={"drafter": "eagle", "num_draft_tokens": 3})
    assert not [w for w in export(r, "vllm").warnings if "draft.source" in w]
    warnings = [w for w in export(r, "sglang").warnings if "draft.source" in w]
    assert len(warnings) == 1 and "speculators layout, which SGLang does not read" in warnings[0]
    assert "--layout eagle" in warnings[0]


@pytest.mark.parametrize("precision, says", [("native", "run here on the file's own Q4_1 / Q8_0 blocks"),
                                             ("int4", "dequantized here (precision int4)")])
def test_the_embedded_targets_warning_says_which_weights_ran_here(precision, says):
    from toolkit.export.common import model_path
    from toolkit.recipe import ModelSpec

    warnings: list[str] = []
    assert model_path(ModelSpec(source="embedded", precision=precision), "target", warnings) == EMBEDDED_HUB_ID
    assert len(warnings) == 1 and says in warnings[0]
    assert (".gguf (GGUF: the engine's support is partial)" in warnings[0]) == (precision == "native")

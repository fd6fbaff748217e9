"""The strongest baselines of ``--compare``: HF static-cache compiled AR (one graph for a whole suite) and the CPU
engines' worker protocol (llama.cpp / OpenVINO in their own interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_llama
from test_decoder import hf_greedy

from eval.evaluate import EvalSettings
from eval.runners import llamacpp_hint, selected_baselines, strongest_baselines
from toolkit.errors import ConfigError
from toolkit.measure import engines
from toolkit.measure.baselines import hf_generate
from toolkit.recipe import GenerationSpec, Recipe


@pytest.mark.slow
def test_static_compiled_ar_is_greedy_ar_with_one_graph_for_every_prompt_length():
    """``ar_static`` gives HF greedy AR's tokens, and a cache sized for the suite (``max_cache_len``) means prompts
    of other lengths reuse the first call's graph: dynamo compiles no new frame after the first call."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_llama(seed=3)
    gen = GenerationSpec(max_new_tokens=8, do_sample=False, ignore_eos=True)
    prompts = [torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 17)]
    frames = []
    for prompt in prompts:
        ids, stats = hf_generate(model, prompt, gen, [], method="ar_static", max_cache_len=64,
                                 compile_backend="eager")
        assert ids == hf_greedy(model, prompt, 8)
        assert stats.new_tokens == 8 and stats.target_forwards == 8
        frames.append(counters["stats"]["unique_graphs"])
    assert frames[0] >= 1, "the decoding step was not compiled"
    assert frames[1] == frames[0], f"recompiled for another prompt length: {frames}"
    torch._dynamo.reset()


def test_strongest_baselines_name_static_ar_where_compiling_pays_and_only_engines_that_apply(monkeypatch):
    monkeypatch.setattr(engines, "available", lambda: ["llamacpp_ar", "llamacpp_lookup", "openvino_ar"])
    monkeypatch.setattr("toolkit.models.llamacpp.installed", lambda: False)  # no ours_llamacpp row (test_llamacpp_*)
    recipe = Recipe.load("recipes/short.yaml")  # the embedded GGUF's own blocks
    int4 = tiny_llama()
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(int4, Int8WeightOnlyConfig())  # torchao weights: compiling pays on CPU
    assert strongest_baselines(recipe, int4) == ["ar_static", "llamacpp_ar", "llamacpp_lookup", "openvino_ar"]
    hub = Recipe.from_dict({**recipe.to_dict(), "target": {**recipe.to_dict()["target"], "source": "org/model",
                                                             "precision": "int4", "backend": "torchao"}})
    assert strongest_baselines(hub, int4) == ["ar_static", "openvino_ar"]  # llama.cpp needs a GGUF
    sampled = Recipe.from_dict({**recipe.to_dict(), "generation": {"max_new_tokens": 8, "do_sample": True}})
    assert strongest_baselines(sampled, int4) == ["ar_static"]  # the engines' samplers are not ours: greedy only
    fp32 = Recipe.load("recipes/short-exact.yaml")  # fp32 weights compile too (~1.3x a step on CPU)
    assert strongest_baselines(fp32, tiny_llama()) == ["ar_static", "llamacpp_ar", "llamacpp_lookup", "openvino_ar"]
    monkeypatch.setattr("toolkit.engine.forward.compile_pays", lambda model: False)  # bitsandbytes' opaque kernels
    assert strongest_baselines(fp32, tiny_llama()) == ["llamacpp_ar", "llamacpp_lookup", "openvino_ar"]


def test_compare_says_how_to_add_llama_cpps_rows_where_a_cpu_gguf_recipe_runs_without_them(monkeypatch):
    recipe = Recipe.load("recipes/short.yaml")  # the embedded GGUF's own blocks, greedy
    model = tiny_llama()
    monkeypatch.setattr("toolkit.models.llamacpp.PACKAGE", "no_such_llama_cpp")  # not installed, wherever this runs
    hint = llamacpp_hint(recipe, ["ours", "ar", "ar_static"], model)
    assert hint is not None and "`make llamacpp`" in hint and "llama.cpp's own AR" in hint
    monkeypatch.setattr("toolkit.models.llamacpp.PACKAGE", "json")  # installed, but a build that would crash
    monkeypatch.setattr("toolkit.models.llamacpp.unusable", lambda: "built with ggml's AMX kernels, which crash")
    assert llamacpp_hint(recipe, ["ours", "ar"], model) == "llama.cpp rows: left out: built with ggml's AMX " \
        "kernels, which crash"
    assert llamacpp_hint(recipe, ["ours", "ar", "llamacpp_ar", "llamacpp_lookup"], model) is None  # they run
    hub = Recipe.from_dict({**recipe.to_dict(), "target": {**recipe.to_dict()["target"], "source": "org/model",
                                                             "precision": "int4", "backend": "torchao"}})
    assert llamacpp_hint(hub, ["ours", "ar"], model) is None  # llama.cpp runs GGUF files only
    sampled = Recipe.from_dict({**recipe.to_dict(), "generation": {"max_new_tokens": 8, "do_sample": True}})
    assert llamacpp_hint(sampled, ["ours", "ar"], model) is None  # its rows are greedy only


def test_no_engines_without_their_interpreter(monkeypatch, tmp_path):
    monkeypatch.setattr("toolkit.models.llamacpp.installed", lambda: False)  # not this interpreter either
    monkeypatch.setenv("TOOLKIT_ENGINES_PYTHON", "off")
    assert engines.engines_python() is None
    monkeypatch.delenv("TOOLKIT_ENGINES_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(engines, "_CHECKOUT", tmp_path)
    assert engines.engines_python() is None and engines.available() == []
    with pytest.raises(engines.EngineError, match="install_engines.sh"):
        engines.EngineProcess(engines.ENGINES["llamacpp_ar"])


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch):
    """A ``llama_cpp`` package whose ``Llama`` echoes the prompt backwards: the worker's protocol, without
    llama.cpp."""
    package = tmp_path / "site" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent("""
        import numpy as np
        __version__ = "fake"

        class Llama:
            def __init__(self, model_path, **kwargs):
                self.kwargs, self.n_tokens = kwargs, 0
                print("engine chatter goes to stderr")  # the worker must keep stdout for replies

            def reset(self):
                self.n_tokens = 0

            def generate(self, tokens, **sampling):
                assert sampling["temp"] == 0.0 and sampling["top_k"] == 1
                assert self.n_tokens == 0, "the previous request's prefix was reused"
                assert len(tokens) < self.kwargs["n_ctx"], "the prompt does not fit the context"
                if self.kwargs.get("draft_model") is not None and not self.kwargs.get("logits_all"):
                    assert len(tokens) <= 512, "could not broadcast into shape (0,)"  # llama-cpp-python's scores
                self.n_tokens = len(tokens)
                for t in reversed(list(tokens) * 10):
                    yield t

            def eval(self, tokens):  # logits favour t + 1 after every token t; appended after n_tokens
                rows = np.eye(8, dtype=np.float32)[[(t + 1) % 8 for t in tokens]] * (5 + self.n_tokens)
                self.scores = np.concatenate([self.scores[:self.n_tokens], rows]) if self.n_tokens else rows
                self.n_tokens += len(tokens)
                self._ctx = self

            def kv_cache_seq_rm(self, seq, start, end):
                assert (seq, end) == (-1, -1) and start == self.n_tokens  # rolled back to the length just set
    """))
    (package / "llama_speculative.py").write_text(textwrap.dedent("""
        class LlamaPromptLookupDecoding:  # the draft object: the fake Llama only checks it is passed
            def __init__(self, max_ngram_size, num_pred_tokens):
                self.sizes = (max_ngram_size, num_pred_tokens)
    """))
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nPYTHONPATH={package.parent} exec {sys.executable} \"$@\"\n")
    script.chmod(0o755)
    monkeypatch.setenv("TOOLKIT_ENGINES_PYTHON", str(script))
    engines._importable.cache_clear()
    yield str(script)
    engines._importable.cache_clear()


def test_engine_worker_serves_generate_and_score_and_reports_errors(fake_llama_cpp, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    assert "llamacpp_ar" in engines.available() and "openvino_ar" not in engines.available()
    gen = GenerationSpec(max_new_tokens=5, do_sample=False, ignore_eos=False)
    with engines.EngineProcess(engines.ENGINES["llamacpp_ar"], model, threads=2) as worker:
        run = engines.engine_runner(worker, eos_ids=[1])
        call = run(torch.tensor([[4, 3, 2]]), gen)  # backwards: 2, 3, 4, 2, 3 (5 tokens, no EOS)
        assert call.token_ids == [2, 3, 4, 2, 3] and call.stats.finish_reason == "length"
        call = run(torch.tensor([[1, 6]]), gen)  # 6, then EOS 1 ends it
        assert call.token_ids == [6, 1] and call.stats.finish_reason == "eos"
        assert call.stats.total_ms >= call.stats.ttft_ms >= 0
        info = worker.request("info")
        assert info == {"engine": "llama.cpp", "version": "fake", "weight_bytes": 64, "threads": 2, "n_ctx": 2048}
        long = run(torch.full((1, 2100), 4), gen)  # longer than --n-ctx: the context grows to the request
        assert len(long.token_ids) == 5 and worker.request("info")["n_ctx"] == 3072
        curve = worker.request("verify_curve", input_ids=[0, 1, 5, 3, 2], widths=[1, 2, 4], repeats=2)
        assert set(curve["ms"]) == {"1", "2", "4"} and curve["rollback_exact"] is True
        score = worker.request("score", input_ids=[0, 1, 5])
        assert score["argmax"] == [1, 2]  # the fake's logits favour t + 1
        assert score["nll"][0] == pytest.approx(-torch.log_softmax(torch.eye(8)[1] * 5, 0)[1].item(), rel=1e-6)
        with pytest.raises(engines.EngineError, match=r"llamacpp_ar: frobnicate failed: op: unknown 'frobnicate'"):
            worker.request("frobnicate")
        with pytest.raises(engines.EngineError, match="greedy only"):
            run(torch.tensor([[4]]), GenerationSpec(max_new_tokens=2, do_sample=True))
    with engines.EngineProcess(engines.ENGINES["llamacpp_lookup"], model, threads=2) as worker:  # > n_batch tokens
        assert engines.engine_runner(worker, eos_ids=[1])(torch.full((1, 600), 4), gen).token_ids == [4] * 5


def test_engine_worker_replies_are_json_lines_only(fake_llama_cpp, tmp_path):
    request = json.dumps({"op": "generate", "input_ids": [3, 2], "max_new_tokens": 2, "eos_token_ids": []})
    out = subprocess.run([fake_llama_cpp, str(engines.WORKER), "--engine", "llamacpp", "--model", "x"],
                         input=request + "\n", capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout)["token_ids"] == [2, 3] and len(out.stdout.splitlines()) == 1
    assert "engine chatter" in out.stderr


def test_an_evaluation_times_static_compiled_ar_where_its_settings_name_it():
    """The long and memory spaces ask for ``ar_static`` by name; it was dropped silently (only ``--compare`` timed
    it), so their held-out confirmations lacked HF's static-cache compiled AR."""
    recipe = Recipe.load("recipes/short.yaml")
    assert selected_baselines(recipe, False, ["ar", "ar_static", "prompt_lookup_10"]) == \
        ["ar", "ar_static", "prompt_lookup_10"]
    assert "ar_static" not in selected_baselines(recipe, True, True)  # all: the ones that compile nothing
    assert selected_baselines(recipe, False, ["ar_static"]) == ["ar_static"]
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    w8a8 = tiny_llama()
    assert selected_baselines(recipe, False, ["ar_static"], w8a8) == ["ar_static"]
    quantize_(w8a8, Int8DynamicActivationInt8WeightConfig())  # inductor compiles it wrongly (compile_breaks)
    assert selected_baselines(recipe, False, ["ar", "ar_static"], w8a8) == ["ar"]
    with pytest.raises(ConfigError, match=r"baselines.*'ar_statc'.*allowed: ar, ar_static"):
        EvalSettings.fast(baselines=["ar", "ar_statc"])
    EvalSettings.fast(baselines=["hf-batch-ar", "ours-single"])  # the batch stage's methods are names too
    # ... and where it was timed, the report's ratios (and a found recipe's header) name it
    from eval.document import _ratios

    timed = {m: {"throughput": {"median": tok_s}} for m, tok_s in (("ours", 28.4), ("ar", 16.3), ("ar_static", 22.0))}
    assert _ratios(timed) == pytest.approx({"ours_vs_ar": 28.4 / 16.3, "ours_vs_ar_static": 28.4 / 22.0})


def test_an_evaluation_sizes_hf_static_cache_for_the_suite_so_no_timed_call_compiles(monkeypatch, tmp_path):
    """A search trial cut to one repetition reported HF static compiled AR at 0.89 tok/s: the evaluator passed no
    cache size, so HF sized the static cache per call (warm-up: prompt 0 + 16 tokens; timed: each prompt + 48) and
    compiled again inside the timed calls. Every ``ar_static`` call of an evaluation, warm-up included, now asks for
    one size that holds the longest request."""
    from eval import runners
    from eval.evaluate import evaluate
    from eval.runners import STATIC_CACHE_STEP, static_cache_len

    assert static_cache_len([5, 300], 48) == 2 * STATIC_CACHE_STEP and static_cache_len([208], 48) == STATIC_CACHE_STEP
    with pytest.raises(ValueError, match="at least one prompt"):
        static_cache_len([], 48)
    sizes = []

    def fake_hf_generate(model, input_ids, gen, eos_ids, method="ar", max_cache_len=None, **kwargs):
        if method == "ar_static":
            sizes.append((input_ids.shape[1], gen.max_new_tokens, max_cache_len))
        return hf_generate(model, input_ids, gen, eos_ids, method="ar")

    monkeypatch.setattr(runners, "hf_generate", fake_hf_generate)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (12, 20)]
    recipe = Recipe.from_dict({"name": "tiny-static", "target": {"device": "cpu"}, "draft": None,
                               "spec": {"drafter": "lookup", "num_draft_tokens": 3},
                               "generation": {"max_new_tokens": 64}})
    settings = EvalSettings.fast(max_new_tokens=24, repeats=1, warmup=1, ppl_tokens=120, ppl_window=64,
                                 ppl_stride=32, baselines=["ar_static"])
    evaluate(recipe, settings=settings, out_dir=tmp_path, target=tiny_llama(), tokenizer=None, prompts=prompts,
             ppl_ids=torch.randint(3, 128, (120,), generator=g).tolist(), progress=False, plots=False)
    assert [(n, new) for n, new, _ in sizes] == [(12, 16), (12, 24), (20, 24)]  # the warm-up, then each prompt
    assert {size for _, _, size in sizes} == {static_cache_len([12, 20], 24)}

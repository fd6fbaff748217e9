"""``target.backend: llama.cpp``: the one decoder driving llama.cpp as the target forward (toolkit/engine/
llamacpp_forward.py, toolkit/kv/llamacpp_cache.py) on the embedded model's Q4_1 GGUF.

The configuration errors run everywhere (they only plan); the rest needs llama-cpp-python (the ``[llamacpp]`` extra,
``make llamacpp``) and is skipped without it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

import toolkit
from toolkit.errors import ConfigError
from toolkit.models.llamacpp import cache_kwargs, installed
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec, Recipe, SpeculationSpec
from toolkit.session import plan

NEEDS_LLAMACPP = pytest.mark.skipif(not installed(), reason="llama-cpp-python (the [llamacpp] extra) is not "
                                    "installed: `make llamacpp` builds and installs it")
GGUF_TARGET = {"source": "embedded", "precision": "native", "backend": "llama.cpp"}
#: a prompt whose continuation repeats what it holds: the lookup drafter's drafts get accepted
PROMPT = [{"role": "user", "content": "Repeat this text exactly: The quick brown fox jumps over the lazy dog. The "
           "quick brown fox jumps over the lazy dog again and again."}]
TEXT = "The quick brown fox jumps over the lazy dog. " * 6
#: ~140 tokens of prose that does not repeat itself
LONG_TEXT = ("Speculative decoding lets a small drafter propose several tokens that the target model then checks in "
             "one forward pass. When the drafts agree with what the target would have produced, many tokens are "
             "committed for the price of one step; when they disagree, the rejected positions are removed from the "
             "cache and decoding continues from the last accepted token. On a CPU the cost of checking grows with "
             "the number of drafted tokens, so a planner weighs the expected acceptance against the measured cost "
             "of each verify width before it decides how many tokens to draft in a round.")


def _recipe(target: dict | None = None, kv: dict | None = None, drafter: str = "lookup", draft=None,
            adaptive: str = "constant", **fields) -> Recipe:
    spec = SpeculationSpec(drafter=drafter, num_draft_tokens=6, adaptive=adaptive, config=None)
    return Recipe(name="llamacpp", target=ModelSpec(**(target or GGUF_TARGET)), draft=draft,
                  kv=KVSpec.from_dict(kv or {"policy": "none"}, "kv"), spec=spec,
                  generation=GenerationSpec(max_new_tokens=48, ignore_eos=True), **fields)


@pytest.mark.parametrize("target,kv,field", [
    ({"source": "/tmp/some-hf-dir", "precision": "fp32", "backend": "llama.cpp"}, None, "target.backend"),
    ({**GGUF_TARGET, "device": "cuda"}, None, "target.backend"),
    ({**GGUF_TARGET, "precision": "int4"}, None, "target.precision"),
    (GGUF_TARGET, {"policy": "l2norm", "budget": 64}, "kv.policy"),
    (GGUF_TARGET, {"policy": "head_aware", "budget": 64}, "kv.policy"),
    (GGUF_TARGET, {"policy": "quantized", "quant_bits": 4}, "kv.policy"),
    (GGUF_TARGET, {"policy": "streaming", "window": 64}, "kv.position_mode"),
    (GGUF_TARGET, {"policy": "streaming", "window": 64, "position_mode": "reindex"}, "kv.exact_window"),
    ({"source": "embedded", "precision": "native"}, {"policy": "ggml_types", "type_k": "q8_0"}, "kv.policy"),
])
def test_what_llama_cpp_cannot_run_is_one_error_naming_the_field(target, kv, field):
    with pytest.raises(ConfigError) as info:
        plan(_recipe(target, kv))
    assert info.value.field == field


def test_llama_cpp_refuses_trees_batches_and_draft_sections_on_it():
    with pytest.raises(ConfigError, match="spec.tree"):
        recipe = _recipe()
        recipe.spec.tree = True
        plan(recipe)
    with pytest.raises(ConfigError, match="batch_size"):
        plan(_recipe(batch_size=2))
    assert plan(_recipe(drafter="eagle", draft=ModelSpec(source="embedded", precision="fp32"))).recipe
    with pytest.raises(ConfigError, match="draft.backend"):
        plan(_recipe(drafter="draft_model", draft=ModelSpec(source="embedded", precision="native",
                                                            backend="llama.cpp")))
    assert plan(_recipe(drafter="draft_model", draft=ModelSpec(source="embedded", precision="int4"))).draft_spec
    with pytest.raises(ConfigError, match="kv.type_k"):
        plan(_recipe(kv={"policy": "ggml_types", "type_k": "q2_k"}))
    assert plan(_recipe(kv={"policy": "ggml_types", "type_k": "q8_0", "type_v": "q4_0"})).target_policy is not None


def test_an_eagle_head_beside_llama_cpp_must_read_the_final_norm_output():
    """llama.cpp hands out its embeddings (the final norm's output): an EAGLE-1 head reads that, an EAGLE-3 head's
    intermediate layers are refused when it is loaded, naming draft.source."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from toolkit.engine.llamacpp_forward import check_head

    target = SimpleNamespace(config=LlamaConfig(num_hidden_layers=30))
    check_head(target, SimpleNamespace(config=SimpleNamespace(variant="eagle1", feature_layers=[-1])))
    with pytest.raises(ConfigError) as info:
        check_head(target, SimpleNamespace(config=SimpleNamespace(variant="eagle3", feature_layers=[1, 14, 26])))
    assert info.value.field == "draft.source" and "EAGLE-1" in str(info.value)


AMX_INFO = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 | "


def test_a_build_with_ggmls_amx_kernels_is_refused_with_the_rebuild_command(monkeypatch):
    """A native build on an AMX Xeon crashed the process at its first decode (ggml's AMX tile config); such a build
    is refused with one error saying how to rebuild, unless the user says it works (TOOLKIT_LLAMACPP_AMX=1)."""
    import importlib.machinery
    import sys
    import types

    from toolkit.errors import ModelLoadError
    from toolkit.models import llamacpp

    monkeypatch.delenv(llamacpp.AMX_ENV, raising=False)
    why = llamacpp.amx_refusal(AMX_INFO)
    assert why is not None and "`make llamacpp`" in why and "20824" in why
    assert llamacpp.amx_refusal(AMX_INFO.replace("AMX_INT8 = 1 | ", "")) is None  # what make llamacpp builds
    fake = types.ModuleType("llama_cpp")
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    fake.llama_print_system_info = lambda: AMX_INFO.encode()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    llamacpp.unusable.cache_clear()
    try:
        assert not llamacpp.installed()
        with pytest.raises(ModelLoadError, match="target.backend: llama.cpp cannot run: .*AMX kernels"):
            llamacpp.require()
        monkeypatch.setenv(llamacpp.AMX_ENV, "1")
        llamacpp.unusable.cache_clear()
        assert llamacpp.installed()
    finally:
        llamacpp.unusable.cache_clear()


@pytest.mark.parametrize("amx", [True, False])
def test_the_engines_probe_leaves_out_a_llama_cpp_build_that_would_crash(tmp_path, monkeypatch, caplog, amx):
    """The llama.cpp AR rows run in a worker process, in the engines' interpreter: its probe reads the build's system
    info there and leaves llama_cpp out where it has the AMX kernels (the worker would die at its first decode)."""
    import sys

    from toolkit.measure import engines
    from toolkit.models import llamacpp

    info = AMX_INFO if amx else AMX_INFO.replace("AMX_INT8 = 1 | ", "")
    (tmp_path / "llama_cpp.py").write_text(f"def llama_print_system_info():\n    return {info.encode()!r}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv(llamacpp.AMX_ENV, raising=False)
    with caplog.at_level(logging.WARNING, "toolkit.models"):
        found = engines._importable.__wrapped__(sys.executable, ("llama_cpp", "no_such_engine_module"))
    assert found == (frozenset() if amx else frozenset({"llama_cpp"}))
    assert ("AMX kernels" in caplog.text) == amx


def test_llama_cpps_log_is_logged_at_its_own_levels_in_whole_lines(caplog):
    from toolkit.models.llamacpp_log import CONT, emit

    caplog.set_level(logging.DEBUG, logger="toolkit.llamacpp")
    emit(4, "llama_decode: failed to find a memory slot\n")  # ggml's ERROR (4), which llama-cpp-python drops
    emit(3, "llama_context: n_ctx_seq (8448) > n_ctx_train (8192) -- possible training context overflow\n")
    emit(3, "some other ")  # a WARN in pieces: logged once its line is whole
    emit(CONT, "warning\n")
    emit(2, "llama_context: constructing llama_context\n")  # INFO
    emit(4, "first error line\nsecond ")  # two lines in one piece, the second finished by the next
    emit(CONT, "error line\n")
    emit(3, "unterminated warning")  # ended by the next message
    emit(4, "last\n")
    got = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert got == [(logging.ERROR, "llama_decode: failed to find a memory slot"),
                   (logging.DEBUG, "llama_context: n_ctx_seq (8448) > n_ctx_train (8192) -- possible training "
                                   "context overflow"),
                   (logging.WARNING, "some other warning"),
                   (logging.DEBUG, "llama_context: constructing llama_context"),
                   (logging.ERROR, "first error line"), (logging.ERROR, "second error line"),
                   (logging.WARNING, "unterminated warning"), (logging.ERROR, "last")]


@NEEDS_LLAMACPP
def test_a_new_context_writes_nothing_to_stderr_and_logs_its_headroom_warning_at_debug(capfd, caplog):
    from toolkit.models.llamacpp import load_llamacpp

    caplog.set_level(logging.DEBUG, logger="toolkit.llamacpp")
    target, _ = load_llamacpp(_recipe().target)
    capfd.readouterr()
    target.context("f16", "f16")  # n_ctx = the model's 8192 positions + the verify headroom
    assert capfd.readouterr().err == ""  # llama-cpp-python's own callback printed the warning there
    headroom = [r for r in caplog.records if "n_ctx_train" in r.getMessage()]
    assert headroom and all(r.levelno == logging.DEBUG for r in headroom)


# ------------------------------------------------------------------------------------------------ on llama.cpp
@pytest.fixture(scope="module")
def generator():
    import os

    before = os.environ.get("TOOLKIT_LLAMACPP_THREADS")
    os.environ["TOOLKIT_LLAMACPP_THREADS"] = "1"  # a loaded 2-core machine: ggml's spinning barriers and a second
    try:                                          # thread that is not scheduled cost 10x (what is tested is not speed)
        yield toolkit.build(_recipe())
    finally:
        if before is None:
            os.environ.pop("TOOLKIT_LLAMACPP_THREADS")
        else:
            os.environ["TOOLKIT_LLAMACPP_THREADS"] = before


def _llama_ar(target, ids: list[int], n: int, kv: str = "f16") -> list[int]:
    """llama.cpp's own greedy decoding (``Llama.generate``, temperature 0: argmax, one token per step) on a context
    of its own over the same file (a ``kv`` cache: ``f16``, or ``q8_0`` keys and values; flash attention as ours)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(target.gguf_path), n_ctx=1024, n_threads=target.threads,
                n_threads_batch=target.threads, verbose=False, **cache_kwargs(kv, kv))
    out = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n:
            return out
    return out


@NEEDS_LLAMACPP
def test_build_loads_llama_cpp_so_the_first_request_does_not():
    lm = toolkit.build(_recipe())
    assert "llama.cpp" in lm.engine_note  # set when the engine (llama.cpp's model and context) is made
    first = lm.generate(PROMPT, max_new_tokens=4)
    assert len(first.token_ids) == 4 and first.stats.total_ms > 0


@NEEDS_LLAMACPP
def test_warm_up_runs_the_widest_verify_so_no_timed_call_grows_llama_cpps_logits(generator, monkeypatch):
    from toolkit.engine.llamacpp_forward import LlamaCppForward

    widths = []
    call = LlamaCppForward.__call__
    monkeypatch.setattr(LlamaCppForward, "__call__", lambda self, cache, ids, hidden=(): (
        widths.append(ids.shape[1]), call(self, cache, ids, hidden))[1])
    assert generator.warm_up(64) > 0
    # first the widest verify the plan allows (then, where this machine's curve is not cached yet, its measurement)
    assert widths[0] == generator.plan.verify_room > 2
    assert generator.generate(PROMPT, max_new_tokens=8).token_ids  # the scratch sequence left the context usable


@NEEDS_LLAMACPP
@pytest.mark.slow
def test_greedy_output_equals_llama_cpps_own_greedy_ar_with_drafts_accepted(generator):
    first = generator.generate(PROMPT, max_new_tokens=40)
    again = generator.generate(PROMPT, max_new_tokens=40)  # the lookup drafter remembers the first request
    reference = _llama_ar(generator.target, first.prompt_ids, 40)
    assert first.token_ids == reference and again.token_ids == reference
    assert again.stats.tokens_per_round > 1.5 and again.stats.accepted > 10
    assert generator.weight_bytes["target"] == generator.target.gguf_path.stat().st_size


@NEEDS_LLAMACPP
@pytest.mark.slow
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_verify_width_changes_no_logit_so_greedy_equals_llama_cpp_ar_at_length(generator, kv):
    """With flash attention (every context, ``cache_kwargs``) a batched verify's logits equal one-token steps' bit for
    bit on this Q4_1 file: on the default f16 cache while it holds at most 256 positions (past them ggml's one-query
    and batched f16 attention sum in another order: up to ~2 in a logit, bench/reports/llamacpp-width; without
    flash attention from the first position), on a q8_0 cache at any length (here past 256). So speculative greedy
    output equals llama.cpp's greedy AR over 200 tokens (f16) and past 256 (q8_0)."""
    lm = generator if kv == "f16" else toolkit.build(
        _recipe(kv={"policy": "ggml_types", "type_k": kv, "type_v": kv}), target=generator.target,
        tokenizer=generator.tokenizer)
    prompt = [{"role": "user", "content": "Repeat this text exactly: " + LONG_TEXT * (1 if kv == "f16" else 3)}]
    ids = lm.encode(prompt)
    assert ids.shape[1] + 64 <= 256 if kv == "f16" else ids.shape[1] - 24 > 256
    forward, head, fed = lm.engine, ids[:, :-24], [int(t) for t in ids[0, -24:]]

    def scored(width: int) -> torch.Tensor:
        """Logits of the last 24 prompt tokens fed after the rest, ``width`` per forward."""
        cache = forward.cache_for(None, 1, 1024, 8)
        _, kwargs = cache.begin_row(head.shape[1])
        forward.prefill(head, kwargs)
        cache.add_row(None, head.shape[1])
        out = []
        for i in range(0, len(fed), width):
            out.append(forward(cache, torch.tensor([fed[i:i + width]]))[0])
            cache.accept(None, [width])
        cache.keep_rows([])
        return torch.cat(out)

    steps, wide = scored(1), scored(8)
    assert torch.equal(steps, wide)
    lm.generate(prompt, max_new_tokens=64)
    out = lm.generate(prompt, max_new_tokens=64)  # the lookup drafter remembers the first request
    assert out.stats.tokens_per_round > 1.5 and ids.shape[1] + 64 > 200
    assert out.token_ids == _llama_ar(generator.target, out.prompt_ids, 64, kv=kv)


@NEEDS_LLAMACPP
@pytest.mark.slow
def test_eagle_head_drafts_from_llama_cpps_embeddings_and_greedy_equals_its_ar(generator):
    """The shipped EAGLE-1 head beside the GGUF on llama.cpp: its features are llama.cpp's embeddings output, which is
    the final norm's hidden state (the file's LM head over it gives llama.cpp's own logits), and greedy output equals
    llama.cpp's greedy AR (flash attention: verify width changes no logit) with drafts accepted. An
    EAGLE-3 head (intermediate layers) is refused when it is loaded."""
    from toolkit.eagle.checkpoint import dense_weight
    from toolkit.engine.llamacpp_forward import FINAL_NORM

    kv = {"policy": "ggml_types", "type_k": "q8_0", "type_v": "q8_0"}
    recipe = _recipe(kv=kv, drafter="eagle", draft=ModelSpec(source="embedded", precision="bf16"))
    recipe.spec.num_draft_tokens = 2
    lm = toolkit.build(recipe, target=generator.target, tokenizer=generator.tokenizer)
    ids = lm.encode(PROMPT)
    forward = lm.engine
    cache = forward.cache_for(None, 1, 256, 8)
    _, kwargs = cache.begin_row(ids.shape[1])
    logits, features = forward.prefill(ids, kwargs, FINAL_NORM)
    cache.keep_rows([])
    assert features.shape == (1, ids.shape[1], generator.target.config.hidden_size)
    own = features[0, -1] @ dense_weight(generator.target.get_output_embeddings()).float().T
    assert torch.cosine_similarity(own, logits, dim=0) > 0.999 and int(own.argmax()) == int(logits.argmax())
    # an EAGLE-3 head trained for this target on a GPU (reads layers 1, 14 and 26)
    eagle3 = str(Path(__file__).resolve().parents[1] / "bench/reports/gpu/h100-2026-11-27-2/eagle3_head")
    with pytest.raises(ConfigError) as info:
        toolkit.build(_recipe(drafter="eagle", draft=ModelSpec(source=eagle3, precision="bf16")),
                      target=generator.target, tokenizer=generator.tokenizer)
    assert info.value.field == "draft.source"
    out = lm.generate(PROMPT, max_new_tokens=40)
    assert "embeddings for the EAGLE head" in lm.engine_note
    assert out.stats.accepted > 0 and out.stats.tokens_per_round > 1.0
    assert out.token_ids == _llama_ar(generator.target, out.prompt_ids, 40, kv="q8_0")


@NEEDS_LLAMACPP
@pytest.mark.heavy
def test_sampling_with_the_eagle_head_on_llama_cpp_follows_llama_cpps_law(generator):
    """The second sampled token (the first comes from the prefill, the second from a round that verified the head's
    drafts) follows the law llama.cpp's own logits give it, top-k and temperature applied: chi-square over 300 draws,
    drafts accepted (a 14-token plain-text prompt: each draw prefills it with every position's feature)."""
    from collections import Counter

    from scipy.stats import chisquare

    top_k, temperature, draws, text = 4, 1.5, 300, "The quick brown fox jumps over the lazy dog. The quick brown fox"
    recipe = _recipe(drafter="eagle", draft=ModelSpec(source="embedded", precision="bf16"))
    recipe.spec.num_draft_tokens = 2
    lm = toolkit.build(recipe, target=generator.target, tokenizer=generator.tokenizer)
    forward, ids = lm.engine, lm.encode(text)

    def law(logits: torch.Tensor) -> dict[int, float]:
        values, tokens = logits.topk(top_k)
        return dict(zip(tokens.tolist(), (values.double() / temperature).softmax(-1).tolist()))

    cache = forward.cache_for(None, 1, 256, 8)
    _, kwargs = cache.begin_row(ids.shape[1])
    first = law(forward.prefill(ids, kwargs))
    cache.add_row(None, ids.shape[1])
    second: Counter = Counter()
    for token, p in first.items():
        for after, q in law(forward(cache, torch.tensor([[token]]))[0, 0]).items():
            second[after] += p * q
        cache.accept(None, [0])
        assert cache.held == ids.shape[1]
    cache.keep_rows([])
    counts, accepted = Counter(), 0
    for seed in range(draws):
        # 3 tokens: the first round can then verify a draft for the second
        out = lm.generate(text, max_new_tokens=3, do_sample=True, temperature=temperature, top_k=top_k, seed=seed)
        counts[out.token_ids[1]] += 1
        accepted += out.stats.accepted
    assert set(counts) <= set(second) and accepted > 0
    common = [t for t in second if second[t] * draws >= 5]  # the rest pooled into one bin
    observed = [counts[t] for t in common] + [draws - sum(counts[t] for t in common)]
    expected = [second[t] * draws for t in common] + [draws * (1 - sum(second[t] for t in common))]
    keep = [i for i, e in enumerate(expected) if e > 1e-9]
    assert len(keep) > 1 and chisquare([observed[i] for i in keep], [expected[i] for i in keep]).pvalue > 0.01


@NEEDS_LLAMACPP
@pytest.mark.slow
def test_verify_cost_curve_is_measured_through_llama_cpp_and_cached(generator, tmp_path):
    from toolkit.engine.cost import load_or_measure

    curve = load_or_measure(generator.target, 3, cache_dir=tmp_path, forward=generator.engine)
    assert curve.source == "measured" and len(curve.step_ms) == 3 and min(curve.step_ms) > 0
    (path,) = tmp_path.iterdir()
    assert load_or_measure(generator.target, 3, cache_dir=tmp_path, forward=generator.engine).source == "cache"
    other = toolkit.build(_recipe(kv={"policy": "ggml_types", "type_k": "q8_0", "type_v": "f16"}),
                          target=generator.target, tokenizer=generator.tokenizer)
    assert other.engine.cost_tag != generator.engine.cost_tag  # other KV types: a curve of their own


@NEEDS_LLAMACPP
@pytest.mark.slow
def test_rollback_is_exact(generator):
    forward = generator.engine
    prompt = generator.encode(PROMPT)

    widths = {}

    def logits_after(drafts: list[int]) -> torch.Tensor:
        cache = forward.cache_for(None, 1, 256, 8)
        _, kwargs = cache.begin_row(prompt.shape[1])
        forward.prefill(prompt, kwargs)
        cache.add_row(None, prompt.shape[1])
        widths[len(drafts) + 1] = forward(cache, torch.tensor([[7] + drafts]))[0, 0]
        cache.accept(None, [1])  # the drafts are rejected
        assert cache.held == prompt.shape[1] + 1
        out = forward(cache, torch.tensor([[11, 12, 13]]))
        cache.keep_rows([])
        return out

    first = logits_after([100, 200, 300])
    assert torch.equal(first, logits_after([5, 6, 7]))  # the rejected entries left no trace
    assert torch.equal(first, logits_after([100, 200, 300]))
    logits_after([])  # a one-token step: on this file the batch width changes no position's logits (Q4_1 rows are
    assert torch.equal(widths[1], widths[4])  # dotted one by one by ggml), so verify = AR bit for bit


@NEEDS_LLAMACPP
@pytest.mark.slow
def test_perplexity_equals_llama_cpps_own(generator):
    from llama_cpp import Llama

    from eval.metrics import nll_sum, perplexity_sliding_window, perplexity_through_cache

    ids = generator.encode(TEXT)[0].tolist()
    target = generator.target
    llm = Llama(model_path=str(target.gguf_path), n_ctx=1024, n_threads=target.threads,
                n_threads_batch=target.threads, logits_all=True, verbose=False, **cache_kwargs())  # as ours
    llm.eval(ids)
    nll = nll_sum(torch.from_numpy(llm.scores[: len(ids) - 1]), torch.tensor(ids[1:]))  # llama.cpp's own logits
    whole = perplexity_sliding_window(target, ids, window=len(ids), stride=len(ids))
    assert whole["nll_sum"] == nll and whole["tokens"] == len(ids) - 1
    chunked = perplexity_through_cache(target, ids, None, chunk=9)  # 9-token forwards: other batch shapes
    assert math.isclose(chunked["value"], whole["value"], rel_tol=1e-3)
    per_token = 30 * 192 * 2 * 2  # f16 keys + values of 30 layers x 3 KV heads x 64 channels
    assert chunked["peak_kv_bytes"] in ((len(ids) - 1) * per_token, len(ids) * per_token)


@NEEDS_LLAMACPP
@pytest.mark.slow
def test_quantized_kv_and_context_shift_run_and_count_exact_bytes(generator):
    models = {"target": generator.target, "tokenizer": generator.tokenizer}
    q8 = toolkit.build(_recipe(kv={"policy": "ggml_types", "type_k": "q8_0", "type_v": "q8_0"}), **models)
    out = q8.generate(PROMPT, max_new_tokens=16)
    held = len(out.prompt_ids) + len(out.token_ids) - 1
    assert out.stats.kv_bytes_target == held * 30 * (192 // 32 * 34) * 2  # q8_0 blocks: 34 bytes per 32 values
    shift = toolkit.build(_recipe(kv={"policy": "streaming", "sink_tokens": 4, "window": 32, "compress_interval": 8,
                                      "position_mode": "reindex", "exact_window": False}), **models)
    out = shift.generate(PROMPT, max_new_tokens=24)
    assert out.stats.compressions_target > 0 and len(out.token_ids) == 24
    assert out.stats.peak_kv_bytes_target <= (4 + 32 + 8 + 9) * 30 * 192 * 2 * 2


def test_compare_rows_and_the_search_offer_llama_cpp_only_where_it_is_installed():
    from eval.runners import baseline_methods, llamacpp_variant
    from eval.space_file import load_space
    from toolkit.resources import resolve

    short = Recipe.load(resolve("short", "", "recipe"))
    variant = llamacpp_variant(short)
    assert (variant is not None) == installed()
    if variant is not None:
        assert variant.target.backend == "llama.cpp" and variant.spec.drafter == short.spec.drafter
        assert baseline_methods(variant) == []  # no HF model to run HF baselines on
    dim = next(d for d in load_space("short").dimensions if d.name == "target_backend_gguf")
    assert ("llama.cpp" in dim.searched) == installed() and dim.when == {"target_precision": ["native"]}

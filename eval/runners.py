"""Runners for :func:`toolkit.measure.harness.measure`: our decoder and the in-process HF baselines, on the same models.

* ``ours`` — the recipe's :class:`~toolkit.speculative_lm.SpeculativeLM` decode loop;
* ``ar`` — the recipe's target with plain HF ``generate`` (autoregressive, uncompressed ``DynamicCache``);
* ``ar_static`` — the same target with HF's static cache + compiled decoding step, the strongest HF baseline (one
  graph for the whole suite: the cache is sized to its longest prompt + ``max_new_tokens``);
* ``assisted`` — HF assisted generation with the same target/draft pair (``draft_model`` and ``self`` drafters);
* ``prompt_lookup`` — HF prompt lookup decoding (for model-free drafters: the same drafting idea in HF) with
  ``prompt_lookup_num_tokens`` = the recipe's K for a constant-K recipe, else 4; ``prompt_lookup_10`` — the same
  with 10 tokens (the value of HF's documentation). Reports compare with the faster of the two;
* ``ar_fp32`` — the fp32 uncompressed reference target with plain ``generate`` (only when the recipe's target is
  not fp32): the quality/fidelity reference and the throughput bar of the memory scenario.

* ``llamacpp_ar``, ``llamacpp_lookup``, ``openvino_ar`` — the CPU engines of :mod:`toolkit.measure.engines` when
  installed (``make bench-cpu-engines``, or llama.cpp alone with ``make llamacpp``), on the recipe's model files, in
  their own processes;
* ``ours_llamacpp`` — our decoder (same drafter, planner, KV policy) with the recipe's GGUF target on llama.cpp
  (``target.backend: llama.cpp``) when llama-cpp-python is installed here (``make llamacpp``).

HF baselines go through :func:`toolkit.measure.baselines.hf_generate`, which leaves the shared models as it found
them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from toolkit.measure import engines
from toolkit.measure.baselines import hf_generate
from toolkit.measure.harness import Call, Runner
from toolkit.measure.timing import synchronize
from toolkit.models.llamacpp import LLAMACPP
from toolkit.models.spec import is_gguf_source
from toolkit.recipe import GenerationSpec, Recipe
from toolkit.speculative.stats import GenerationStats

OURS = "ours"
#: our decoder with the recipe's GGUF target on llama.cpp (``target.backend: llama.cpp``), next to ``ours``
OURS_LLAMACPP = "ours_llamacpp"
#: HF prompt lookup's ``max_matching_ngram_size`` in every comparison (HF's default is 2; 3 was measured better here)
PROMPT_LOOKUP_NGRAM = 3
#: the HF prompt-lookup baselines timed next to a model-free drafter (see the module docstring)
PROMPT_LOOKUPS = ["prompt_lookup", "prompt_lookup_10"]


def baseline_methods(recipe: Recipe, has_reference: bool = False) -> list[str]:
    """The HF baselines that make sense next to this recipe's drafter (``ar`` always; ``ar_fp32`` with a reference).
    A llama.cpp target has no HF model to generate with: only ``ar_fp32`` (llama.cpp's own AR and prompt lookup are
    engine rows: :func:`strongest_baselines`)."""
    if recipe.target.backend == LLAMACPP:
        return ["ar_fp32"] if has_reference else []
    methods = ["ar"]
    baseline = recipe.spec.config.hf_baseline  # the HF method that drafts the same way (registry)
    if baseline is not None:
        methods += PROMPT_LOOKUPS if baseline == "prompt_lookup" else [baseline]
    return methods + (["ar_fp32"] if has_reference else [])


def strongest_baselines(recipe: Recipe, target) -> list[str]:
    """What a user would run instead, next to ``toolkit run --compare``: ``ar_static`` (HF static cache + compile)
    where compiling pays (:func:`toolkit.engine.forward.compile_pays`: not for bitsandbytes' weights on CPU, where
    HF eager AR is the strongest HF baseline) and, for greedy recipes, the installed CPU engines that apply to the
    target (llama.cpp needs a GGUF source: ``embedded`` or a ``.gguf`` file)."""
    from toolkit.engine.forward import compile_pays

    methods = ["ar_static"] if compile_pays(target) and recipe.target.backend != LLAMACPP else []
    if not recipe.generation.do_sample:
        gguf = is_gguf_source(recipe.target.source)
        methods += [m for m in engines.available() if gguf or not m.startswith("llamacpp")]
    if llamacpp_variant(recipe) is not None:
        methods.append(OURS_LLAMACPP)
    return methods


def llamacpp_hint(recipe: Recipe, methods: list[str], target) -> str | None:
    """What ``--compare`` leaves out for a CPU user of a GGUF: llama.cpp's rows (its AR and prompt lookup on the same
    file, and this recipe on llama.cpp's kernels — on a CPU the strongest baselines), where llama-cpp-python is not
    installed or cannot run (:func:`toolkit.models.llamacpp.unusable`, logged); ``None`` where they run, do not apply
    (sampling, a non-GGUF source) or the target is on a GPU."""
    if recipe.generation.do_sample or not is_gguf_source(recipe.target.source):
        return None
    if next(target.parameters()).device.type != "cpu" or any(m.startswith("llamacpp") for m in methods):
        return None
    from toolkit.models.llamacpp import importable, unusable

    if importable():
        return f"llama.cpp rows: left out: {unusable() or 'its engine did not start'}"
    return ("llama.cpp rows: llama-cpp-python is not installed here; `make llamacpp` (a native build, once: ~9-15 min "
            "on 2 cores) adds llama.cpp's own AR and prompt lookup on the same GGUF and this recipe on llama.cpp's "
            "kernels, a CPU user's strongest baselines")


def llamacpp_variant(recipe: Recipe) -> Recipe | None:
    """The recipe with its GGUF target on llama.cpp (``target.backend: llama.cpp``): the ``ours_llamacpp`` row of
    ``--compare`` (the same decoder, drafter and planner, the same file's own blocks, on llama.cpp's kernels), or
    ``None`` where it does not apply: llama.cpp not installed, a target that is not a GGUF's own blocks
    (``precision: native``; other precisions are other weights), already on llama.cpp, or a combination llama.cpp
    refuses."""
    from toolkit.errors import ConfigError
    from toolkit.models.llamacpp import installed
    from toolkit.session import plan

    spec = recipe.target
    if not installed() or not is_gguf_source(spec.source) or spec.precision != "native" or spec.backend == LLAMACPP:
        return None
    target = dataclasses.replace(spec, backend=LLAMACPP, device="cpu")
    variant = dataclasses.replace(recipe, name=f"{recipe.name}-llamacpp", target=target)
    try:
        plan(variant)
    except ConfigError:
        return None
    return variant


def engine_model(recipe: Recipe, method: str) -> str:
    """The model file an engine ``method`` runs for ``recipe``'s target: the GGUF itself (llama.cpp) or the int4
    OpenVINO export of the target's HF directory (made once, cached)."""
    from toolkit.models.embedded import embedded_gguf_path, resolve_source

    if method.startswith("llamacpp"):
        return str(embedded_gguf_path()) if recipe.target.source == "embedded" else recipe.target.source
    return str(engines.openvino_model(resolve_source(recipe.target.source, "target.source", torch.float32)))


@contextlib.contextmanager
def engine_runners(recipe: Recipe, methods: list[str], eos_ids: list[int]):
    """``{method: runner}`` for the engine methods among ``methods``, their worker processes ended on exit."""
    with contextlib.ExitStack() as stack:
        out = {}
        for method in methods:
            if method in engines.ENGINES:
                process = stack.enter_context(engines.EngineProcess(engines.ENGINES[method],
                                                                    engine_model(recipe, method)))
                out[method] = engines.engine_runner(process, eos_ids)
        yield out


#: every HF baseline an evaluation can time (``EvalSettings.baselines`` names a subset)
BASELINES = ("ar", "ar_static", "ar_fp32", "assisted", "prompt_lookup", "prompt_lookup_10")


def selected_baselines(recipe: Recipe, has_reference: bool, wanted: bool | list[str], target=None) -> list[str]:
    """The baselines an evaluation times: :func:`baseline_methods` as ``EvalSettings.baselines`` asks — all
    (``True``), none (``False``, an empty list) or those the list names. ``ar_static`` (HF's static cache +
    ``torch.compile``: it compiles on its first call, so only where asked by name) joins where the target is an HF
    model whose weights compile to the same output (``target``: :func:`toolkit.engine.capabilities.
    compile_breaks`)."""
    from toolkit.engine.capabilities import compile_breaks

    if not wanted:
        return []
    methods = baseline_methods(recipe, has_reference)
    if wanted is True:
        return methods
    if "ar_static" in wanted and recipe.target.backend != LLAMACPP and (target is None or not compile_breaks(target)):
        methods.insert(1, "ar_static")
    return [m for m in methods if m in wanted]


#: HF's static cache for ``ar_static`` is sized in steps of this many tokens
STATIC_CACHE_STEP = 256


def static_cache_len(prompt_lens: list[int], max_new_tokens: int) -> int:
    """The size in tokens of HF's static cache for ``ar_static`` over a whole suite: the longest request (prompt +
    ``max_new_tokens``) rounded up to :data:`STATIC_CACHE_STEP`, so the warm-up call and every timed call (any prompt
    length, fewer new tokens too) run one compiled graph. Without it HF sizes the cache per call and compiles again
    for every new request length, inside the timed calls (a search trial cut to one repetition by its time budget
    reported HF static compiled AR at 0.89 tok/s, a compile timed as decoding). Raises ``ValueError`` for no
    prompts."""
    if not prompt_lens:
        raise ValueError("static_cache_len: needs at least one prompt length")
    return -(-(max(prompt_lens) + max_new_tokens) // STATIC_CACHE_STEP) * STATIC_CACHE_STEP


def prompt_lookup_tokens(recipe: Recipe) -> int:
    """``prompt_lookup_num_tokens`` of the ``prompt_lookup`` baseline: the recipe's K where K is constant, else 4."""
    return recipe.spec.num_draft_tokens if recipe.spec.adaptive == "constant" else 4


def ours_runner(generator, eos_ids: list[int], trajectory: bool = False) -> Runner:
    """Our decode loop; with ``trajectory`` the call records ``[new_tokens, ms, kv_bytes_target, kv_bytes_draft]``
    after every round."""

    def run(input_ids: torch.Tensor, gen: GenerationSpec) -> Call:
        stats = GenerationStats()
        new_ids: list[int] = []
        rows = [] if trajectory else None
        device = next(generator.target.parameters()).device
        synchronize(device)
        start = time.perf_counter()
        for chunk in generator.decoder(gen).decode(input_ids, gen, stats, eos_ids, None):
            new_ids.extend(chunk)
            if rows is not None:
                rows.append([len(new_ids), (time.perf_counter() - start) * 1000, stats.kv_bytes_target,
                             stats.kv_bytes_draft])
        synchronize(device)
        return Call(new_ids, stats, rows)

    return run


def baseline_runner(method: str, recipe: Recipe, eos_ids: list[int], *, target, draft_model=None,
                    reference=None, tokenizers: tuple | None = None, static_cache_len: int | None = None) -> Runner:
    """A runner for HF baseline ``method``; ``tokenizers`` = ``(target's, draft's)`` when the draft's vocabulary is
    another (``assisted`` is then HF's universal assisted decoding); ``static_cache_len``: the static cache's size in
    tokens for ``ar_static``. Raises ``ValueError`` for an unknown method or a missing model."""
    k = recipe.spec.num_draft_tokens
    universal = {} if tokenizers is None else {"tokenizer": tokenizers[0], "assistant_tokenizer": tokenizers[1]}
    kwargs = {"ar": dict(model=target, method="ar"),
              "ar_static": dict(model=target, method="ar_static", max_cache_len=static_cache_len),
              "prompt_lookup_10": dict(model=target, method="prompt_lookup", num_draft_tokens=10,
                                       max_ngram=PROMPT_LOOKUP_NGRAM),
              "ar_fp32": dict(model=reference, method="ar"),
              "assisted": dict(model=target, method="assisted", assistant_model=draft_model, num_draft_tokens=k,
                               **universal),
              "prompt_lookup": dict(model=target, method="prompt_lookup", num_draft_tokens=prompt_lookup_tokens(recipe),
                                    max_ngram=PROMPT_LOOKUP_NGRAM)}.get(method)
    if kwargs is None:
        raise ValueError(f"method: unknown baseline {method!r} (allowed: {', '.join(BASELINES)})")
    if kwargs["model"] is None:
        raise ValueError(f"method: baseline {method!r} needs a loaded model")
    model = kwargs.pop("model")

    def run(input_ids: torch.Tensor, gen: GenerationSpec) -> Call:
        return Call(*hf_generate(model, input_ids, gen, eos_ids, **kwargs))

    return run


def runners_for(generator, methods: list[str], eos_ids: list[int], reference=None, trajectory: bool = False,
                static_cache_len: int | None = None, engine_calls: dict | None = None) -> dict:
    """``{method: runner}`` for ``ours`` and the named baselines of ``generator``'s recipe, in that order; engine
    methods take their runners from ``engine_calls`` (:func:`engine_runners`)."""
    out = {}
    for method in methods:
        if engine_calls and method in engine_calls:
            out[method] = engine_calls[method]
        elif method == OURS:
            out[method] = ours_runner(generator, eos_ids, trajectory)
        elif method == OURS_LLAMACPP:  # our decoder on llama.cpp; its generator is forgotten with ours (run.py)
            from toolkit.session import SHARED_POOL
            from toolkit.speculative_lm import build

            on_llamacpp = build(llamacpp_variant(generator.recipe), pool=SHARED_POOL)
            on_llamacpp.warm_up(static_cache_len or 4096)  # the widest verify once: llama.cpp grows its logits
            out[method] = ours_runner(on_llamacpp, eos_ids, trajectory)
            out[method].generator = on_llamacpp
        else:
            cross = None if generator.draft_tokenizer is None else (generator.tokenizer, generator.draft_tokenizer)
            out[method] = baseline_runner(method, generator.recipe, eos_ids, target=generator.target,
                                          draft_model=generator.draft_model, reference=reference, tokenizers=cross,
                                          static_cache_len=static_cache_len)
    return out

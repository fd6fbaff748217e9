"""Runners for :func:`toolkit.measure.harness.measure`: our decoder and the in-process HF baselines, on the same models.

* ``ours`` — the recipe's :class:`~toolkit.generator.Generator` decode loop;
* ``ar`` — the recipe's target with plain HF ``generate`` (autoregressive, uncompressed ``DynamicCache``);
* ``assisted`` — HF assisted generation with the same target/draft pair (``draft_model`` and ``self`` drafters);
* ``prompt_lookup`` — HF prompt lookup decoding (for model-free drafters: the same drafting idea in HF) with
  ``prompt_lookup_num_tokens`` = the recipe's K for a constant-K recipe, else 4; ``prompt_lookup_10`` — the same
  with 10 tokens (the value of HF's documentation). Reports compare with the faster of the two;
* ``ar_fp32`` — the fp32 uncompressed reference target with plain ``generate`` (only when the recipe's target is
  not fp32): the quality/fidelity reference and the throughput bar of the memory scenario.

Baselines go through :func:`toolkit.measure.baselines.hf_generate`, which leaves the shared models as it found them.
"""

from __future__ import annotations

import time

import torch

from toolkit.measure.baselines import hf_generate
from toolkit.measure.harness import Call, Runner
from toolkit.measure.timing import synchronize
from toolkit.recipe import GenerationSpec, Recipe
from toolkit.speculative.stats import GenerationStats

OURS = "ours"
#: HF prompt lookup's ``max_matching_ngram_size`` in every comparison (HF's default is 2; 3 was measured better here)
PROMPT_LOOKUP_NGRAM = 3
#: the HF prompt-lookup baselines timed next to a model-free drafter (see the module docstring)
PROMPT_LOOKUPS = ["prompt_lookup", "prompt_lookup_10"]


def baseline_methods(recipe: Recipe, has_reference: bool = False) -> list[str]:
    """The HF baselines that make sense next to this recipe's drafter (``ar`` always; ``ar_fp32`` with a reference)."""
    methods = ["ar"]
    baseline = recipe.spec.config.hf_baseline  # the HF method that drafts the same way (registry)
    if baseline is not None:
        methods += PROMPT_LOOKUPS if baseline == "prompt_lookup" else [baseline]
    return methods + (["ar_fp32"] if has_reference else [])


def selected_baselines(recipe: Recipe, has_reference: bool, wanted: bool | list[str]) -> list[str]:
    """The baselines an evaluation times: :func:`baseline_methods` as ``EvalSettings.baselines`` asks — all
    (``True``), none (``False``, an empty list) or those the list names."""
    if not wanted:
        return []
    methods = baseline_methods(recipe, has_reference)
    return methods if wanted is True else [m for m in methods if m in wanted]


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
                    reference=None, tokenizers: tuple | None = None) -> Runner:
    """A runner for HF baseline ``method``; ``tokenizers`` = ``(target's, draft's)`` when the draft's vocabulary is
    another (``assisted`` is then HF's universal assisted decoding). Raises ``ValueError`` for an unknown method or a
    missing model."""
    k = recipe.spec.num_draft_tokens
    universal = {} if tokenizers is None else {"tokenizer": tokenizers[0], "assistant_tokenizer": tokenizers[1]}
    kwargs = {"ar": dict(model=target, method="ar"),
              "prompt_lookup_10": dict(model=target, method="prompt_lookup", num_draft_tokens=10,
                                       max_ngram=PROMPT_LOOKUP_NGRAM),
              "ar_fp32": dict(model=reference, method="ar"),
              "assisted": dict(model=target, method="assisted", assistant_model=draft_model, num_draft_tokens=k,
                               **universal),
              "prompt_lookup": dict(model=target, method="prompt_lookup", num_draft_tokens=prompt_lookup_tokens(recipe),
                                    max_ngram=PROMPT_LOOKUP_NGRAM)}.get(method)
    if kwargs is None:
        raise ValueError(f"method: unknown baseline {method!r} (allowed: ar, ar_fp32, assisted, prompt_lookup, "
                         "prompt_lookup_10)")
    if kwargs["model"] is None:
        raise ValueError(f"method: baseline {method!r} needs a loaded model")
    model = kwargs.pop("model")

    def run(input_ids: torch.Tensor, gen: GenerationSpec) -> Call:
        return Call(*hf_generate(model, input_ids, gen, eos_ids, **kwargs))

    return run


def runners_for(generator, methods: list[str], eos_ids: list[int], reference=None, trajectory: bool = False) -> dict:
    """``{method: runner}`` for ``ours`` and the named baselines of ``generator``'s recipe, in that order."""
    out = {}
    for method in methods:
        if method == OURS:
            out[method] = ours_runner(generator, eos_ids, trajectory)
        else:
            cross = None if generator.draft_tokenizer is None else (generator.tokenizer, generator.draft_tokenizer)
            out[method] = baseline_runner(method, generator.recipe, eos_ids, target=generator.target,
                                          draft_model=generator.draft_model, reference=reference, tokenizers=cross)
    return out

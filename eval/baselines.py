"""In-process baselines for a recipe, run on the same model objects, prompts and generation settings as ours.

* ``ar`` — the recipe's target with plain HF ``generate`` (autoregressive, uncompressed ``DynamicCache``);
* ``assisted`` — HF assisted generation with the same target/draft pair (``draft_model`` and ``self`` drafters);
* ``prompt_lookup`` — HF prompt lookup decoding (for the ``ngram`` drafter: the same drafting idea in HF);
* ``ar_fp32`` — the fp32 uncompressed reference target with plain ``generate`` (only when the recipe's target is
  not fp32): the quality/fidelity reference and the throughput bar of the memory scenario.

All go through :func:`toolkit.baselines.hf_generate`.
"""

from __future__ import annotations

import torch

from toolkit.baselines import hf_generate
from toolkit.recipe import GenerationSpec, Recipe
from toolkit.runner import baseline_methods as toolkit_baseline_methods
from toolkit.speculative.stats import GenerationStats


def baseline_methods(recipe: Recipe, has_reference: bool) -> list[str]:
    """The runner's baselines for ``recipe`` (``ar`` always), plus ``ar_fp32`` when a reference model is loaded."""
    return toolkit_baseline_methods(recipe) + (["ar_fp32"] if has_reference else [])


def run_baseline(method: str, recipe: Recipe, input_ids: torch.Tensor, gen: GenerationSpec, eos_ids: list[int], *,
                 target, draft_model=None, reference=None) -> tuple[list[int], GenerationStats]:
    """One timed baseline call; returns ``(new_ids, stats)``. Raises ``ValueError`` for an unknown method."""
    k = recipe.spec.num_draft_tokens
    if method == "ar":
        return hf_generate(target, input_ids, gen, eos_ids, method="ar")
    if method == "ar_fp32":
        return hf_generate(reference, input_ids, gen, eos_ids, method="ar")
    if method == "assisted":
        return hf_generate(target, input_ids, gen, eos_ids, method="assisted", assistant_model=draft_model,
                           num_draft_tokens=k)
    if method == "prompt_lookup":
        return hf_generate(target, input_ids, gen, eos_ids, method="prompt_lookup", num_draft_tokens=k,
                           max_ngram=recipe.spec.max_ngram)
    raise ValueError(f"method: unknown baseline {method!r}")

"""Recipe -> vLLM configuration (``LLM(**config)`` / ``vllm serve``).

Key names checked against vLLM's documentation of ``SpeculativeConfig`` and its speculative-decoding pages
(docs.vllm.ai, latest; vllm/config/speculative.py): ``speculative_config`` = ``{method, model,
num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, suffix_decoding_max_tree_depth,
suffix_decoding_max_cached_requests, suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob, quantization}``
with ``method`` one of ``draft_model``, ``ngram``, ``suffix``, ``eagle``, ``eagle3`` (held against that source by
``tests/test_export.py``);
top-level ``quantization`` (``bitsandbytes``), ``dtype`` and ``kv_cache_dtype`` (``auto``). Marked uncertain for the
lead: the draft's own ``quantization`` key inside ``speculative_config`` and the tree settings (vLLM's token tree
option is experimental), both reported as warnings rather than guessed.
"""

from __future__ import annotations

import json
import shlex

from toolkit.export import Export
from toolkit.export.common import draft_source, eagle_head_path, eagle_variant, model_path, target_config
from toolkit.export.gaps import engine_warnings
from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD


def _speculative_config(recipe, warnings: list[str]) -> dict | None:
    s, config = recipe.spec, recipe.spec.config
    if not config.speculates:
        return None
    if config.vllm_method is None:
        warnings.append(f"spec.drafter: {s.drafter} — no vLLM method; exported without speculation")
        return None
    cfg: dict = {"method": config.vllm_method, "num_speculative_tokens": s.num_draft_tokens,
                 **config.engine_params("vllm")}
    if config.uses_draft_model:
        source, role = draft_source(recipe)
        cfg["model"] = model_path(source, role, [])
        if recipe.draft.precision in ("fp32", "fp16", "bf16") and recipe.draft.precision != recipe.target.precision:
            warnings.append(f"draft.precision: {recipe.draft.precision} differs from the target's; vLLM runs the "
                            "draft at the engine's dtype")
    elif config.draft == DRAFT_EAGLE_HEAD:
        cfg["method"] = eagle_variant(recipe)
        cfg["model"] = eagle_head_path(recipe, warnings, "vllm")
    if s.tree:
        tree = {k: getattr(s, k) for k in ("tree_budget", "tree_depth", "tree_topk")}
        warnings.append(f"spec.tree_*: {tree} — token-tree drafting is not exported to vLLM (its tree option is "
                        "experimental and EAGLE-only); linear drafting with K = spec.num_draft_tokens instead")
    return cfg


def to_vllm(recipe) -> Export:
    """The vLLM configuration of ``recipe``; see :class:`toolkit.export.Export`."""
    warnings: list[str] = []
    config = target_config(recipe, "model", warnings)
    spec = _speculative_config(recipe, warnings)
    if spec is not None:
        config["speculative_config"] = spec
    warnings += engine_warnings(recipe, "vllm")
    g = recipe.generation
    sampling = {"max_tokens": g.max_new_tokens, "temperature": g.temperature if g.do_sample else 0.0,
                "top_p": g.top_p, "top_k": g.top_k if g.top_k > 0 else -1, "seed": g.seed,
                "ignore_eos": g.ignore_eos}
    if g.stop_strings:
        sampling["stop"] = list(g.stop_strings)
    args = ["vllm", "serve", config["model"], "--dtype", config["dtype"], "--kv-cache-dtype", config["kv_cache_dtype"]]
    if "quantization" in config:
        args += ["--quantization", config["quantization"]]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return Export("vllm", config, sampling, shlex.join(args), warnings, recipe.name)

"""Recipe -> SGLang server arguments (``python -m sglang.launch_server ...``).

Flag names checked against SGLang's speculative-decoding documentation (docs.sglang.io, "Speculative Decoding" and
its parameter reference): ``--speculative-algorithm`` (``STANDALONE`` for a small draft model, ``NGRAM``, ``EAGLE``,
``EAGLE3``), ``--speculative-draft-model-path``, ``--speculative-num-steps``, ``--speculative-eagle-topk``,
``--speculative-num-draft-tokens``, ``--speculative-ngram-min-match-window-size`` /
``--speculative-ngram-max-match-window-size``; plus ``--dtype``, ``--quantization bitsandbytes`` and
``--kv-cache-dtype auto``. Uncertain for the lead: SGLang counts ``--speculative-num-draft-tokens`` including the
root token for chains (num_steps = K, topk = 1, num_draft_tokens = K + 1), as in its examples; NGRAM is CUDA-only.
"""

from __future__ import annotations

import shlex

from toolkit.export import Export
from toolkit.export.gaps import eagle_variant, engine_warnings, model_path, target_config


def _speculative(recipe, warnings: list[str]) -> dict:
    s = recipe.spec
    K = s.num_draft_tokens
    tree = {k: getattr(s, k, None) for k in ("tree_budget", "tree_depth", "tree_topk")}
    if s.drafter == "none":
        return {}
    if s.drafter in ("draft_model", "self"):
        source = recipe.target if s.drafter == "self" else recipe.draft
        out = {"speculative_algorithm": "STANDALONE",
               "speculative_draft_model_path": model_path(source, "draft", [])}
    elif s.drafter == "ngram":
        out = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": s.min_ngram,
               "speculative_ngram_max_match_window_size": s.max_ngram}
        warnings.append("spec.drafter: ngram — SGLang's NGRAM speculation runs on CUDA only")
    elif s.drafter == "eagle":
        out = {"speculative_algorithm": eagle_variant(recipe).upper()}
        if recipe.draft is not None:
            out["speculative_draft_model_path"] = recipe.draft.source
        else:
            warnings.append("spec.drafter: eagle — the recipe names no trained head checkpoint; set "
                            "--speculative-draft-model-path to an EAGLE head trained for this target")
    else:
        warnings.append(f"spec.drafter: {s.drafter} — no SGLang algorithm (suffix decoding is vLLM-only); exported "
                        "without speculation")
        return {}
    if getattr(s, "tree", False) and out["speculative_algorithm"] != "NGRAM":
        depth, topk, budget = tree.get("tree_depth") or K, tree.get("tree_topk") or 1, tree.get("tree_budget")
        out.update(speculative_num_steps=depth, speculative_eagle_topk=topk,
                   speculative_num_draft_tokens=budget or depth * topk + 1)
        if out["speculative_algorithm"] == "STANDALONE":
            warnings.append("spec.tree_*: trees with a STANDALONE draft model are exported as SGLang's EAGLE-style "
                            "tree settings [uncertain: check that your SGLang version accepts topk > 1 here]")
    elif out["speculative_algorithm"] == "NGRAM":
        out["speculative_num_draft_tokens"] = K
    else:
        out.update(speculative_num_steps=K, speculative_eagle_topk=1, speculative_num_draft_tokens=K + 1)
    return out


def to_sglang(recipe) -> Export:
    """The SGLang server arguments of ``recipe``; see :class:`toolkit.export.Export`."""
    warnings: list[str] = []
    config = target_config(recipe, "model_path", warnings)
    config.update(_speculative(recipe, warnings))
    warnings += engine_warnings(recipe, "sglang")
    g = recipe.generation
    sampling = {"max_new_tokens": g.max_new_tokens, "temperature": g.temperature if g.do_sample else 0.0,
                "top_p": g.top_p, "top_k": g.top_k if g.top_k > 0 else -1, "ignore_eos": g.ignore_eos}
    if g.stop_strings:
        sampling["stop"] = list(g.stop_strings)
    args = ["python", "-m", "sglang.launch_server"]
    for key, value in config.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return Export("sglang", config, sampling, shlex.join(args), warnings)

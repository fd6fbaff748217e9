"""Recipe -> SGLang server arguments (``python -m sglang.launch_server ...``).

Flags as SGLang's own parser defines them (``python/sglang/srt/server_args.py`` and
``arg_groups/speculative_hook.py``, sgl-project/sglang at commit 001067ff, Nov 2026; held against a table written
from that source in ``tests/test_export.py``): ``--speculative-algorithm`` (``STANDALONE`` for a small draft
model, ``NGRAM``, ``EAGLE``, ``EAGLE3``), ``--speculative-draft-model-path``, ``--speculative-num-steps``,
``--speculative-eagle-topk``, ``--speculative-num-draft-tokens``; plus ``--dtype``, ``--quantization bitsandbytes``
and ``--kv-cache-dtype auto``. For chains SGLang counts ``--speculative-num-draft-tokens`` with the root token
(num_steps = K, topk = 1, num_draft_tokens = K + 1: its hook forces that when topk is 1). SGLang's NGRAM matches
through a trie (``--speculative-ngram-max-trie-depth``, BFS breadths) with no n-gram size setting, so our n-gram
sizes are listed as a gap, not exported.
"""

from __future__ import annotations

import shlex

from toolkit.export import Export
from toolkit.export.common import draft_source, eagle_head_path, eagle_variant, model_path, target_config
from toolkit.export.gaps import engine_warnings
from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD


def _speculative(recipe, warnings: list[str]) -> dict:
    s, config = recipe.spec, recipe.spec.config
    K = s.num_draft_tokens
    if not config.speculates:
        return {}
    if config.sglang_algorithm is None:
        warnings.append(f"spec.drafter: {s.drafter} — no SGLang algorithm; exported without speculation")
        return {}
    out = {"speculative_algorithm": config.sglang_algorithm, **config.engine_params("sglang")}
    if config.uses_draft_model:
        source, role = draft_source(recipe)
        out["speculative_draft_model_path"] = model_path(source, role, [])
    elif config.draft == DRAFT_EAGLE_HEAD:
        out["speculative_algorithm"] = eagle_variant(recipe).upper()
        out["speculative_draft_model_path"] = eagle_head_path(recipe, warnings, "sglang")
    if out["speculative_algorithm"] == "NGRAM":
        warnings.append(f"spec.drafter: {s.drafter} — SGLang's NGRAM speculation runs on CUDA only")
        out["speculative_num_draft_tokens"] = K
    elif s.tree:
        out.update(speculative_num_steps=s.tree_depth, speculative_eagle_topk=s.tree_topk,
                   speculative_num_draft_tokens=s.tree_budget)
        if config.uses_draft_model:
            warnings.append("spec.tree_*: trees with a STANDALONE draft model are exported as SGLang's EAGLE-style "
                            "tree settings [uncertain: check that your SGLang version accepts topk > 1 here]")
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
    return Export("sglang", config, sampling, shlex.join(args), warnings, recipe.name)

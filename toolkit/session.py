"""A recipe compiled once: the plan (policies, cross-section checks, which models) and the loaded models.

Building a recipe happens here and nowhere else::

    plan = toolkit.session.plan(recipe)        # pure: no model loads; raises ConfigError for any invalid combination
    pool = ModelPool()                         # loads each ModelSpec once, shares it between recipes
    generator = toolkit.build(recipe, pool=pool)

:func:`plan` applies the ``self``-drafter rule (the draft is the target's weights at ``draft.precision``) once,
builds each KV policy once, and runs the checks that span recipe sections (a KV window must hold a whole verify
forward of K + 1 tokens, ...). The evaluator, the search (which rejects invalid combinations with :func:`plan`
before any model loads), the benchmarks and distillation all go through it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from toolkit.engine.planner import verify_room
from toolkit.errors import ConfigError
from toolkit.kv import make_policy
from toolkit.recipe import ModelSpec, Recipe
from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD, DRAFT_MODEL, DRAFT_TARGET


@dataclass(frozen=True)
class Plan:
    """What a recipe needs, decided once, before any model is loaded.

    Attributes:
        recipe: the validated recipe.
        target_policy / draft_policy: built KV policies (``None`` = uncompressed ``DynamicCache``).
        draft_spec: the draft LM to load (``self`` drafter: the target's source at ``draft.precision``), or
            ``None`` when the drafter needs no separate LM.
        max_query_tokens: the most tokens one target forward appends during decoding (K + 1 for a chain).
    """

    recipe: Recipe
    target_policy: Any
    draft_policy: Any
    draft_spec: ModelSpec | None
    max_query_tokens: int

    @property
    def verify_room(self) -> int:
        """The widest forward a round may run (tokens per row): ``max_query_tokens``, or room to pad a round to a
        cheaper width on uncompressed caches (:func:`toolkit.engine.planner.verify_room`)."""
        return verify_room(self.max_query_tokens, (self.target_policy, self.draft_policy))


def max_query_tokens(recipe: Recipe) -> int:
    """Tokens a verify forward leaves in a cache after its commit point: the last committed token plus the longest
    draft that can be accepted (K, ``k_max`` with adaptive K, ``tree_depth`` under tree speculation; a tree's
    rejected branches are gathered away before any policy compresses)."""
    spec = recipe.spec
    if not spec.config.speculates:
        return 1
    k = max(spec.num_draft_tokens, spec.k_max if spec.adaptive == "ema" else 0)
    if spec.tree:
        k = max(k, spec.tree_depth)
    return k + 1


def draft_spec(recipe: Recipe) -> ModelSpec | None:
    """The draft LM a recipe loads: the draft section, or for ``self`` the target's source at draft precision."""
    config = recipe.spec.config
    if not config.uses_draft_model:
        return None
    if config.draft == DRAFT_TARGET:
        return dataclasses.replace(recipe.draft, source=recipe.target.source)
    return recipe.draft


def plan(recipe: Recipe) -> Plan:
    """Validate ``recipe`` across sections and build its policies once; loads nothing.

    Raises:
        ConfigError: an invalid field or an invalid combination (the field is named).
    """
    recipe.validate(kv=False)  # the KV sections are validated by building their policies, once, below
    widest = max_query_tokens(recipe)
    policies = {}
    for section in ("kv", "draft_kv"):
        policy = make_policy(getattr(recipe, section), section)
        if recipe.spec.tree and (section == "kv" or recipe.spec.config.uses_draft_model):
            from toolkit.engine.tree import check_tree_support

            check_tree_support(policy, None, "target" if section == "kv" else "draft")  # trees: static caches only
        if policy is not None:
            policy.check_compatible(widest, section)
            if recipe.spec.tree:
                policy.check_tree(recipe.spec.tree_depth, section)
        policies[section] = policy
    _check_backend(recipe, policies)
    draft = draft_spec(recipe)
    if draft is not None and recipe.spec.config.draft == DRAFT_TARGET:
        draft.validate("draft")  # the target's source at draft.precision (e.g. a re-quantization of its weights)
    return Plan(recipe, policies["kv"], policies["draft_kv"], draft, widest)


def _check_backend(recipe: Recipe, policies: dict) -> None:
    """KV policies against the target's backend: llama.cpp's own KV formats only on a llama.cpp target (and never on
    the draft, which runs on torch); a llama.cpp target's combinations (:func:`toolkit.engine.llamacpp_forward.
    check_plan`). Raises :class:`ConfigError` naming the field."""
    from toolkit.models.llamacpp import LLAMACPP

    llamacpp = recipe.target.backend == LLAMACPP
    for section, policy in policies.items():
        if policy is not None and not policy.torch_form and (section != "kv" or not llamacpp):
            owner = "the draft runs on torch" if section == "draft_kv" else "the target runs on torch"
            raise ConfigError(f"{section}.policy", f"{policy.name} is llama.cpp's own KV cache format and {owner} "
                              "(target.backend llama.cpp runs it)", ["none", "streaming", "l2norm", "head_aware",
                                                                      "quantized"])
    if llamacpp:
        from toolkit.engine.llamacpp_forward import check_plan

        check_plan(recipe, policies)


class ModelPool:
    """Loads each :class:`ModelSpec` once and hands out the same ``(model, tokenizer)`` afterwards.

    Models are keyed by every field of the spec, so ``fp32`` and ``bf16`` of one source are two entries. Sharing
    is safe because nothing the toolkit does leaves a model changed (hooks are scoped to a generation).
    """

    def __init__(self):
        self._models: dict[str, tuple] = {}

    @staticmethod
    def key(spec: ModelSpec) -> str:
        return json.dumps(dataclasses.asdict(spec), sort_keys=True)

    def get(self, spec: ModelSpec, field: str = "model") -> tuple:
        """``(model, tokenizer)`` for ``spec``, loading it on first use. Raises ConfigError / ModelLoadError."""
        key = self.key(spec)
        if key not in self._models:
            from toolkit.models import load_model

            self._models[key] = load_model(spec, field)
        return self._models[key]

    def put(self, spec: ModelSpec, model, tokenizer) -> None:
        """Register an already-loaded model for ``spec`` (e.g. one a caller built itself)."""
        self._models[self.key(spec)] = (model, tokenizer)

    def clear(self) -> None:
        self._models.clear()

    def __len__(self) -> int:
        return len(self._models)


#: the process-wide pool of the evaluator and the search (which evaluate many recipes over the same models)
SHARED_POOL = ModelPool()


def load_models(p: Plan, pool: ModelPool | None = None, target=None, tokenizer=None, draft_model=None,
                draft_tokenizer=None) -> tuple:
    """``(target, tokenizer, draft_model | None, draft_tokenizer | None)`` for a plan, from ``pool`` unless given.

    ``draft_tokenizer`` is returned (not ``None``) only for a draft LM whose vocabulary is not the target's: the
    ``draft_model`` drafter then drafts across tokenizers (:mod:`toolkit.speculative.drafters.cross_tokenizer`).

    Raises:
        ModelLoadError: a source cannot be read.
        TokenizerMismatchError: target and draft vocabularies differ where the drafter cannot translate (``self``),
            or the tokenizers agree but the models' ``vocab_size`` does not (field ``draft.source``).
    """
    from toolkit.models import check_same_vocab, check_same_vocab_size

    pool = pool if pool is not None else ModelPool()
    recipe = p.recipe
    if target is None:
        target, tokenizer = pool.get(recipe.target, "target")
    if recipe.spec.config.draft == DRAFT_EAGLE_HEAD:  # the EAGLE head plays the draft model's part (target embedding)
        if draft_model is None:
            from toolkit.eagle.precision import load_recipe_head

            draft_model = load_recipe_head(recipe.draft, target)
        return target, tokenizer, draft_model, None
    if p.draft_spec is None:
        return target, tokenizer, None, None
    if draft_model is None:
        draft_model, draft_tokenizer = pool.get(p.draft_spec, "draft")
    if draft_tokenizer is not None and tokenizer is not None and \
            draft_tokenizer.get_vocab() != tokenizer.get_vocab() and recipe.spec.config.draft == DRAFT_MODEL:
        return target, tokenizer, draft_model, draft_tokenizer  # drafted across tokenizers
    if draft_tokenizer is not None and tokenizer is not None:
        check_same_vocab(tokenizer, draft_tokenizer, recipe.target.source, p.draft_spec.source)
    check_same_vocab_size(target, draft_model, recipe.target.source, p.draft_spec.source)
    return target, tokenizer, draft_model, None

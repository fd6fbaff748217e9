"""Search spaces: editable YAML files ``recipes/search/<scenario>.yaml`` (read as package data, see :func:`toolkit.resources.shipped`).

Format::

    scenario: short                    # which selection rule / constraints (eval.scenarios)
    trials: 24                         # default number of completed trials (``--trials`` overrides)
    timeout_s: 1500                    # default wall-clock budget of one search run (``--timeout`` overrides)
    constraints: {ppl_ratio_max: 1.10} # overrides of the scenario's bounds (see eval.scenarios.Scenario)
    base: {...}                        # a complete recipe; every trial starts from it
    eval: {num_prompts: 2, ...}        # eval.evaluate.EvalSettings of a trial (fast mode)
    heldout: {prompts: short-heldout, num_prompts: 4, compare: [short, short-ngram]}
                                       # the winner's confirmation on prompts no trial saw, next to shipped recipes
    seeds:                             # points measured first (Optuna ``enqueue_trial``): the shipped recipes as
      short: {target_precision: fp32, drafter: suffix, ...}   # space labels, so the search starts from them
    space:
      target_precision: {path: target.precision, choices: [fp32, bf16, int8, int4]}   # set one field
      drafter:                                                                         # or merge a named fragment
        choices:
          self: {spec: {drafter: self}, draft: {precision: int4}}
          ngram: {spec: {drafter: ngram}, draft: null}
          suffix: {spec: {drafter: suffix}, draft: null}
        disabled: [suffix]             # labels kept in the file but not searched (``--enable drafter.suffix``)
      draft_precision: {path: draft.precision, choices: [bf16, int8, int4], when: {drafter: [self]}}
      target_backend: {path: target.backend, choices: [bitsandbytes, torchao], when: {target_precision: [int8]},
                       enabled: false} # a whole dimension kept off (``--enable target_backend``)
      target_backend_gguf: {path: target.backend, choices: [auto, llama.cpp], when: {target_precision: [native]}}
                                       # a GGUF's own blocks on torch or on llama.cpp (a weight backend whose
                                       # package is not installed is never searched: labels disabled at load)

A trial walks the dimensions in file order and picks one label for every *active* one: a dimension with ``when``
is active only when each named (earlier) dimension is active and took one of the listed labels — a KV budget
exists only when its policy was picked, tree fields only for trees. The recipe is ``base`` with every picked
``path`` set / fragment deep-merged (a KV section with a ``policy`` key replaces the base's section instead of
merging into it). A combination that makes no valid recipe (a StreamingLLM window smaller than K + 1, a field this
version of :mod:`toolkit.recipe` does not know yet, ...) raises :class:`ConfigError` here, before any model loads:
the search counts it and never evaluates it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from toolkit.errors import ConfigError
from toolkit.models.prequantized import checkpoint_quantization
from toolkit.models.spec import NATIVE
from toolkit.recipe import Recipe
from toolkit.resources import shipped
from toolkit.session import plan
from toolkit.speculative.drafters import config_type
from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD, DRAFT_MODEL

SPACES_DIR = shipped("search")


@dataclass
class Dimension:
    """One searched dimension: ``labels`` are what Optuna sees (str/int/float/bool).

    ``when`` maps earlier dimension names to the labels under which this one is active; ``disabled`` labels and a
    dimension with ``enabled=False`` stay in the file but are not searched until enabled.
    """

    name: str
    labels: list
    path: str | None = None
    fragments: dict[str, dict] | None = None
    when: dict[str, list] = field(default_factory=dict)
    enabled: bool = True
    disabled: list = field(default_factory=list)

    @property
    def searched(self) -> list:
        """The labels a trial may pick (empty when the dimension is off)."""
        return [x for x in self.labels if x not in self.disabled] if self.enabled else []

    def active(self, params: dict) -> bool:
        """Whether this dimension is part of a point whose earlier picks are ``params``."""
        return bool(self.searched) and all(name in params and params[name] in allowed
                                           for name, allowed in self.when.items())

    def apply(self, data: dict, label) -> None:
        if self.path is not None:
            node = data
            *parents, leaf = self.path.split(".")
            for key in parents:
                if node.get(key) is None:
                    node[key] = {}
                node = node[key]
                if not isinstance(node, dict):
                    raise ConfigError(f"search.space.{self.name}.path", f"{self.path!r} runs through {key!r}, which "
                                      "is not a section of the recipe")
            node[leaf] = label
        else:
            _merge(data, copy.deepcopy(self.fragments[label]))


def trial_name(scenario: str, labels: list) -> str:
    """The recipe name of a point: ``<scenario>-<label>-<label>...`` with every character a recipe name may not hold
    replaced by ``_`` (labels are free text) and cut to the 100 characters a name may have."""
    import re

    name = re.sub(r"[^A-Za-z0-9._-]", "_", f"{scenario}-" + "-".join(str(v) for v in labels))
    if not name[:1].isalnum():
        name = "s" + name
    return name[:100]


def _drafts_with(fragment: dict, kind: str) -> bool:
    """The fragment picks a drafter whose draft section is of ``kind`` (registry: ``DrafterConfig.draft``)."""
    name = (fragment.get("spec") or {}).get("drafter")
    if name is None:
        return False
    try:
        return config_type(name, "search.space").draft == kind
    except ConfigError:
        return False


def _head_dim(source: str) -> int | None:
    """Attention head dimension of the model at ``source`` (a directory or .gguf), read from its config."""
    from transformers import AutoConfig

    from toolkit.models.embedded import resolve_source

    try:
        config = AutoConfig.from_pretrained(resolve_source(source, "--target")).get_text_config(decoder=True)
    except (OSError, ValueError) as exc:
        raise ConfigError("--target", f"cannot read the model config of {source!r}: {exc}") from None
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _merge(dst: dict, src: dict) -> None:
    for key, value in src.items():
        # a KV section (has 'policy') replaces the base's whole section: parameters differ between policies
        if isinstance(value, dict) and isinstance(dst.get(key), dict) and value and "policy" not in value:
            _merge(dst[key], value)
        else:
            dst[key] = value


@dataclass
class SearchSpace:
    scenario: str
    base: dict
    dimensions: list[Dimension]
    eval: dict = field(default_factory=dict)
    constraints: dict = field(default_factory=dict)
    trials: int = 8
    timeout_s: float | None = None
    heldout: dict = field(default_factory=dict)
    seeds: dict[str, dict] = field(default_factory=dict)
    source: str = "<dict>"
    target: str | None = None  # the user's model the space was adapted to (for_model), None = as shipped

    @property
    def grid_size(self) -> int:
        """Number of points (conditional dimensions counted only where active), counted without listing them."""
        return sum(1 for _ in self.iter_points())

    def enable(self, names: list[str]) -> None:
        """Turn on dimensions (``"dim"``) or single labels (``"dim.label"``) kept off in the file.

        Raises:
            ConfigError: an unknown dimension or label.
        """
        by_name = {d.name: d for d in self.dimensions}
        for item in names:
            dim_name, _, label = item.partition(".")
            if dim_name not in by_name:
                raise ConfigError("--enable", f"unknown dimension {dim_name!r}", sorted(by_name))
            dim = by_name[dim_name]
            dim.enabled = True
            if label:
                match = [x for x in dim.labels if str(x) == label]
                if not match:
                    raise ConfigError("--enable", f"unknown label {label!r} of {dim_name}", [str(x) for x in dim.labels])
                dim.disabled = [x for x in dim.disabled if x != match[0]]

    def for_model(self, target: str | None = None, draft: str | None = None) -> None:
        """Adapt the space to a user's model: ``target`` replaces the target's source everywhere, ``draft`` the
        draft LM's; what exists only for the embedded model goes (the shipped EAGLE head: its labels, and the seeds
        that use them), KV quantization groups keep the sizes that divide the model's head dimension.

        Raises:
            ConfigError: the target's config cannot be read (field ``--target``); ``draft`` where no searched label
                drafts with a draft model (field ``--draft``: ``--enable drafter.draft_model`` where it is off).
        """
        if target is None and draft is None:
            return
        if draft is not None and not any(_drafts_with(d.fragments[x], DRAFT_MODEL) for d in self.dimensions
                                         if d.fragments is not None for x in d.searched):
            off = [f"{d.name}.{x}" for d in self.dimensions if d.fragments is not None for x in d.labels
                   if x not in d.searched and _drafts_with(d.fragments[x], DRAFT_MODEL)]
            raise ConfigError("--draft", f"the {self.scenario} space searches no drafter that runs a draft model"
                              + (f" (off in its file: --enable {' '.join(off)})" if off else ""))
        quantized = None
        if target is not None:
            self.base.setdefault("target", {})["source"] = target
            self.target = target
            head_dim = _head_dim(target)
            quantized = checkpoint_quantization(target)
            # a GGUF, or a checkpoint quantized by torchao / bitsandbytes, starts from its own weights, not a
            # re-quantized copy
            if target.endswith(".gguf") or (quantized is not None and quantized.native):
                self.base["target"]["precision"] = NATIVE
        else:
            head_dim = None
        for dim in self.dimensions:
            if target is not None and dim.path == "target.precision":
                if quantized is not None:  # int8 / int4 would re-quantize the checkpoint's weights (refused)
                    dim.disabled = [*dim.disabled, "int8", "int4", *([] if quantized.native else [NATIVE])]
                elif not target.endswith(".gguf"):
                    dim.disabled = [*dim.disabled, NATIVE]  # native needs a GGUF or a quantized checkpoint
            if dim.fragments is not None:
                for label, fragment in dim.fragments.items():
                    if _drafts_with(fragment, DRAFT_EAGLE_HEAD) and target is not None:
                        dim.disabled = [*dim.disabled, label]
                    elif draft is not None and _drafts_with(fragment, DRAFT_MODEL):
                        fragment.setdefault("draft", {})["source"] = draft
            if head_dim and dim.path is not None and dim.path.endswith("quant_group_size"):
                dim.disabled = [*dim.disabled, *(g for g in dim.labels if head_dim % int(g))]
        off = {(d.name, str(x)) for d in self.dimensions for x in d.disabled}
        self.seeds = {name: point for name, point in self.seeds.items()
                      if not any((k, str(v)) in off for k, v in point.items())}

    def recipe(self, params: dict) -> Recipe:
        """The recipe of one point (a label per active dimension).

        Raises:
            ConfigError: an invalid combination (the recipe field is named) or labels that do not fit the space.
        """
        data = copy.deepcopy(self.base)
        seen: dict = {}
        for dim in self.dimensions:
            if not dim.active(seen):
                if dim.name in params:
                    raise ConfigError(f"search.space.{dim.name}", "not active for this point (see its 'when')")
                continue
            if dim.name not in params:
                raise ConfigError(f"search.space.{dim.name}", "no label picked for an active dimension",
                                  dim.searched)
            label = params[dim.name]
            if label not in dim.searched:
                raise ConfigError(f"search.space.{dim.name}", f"label {label!r} is not searched", dim.searched)
            seen[dim.name] = label
            dim.apply(data, label)
        data["name"] = trial_name(self.scenario, list(seen.values()))
        recipe = Recipe.from_dict(data)
        plan(recipe)  # cross-section checks (a window that cannot hold a verify forward, ...): nothing loads
        return recipe

    def seed_points(self) -> list[tuple[str, dict]]:
        """``[(name, point)]`` of the ``seeds`` section, each checked against the space as searched now.

        Raises:
            ConfigError: a seed whose labels do not make a valid recipe (``search.seeds.<name>`` and the reason).
        """
        out = []
        for name, point in self.seeds.items():
            try:
                self.recipe(point)
            except ConfigError as exc:
                raise ConfigError(f"search.seeds.{name}", f"not a valid point of this space: {exc}") from None
            out.append((name, dict(point)))
        return out

    def iter_points(self):
        """Every point (label dicts over the active dimensions), lazily, in file order (the full spaces hold
        millions of points: never materialize them)."""

        def walk(i: int, params: dict):
            if i == len(self.dimensions):
                yield dict(params)
                return
            dim = self.dimensions[i]
            if not dim.active(params):
                yield from walk(i + 1, params)
                return
            for label in dim.searched:
                params[dim.name] = label
                yield from walk(i + 1, params)
                del params[dim.name]

        return walk(0, {})

    def random_point(self, rng) -> dict:
        """One point drawn uniformly label by label (``rng``: a ``random.Random``), conditions respected."""
        params: dict = {}
        for dim in self.dimensions:
            if dim.active(params):
                params[dim.name] = rng.choice(list(dim.searched))
        return params

    def points(self, limit: int | None = None) -> list[dict]:
        """The points in file order; at most ``limit + 1`` of them when ``limit`` is given (enough to tell whether
        the space fits a trial budget)."""
        import itertools

        return list(itertools.islice(self.iter_points(), None if limit is None else limit + 1))

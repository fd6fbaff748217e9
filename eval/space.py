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
from pathlib import Path

import yaml

from toolkit.errors import ConfigError
from toolkit.recipe import Recipe
from toolkit.resources import shipped, shipped_name
from toolkit.session import plan

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
            node[leaf] = label
        else:
            _merge(data, copy.deepcopy(self.fragments[label]))


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
        data["name"] = f"{self.scenario}-" + "-".join(str(v) for v in seen.values())
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


def load_space(source: str | Path | dict) -> SearchSpace:
    """Parse a search-space YAML (a scenario name -> ``recipes/search/<name>.yaml``, a path, or a dict).

    Raises:
        ConfigError: malformed file (the field is named) or a base recipe that does not validate.
    """
    where = "<dict>"
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if not path.suffix:
            path = shipped("search") / f"{source}.yaml"
        if not path.is_file():
            raise ConfigError("scenario", f"no search space file {path}",
                              sorted(p.stem for p in shipped("search").glob("*.yaml")))
        data = yaml.safe_load(path.read_text()) or {}
        where = shipped_name(path)
    known = {"scenario", "trials", "timeout_s", "constraints", "base", "eval", "heldout", "seeds", "space",
             "description"}
    for key in data:
        if key not in known:
            raise ConfigError(f"search.{key}", "unknown field", sorted(known))
    if not isinstance(data.get("base"), dict):
        raise ConfigError("search.base", "must be a complete recipe mapping")
    Recipe.from_dict({**data["base"], "name": data["base"].get("name", "base")})  # validates the base
    dims: list[Dimension] = []
    for name, spec in (data.get("space") or {}).items():
        field_name = f"search.space.{name}"
        if not isinstance(spec, dict) or "choices" not in spec:
            raise ConfigError(field_name, "needs 'choices' (a list with 'path', or a mapping of label -> recipe "
                              "fragment)")
        unknown = sorted(set(spec) - {"choices", "path", "when", "enabled", "disabled"})
        if unknown:
            raise ConfigError(f"{field_name}.{unknown[0]}", "unknown field", ["choices", "path", "when", "enabled",
                                                                              "disabled"])
        choices = spec["choices"]
        if "path" in spec:
            if not isinstance(choices, list) or not choices:
                raise ConfigError(f"{field_name}.choices", "must be a non-empty list when 'path' is set")
            dim = Dimension(name, list(choices), path=spec["path"])
        else:
            if not isinstance(choices, dict) or not choices:
                raise ConfigError(f"{field_name}.choices", "must map labels to recipe fragments")
            dim = Dimension(name, [str(k) for k in choices], fragments={str(k): v or {} for k, v in choices.items()})
        when = spec.get("when") or {}
        earlier = {d.name: d for d in dims}
        if not isinstance(when, dict):
            raise ConfigError(f"{field_name}.when", "must map earlier dimension names to lists of labels")
        for other, allowed in when.items():
            if other not in earlier:
                raise ConfigError(f"{field_name}.when.{other}", "must name an earlier dimension", sorted(earlier))
            allowed = allowed if isinstance(allowed, list) else [allowed]
            bad = [x for x in allowed if x not in earlier[other].labels]
            if bad:
                raise ConfigError(f"{field_name}.when.{other}", f"unknown labels {bad}", earlier[other].labels)
            when[other] = allowed
        dim.when = when
        enabled = spec.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{field_name}.enabled", "must be true or false")
        dim.enabled = enabled
        disabled = spec.get("disabled") or []
        bad = [x for x in disabled if x not in dim.labels]
        if not isinstance(disabled, list) or bad:
            raise ConfigError(f"{field_name}.disabled", f"must list labels of this dimension, got {bad or disabled}",
                              dim.labels)
        dim.disabled = list(disabled)
        dims.append(dim)
    if not dims:
        raise ConfigError("search.space", "no dimensions to search")
    trials = data.get("trials", 8)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ConfigError("search.trials", f"must be an integer >= 1, got {trials!r}")
    timeout = data.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError("search.timeout_s", f"must be a positive number of seconds, got {timeout!r}")
    heldout = data.get("heldout") or {}
    if not isinstance(heldout, dict) or set(heldout) - {"prompts", "num_prompts", "compare"}:
        raise ConfigError("search.heldout", "must be a mapping with 'prompts' (a suite), optional 'num_prompts' and "
                          "'compare' (shipped recipe names measured on the same prompts)")
    seeds = data.get("seeds") or {}
    if not isinstance(seeds, dict) or not all(isinstance(v, dict) for v in seeds.values()):
        raise ConfigError("search.seeds", "must map a name to a point (dimension name -> label)")
    names = [d.name for d in dims]
    for seed_name, point in seeds.items():
        unknown = sorted(set(point) - set(names))
        if unknown:
            raise ConfigError(f"search.seeds.{seed_name}.{unknown[0]}", "unknown dimension", names)
    return SearchSpace(scenario=data.get("scenario", "short"), base=data["base"], dimensions=dims,
                       eval=data.get("eval") or {}, constraints=data.get("constraints") or {}, trials=trials,
                       timeout_s=timeout, heldout=heldout, seeds={str(k): v for k, v in seeds.items()},
                       source=where)

"""Search spaces: editable YAML files ``recipes/search/<scenario>.yaml``.

Format::

    scenario: short                    # which selection rule / constraints (eval.scenarios)
    trials: 8                          # default trial budget (``--trials`` overrides)
    constraints: {ppl_ratio_max: 1.10} # overrides of the scenario's bounds (see eval.scenarios.Scenario)
    base: {...}                        # a complete recipe; every trial starts from it
    eval: {num_prompts: 2, ...}        # eval.evaluate.EvalSettings of a trial (fast mode)
    space:
      target_precision: {path: target.precision, choices: [fp32, bf16]}     # set one field
      drafter:                                                               # or merge a named fragment
        choices:
          self_int4: {spec: {drafter: self}, draft: {precision: int4}}
          ngram: {spec: {drafter: ngram}, draft: null}

A trial picks one choice per dimension; the recipe is ``base`` with every picked ``path`` set / fragment deep-merged
(a KV section with a ``policy`` key replaces the base's section instead of merging into it).
Choices that make an invalid recipe (e.g. a StreamingLLM window smaller than K + 1) are pruned, never evaluated.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from toolkit.errors import ConfigError
from toolkit.recipe import Recipe

SPACES_DIR = Path(__file__).resolve().parent.parent / "recipes" / "search"


@dataclass
class Dimension:
    """One searched dimension: ``labels`` are what Optuna sees (str/int/float/bool)."""

    name: str
    labels: list
    path: str | None = None
    fragments: dict[str, dict] | None = None

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
    source: str = "<dict>"

    @property
    def grid_size(self) -> int:
        return math.prod(len(d.labels) for d in self.dimensions)

    def grid(self) -> dict[str, list]:
        return {d.name: list(d.labels) for d in self.dimensions}

    def recipe(self, params: dict) -> Recipe:
        """The recipe of one point. Raises :class:`ConfigError` for an invalid combination."""
        data = copy.deepcopy(self.base)
        for dim in self.dimensions:
            dim.apply(data, params[dim.name])
        if data.get("draft") is None and data.get("spec", {}).get("drafter") in ("draft_model", "self"):
            raise ConfigError("draft", "this drafter needs a draft section")
        data["name"] = f"{self.scenario}-" + "-".join(str(params[d.name]) for d in self.dimensions)
        return Recipe.from_dict(data)

    def points(self) -> list[dict]:
        """Every point of the grid (label dicts), in grid order."""
        names = [d.name for d in self.dimensions]
        return [dict(zip(names, combo)) for combo in itertools.product(*(d.labels for d in self.dimensions))]


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
            path = SPACES_DIR / f"{source}.yaml"
        if not path.is_file():
            raise ConfigError("scenario", f"no search space file {path}",
                              sorted(p.stem for p in SPACES_DIR.glob("*.yaml")))
        data = yaml.safe_load(path.read_text()) or {}
        where = str(path)
    known = {"scenario", "trials", "constraints", "base", "eval", "space", "description"}
    for key in data:
        if key not in known:
            raise ConfigError(f"search.{key}", "unknown field", sorted(known))
    if not isinstance(data.get("base"), dict):
        raise ConfigError("search.base", "must be a complete recipe mapping")
    Recipe.from_dict({**data["base"], "name": data["base"].get("name", "base")})  # validates the base
    dims = []
    for name, spec in (data.get("space") or {}).items():
        if not isinstance(spec, dict) or "choices" not in spec:
            raise ConfigError(f"search.space.{name}", "needs 'choices' (a list with 'path', or a mapping of "
                              "label -> recipe fragment)")
        choices = spec["choices"]
        if "path" in spec:
            if not isinstance(choices, list) or not choices:
                raise ConfigError(f"search.space.{name}.choices", "must be a non-empty list when 'path' is set")
            dims.append(Dimension(name, list(choices), path=spec["path"]))
        else:
            if not isinstance(choices, dict) or not choices:
                raise ConfigError(f"search.space.{name}.choices", "must map labels to recipe fragments")
            dims.append(Dimension(name, [str(k) for k in choices], fragments={str(k): v or {}
                                                                            for k, v in choices.items()}))
    if not dims:
        raise ConfigError("search.space", "no dimensions to search")
    trials = data.get("trials", 8)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ConfigError("search.trials", f"must be an integer >= 1, got {trials!r}")
    return SearchSpace(scenario=data.get("scenario", "short"), base=data["base"], dimensions=dims,
                       eval=data.get("eval") or {}, constraints=data.get("constraints") or {}, trials=trials,
                       source=where)

"""Reading a search-space file (its format: :mod:`eval.space`): :func:`load_space` checks every section and returns
the :class:`~eval.space.SearchSpace`; a malformed field raises :class:`ConfigError` naming it
(``search.space.<dim>.choices``, ``search.constraints.<bound>``, ``search.eval.<setting>`` ...)."""

from __future__ import annotations

from pathlib import Path

from eval.space import Dimension, SearchSpace
from toolkit.checks import check_float, check_int, check_str_list
from toolkit.errors import ConfigError
from toolkit.recipe import Recipe, check_name
from toolkit.resources import shipped, shipped_name

#: top-level keys of a space file
SPACE_KEYS = ("scenario", "trials", "timeout_s", "constraints", "base", "eval", "heldout", "seeds", "space",
              "description")
DIMENSION_KEYS = ("choices", "path", "when", "enabled", "disabled")
HELDOUT_KEYS = ("prompts", "num_prompts", "compare", "baselines")
MAX_TRIALS = 100_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def load_space(source: str | Path | dict) -> SearchSpace:
    """Parse a search-space YAML (a scenario name -> ``recipes/search/<name>.yaml``, a path, or a dict).

    Raises:
        ConfigError: malformed file (the field is named: ``search.space.<dim>.choices``, ``search.constraints.<bound>``,
            ``search.eval.<setting>`` ...) or a base recipe that does not validate.
    """
    from toolkit.recipe import load_yaml_text, read_text

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
        data = load_yaml_text(read_text(path, "search"), "search")
        where = shipped_name(path)
        if data is None:
            data = {}
    if not isinstance(data, dict):
        raise ConfigError("search", f"a search space must be a mapping with the keys {', '.join(SPACE_KEYS)}, got "
                          f"{type(data).__name__}")
    for key in data:
        if key not in SPACE_KEYS:
            raise ConfigError(f"search.{key}", "unknown field", sorted(SPACE_KEYS))
    scenario = check_name("search.scenario", data.get("scenario", "short"))
    if not isinstance(data.get("description", ""), str):
        raise ConfigError("search.description", "must be a string")
    if not isinstance(data.get("base"), dict):
        raise ConfigError("search.base", "must be a complete recipe mapping")
    Recipe.from_dict({**data["base"], "name": data["base"].get("name", "base")})  # validates the base
    dims = _dimensions(data.get("space"))
    trials = data.get("trials", 8)
    check_int("search.trials", trials, low=1, high=MAX_TRIALS)
    timeout = data.get("timeout_s")
    if timeout is not None:
        check_float("search.timeout_s", timeout, low=0.0, high=MAX_TIMEOUT_S, low_open=True)
    heldout = _heldout(data.get("heldout") or {})
    seeds = data.get("seeds") or {}
    if not isinstance(seeds, dict) or not all(isinstance(v, dict) for v in seeds.values()):
        raise ConfigError("search.seeds", "must map a name to a point (dimension name -> label)")
    names = [d.name for d in dims]
    for seed_name, point in seeds.items():
        unknown = sorted(map(str, set(point) - set(names)))
        if unknown:
            raise ConfigError(f"search.seeds.{seed_name}.{unknown[0]}", "unknown dimension", names)
    return SearchSpace(scenario=scenario, base=data["base"], dimensions=dims,
                       eval=_eval_settings(data.get("eval") or {}),
                       constraints=_constraints(data.get("constraints") or {}), trials=trials,
                       timeout_s=timeout, heldout=heldout, seeds={str(k): v for k, v in seeds.items()},
                       source=where)


def _label(value: object, field: str) -> object:
    """A label Optuna can store: a string, a bool, an int or a finite float."""
    if isinstance(value, float):
        check_float(field, value)
    elif not isinstance(value, (str, int, bool)):
        raise ConfigError(field, f"labels must be strings, numbers or booleans, got {value!r}")
    return value


def _dimensions(space: object) -> list[Dimension]:
    """The ``space`` section as dimensions, in file order (see :mod:`eval.space`). Raises :class:`ConfigError`."""
    if space is None:
        space = {}
    if not isinstance(space, dict):
        raise ConfigError("search.space", f"must map dimension names to their choices, got {type(space).__name__}")
    dims: list[Dimension] = []
    for name, spec in space.items():
        field_name = f"search.space.{name}"
        if not isinstance(name, str) or not name or "." in name:
            raise ConfigError(field_name, "a dimension name must be a non-empty string without '.'")
        if not isinstance(spec, dict) or "choices" not in spec:
            raise ConfigError(field_name, "needs 'choices' (a list with 'path', or a mapping of label -> recipe "
                              "fragment)")
        unknown = sorted(map(str, set(spec) - set(DIMENSION_KEYS)))
        if unknown:
            raise ConfigError(f"{field_name}.{unknown[0]}", "unknown field", list(DIMENSION_KEYS))
        dim = _choices(name, spec, field_name)
        dim.when = _when(spec.get("when") or {}, {d.name: d for d in dims}, field_name)
        _switches(dim, spec, field_name)
        dims.append(dim)
    if not dims:
        raise ConfigError("search.space", "no dimensions to search")
    return dims


def _choices(name: str, spec: dict, field_name: str) -> Dimension:
    """The dimension of ``spec``'s ``choices``: labels that set one ``path``, or labels of recipe fragments."""
    choices = spec["choices"]
    if "path" in spec:
        path = spec["path"]
        if not isinstance(path, str) or not all(path.split(".")):
            raise ConfigError(f"{field_name}.path", f"must be a dotted recipe field such as target.precision, "
                              f"got {path!r}")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{field_name}.choices", "must be a non-empty list when 'path' is set")
        return Dimension(name, [_label(c, f"{field_name}.choices[{i}]") for i, c in enumerate(choices)], path=path)
    if not isinstance(choices, dict) or not choices:
        raise ConfigError(f"{field_name}.choices", "must map labels to recipe fragments")
    for label, fragment in choices.items():
        if fragment is not None and not isinstance(fragment, dict):
            raise ConfigError(f"{field_name}.choices.{label}", f"must be a recipe fragment (a mapping such as "
                              f"{{spec: {{drafter: ngram}}}}), got {fragment!r}")
    return Dimension(name, [str(k) for k in choices], fragments={str(k): v or {} for k, v in choices.items()})


def _when(when: object, earlier: dict, field_name: str) -> dict:
    """``when``: earlier dimensions' names -> the labels under which this dimension is active."""
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
    return when


def _switches(dim: Dimension, spec: dict, field_name: str) -> None:
    """``enabled`` and ``disabled`` onto ``dim``; a weight backend that is not installed here is disabled too."""
    enabled = spec.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{field_name}.enabled", "must be true or false")
    dim.enabled = enabled
    disabled = spec.get("disabled") or []
    if not isinstance(disabled, list):
        raise ConfigError(f"{field_name}.disabled", f"must be a list of labels of this dimension, got "
                          f"{disabled!r}", dim.labels)
    bad = [x for x in disabled if x not in dim.labels]
    if bad:
        raise ConfigError(f"{field_name}.disabled", f"must list labels of this dimension, got {bad}", dim.labels)
    dim.disabled = list(disabled)
    if dim.path in ("target.backend", "draft.backend"):  # backends not installed here are not searched
        from toolkit.quant import AUTO, installed

        dim.disabled += [x for x in dim.labels if x != AUTO and x not in dim.disabled and not installed(x)]


def _constraints(constraints: object) -> dict:
    """Overrides of the scenario's bounds: each a finite number >= 0 (``ppl_ratio_max`` > 0) or null (off)."""
    from eval.scenarios import BOUNDS, check_bound

    if not isinstance(constraints, dict):
        raise ConfigError("search.constraints", f"must map bounds to numbers, got {constraints!r}", BOUNDS)
    for key, value in constraints.items():
        if key not in BOUNDS:
            raise ConfigError(f"search.constraints.{key}", "unknown bound", BOUNDS)
        check_bound(key, value, f"search.constraints.{key}")
    return dict(constraints)


def _eval_settings(settings: object) -> dict:
    """The ``eval`` section: keyword arguments of :class:`eval.evaluate.EvalSettings`, checked by building one."""
    import dataclasses

    from eval.settings import EvalSettings

    if not isinstance(settings, dict):
        raise ConfigError("search.eval", f"must map evaluation settings to values, got {settings!r}")
    known = [f.name for f in dataclasses.fields(EvalSettings)]
    for key in settings:
        if key not in known:
            raise ConfigError(f"search.eval.{key}", "unknown evaluation setting", known)
    try:
        EvalSettings(**settings)
    except ConfigError as exc:
        raise ConfigError(f"search.eval.{exc.field}", str(exc).split(": ", 1)[1]) from None
    return dict(settings)


def _heldout(heldout: object) -> dict:
    """The ``heldout`` section: ``prompts`` (a suite), optional ``num_prompts`` (>= 1), ``compare`` (names) and
    ``baselines`` (the confirmation's, as ``eval.baselines``)."""
    if not isinstance(heldout, dict) or set(heldout) - set(HELDOUT_KEYS):
        raise ConfigError("search.heldout", "must be a mapping with 'prompts' (a suite), optional 'num_prompts', "
                          "'compare' (shipped recipe names measured on the same prompts) and 'baselines'")
    if "prompts" in heldout and (not isinstance(heldout["prompts"], str) or not heldout["prompts"]):
        raise ConfigError("search.heldout.prompts", f"must name a prompt suite, got {heldout['prompts']!r}")
    if heldout.get("num_prompts") is not None:
        check_int("search.heldout.num_prompts", heldout["num_prompts"], low=1, high=10_000)
    if "compare" in heldout:
        check_str_list("search.heldout.compare", heldout["compare"], "shipped recipe names")
    if "baselines" in heldout and not isinstance(heldout["baselines"], bool):
        check_str_list("search.heldout.baselines", heldout["baselines"], "baseline names (eval.evaluate.EvalSettings)")
    return heldout

"""The ``spec`` section of a recipe: the drafter (its own typed config from the drafter registry) and the loop
settings every drafter shares."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from toolkit.checks import check_choice, check_float, check_int
from toolkit.errors import ConfigError
from toolkit.recipe.sections import ADAPTIVE
from toolkit.speculative.drafters import DrafterConfig, config_type
from toolkit.speculative.drafters.registry import config_types, owner_of

#: loop-level fields of ``spec`` (every other field belongs to the drafter's own config)
LOOP_FIELDS = ("drafter", "num_draft_tokens", "adaptive", "k_min", "k_max", "ema_decay", "tree", "tree_budget",
               "tree_depth", "tree_topk")


@dataclass(init=False)
class SpeculationSpec:
    """How to speculate: the drafter (its own typed config) and the loop settings every drafter shares.

    In YAML the drafter's fields sit flat next to ``drafter``
    (``spec: {drafter: suffix, num_draft_tokens: 4, max_spec_factor: 2.0}``); in Python either the same keywords or a
    config object: ``SpeculationSpec(NgramConfig(max_ngram=4), num_draft_tokens=3)``. The registered drafters and their
    configs are in :mod:`toolkit.speculative.drafters` (``draft_model``, ``self``, ``ngram``, ``suffix``, ``eagle``,
    ``none``, ...).

    Attributes:
        drafter: the registered drafter name (``spec.drafter``).
        config: that drafter's config dataclass (only its own fields, e.g. ``max_ngram`` for ``ngram``).
        num_draft_tokens: draft length K (tokens proposed per round); with ``adaptive: ema`` the starting K; with
            ``adaptive: cost`` the most tokens asked of the drafter per round.
        adaptive: ``constant`` K; ``ema``: an acceptance-EMA controller that shrinks K when the EMA < 0.5 and grows
            it when > 0.85, within ``[k_min, k_max]``; ``cost``: each round verifies the number of proposed tokens
            with the most expected tokens per millisecond, from the target's verify cost curve measured on this
            machine and the drafter's calibrated confidence (0 = a plain one-token step;
            :mod:`toolkit.speculative.verify_length`).
        ema_decay: weight of the past in the acceptance EMA.
        tree: verify a token tree per round (SpecInfer / EAGLE-2) instead of one chain of K tokens (drafters whose
            config declares ``tree``).
        tree_budget: most tree nodes per round (the target verifies ``tree_budget + 1`` tokens), 1..256.
        tree_depth: most levels of a tree (the most draft tokens a round can accept), 1..64.
        tree_topk: children per expanded node and nodes expanded per level (EAGLE-2 dynamic trees), 1..64.

    Old flat recipes load: a field of another drafter's config is dropped when it holds that config's default (the
    form ``Recipe.to_dict`` wrote before drafters had their own configs) and is an error naming it otherwise.
    """

    drafter: str
    num_draft_tokens: int
    adaptive: str
    k_min: int
    k_max: int
    ema_decay: float
    tree: bool
    tree_budget: int
    tree_depth: int
    tree_topk: int
    config: Any

    def __init__(self, drafter: Any = "draft_model", num_draft_tokens: int = 4, adaptive: str = "constant",
                 k_min: int = 1, k_max: int = 8, ema_decay: float = 0.7, tree: bool = False, tree_budget: int = 16,
                 tree_depth: int = 5, tree_topk: int = 4, config: Any = None, **drafter_fields: Any):
        if isinstance(drafter, DrafterConfig):
            drafter, config = drafter.name, drafter
        self.drafter, self.num_draft_tokens, self.adaptive = drafter, num_draft_tokens, adaptive
        self.k_min, self.k_max, self.ema_decay = k_min, k_max, ema_decay
        self.tree, self.tree_budget, self.tree_depth, self.tree_topk = tree, tree_budget, tree_depth, tree_topk
        self.config = config
        self._pending = drafter_fields  # drafter fields, resolved into ``config`` by _resolve (errors wait for validate)
        self._error: ConfigError | None = None
        self._resolve()

    def _resolve(self) -> None:
        try:
            kind = config_type(self.drafter)
        except ConfigError as exc:
            self._error = exc
            return
        if self.config is not None:
            if not isinstance(self.config, kind) or self._pending:
                self._error = ConfigError("spec.config", f"must be a {kind.__name__} for drafter {self.drafter!r}, "
                                          "with no separate drafter fields")
            return
        own = {f.name: f for f in dataclasses.fields(kind)}
        kwargs = {}
        for key, value in self._pending.items():
            if key in own:
                kwargs[key] = value
                continue
            owners = owner_of(key)
            if not owners:
                self._error = ConfigError(f"spec.{key}", "unknown field", list(LOOP_FIELDS) + list(own))
                return
            if any(value == _default(c, key) for c in owners):
                continue  # an old flat recipe's default for another drafter: nothing to apply
            self._error = ConfigError(f"spec.{key}", f"applies to drafter {', '.join(c.name for c in owners)}, "
                                      f"not {self.drafter!r}", list(own))
            return
        self.config = kind(**kwargs)

    def __getattr__(self, name: str) -> Any:
        """Read access to the drafter config's fields (``spec.max_ngram``), as recipes exposed them before."""
        config = self.__dict__.get("config")
        if config is not None and name in {f.name for f in dataclasses.fields(config)}:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SpeculationSpec) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"SpeculationSpec({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def to_dict(self) -> dict:
        """The flat YAML form: loop fields, then the drafter's own fields."""
        data = {name: getattr(self, name) for name in LOOP_FIELDS}
        if self.config is not None:
            data.update(self.config.to_dict())
        return data

    def validate(self, prefix: str) -> None:
        if self._error is not None:
            raise self._error
        check_int(f"{prefix}.num_draft_tokens", self.num_draft_tokens, low=1, high=64)
        check_choice(f"{prefix}.adaptive", self.adaptive, ADAPTIVE)
        check_int(f"{prefix}.k_min", self.k_min, low=1, high=64)
        check_int(f"{prefix}.k_max", self.k_max, low=self.k_min, high=64)
        check_float(f"{prefix}.ema_decay", self.ema_decay, low=0.0, high=1.0)
        self.config.validate(prefix)
        if not isinstance(self.tree, bool):
            raise ConfigError(f"{prefix}.tree", f"must be true or false, got {self.tree!r}")
        if self.tree and not self.config.tree:
            raise ConfigError(f"{prefix}.tree", f"tree speculation needs a tree drafter, got drafter="
                              f"{self.drafter!r}", [c.name for c in config_types() if c.tree])
        check_int(f"{prefix}.tree_budget", self.tree_budget, low=1, high=256)
        check_int(f"{prefix}.tree_depth", self.tree_depth, low=1, high=64)
        check_int(f"{prefix}.tree_topk", self.tree_topk, low=1, high=64)


def _default(config_type: type, name: str) -> Any:
    for f in dataclasses.fields(config_type):
        if f.name == name:
            return f.default
    raise KeyError(name)



"""The KV-policy registry: one policy dataclass per recipe name, registered with what the rest of the toolkit needs to
know about it.

Modelled on the drafter registry (:mod:`toolkit.speculative.drafters.registry`). A policy file defines

* the policy dataclass (a :class:`~toolkit.kv.base.KVPolicy`; its fields are the recipe's ``kv`` parameters),
  decorated with ``@register_policy(name, summary=...)``: its ``kv.policy`` value and, for the exporters, what it
  does in words (and the serving engines' closest option, if any), and
* for an eviction policy that composes with KV quantization, the composed dataclass, decorated with
  ``@register_composed(name)`` (chosen when a recipe gives that policy any of :data:`QUANT_FIELDS`).

:func:`make_policy` (recipe validation, the plan), the exporters and the reports look policies up here by name;
nothing outside this module compares policy names. Adding a policy = one new file plus one import line in
:mod:`toolkit.kv`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

from toolkit.errors import ConfigError

#: the ``kv.policy`` value meaning "no compression" (no policy is built)
NONE = "none"
#: the fields that switch an eviction policy to its quantized composition (``toolkit.kv.quantized``)
QUANT_FIELDS = ("quant_bits", "quant_group_size", "residual_length")


@dataclass(frozen=True)
class PolicyInfo:
    """What a registered policy declares besides its class.

    Attributes:
        name: the recipe's ``kv.policy`` value.
        summary: what the policy does, in words (exports: what a serving engine cannot express).
        engine_hint: the serving engines' closest option, if any (exports say it is not set); ``""`` = none.
    """

    name: str
    summary: str
    engine_hint: str = ""


_POLICIES: dict[str, type] = {}
_COMPOSED: dict[str, type] = {}
_INFO: dict[str, PolicyInfo] = {}

#: policy name -> its dataclass (a read-only view of the registry)
POLICIES = MappingProxyType(_POLICIES)
#: eviction policy name -> its class composed with KV quantization (a read-only view of the registry)
COMPOSED = MappingProxyType(_COMPOSED)


def _check_free(table: dict[str, type], name: str, cls: type, what: str) -> None:
    if not name or name == NONE:
        raise ValueError(f"{cls.__name__}: {name!r} cannot name a {what}")
    known = table.get(name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"{what} name {name!r} is already registered to {known.__name__}")


def register_policy(name: str, summary: str, engine_hint: str = "") -> Callable:
    """Class decorator: ``@register_policy("streaming", summary="...") @dataclass class StreamingLLM(KVPolicy)``.

    Sets ``cls.name``. Raises ValueError: the name is ``none``, empty, or registered to another class.
    """

    def decorate(cls):
        _check_free(_POLICIES, name, cls, "KV policy")
        _POLICIES[name] = cls
        _INFO[name] = PolicyInfo(name, summary, engine_hint)
        cls.name = name
        return cls

    return decorate


def register_composed(name: str) -> Callable:
    """Class decorator: ``cls`` is eviction policy ``name`` composed with KV quantization (evict, then quantize what
    stays). Sets ``cls.name`` to ``name`` (reports name the eviction policy)."""

    def decorate(cls):
        _check_free(_COMPOSED, name, cls, "composed KV policy")
        _COMPOSED[name] = cls
        cls.name = name
        return cls

    return decorate


def policy_names() -> tuple[str, ...]:
    """Every registered policy name, in registration order (``none`` is not a policy)."""
    return tuple(_POLICIES)


def allowed_policies() -> list[str]:
    """The allowed values of ``kv.policy``: ``none`` and every registered name, sorted."""
    return [NONE, *sorted(_POLICIES)]


def policy_type(name: object, field: str = "kv.policy") -> type:
    """The dataclass registered as ``name``. Raises :class:`ConfigError` naming ``field`` and the allowed names."""
    if not isinstance(name, str):
        raise ConfigError(field, f"must be a policy name, got {name!r}", allowed_policies())
    if name not in _POLICIES:
        raise ConfigError(field, f"unknown policy {name!r}", allowed_policies())
    return _POLICIES[name]


def policy_info(name: str) -> PolicyInfo:
    """What policy ``name`` declared at registration (an unregistered name is its own summary)."""
    return _INFO.get(name) or PolicyInfo(name, name)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def takes_quant_fields(cls: type) -> bool:
    """The policy class quantizes by itself: every one of :data:`QUANT_FIELDS` is its own field."""
    return set(QUANT_FIELDS) <= set(_field_names(cls))


def quantizing_policies() -> list[str]:
    """The policies that accept :data:`QUANT_FIELDS`: those that quantize by themselves, then those with a
    registered composition (each group sorted)."""
    return [*sorted(n for n, c in _POLICIES.items() if takes_quant_fields(c)), *sorted(_COMPOSED)]


def composed_type(name: str, field: str) -> type:
    """The composition of eviction policy ``name`` with KV quantization. Raises :class:`ConfigError` naming
    ``field`` (the first quantization field given) and the policies that take it."""
    if name not in _COMPOSED:
        raise ConfigError(field, f"policy {name!r} does not compose with KV quantization (score-based eviction "
                          "breaks per-channel key groups)", quantizing_policies())
    return _COMPOSED[name]


def make_policy(spec, prefix: str = "kv"):
    """Build the policy named by ``spec.policy`` from ``spec.params``; ``None`` for ``policy: none``.

    An eviction policy given any of :data:`QUANT_FIELDS` (``kv: {policy: streaming, window: 252, quant_bits: 4}``)
    is built as its registered quantized composition (evict, then quantize what stays).

    Raises:
        ConfigError: unknown policy, unknown parameter, an invalid parameter value (the field is named), or
            ``quant_*`` fields on a policy that does not compose with quantization.
    """
    if not isinstance(spec.policy, str):
        policy_type(spec.policy, f"{prefix}.policy")
    for key in spec.params:
        if not isinstance(key, str):
            raise ConfigError(f"{prefix}.{key}", "is not a parameter name (keys are names, e.g. 'window')")
    if spec.policy == NONE:
        if spec.params:
            raise ConfigError(f"{prefix}.{next(iter(spec.params))}", "policy 'none' takes no parameters")
        return None
    cls = policy_type(spec.policy, f"{prefix}.policy")
    quant = [key for key in spec.params if key in QUANT_FIELDS]
    if quant and not takes_quant_fields(cls):
        cls = composed_type(spec.policy, f"{prefix}.{quant[0]}")
    fields = _field_names(cls)
    for key in spec.params:
        if key not in fields:
            raise ConfigError(f"{prefix}.{key}", f"unknown parameter of policy {spec.policy!r}", fields)
    try:
        policy = cls(**spec.params)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}.{exc.field}", str(exc).split(": ", 1)[1]) from None
    policy._prefix = prefix  # so errors raised later (make_cache) name the recipe field
    return policy

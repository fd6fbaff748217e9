"""KV-cache compression policies. ``make_policy(KVSpec)`` builds one; ``POLICIES`` lists them by name."""

from __future__ import annotations

from toolkit.errors import ConfigError

POLICIES: dict[str, type] = {}


def register(name: str):
    """Class decorator adding a policy dataclass to :data:`POLICIES` under ``name``."""

    def wrap(cls):
        POLICIES[name] = cls
        cls.name = name
        return cls

    return wrap


def make_policy(spec, prefix: str = "kv"):
    """Build the policy named by ``spec.policy`` from ``spec.params``; ``None`` for ``policy: none``.

    Raises:
        ConfigError: unknown policy, unknown parameter, or an invalid parameter value (the field is named).
    """
    _load_builtin_policies()
    if spec.policy == "none":
        if spec.params:
            raise ConfigError(f"{prefix}.{next(iter(spec.params))}", "policy 'none' takes no parameters")
        return None
    if spec.policy not in POLICIES:
        raise ConfigError(f"{prefix}.policy", f"unknown policy {spec.policy!r}", ["none", *sorted(POLICIES)])
    cls = POLICIES[spec.policy]
    import dataclasses

    fields = [f.name for f in dataclasses.fields(cls)]
    for key in spec.params:
        if key not in fields:
            raise ConfigError(f"{prefix}.{key}", f"unknown parameter of policy {spec.policy!r}", fields)
    try:
        policy = cls(**spec.params)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}.{exc.field}", str(exc).split(": ", 1)[1]) from None
    policy._prefix = prefix  # so errors raised later (make_cache) name the recipe field
    return policy


def _load_builtin_policies() -> None:
    import importlib

    for module in ("streaming", "l2norm", "head_aware"):
        try:
            importlib.import_module(f"toolkit.kv.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"toolkit.kv.{module}":
                raise

"""KV-cache compression policies. ``make_policy(KVSpec)`` builds one; ``POLICIES`` lists them by name."""

from __future__ import annotations

from toolkit.errors import ConfigError

POLICIES: dict[str, type] = {}
#: eviction policy name -> its class composed with KV quantization (chosen when a ``quant_*`` field is given)
COMPOSED: dict[str, type] = {}
#: the fields that switch an eviction policy to its quantized composition (``toolkit.kv.quantized``)
QUANT_FIELDS = ("quant_bits", "quant_group_size", "residual_length")


def _registrar(table: dict[str, type], name: str):
    def wrap(cls):
        table[name] = cls
        cls.name = name
        return cls

    return wrap


def register(name: str):
    """Class decorator adding a policy dataclass to :data:`POLICIES` under ``name``."""
    return _registrar(POLICIES, name)


def register_composed(name: str):
    """Class decorator: ``cls`` is eviction policy ``name`` composed with quantization (evict, then quantize)."""
    return _registrar(COMPOSED, name)


def make_policy(spec, prefix: str = "kv"):
    """Build the policy named by ``spec.policy`` from ``spec.params``; ``None`` for ``policy: none``.

    An eviction policy given any of :data:`QUANT_FIELDS` (``kv: {policy: streaming, window: 252, quant_bits: 4}``)
    is built as its quantized composition from :data:`COMPOSED` (evict, then quantize what stays).

    Raises:
        ConfigError: unknown policy, unknown parameter, an invalid parameter value (the field is named), or
            ``quant_*`` fields on a policy that does not compose with quantization.
    """
    _load_builtin_policies()
    if not isinstance(spec.policy, str):
        raise ConfigError(f"{prefix}.policy", f"must be a policy name, got {spec.policy!r}",
                          ["none", *sorted(POLICIES)])
    for key in spec.params:
        if not isinstance(key, str):
            raise ConfigError(f"{prefix}.{key}", "is not a parameter name (keys are names, e.g. 'window')")
    if spec.policy == "none":
        if spec.params:
            raise ConfigError(f"{prefix}.{next(iter(spec.params))}", "policy 'none' takes no parameters")
        return None
    if spec.policy not in POLICIES:
        raise ConfigError(f"{prefix}.policy", f"unknown policy {spec.policy!r}", ["none", *sorted(POLICIES)])
    cls = POLICIES[spec.policy]
    quant = [key for key in spec.params if key in QUANT_FIELDS]
    if quant and spec.policy != "quantized":
        if spec.policy not in COMPOSED:
            raise ConfigError(f"{prefix}.{quant[0]}", f"policy {spec.policy!r} does not compose with KV "
                              "quantization (score-based eviction breaks per-channel key groups)",
                              ["quantized", *sorted(COMPOSED)])
        cls = COMPOSED[spec.policy]
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

    for module in ("streaming", "l2norm", "head_aware", "quantized"):
        try:
            importlib.import_module(f"toolkit.kv.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"toolkit.kv.{module}":
                raise

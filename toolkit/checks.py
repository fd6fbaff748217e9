"""Field checks shared by recipes, KV policies and drafters: each raises one :class:`ConfigError` naming the field."""

from __future__ import annotations

from toolkit.errors import ConfigError


def check_choice(name: str, value: object, allowed: tuple) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(name, f"unknown value {value!r}", allowed)


def check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int in ``[low, high]`` (inclusive bounds, None = open)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ConfigError(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ConfigError(name, f"must be <= {high}, got {value}")


def check_float(name: str, value: object, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a real number in the given range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, f"must be a number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ConfigError(name, f"must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ConfigError(name, f"must be <= {high}, got {value}")

"""Field checks shared by recipes, KV policies and drafters: each raises one :class:`ConfigError` naming the field.

Numbers are bounded on both sides: a float must be finite (NaN and ±inf are refused everywhere), and the integer
fields without a natural ceiling use the ceilings below, so a typo such as a 20-digit seed is an error naming the
field instead of an overflow deep inside torch.
"""

from __future__ import annotations

import math

from toolkit.errors import ConfigError

#: largest seed: ``torch.Generator.manual_seed`` takes 64-bit seeds and drafters seed their own generator with
#: ``seed + 1``; ``2**32 - 1`` also fits NumPy and every other RNG a seed may reach
SEED_MAX = 2**32 - 1
#: largest token count of a length field (``max_new_tokens``, windows, budgets, calibration tokens): 16 Mi tokens
TOKENS_MAX = 2**24


def check_choice(name: str, value: object, allowed: tuple) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``allowed``."""
    try:
        known = value in allowed
    except TypeError:  # an unhashable value (a list) against a mapping / set of names
        known = False
    if not known:
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
    """Raise :class:`ConfigError` unless ``value`` is a finite real number in the given range (NaN and ±inf are
    refused whatever the bounds)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ConfigError(name, f"must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ConfigError(name, f"must be <= {high}, got {value}")


def check_seed(name: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int in ``[0, SEED_MAX]``."""
    check_int(name, value, low=0, high=SEED_MAX)


def check_str_list(name: str, value: object, what: str = "strings") -> list[str]:
    """``value`` as a list of non-empty strings; a single string is refused (it is not a one-element list: a typo
    such as ``files: a.txt`` would otherwise be read letter by letter). Raises :class:`ConfigError`."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(name, f"must be a list of {what}, got {value!r}" + (
            f" (write [{value!r}] for one)" if isinstance(value, str) else ""))
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{name}[{i}]", f"must be a non-empty string, got {item!r}")
    return list(value)

"""Reading recipe-like YAML files: one clear error for an unreadable file, bad YAML or an unknown key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from toolkit.errors import ConfigError


def read_text(path: str | Path, field_name: str) -> str:
    """The UTF-8 text of a configuration file. Raises :class:`ConfigError` naming ``field_name`` when it cannot be
    read (missing, a directory, no permission) or is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(field_name, f"{path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(field_name, f"cannot read {path}: {exc.strerror or exc.__class__.__name__}") from None


def load_yaml_text(text: str, field_name: str) -> Any:
    """``yaml.safe_load(text)``; a syntax error is a :class:`ConfigError` naming ``field_name`` (on one line)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(field_name, f"not valid YAML{at}: {problem}") from None


def check_keys(data: dict, prefix: str) -> None:
    """Raise :class:`ConfigError` for a key of ``data`` that is not a field name (YAML allows ``5: 1``)."""
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{prefix}.{key}", "is not a field name (keys are names, e.g. 'window')")


def section(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from mapping ``data``, rejecting unknown keys with the allowed ones."""
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping, got {data!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}.{key}", "unknown field", known)
    return cls(**data)

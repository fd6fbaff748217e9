"""Errors raised by the toolkit.

Every configuration problem is a :class:`ConfigError` naming the offending field and, where the field takes a
closed set of values, the allowed ones, so that a user can fix the recipe from the message alone.
"""

from __future__ import annotations

from collections.abc import Iterable


class ToolkitError(Exception):
    """Base class of every error the toolkit raises on purpose."""


class ConfigError(ToolkitError, ValueError):
    """A recipe or argument field holds a value the toolkit cannot use.

    Attributes:
        field: dotted path of the field, e.g. ``"target.precision"``.
    """

    def __init__(self, field: str, message: str, allowed: Iterable[object] | None = None):
        self.field = field
        self.allowed = list(allowed) if allowed is not None else None
        text = f"{field}: {message}"
        if self.allowed is not None:
            text += f" (allowed: {', '.join(map(str, self.allowed))})"
        super().__init__(text)


class ModelLoadError(ToolkitError, RuntimeError):
    """A model could not be loaded from its source (missing path, hub unreachable, bad GGUF)."""


class TokenizerMismatchError(ToolkitError, ValueError):
    """Target and draft do not share a tokenizer vocabulary, so draft tokens cannot be verified by the target."""

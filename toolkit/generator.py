"""Deprecated module: it moved to :mod:`toolkit.speculative_lm`, and its ``Generator`` class is now
:class:`~toolkit.speculative_lm.SpeculativeLM`. Every name still resolves here, with a ``DeprecationWarning``."""

from __future__ import annotations

import warnings


def __getattr__(name: str):
    from toolkit import speculative_lm

    new = "SpeculativeLM" if name == "Generator" else name
    if name.startswith("__") or not hasattr(speculative_lm, new):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(speculative_lm, new)
    warnings.warn(f"toolkit.generator.{name} is deprecated; use toolkit.speculative_lm.{new}", DeprecationWarning,
                  stacklevel=2)
    return value

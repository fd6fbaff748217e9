"""Speculative decoding with weight quantization and KV-cache compression for Hugging Face causal LMs.

Public API::

    import toolkit
    recipe = toolkit.Recipe.load("recipes/short.yaml")
    lm = toolkit.build(recipe)  # a toolkit.SpeculativeLM
    result = lm.generate("def fibonacci(n):", max_new_tokens=64)

``toolkit.Generator`` and ``toolkit.SpecSpec`` are deprecated names of :class:`SpeculativeLM` and
:class:`SpeculationSpec`: they still resolve, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from toolkit.errors import ConfigError, ModelLoadError, TokenizerMismatchError, ToolkitError
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec, Recipe, SpeculationSpec

if TYPE_CHECKING:
    from toolkit.speculative_lm import SpeculativeLM

__version__ = "0.1.0"

#: deprecated name -> its current name (resolved by ``__getattr__`` with a ``DeprecationWarning``)
_DEPRECATED = {"Generator": "SpeculativeLM", "SpecSpec": "SpeculationSpec"}


def build(recipe, **kwargs) -> SpeculativeLM:
    """Load a recipe's models and return a :class:`toolkit.speculative_lm.SpeculativeLM` (see there)."""
    from toolkit.speculative_lm import build as _build

    return _build(recipe, **kwargs)


def generate(recipe, prompt, **overrides):
    """One-shot helper: ``build(recipe).generate(prompt, **overrides)``."""
    return build(recipe).generate(prompt, **overrides)


def __getattr__(name: str):
    """:class:`SpeculativeLM`, imported on first use (it loads the decoder), and the deprecated names."""
    if name in _DEPRECATED:
        warnings.warn(f"toolkit.{name} is deprecated; use toolkit.{_DEPRECATED[name]}", DeprecationWarning,
                      stacklevel=2)
        name = _DEPRECATED[name]
        if name in globals():
            return globals()[name]
    if name == "SpeculativeLM":
        from toolkit.speculative_lm import SpeculativeLM

        return SpeculativeLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Recipe", "ModelSpec", "KVSpec", "SpeculationSpec", "GenerationSpec", "SpeculativeLM", "build", "generate",
           "ConfigError", "ModelLoadError", "TokenizerMismatchError", "ToolkitError", "__version__"]

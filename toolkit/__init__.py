"""Speculative decoding with weight quantization and KV-cache compression for Hugging Face causal LMs.

Public API::

    import toolkit
    recipe = toolkit.Recipe.load("recipes/short.yaml")
    lm = toolkit.build(recipe)  # a toolkit.SpeculativeLM
    result = lm.generate("def fibonacci(n):", max_new_tokens=64)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.errors import ConfigError, ModelLoadError, TokenizerMismatchError, ToolkitError
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec, Recipe, SpeculationSpec

if TYPE_CHECKING:
    from toolkit.speculative_lm import SpeculativeLM

__version__ = "0.1.0"


def build(recipe, **kwargs) -> SpeculativeLM:
    """Load a recipe's models and return a :class:`toolkit.speculative_lm.SpeculativeLM` (see there)."""
    from toolkit.speculative_lm import build as _build

    return _build(recipe, **kwargs)


def generate(recipe, prompt, **overrides):
    """One-shot helper: ``build(recipe).generate(prompt, **overrides)``."""
    return build(recipe).generate(prompt, **overrides)


def __getattr__(name: str):
    """:class:`SpeculativeLM`, imported on first use (it loads the decoder)."""
    if name == "SpeculativeLM":
        from toolkit.speculative_lm import SpeculativeLM

        return SpeculativeLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Recipe", "ModelSpec", "KVSpec", "SpeculationSpec", "GenerationSpec", "SpeculativeLM", "build", "generate",
           "ConfigError", "ModelLoadError", "TokenizerMismatchError", "ToolkitError", "__version__"]

"""Speculative decoding with weight quantization and KV-cache compression for Hugging Face causal LMs.

Public API::

    import toolkit
    recipe = toolkit.Recipe.load("recipes/short.yaml")
    generator = toolkit.build(recipe)
    result = generator.generate("def fibonacci(n):", max_new_tokens=64)
"""

from toolkit.errors import ConfigError, ModelLoadError, TokenizerMismatchError, ToolkitError
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec, Recipe, SpecSpec

__version__ = "0.1.0"


def build(recipe, **kwargs):
    """Load a recipe's models and return a :class:`toolkit.generator.Generator` (see there)."""
    from toolkit.generator import build as _build

    return _build(recipe, **kwargs)


def generate(recipe, prompt, **overrides):
    """One-shot helper: ``build(recipe).generate(prompt, **overrides)``."""
    return build(recipe).generate(prompt, **overrides)


__all__ = ["Recipe", "ModelSpec", "KVSpec", "SpecSpec", "GenerationSpec", "build", "generate", "ConfigError",
           "ModelLoadError", "TokenizerMismatchError", "ToolkitError", "__version__"]

"""What a loaded model's architecture allows: token trees need every attention layer to take the tree mask as given.

Models with sliding-window or hybrid attention layers (Gemma-2, Gemma-3, Mistral with a ``sliding_window``, Qwen2
with ``use_sliding_window``, ...) build their own per-layer masks and caches for the sliding layers, which a token
tree's 4D mask does not reach: chains work on them (their masks are causal), trees are refused with a clear error.
"""

from __future__ import annotations

from toolkit.errors import ConfigError


def sliding_layers(model) -> bool:
    """The model has attention layers with a sliding window (or other non-full attention layer types)."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return True
    window = getattr(config, "sliding_window", None)
    return bool(window) and getattr(config, "use_sliding_window", True) is not False


def check_tree_support(model, field: str) -> None:
    """Raise :class:`ConfigError` (field ``spec.tree``) when ``model`` cannot verify or draft token trees."""
    if sliding_layers(model):
        arch = model.config.model_type
        raise ConfigError("spec.tree", f"token trees are not supported on the {field} ({arch}): its sliding-window "
                          "attention layers build their own masks, which the tree mask does not reach; use a chain "
                          "(spec.tree: false)", [False])

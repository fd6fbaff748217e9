"""Capture the target's features with forward hooks, scoped to a ``with`` block (no ``output_hidden_states``).

``FeatureHook(target, layers)`` registers a forward hook on each listed decoder layer (``-1`` = the last) and keeps
the output of the most recent forward: ``hook.outputs`` is a list of ``(batch, seq, H)`` tensors, one per layer.
:meth:`FeatureHook.features` turns them into the head's step-1 feature: for one layer (EAGLE-1) the last layer's
output through the target's own final norm (``model.model.norm``), for several (EAGLE-3) their concatenation.
"""

from __future__ import annotations

import torch


def decoder_layers(model) -> torch.nn.ModuleList:
    """The target's decoder layers (``model.model.layers`` for Llama-like HF models)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise AttributeError(f"{type(model).__name__} has no model.layers")
    return layers


def final_norm(model):
    inner = getattr(model, "model", model)
    return getattr(inner, "norm", None)


class FeatureHook:
    """Context manager / closable object holding forward hooks on target decoder layers.

    Args:
        model: HF causal LM (Llama-like: ``model.model.layers``, ``model.model.norm``).
        layers: decoder layer indices (negative counts from the end).
        normalize: apply the target's final norm to a single captured layer (EAGLE-1 features).
    """

    def __init__(self, model, layers: list[int], normalize: bool = True):
        self.model = model
        all_layers = decoder_layers(model)
        self.indices = [i % len(all_layers) for i in layers]
        self.normalize = normalize and len(layers) == 1
        self.outputs: list[torch.Tensor | None] = [None] * len(self.indices)
        self._handles = []
        for slot, index in enumerate(self.indices):
            self._handles.append(all_layers[index].register_forward_hook(self._make_hook(slot)))

    def _make_hook(self, slot: int):
        def hook(module, args, output):
            self.outputs[slot] = output[0] if isinstance(output, tuple) else output
        return hook

    def features(self) -> torch.Tensor:
        """The last forward's features ``(batch, seq, F)`` (F = H, or 3H for three layers)."""
        if self.normalize:
            return final_norm(self.model)(self.outputs[0])
        return torch.cat(self.outputs, dim=-1) if len(self.outputs) > 1 else self.outputs[0]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "FeatureHook":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Capture the target's features with forward hooks, scoped to a ``with`` block (no ``output_hidden_states``).

``FeatureHook(target, layers)`` registers a forward hook on each listed decoder layer (``-1`` = the last) and keeps
the output of the most recent forward: ``hook.outputs`` is a list of ``(batch, seq, H)`` tensors, one per layer.
:meth:`FeatureHook.features` turns them into the head's step-1 feature: for one layer (EAGLE-1) the last layer's
output through the target's own final norm, for several (EAGLE-3) their concatenation.

Any HF decoder-only family: the decoder layers are the ``ModuleList`` of ``num_hidden_layers`` modules inside the
model's ``base_model`` (``model.layers`` for Llama / Qwen / Mistral / Phi-3, ``gpt_neox.layers``, ``transformer.h``
for GPT-2, ``model.decoder.layers`` for OPT), the final norm the one of the names in :data:`FINAL_NORMS` there.
"""

from __future__ import annotations

import torch

#: where HF decoder-only families keep the norm after their last layer (inside ``base_model``)
FINAL_NORMS = ("norm", "final_layer_norm", "ln_f", "final_layernorm", "decoder.final_layer_norm")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The target's decoder layers: the ``ModuleList`` of ``num_hidden_layers`` modules in its ``base_model``.

    Raises:
        AttributeError: no such list (not a decoder-only transformer).
    """
    inner = getattr(model, "base_model", model)
    count = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    for _, module in inner.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    raise AttributeError(f"{type(model).__name__} has no list of its {count} decoder layers")


def final_norm(model):
    """The norm the target applies after its last decoder layer (``None`` when it has none of :data:`FINAL_NORMS`)."""
    inner = getattr(model, "base_model", model)
    for name in FINAL_NORMS:
        module = inner
        for part in name.split("."):
            module = getattr(module, part, None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


class FeatureHook:
    """Context manager / closable object holding forward hooks on target decoder layers.

    Args:
        model: HF causal LM (any decoder-only family, see the module docstring).
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
            norm = final_norm(self.model)
            return norm(self.outputs[0]) if norm is not None else self.outputs[0]
        return torch.cat(self.outputs, dim=-1) if len(self.outputs) > 1 else self.outputs[0]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "FeatureHook":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hidden_indices(model, layers: list[int]) -> tuple[int, ...]:
    """Where a head's features are in HF's ``hidden_states`` of ``model``'s forward (``output_hidden_states``; index
    ``i + 1`` is decoder layer ``i``'s output, the last index the final norm's output): one layer (EAGLE-1) must be the
    last, read after the final norm (index ``-1``); several (EAGLE-3) are read as they leave their layers and must
    not include the last (whose entry in ``hidden_states`` is normed). What :class:`FeatureHook` captures, without
    hooks: the compiled target graph returns these tensors with its logits
    (:func:`toolkit.engine.forward.select_hidden`).

    Raises:
        ValueError: a layer the hidden states cannot give that way.
    """
    count = model.config.get_text_config().num_hidden_layers
    indices = [i % count for i in layers]
    if len(indices) == 1:
        if indices[0] != count - 1:
            raise ValueError(f"feature_layers {layers}: a single feature layer is read after the final norm, so it "
                             f"must be the last of the target's {count} layers")
        return (-1,)
    if count - 1 in indices:
        raise ValueError(f"feature_layers {layers}: the last of the target's {count} layers is read after the final "
                         "norm in hidden_states; EAGLE-3 layers are read before it")
    return tuple(i + 1 for i in indices)

"""Build an N-layer draft of the target's own architecture class, sharing its tokenizer, embedding and LM head.

Design choice — embedding and LM head are **copied from the target and frozen** (and stay tied when the target
ties them, as SmolLM2 does):

* the draft must emit the target's token ids, and reusing the target's input/output embeddings puts the draft's
  hidden states in the target's own residual-stream coordinates from step 0, so layers copied from the target work
  immediately (the draft before training is a layer-pruned target, a useful baseline — cf. layer skipping in
  self-speculative decoding);
* the embedding matrix is most of a small model (SmolLM2-135M: 49152 x 576 = 28.3 M of 134.5 M parameters); frozen,
  it needs no gradient and no AdamW moments (~340 MB saved in fp32), and a few million distillation tokens cannot
  overfit the rows of rare tokens;
* the trainable part is the N decoder layers and the final norm: what KD (Hinton et al. 2015) must fit.

The result is a plain ``AutoModelForCausalLM`` of the target's class with ``num_hidden_layers = N`` (``layer_types``
and similar per-layer lists are sliced to the chosen layers), so ``ModelSpec(source=DIR)`` loads it.
"""

from __future__ import annotations

import copy
import re

import torch

from toolkit.errors import ConfigError

_PER_LAYER_LISTS = ("layer_types", "sliding_window_pattern_list", "no_rope_layers")


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """``(qualified name, ModuleList)`` of the model's decoder layers: the ModuleList with ``num_hidden_layers``
    entries (``model.layers`` for Llama, ``gpt_neox.layers`` for GPT-NeoX, ``transformer.h`` for GPT-2).

    Raises :class:`ConfigError` (field ``target``) when there is none.
    """
    count = model.config.num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return name, module
    raise ConfigError("target", f"{type(model).__name__} has no ModuleList of {count} decoder layers to copy")


def check_target(model: torch.nn.Module, layers: int) -> int:
    """Validate a target for distillation; returns its number of decoder layers L.

    Raises :class:`ConfigError`: ``target`` when it has no LM head (``get_output_embeddings()`` is None, e.g. a
    bare ``LlamaModel``) or is quantized; ``layers`` when not ``1 <= layers < L``.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    if get_head is None or get_head() is None:
        raise ConfigError("target", f"{type(model).__name__} has no LM head (get_output_embeddings() is None); "
                          "distillation needs a causal LM (an *ForCausalLM model) whose logits it can match")
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None):
        raise ConfigError("target", "a quantized (bitsandbytes) target cannot seed the draft's weights; load it at "
                          "fp32, bf16 or fp16", ["fp32", "bf16", "fp16"])
    total = getattr(model.config, "num_hidden_layers", None)
    if not isinstance(total, int) or total < 1:
        raise ConfigError("target", f"{type(model).__name__} config has no num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < total:
        raise ConfigError("layers", f"must be an integer with 1 <= layers < {total} (the target's layers), got "
                          f"{layers!r}", [f"1..{total - 1}"])
    return total


def draft_config(target_config, layers: int, sources: list[int] | None):
    """Copy of the target config with ``num_hidden_layers = layers``; per-layer lists sliced to ``sources``."""
    config = copy.deepcopy(target_config)
    total = target_config.num_hidden_layers
    picks = sources if sources is not None else [round(i * (total - 1) / max(layers - 1, 1)) for i in range(layers)]
    for name in _PER_LAYER_LISTS:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and len(value) == total:
            setattr(config, name, type(value)(value[i] for i in picks))
    config.num_hidden_layers = layers
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def build_draft(target: torch.nn.Module, layers: int, sources: list[int] | None, *, freeze_embeddings: bool = True,
                seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A new ``layers``-layer model of ``type(target)``, in train mode on the target's device, ``dtype`` weights.

    Args:
        target: the teacher (any HF ``*ForCausalLM`` with decoder layers in one ModuleList).
        layers: N, number of draft decoder layers (``check_target`` must have passed).
        sources: target layer index for each draft layer (``len == layers``), or ``None`` for a random init.
        freeze_embeddings: freeze input embedding and LM head (see the module docstring).
        seed: seed of the random initialization (used for ``sources=None`` and any weight not copied).

    Every non-layer weight (embedding, final norm, LM head, rotary buffers) is copied from the target; draft layer i
    is a copy of target layer ``sources[i]``.
    """
    from transformers import AutoModelForCausalLM

    config = draft_config(target.config, layers, sources)
    torch.manual_seed(seed)
    draft = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if type(draft) is not type(target):  # a custom class registered outside the auto mapping
        draft = type(target)(config).to(dtype)
    prefix, _ = decoder_layers(target)
    layer_key = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$")
    target_state = target.state_dict()
    new_state = {}
    for key, value in draft.state_dict().items():
        match = layer_key.match(key)
        if match:
            if sources is None:
                continue
            source_key = f"{prefix}.{sources[int(match.group(1))]}.{match.group(2)}"
        else:
            source_key = key
        if source_key in target_state and target_state[source_key].shape == value.shape:
            new_state[key] = target_state[source_key].detach().to(dtype=dtype).clone()
    draft.load_state_dict(new_state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        draft.tie_weights()
    draft.generation_config = copy.deepcopy(target.generation_config)
    device = next(target.parameters()).device
    draft.to(device)
    return set_trainable(draft, freeze_embeddings)


def set_trainable(draft: torch.nn.Module, freeze_embeddings: bool = True) -> torch.nn.Module:
    """Put ``draft`` in train mode with every weight trainable except (optionally) embedding and LM head."""
    draft.requires_grad_(True)
    if freeze_embeddings:
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
    draft.train()
    return draft

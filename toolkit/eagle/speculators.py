"""EAGLE-3 heads in the speculators layout (vllm-project/speculators, the format ``vllm serve`` reads for
``speculators_model_type: eagle3``; checked against speculators c05b95b3 ``models/eagle3/config.py`` + ``core.py``
and vLLM's ``transformers_utils/configs/speculators`` parser).

``config.json``::

    {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
     "transformer_layer_config": {"model_type": "llama" | "qwen3", "hidden_size": H, "num_hidden_layers": 1,
                                  "vocab_size": <target vocabulary>, ...},
     "draft_vocab_size": D, "norm_before_residual": bool, "target_hidden_size": null,
     "eagle_aux_hidden_state_layer_ids": [i, j, k] | null,     # output_hidden_states indices of the verifier
     "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": K, ...}],
                            "verifier": {"name_or_path": ..., "architectures": [...]}}}

Tensors: ``fc.weight`` ``(H, 3H)``, ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``layers.0.self_attn.{q,k,v}_proj.weight`` ``(*, 2H)`` (+ ``q_norm`` / ``k_norm`` for qwen3), ``o_proj``,
``layers.0.mlp.*``, ``norm.weight``, ``lm_head.weight`` ``(D, H)``, ``d2t`` ``(D,)`` offsets, ``t2d`` ``(V,)`` bool;
``embed_tokens.weight`` optional (the verifier's is used). That is the EAGLE-3 repository's layout with ``midlayer.``
renamed ``layers.0.`` and the layer's shape moved into ``transformer_layer_config``; :func:`flat_config` and
:func:`rename_to_eagle3` map it onto that layout, which :func:`toolkit.eagle.checkpoint.load_head` reads.

Speculators no longer ships EAGLE-1 (its ``eagle`` type was removed in speculators #332); EAGLE-1 heads are
exported in the EAGLE repository's layout instead (``vllm ... method: eagle``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.eagle.files import write_head_files
from toolkit.errors import ConfigError

#: speculators model types this toolkit reads and writes
SPECULATORS_TYPES = ("eagle3",)
#: transformer layer types of speculators' EAGLE-3 first layer (``models/eagle3/model_definitions.py``)
LAYER_TYPES = ("llama", "qwen3")
#: speculators options that change the head's computation and that this toolkit's head does not implement
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
#: the speculators release whose layout is written (``speculators_version``; v0.7.0, source checked at c05b95b3)
SPECULATORS_VERSION = "0.7.0"
_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "vocab_size", "attention_bias")


def is_speculators(raw: dict) -> bool:
    """Whether a head's ``config.json`` (as a dict) is in the speculators layout."""
    return "speculators_model_type" in raw


def flat_config(raw: dict, field: str = "draft.source") -> dict:
    """A speculators ``config.json`` -> the EAGLE-3 repository's config keys (``hidden_size``, ``draft_vocab_size``,
    ``eagle_config.eagle_aux_hidden_state_layer_ids``, ...) plus ``norm_before_residual`` and ``model_type``.

    Raises:
        ConfigError (``field``): a model type other than ``eagle3``, a transformer layer config that is missing,
            not a mapping, not one layer, or of a layer type other than llama / qwen3, options the head does not
            implement (``norm_before_fc``, ``fc_norm``, ``norm_output``), or a ``target_hidden_size`` other than
            the layer's hidden size.
    """
    kind = raw.get("speculators_model_type")
    if kind not in SPECULATORS_TYPES:
        raise ConfigError(field, f"speculators_model_type {kind!r} is not supported; allowed: "
                          f"{', '.join(SPECULATORS_TYPES)} (EAGLE-1 heads load in the EAGLE repository's layout)")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(field, "a speculators head needs transformer_layer_config (a mapping: the draft "
                          "layer's model_type, hidden_size, heads, ...)")
    layer_type = layer.get("model_type", "qwen3")  # speculators' default layer config is Qwen3Config
    if layer_type not in LAYER_TYPES:
        raise ConfigError(field, f"transformer_layer_config.model_type {layer_type!r} is not supported; allowed: "
                          f"{', '.join(LAYER_TYPES)}")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ConfigError(field, f"transformer_layer_config.num_hidden_layers is {layer['num_hidden_layers']}; "
                          "this toolkit runs one-layer EAGLE-3 heads only")
    on = [flag for flag in UNSUPPORTED_FLAGS if raw.get(flag)]
    if on:
        raise ConfigError(field, f"speculators options {on} are not supported by this toolkit's EAGLE-3 head; "
                          f"supported: {', '.join(UNSUPPORTED_FLAGS)} all false")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and target_hidden != layer.get("hidden_size"):
        raise ConfigError(field, f"target_hidden_size {target_hidden} differs from the head's hidden_size "
                          f"{layer.get('hidden_size')}; heads narrower than their verifier are not supported")
    flat = {key: layer[key] for key in _LAYER_KEYS if key in layer}
    flat.update(model_type=layer_type, architectures=["LlamaForCausalLMEagle3"],
                qk_norm=layer_type == "qwen3",  # Qwen3's decoder layer norms queries and keys; Llama's does not
                draft_vocab_size=raw.get("draft_vocab_size"),
                norm_before_residual=bool(raw.get("norm_before_residual", False)))
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    return flat


def rename_to_eagle3(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Speculators tensor names -> the EAGLE-3 repository's (``layers.0.`` -> ``midlayer.``); training-only
    tensors (``verifier_*``) dropped."""
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("verifier_"):
            continue
        renamed["midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name] = tensor
    return renamed


def layer_config(config, max_position_embeddings: int | None = None) -> dict:
    """The ``transformer_layer_config`` of a :class:`toolkit.eagle.head.HeadConfig` (a one-layer Llama, or Qwen3
    when the layer norms queries and keys), with the target's context length (an engine builds the draft layer
    from this config: without it, the layer type's default)."""
    c = config
    layer = {"model_type": "qwen3" if c.qk_norm else "llama", "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
             "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
             "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
             "hidden_act": "silu", "attention_bias": c.attention_bias, "mlp_bias": False,
             "tie_word_embeddings": False}
    if c.rope_scaling:
        layer["rope_scaling"] = dict(c.rope_scaling)
    if max_position_embeddings:
        layer["max_position_embeddings"] = int(max_position_embeddings)
    return layer


def speculators_config(config, verifier: str, verifier_architectures: list[str], num_speculative_tokens: int,
                       dtype: str, max_position_embeddings: int | None = None) -> dict:
    """The speculators ``config.json`` of an EAGLE-3 head (``config``: its HeadConfig) for ``verifier`` (a hub id
    or path: what ``vllm serve <head>`` loads as the target) proposing ``num_speculative_tokens`` per round;
    ``max_position_embeddings``: the target's context length."""
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": layer_config(config, max_position_embeddings),
            "draft_vocab_size": config.draft_vocab_size, "norm_before_residual": config.norm_before_residual,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in config.feature_layers],
            "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}},
            "torch_dtype": dtype}


def rename_from_eagle3(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The EAGLE-3 repository's tensor names -> speculators' (``midlayer.`` -> ``layers.0.``)."""
    return {("layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name): tensor
            for name, tensor in state.items()}


def check_exportable(config, field: str = "layout") -> None:
    """ConfigError (``field``) unless the head is an EAGLE-3 head, the only EAGLE kind speculators stores."""
    if config.variant != "eagle3":
        raise ConfigError(field, f"'speculators' stores EAGLE-3 heads only and this is an {config.variant} head; "
                          "allowed for it: 'eagle' (the EAGLE repository's layout, vLLM method 'eagle')")


def write_speculators(directory: Path, state: dict[str, torch.Tensor], config: dict) -> None:
    """Write ``config.json`` + ``model.safetensors`` (tensors in the EAGLE-3 repository's names, renamed here)
    into ``directory``, each file atomically."""
    write_head_files(directory, rename_from_eagle3(state), config)

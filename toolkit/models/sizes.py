"""Exact weight bytes of a loaded model, whatever stores its weights (plain tensors, bitsandbytes, torchao)."""

from __future__ import annotations

import torch

from toolkit.quant.packed_fp32 import packed_bytes


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor really holds.

    * torchao tensor subclasses (``Int8Tensor``, ``Int4OpaqueTensor``, ...) are traversable wrappers: their logical
      dtype/shape say nothing about storage, so their inner tensors (``__tensor_flatten__``: packed data, scales,
      zero points) are counted, recursively;
    * bitsandbytes NF4 parameters are packed ``uint8`` data plus a ``quant_state`` whose ``absmax`` / ``code`` (and,
      with double quantization, the nested state) are counted too; LLM.int8() ``Int8Params`` add their row scales
      ``SCB``;
    * anything else: ``numel * element_size``.
    """
    if hasattr(type(tensor), "__tensor_flatten__"):  # a traversable tensor subclass (also as a Parameter)
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(inner) for inner in (getattr(tensor, name) for name in names) if inner is not None)
    total = tensor.numel() * tensor.element_size()
    total += _quant_state_bytes(getattr(tensor, "quant_state", None))
    scb = getattr(tensor, "SCB", None)  # bitsandbytes LLM.int8() per-row scales
    if torch.is_tensor(scb):
        total += scb.numel() * scb.element_size()
    return total


def _quant_state_bytes(state) -> int:
    if state is None:
        return 0
    total = 0
    for name in ("absmax", "code", "offset"):
        extra = getattr(state, name, None)
        if torch.is_tensor(extra):
            total += extra.numel() * extra.element_size()
    return total + _quant_state_bytes(getattr(state, "state2", None))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's parameters and buffers, each storage counted once (tied weights once), quantized
    weights at their packed size plus their scales / zero points (see :func:`tensor_bytes`). A model whose weights
    live outside torch (a llama.cpp target) states them as ``toolkit_weight_bytes`` (the GGUF file's bytes). fp32
    linears prepacked for oneDNN (:mod:`toolkit.quant.packed_fp32`) count twice: the weight and its packed copy."""
    return _held_bytes(model) + packed_bytes(model)


def _held_bytes(model: torch.nn.Module) -> int:
    """:func:`weight_bytes` without the packed copies: what a step reads, each weight once."""
    if getattr(model, "toolkit_weight_bytes", None) is not None:
        return int(model.toolkit_weight_bytes)
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor_bytes(tensor)
    return total


def bytes_read_per_token(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every weight once, except the input embedding, of which a step reads
    one row (unless the embedding is also the LM head: tied weights are read whole). A quantized LM head next to a
    half-precision embedding (torchao int4 quantizes ``lm_head`` and leaves the embedding; a native GGUF head has
    its own int4 planes, :mod:`toolkit.models.gguf_native`) counts at its packed size; an embedding held in a GGUF's
    blocks (:class:`~toolkit.quant.block_embedding.BlockEmbedding`: codes and scales, every tensor one row per
    token) counts one row of each. A layer prepacked for oneDNN (:mod:`toolkit.quant.packed_fp32`) reads its packed
    copy instead of its weight: counted once."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    weight = getattr(embedding, "weight", None)
    tied = weight is not None and head is not None and getattr(head, "weight", None) is weight
    total = _held_bytes(model)
    if not tied:
        held = sum(tensor_bytes(t) for t in list(embedding.parameters()) + list(embedding.buffers()))
        rows = getattr(embedding, "num_embeddings", None) or weight.shape[0]
        total -= held - held // max(1, rows)
    return total

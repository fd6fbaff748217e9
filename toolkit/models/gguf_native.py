"""``precision: native`` — a GGUF file's own quantized blocks, loaded as they are: no dequantize-then-requantize.

**Conversion** (once per file, cached like every converted copy: :func:`toolkit.models.embedded.convert_gguf`'s
lock, manifest and atomic rename). The file is read memory-mapped (``gguf.GGUFReader``) one tensor at a time, in row
chunks; nothing holds a dequantized model:

* a linear layer's weight in a block format with a group-32 affine form (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K:
  :mod:`toolkit.quant.gguf_blocks`) keeps its integer codes; each group's scale and zero come from the block's own
  fields; codes wider than 4 bits become 4-bit planes. It runs as a :class:`~toolkit.quant.int4_linear.PackedInt4Linear`
  (ATen's int4 CPU kernel). The LM head of a model with tied embeddings is made the same way from the embedding's
  blocks, so the head reads the file's codes too;
* the input embedding in such a block format keeps its blocks as they are — codes plus each block's own fp16
  fields (Q8_0: one byte a weight and an fp16 scale per 32: the file's bytes) — as a
  :class:`~toolkit.quant.block_embedding.BlockEmbedding`, which dequantizes only the rows a forward looks up,
  bit for bit the rows of the bf16 table it replaces (a step reads one row; SmolLM2-135M's Q8_0 table is 28.7 MiB
  so, 54.0 MiB at bf16). A Q6_K / Q2_K / Q3_K / IQ embedding, or one whose module scales its rows (a subclass of
  ``nn.Embedding``, Gemma's), keeps a bf16 table. ``native.json``'s ``embedding`` says which (``kept_as``:
  ``blocks`` or ``bf16``, with its GGUF type and bytes);
* every other tensor (norms, and weights in a format no int4 kernel holds without a second rounding: Q6_K, Q2_K,
  Q3_K, IQ formats) is dequantized by the ``gguf`` package and kept at bf16, the dtype the model computes in. Such
  *linear* weights are listed in the run log and in ``model.toolkit_native["dequantized"]`` with their GGUF type.

Names and llama.cpp's Q/K row permutation come from transformers' GGUF tables (``get_gguf_hf_weights_map`` and its
tensor processors); the permutation is applied to codes, scales and zeros alike (it only reorders rows).

The copy holds ``config.json``, the tokenizer, ``native.safetensors`` (codes two to a byte, bf16 scales and zeros,
the embedding's blocks, bf16 tensors) and ``native.json`` (what each tensor became). Loading builds the model with
empty weights and assigns these tensors (the embedding's blocks included, uncopied), so memory peaks at about the
final weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolkit.errors import ModelLoadError
from toolkit.quant.block_embedding import BlockEmbedding, block_tensors
from toolkit.quant.gguf_blocks import affine_groups, block_fields, block_format, nibble_planes
from toolkit.quant.int4_linear import GROUP, PackedInt4Linear, pack_nibbles

#: bump when the on-disk layout of native copies changes
NATIVE_FORMAT = "v3"
TENSORS = "native.safetensors"
REPORT = "native.json"
#: weights per row chunk while decoding blocks (float32 temporaries of ~64 MiB)
CHUNK_ELEMENTS = 1 << 24
COMPUTE_DTYPE = torch.bfloat16


def _processor(reader, config: dict):
    """transformers' tensor processor for the file's architecture, and whether it only reorders rows."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
        read_field,
    )

    arch = read_field(reader, "general.architecture")[0]
    cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    return cls(config=config), cls in (TensorProcessor, LlamaTensorProcessor)


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """The row permutation the processor applies to tensor ``name`` (``None``: none), read by processing a column
    of row indices."""
    order = processor.process(weights=np.arange(rows).reshape(rows, 1), name=name).weights[:, 0]
    return None if np.array_equal(order, np.arange(rows)) else order


def _in_chunks(tensor, fn) -> list:
    """``[fn(raw_rows), ...]`` over row chunks of a 2-D GGUF tensor (``tensor.data``: ``(rows, bytes)``, mapped)."""
    rows, columns = int(tensor.shape[1]), int(tensor.shape[0])
    step = max(1, CHUNK_ELEMENTS // columns)
    return [fn(np.asarray(tensor.data[start:start + step])) for start in range(0, rows, step)]


def _dequantized(tensor) -> torch.Tensor:
    """A tensor dequantized by the ``gguf`` package, row chunk by row chunk, at :data:`COMPUTE_DTYPE`."""
    from gguf.quants import dequantize

    if len(tensor.shape) != 2:
        weights = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return torch.from_numpy(np.array(weights, dtype=np.float32)).to(COMPUTE_DTYPE)
    parts = _in_chunks(tensor, lambda raw: torch.from_numpy(
        dequantize(raw, tensor.tensor_type).astype(np.float32)).to(COMPUTE_DTYPE))
    return torch.cat(parts).reshape(int(tensor.shape[1]), int(tensor.shape[0]))


def _planes(tensor, order) -> dict:
    """``{"nibbles", "scale_and_zero"}`` of a block-quantized 2-D tensor (see :class:`PackedInt4Linear`)."""
    columns = int(tensor.shape[0])
    parts = _in_chunks(tensor, lambda raw: affine_groups(raw, tensor.tensor_type, columns)[:3])
    codes, scale, minimum = (np.concatenate(items) for items in zip(*parts))
    if order is not None:
        codes, scale, minimum = codes[order], scale[order], minimum[order]
    bits = block_format(tensor.tensor_type).bits
    codes, scale, zero = nibble_planes(codes, scale, minimum, bits)
    scale_zero = np.ascontiguousarray(np.stack([scale.T, zero.T], axis=-1))  # (groups, out_features, 2)
    return {"nibbles": torch.from_numpy(np.ascontiguousarray(pack_nibbles(codes))),
            "scale_and_zero": torch.from_numpy(scale_zero).to(COMPUTE_DTYPE)}


def _embedding_blocks(tensor, order) -> dict:
    """``{field: tensor}`` of a :class:`~toolkit.quant.block_embedding.BlockEmbedding` holding a block-quantized
    2-D tensor's rows as they are (codes and the blocks' own fields)."""
    columns = int(tensor.shape[0])
    parts = _in_chunks(tensor, lambda raw: block_tensors(block_fields(raw, tensor.tensor_type, columns)))
    out = {}
    for key in parts[0]:
        value = np.concatenate([part[key] for part in parts])
        out[key] = torch.from_numpy(np.ascontiguousarray(value[order] if order is not None else value))
    return out


def _release(reader) -> None:
    """Drop the file pages of ``reader``'s memory map from this process (they stay in the page cache): a tensor
    once converted no longer counts in the resident set, so converting peaks at the converted tensors plus one
    tensor of the file, not plus the whole file."""
    import mmap

    handle = getattr(reader.data, "_mmap", None)
    if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
        handle.madvise(mmap.MADV_DONTNEED)


@dataclass(frozen=True)
class _Plan:
    """What a conversion does with each tensor: the model's linear weights' names, its input embedding's weight
    name and whether that embedding is a plain ``nn.Embedding`` (a subclass may scale rows: Gemma's), the tied LM
    head's name (``""``: none, or the file has its own), and transformers' tensor processor (``rows_only``: it only
    reorders rows, so blocks may be kept)."""

    linear: frozenset
    embedding: str
    plain_embedding: bool
    tied_head: str
    processor: object
    rows_only: bool


def _plan(model, reader, mapping: dict, processor, rows_only: bool) -> _Plan:
    """The :class:`_Plan` for an empty ``model`` and its GGUF ``reader`` (``mapping``: GGUF names -> model names)."""
    by_id = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    linear = frozenset(f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings()
    names = [name for name, m in model.named_modules() if m is head]
    head = f"{names[0]}.weight" if names else ""
    tied_head = "" if not head or any(mapping.get(t.name) == head for t in reader.tensors) else head
    embedding = model.get_input_embeddings()
    return _Plan(linear, by_id[id(embedding.weight)], type(embedding) is torch.nn.Embedding, tied_head, processor,
                 rows_only)


def _empty_model(config, **kwargs):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=COMPUTE_DTYPE, **kwargs)


def convert_native(gguf_path: Path, out: Path, dtype=None) -> None:
    """Write the native copy of ``gguf_path`` into the directory ``out`` (see the module docstring); ``dtype`` is
    unused (the signature of :func:`toolkit.models.embedded.convert_gguf`'s converters).

    Raises:
        ValueError: a parameter of the model that the file provides no tensor for.
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    kwargs = {"gguf_file": gguf_path.name}
    config = AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = _empty_model(config)
    reader = GGUFReader(gguf_path)
    processor, rows_only = _processor(reader, config.to_dict())
    mapping = get_gguf_hf_weights_map(model, processor)
    plan = _plan(model, reader, mapping, processor, rows_only)
    tensors: dict[str, torch.Tensor] = {}
    report: dict = {"source": gguf_path.name, "file_bytes": gguf_path.stat().st_size, "native": {},
                    "dequantized": {}, "tied_head": bool(plan.tied_head)}
    for tensor in tqdm(reader.tensors, desc=f"{gguf_path.name}: blocks as they are", unit="tensor"):
        name = mapping.get(tensor.name)
        if name is None:
            continue
        order = _row_order(processor, tensor.name, int(tensor.shape[1])) if rows_only and len(tensor.shape) == 2 \
            else None
        for target in [name] + ([plan.tied_head] if name == plan.embedding and plan.tied_head else []):
            _convert_tensor(tensor, target, order, plan, tensors, report)
        _release(reader)
    blocks = {report["embedding"]["name"]} if report.get("embedding", {}).get("kept_as") == "blocks" else set()
    missing = [n for n, _ in model.named_parameters() if n not in tensors and n not in report["native"]
               and n not in blocks]
    if missing:
        raise ValueError(f"the GGUF file provides no tensor for {missing[:3]}")
    save_file(tensors, str(out / TENSORS))
    (out / REPORT).write_text(json.dumps(report, indent=1, sort_keys=True))
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs).save_pretrained(out)


def _convert_tensor(tensor, target: str, order, plan: _Plan, tensors: dict, report: dict) -> None:
    """Put GGUF ``tensor`` into ``tensors`` as the model's ``target`` and say in ``report`` what it became: int4
    planes (a linear weight in a block format), the blocks as they are (the input embedding in a block format), or
    dequantized at bf16 (anything else)."""
    kind = tensor.tensor_type.name
    blocks = plan.rows_only and block_format(tensor.tensor_type) is not None
    if blocks and target in plan.linear and int(tensor.shape[0]) % GROUP == 0:
        for key, value in _planes(tensor, order).items():
            tensors[f"{target}.{key}"] = value
        report["native"][target] = {"gguf_type": kind, "in_features": int(tensor.shape[0]),
                                    "out_features": int(tensor.shape[1])}
        return
    if blocks and target == plan.embedding and plan.plain_embedding:
        held = _embedding_blocks(tensor, order)
        tensors.update({f"{target.removesuffix('.weight')}.{key}": value for key, value in held.items()})
        report["embedding"] = {"name": target, "gguf_type": kind, "kept_as": "blocks",
                               "bytes": sum(value.numel() * value.element_size() for value in held.values())}
        return
    value = _dequantized(tensor) if plan.rows_only else _processed(tensor, plan.processor)
    tensors[target] = value[torch.from_numpy(order)] if order is not None else value
    if target == plan.embedding:
        report["embedding"] = {"name": target, "gguf_type": kind, "kept_as": "bf16",
                               "bytes": value.numel() * value.element_size()}
    elif target in plan.linear and kind not in ("F32", "F16", "BF16"):
        report["dequantized"][target] = {"gguf_type": kind, "kept_as": "bf16"}


def _processed(tensor, processor) -> torch.Tensor:
    """A tensor through transformers' own path (dequantize whole, then the processor): architectures whose
    processor reshapes or rewrites values (Bloom's fused QKV, Gemma's norms, ...)."""
    from gguf.quants import dequantize

    weights = dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.copy(processor.process(weights=weights, name=tensor.name).weights)).to(COMPUTE_DTYPE)


def resolve_native(source: str, field: str = "source") -> str:
    """The directory of a GGUF source's native copy (its quantized blocks as they are,
    this module), converted once and cached as ``NAME-native``.

    Raises:
        ModelLoadError: naming ``field``: not a GGUF source (``embedded`` or a ``.gguf`` file), a missing or
            unreadable file, or a failed conversion.
    """
    from toolkit.models.embedded import convert_gguf, gguf_source
    from toolkit.resources import cache_dir

    found = gguf_source(source, field)
    if found is None:
        raise ModelLoadError(f"{field}: precision native keeps a GGUF file's own quantized blocks; {source!r} is not "
                             "a GGUF source (embedded or a .gguf file): use precision fp32, bf16, int8 or int4")
    path, name = found
    return str(convert_gguf(path, cache_dir() / f"{name}-native-{NATIVE_FORMAT}", field, convert=convert_native))


def load_native(directory: str | Path, attn_implementation: str = "sdpa"):
    """The model of a native copy (:func:`convert_native`) on the CPU, in eval mode, with ``model.toolkit_native``
    (what each tensor became: ``native.json``).

    Raises:
        ModelLoadError: a tensor the model needs is missing from the copy.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    directory = Path(directory)
    report = json.loads((directory / REPORT).read_text())
    config = AutoConfig.from_pretrained(directory)
    if report["tied_head"] or report["embedding"]["kept_as"] == "blocks":
        config.tie_word_embeddings = False  # the head has its own int4 planes (the embedding's codes)
    model = _empty_model(config, attn_implementation=attn_implementation)
    with safe_open(str(directory / TENSORS), framework="pt") as handle:
        keys = set(handle.keys())
        held = _assign_native_modules(model, report, handle, keys)
        plain = {key: handle.get_tensor(key) for key in sorted(keys - held)}
    model.load_state_dict(plain, strict=False, assign=True)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"the native copy in {directory} has no tensor for {missing[:3]}; delete it to convert "
                             "again")
    model.toolkit_native = report
    return model


def _assign_native_modules(model, report: dict, handle, keys: set) -> set:
    """Put a :class:`PackedInt4Linear` in place of each linear layer ``report["native"]`` lists and a
    :class:`BlockEmbedding` in place of an input embedding kept in its blocks; returns the stored keys they took."""
    held = set()
    for name, info in report["native"].items():
        module_name = name.removesuffix(".weight")
        parent, _, child = module_name.rpartition(".")
        bias = f"{module_name}.bias"
        layer = PackedInt4Linear(handle.get_tensor(f"{name}.nibbles"), handle.get_tensor(f"{name}.scale_and_zero"),
                                 info["in_features"], info["out_features"],
                                 handle.get_tensor(bias) if bias in keys else None)
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        held |= {f"{name}.nibbles", f"{name}.scale_and_zero", bias}
    embedding = report["embedding"]
    if embedding["kept_as"] == "blocks":
        prefix = embedding["name"].removesuffix("weight")
        fields = {key[len(prefix):]: handle.get_tensor(key) for key in keys if key.startswith(prefix)}
        model.set_input_embeddings(BlockEmbedding(fields, embedding["gguf_type"], COMPUTE_DTYPE))
        held |= {prefix + field for field in fields}
    return held & keys

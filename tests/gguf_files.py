"""Small real GGUF files for tests, written with the ``gguf`` package.

A llama-architecture file carrying the embedded model's tokenizer metadata cut to its first ``VOCAB`` tokens (special
tokens, the byte alphabet and the merges among them, so transformers' GGUF loader builds a working GPT-2 BPE
tokenizer) and random decoder layers of any shape (one small layer by default; the native-weights benchmark writes
Llama-3.1-8B's shape with it). Tensors are F32 by default; ``types`` gives a GGUF type per tensor kind (``attn_q``,
``ffn_down``, ``token_embd``, ``output``, ...), or is a function ``(kind, layer) -> type``: the block formats the
``gguf`` package can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized from the random weights, the K-quants
(Q4_K, Q5_K, Q6_K) are random blocks with scales that give weights of the same size.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from toolkit.models import embedded_gguf_path

VOCAB = 1024
#: byte offsets of the fp16 super-block scale (and minimum) in K-quant blocks
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}


def _overrides(shape: dict) -> dict:
    return {"llama.vocab_size": shape["vocab"], "llama.block_count": shape["layers"],
            "llama.embedding_length": shape["hidden"], "llama.feed_forward_length": shape["ffn"],
            "llama.attention.head_count": shape["heads"], "llama.attention.head_count_kv": shape["kv_heads"],
            "llama.rope.dimension_count": shape["hidden"] // shape["heads"], "llama.context_length": 512,
            "general.file_type": 0}


@functools.lru_cache(maxsize=1)
def _embedded_fields() -> tuple:
    """``((name, value, type, sub_type), ...)``: the embedded file's metadata, the tokenizer cut to ``VOCAB``
    tokens; read once per process (reading 49k tokens and their merges takes seconds)."""
    import gguf

    reader = gguf.GGUFReader(embedded_gguf_path())
    kept = set(reader.fields["tokenizer.ggml.tokens"].contents()[:VOCAB])
    out = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.quantization_version"):
            continue
        value = field.contents()
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = value[:VOCAB]
        elif name == "tokenizer.ggml.merges":
            value = [m for m in value if "".join(m.split(" ")) in kept and all(p in kept for p in m.split(" "))]
        out.append((name, value, field.types[0], field.types[1] if len(field.types) > 1 else None))
    return tuple(out)


def _copy_tokenizer(writer, shape: dict) -> None:
    overrides = _overrides(shape)
    for name, value, main_type, sub_type in _embedded_fields():
        writer.add_key_value(name, overrides.get(name, value), main_type, sub_type=sub_type)


def random_k_blocks(rows: int, columns: int, qtype, rng, scale: float = 0.002) -> np.ndarray:
    """``(rows, bytes)`` random blocks of a K-quant type, super-block scales ``scale`` (and minimums ``2 scale``)."""
    import gguf

    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * columns // per_block, block_bytes), dtype=np.uint8)
    at_d, at_min = _K_SCALES[qtype.name]
    raw[:, at_d:at_d + 2] = np.array([scale], dtype=np.float16).view(np.uint8)
    if at_min is not None:
        raw[:, at_min:at_min + 2] = np.array([2 * scale], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_llama_gguf(path: Path, seed: int = 0, types=None, hidden: int = 64, ffn: int = 128, heads: int = 4,
                     kv_heads: int = 2, layers: int = 1, vocab: int = VOCAB, output: bool = False) -> Path:
    """The GGUF of the module docstring at ``path`` (``vocab``: rows of the embedding and ``output.weight``, an untied
    head with ``output``); returns ``path``."""
    import gguf
    from gguf.quants import quantize

    shape = {"hidden": hidden, "ffn": ffn, "heads": heads, "kv_heads": kv_heads, "layers": layers, "vocab": vocab}
    writer = gguf.GGUFWriter(str(path), "llama")
    _copy_tokenizer(writer, shape)
    rng = np.random.default_rng(seed)
    kinds = types or {}
    qtype_of = types if callable(types) else lambda kind, layer: kinds.get(kind, gguf.GGMLQuantizationType.F32)

    def add(name: str, kind: str, rows: int, columns: int, layer: int | None = None) -> None:
        qtype = qtype_of(kind, layer)
        if qtype.name in _K_SCALES:
            writer.add_tensor(name, random_k_blocks(rows, columns, qtype, rng), raw_dtype=qtype)
            return
        weights = (rng.standard_normal((rows, columns)) * 0.05).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, weights)
        else:
            writer.add_tensor(name, quantize(weights, qtype), raw_dtype=qtype)

    add("token_embd.weight", "token_embd", vocab, hidden)
    if output:
        add("output.weight", "output", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    kv = kv_heads * hidden // heads
    for i in range(layers):
        for name, rows, columns in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                    ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden),
                                    ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            add(f"blk.{i}.{name}.weight", name, rows, columns, i)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

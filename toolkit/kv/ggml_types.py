"""llama.cpp's quantized KV cache (``kv: {policy: ggml_types, type_k: q8_0, type_v: q8_0}``): keys and values stored
as ggml blocks, for a target on ``target.backend: llama.cpp`` only.

What it is (ggml's formats, ``ggml-quants.c``; llama.cpp's ``--cache-type-k`` / ``--cache-type-v``): every cached
key and value vector is cut into blocks of 32 consecutive channels (along ``head_dim`` of one KV head, one token),
each block stored with one fp16 scale:

* ``q8_0`` — 32 signed 8-bit codes, scale = max |x| / 127: 34 bytes per 32 values (8.5 bits each);
* ``q4_0`` — 32 4-bit codes, scale = the signed max / -8, codes offset by 8: 18 bytes per 32 values (4.5 bits);
* ``f16`` — no quantization (2 bytes a value), llama.cpp's default.

Unlike KIVI (``policy: quantized``: keys per channel over groups of tokens, a full-precision residual) every token
is quantized as it is written, per token, so rollback is exact as for the f16 cache (removing positions removes
their blocks). Quantized values need flash attention in llama.cpp, which every context of the target runs
(:func:`toolkit.models.llamacpp.cache_kwargs`).

The policy has no torch form (``torch_form = False``): on a torch target :func:`toolkit.session.plan` refuses it,
naming ``kv.policy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from toolkit.checks import check_choice
from toolkit.errors import ConfigError
from toolkit.kv.base import KVPolicy
from toolkit.kv.registry import register_policy

#: the types a llama.cpp KV cache takes here -> (values per block, bytes per block)
GGML_TYPES = {"f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}


@register_policy("ggml_types", summary="llama.cpp's KV cache types (ggml q8_0 / q4_0 blocks of 32 channels per "
                 "token; target.backend llama.cpp only)", engine_hint="llama.cpp --cache-type-k / --cache-type-v")
@dataclass
class GgmlTypes(KVPolicy):
    """llama.cpp's KV cache types (see the module docstring).

    Attributes:
        type_k: how keys are stored: ``f16``, ``q8_0`` or ``q4_0``.
        type_v: how values are stored (the same choices; llama.cpp quantizes values inside flash attention).

    Raises:
        ConfigError: a type outside :data:`GGML_TYPES` (named), or both ``f16`` (that is ``policy: none``).
    """

    type_k: str = "q8_0"
    type_v: str = "q8_0"

    torch_form: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("type_k", self.type_k, tuple(GGML_TYPES))
        check_choice("type_v", self.type_v, tuple(GGML_TYPES))
        if self.type_k == self.type_v == "f16":
            raise ConfigError("type_k", "f16 keys and values are llama.cpp's plain cache: use policy none",
                              [t for t in GGML_TYPES if t != "f16"])

    def budget_for(self, length: int = 0) -> int:
        return length  # nothing is evicted: every token is kept, in fewer bytes

    def bytes_per_token(self, kv_heads: int, head_dim: int, layers: int) -> int:
        """Exact bytes one token occupies in the cache: keys and values of every layer and KV head, in blocks."""
        per_block_k, per_block_v = GGML_TYPES[self.type_k], GGML_TYPES[self.type_v]
        values = kv_heads * head_dim
        return layers * (values // per_block_k[0] * per_block_k[1] + values // per_block_v[0] * per_block_v[1])

    def make_cache(self, model):
        raise ConfigError(f"{getattr(self, '_prefix', 'kv')}.policy", "ggml_types is llama.cpp's KV cache; it runs "
                          "on target.backend llama.cpp only", ["none", "streaming", "quantized"])

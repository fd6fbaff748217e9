"""The decoder's row cache (:mod:`toolkit.kv.rows`) on llama.cpp's KV cache: one sequence (``seq_id`` 0) of a
``llama_context``, for a target on ``target.backend: llama.cpp``.

What the protocol's calls do here::

    begin_row(length)      the context's memory is cleared; the prompt is prefilled by the forward at positions
                           0 .. length - 1 (one row only: a second is a ValueError)
    prepare(width)         nothing to build: the forward writes `width` tokens at the next positions itself
    accept(kept, host)     rollback: ``llama_memory_seq_rm(mem, 0, held - rejected, -1)`` removes the positions past
                           the kept tokens (exact: what stays is bit-identical to a cache that never saw them)
    commit()               the commit point; StreamingLLM evicts here (below)
    kv_bytes()             tokens held x bytes per token of the cache types (exact for llama.cpp's layout)

What maps (:func:`llamacpp_form`; anything else is one :class:`ConfigError` naming ``kv.policy``):

* ``none`` — llama.cpp's f16 cache;
* ``ggml_types`` (:mod:`toolkit.kv.ggml_types`) — the context's ``type_k`` / ``type_v`` (q8_0 / q4_0 blocks);
* ``streaming`` with ``position_mode: reindex`` and ``exact_window: false`` — llama.cpp's context shift (Xiao et al.
  2024's rolling cache with positions as cache slots, what ``llama-cli --keep N`` does): at a commit point where
  more than ``sink_tokens + window + compress_interval`` entries are held, the oldest ones after the ``sink_tokens``
  sinks are removed (``llama_memory_seq_rm``) and the rest moved down by as many positions
  (``llama_memory_seq_add``: llama.cpp re-rotates the cached keys, as :func:`toolkit.kv.rope.shift_positions` does on
  torch). The exact banded window and absolute positions have no llama.cpp form (a query there attends to every held
  entry at slot positions).

KIVI-quantized, L2-norm and head-aware caches choose or re-pack entries per head, which llama.cpp's cache (one cell
per token for all heads) cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.errors import ConfigError

#: what llama.cpp maps, for the errors
MAPPED = ["none", "ggml_types", "streaming (position_mode reindex, exact_window false)"]


@dataclass(frozen=True)
class LlamaCppForm:
    """A KV policy as llama.cpp runs it: cache types and, for StreamingLLM, the context shift.

    Attributes:
        type_k / type_v: ``f16``, ``q8_0`` or ``q4_0``.
        n_keep: sink tokens kept at the start (StreamingLLM's ``sink_tokens``).
        window: recent entries kept after a shift (0: no eviction).
        interval: entries the cache may grow past ``n_keep + window`` before a shift.
    """

    type_k: str = "f16"
    type_v: str = "f16"
    n_keep: int = 0
    window: int = 0
    interval: int = 0

    @property
    def shifts(self) -> bool:
        return self.window > 0


def llamacpp_form(policy, prefix: str = "kv") -> LlamaCppForm:
    """The llama.cpp form of a built KV ``policy`` (``None``: the plain f16 cache); see the module docstring.

    Raises:
        ConfigError: naming ``{prefix}.policy`` (or the StreamingLLM field that has no llama.cpp form).
    """
    from toolkit.kv.ggml_types import GgmlTypes
    from toolkit.kv.streaming import StreamingLLM

    if policy is None:
        return LlamaCppForm()
    if type(policy) is GgmlTypes:
        return LlamaCppForm(policy.type_k, policy.type_v)
    if type(policy) is StreamingLLM:
        if policy.position_mode != "reindex":
            raise ConfigError(f"{prefix}.position_mode", "llama.cpp's context shift moves cached entries to slot "
                              "positions; absolute positions have no llama.cpp form", ["reindex"])
        if policy.exact_window:
            raise ConfigError(f"{prefix}.exact_window", "llama.cpp attends to every held entry; the exact banded "
                              "window has no llama.cpp form", [False])
        return LlamaCppForm(n_keep=policy.sink_tokens, window=policy.window, interval=policy.compress_interval)
    raise ConfigError(f"{prefix}.policy", f"{policy.name} has no form on target.backend llama.cpp (its cache keeps "
                      "one cell per token for every head: per-head eviction and KIVI groups cannot be expressed)",
                      MAPPED)


def bytes_per_token(config, form: LlamaCppForm) -> int:
    """Bytes one token occupies in llama.cpp's cache of ``config``'s model under ``form`` (keys and values of every
    layer; ggml blocks of :data:`toolkit.kv.ggml_types.GGML_TYPES`)."""
    from toolkit.kv.ggml_types import GGML_TYPES

    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    values = heads * head_dim
    per_k, per_v = GGML_TYPES[form.type_k], GGML_TYPES[form.type_v]
    return text.num_hidden_layers * (values // per_k[0] * per_k[1] + values // per_v[0] * per_v[1])


class LlamaCppCache:
    """One sequence on a llama.cpp context (see the module docstring).

    Args:
        llama: the ``llama_cpp.Llama`` whose context holds the cache.
        form: the KV policy's :class:`LlamaCppForm`.
        token_bytes: :func:`bytes_per_token`.

    Attributes:
        held: entries held (= the next position: llama.cpp positions are cache slots here).
        length: tokens represented (the next absolute position; past ``held`` once StreamingLLM evicted).
        compressions: commit points that shifted the context.
    """

    static = False

    def __init__(self, llama, form: LlamaCppForm, token_bytes: int):
        import llama_cpp

        self.llama_cpp, self.llama, self.form, self.token_bytes = llama_cpp, llama, form, token_bytes
        self.memory = llama_cpp.llama_get_memory(llama.ctx)
        if form.shifts and not llama_cpp.llama_memory_can_shift(self.memory):
            raise ConfigError("kv.policy", "this model's llama.cpp cache cannot shift positions (no RoPE "
                              "re-rotation), so StreamingLLM has no form here", ["none", "ggml_types"])
        self.in_use = False
        self.held = self.length = self.compressions = 0
        self._width = 0

    @property
    def rows(self) -> int:
        return 1 if self.in_use else 0

    def begin_row(self, length: int) -> tuple[object, dict]:
        """Clear the context's memory for a new sequence; the forward's ``prefill`` fills it (kwargs name this
        cache). Raises ``ValueError`` while a sequence is in use (llama.cpp targets decode one row)."""
        if self.in_use:
            raise ValueError("batch_size: a llama.cpp target decodes one sequence at a time")
        # metadata only: the cells are marked empty, so no attention reads what they held (as llama-cpp-python's own
        # reset does); zeroing the buffers too (data=True) costs ~5 ms a request at the 8k-token context
        self.llama_cpp.llama_memory_clear(self.memory, False)
        self.in_use, self.held, self.length, self.compressions = True, 0, 0, 0
        return self, {"llama_cache": self}

    def add_row(self, prefilled, length: int) -> None:
        self.length = length
        self.commit()

    def written(self, width: int) -> None:
        """The forward wrote ``width`` tokens at positions ``held .. held + width - 1``."""
        self.held += width
        self._width = width

    def prepare(self, width: int, rows: range | None = None) -> dict:
        return {"llama_cache": self}

    def accept(self, kept: torch.Tensor, kept_host: list[int]) -> None:
        """Keep the first ``kept_host[0]`` tokens of the last forward; remove the rest from the context."""
        rejected = self._width - kept_host[0]
        if rejected > 0:
            self.held -= rejected
            if not self.llama_cpp.llama_memory_seq_rm(self.memory, 0, self.held, -1):
                raise RuntimeError(f"llama.cpp could not remove positions {self.held}.. of sequence 0")
        self.length += kept_host[0]
        self._width = 0

    def commit(self) -> None:
        """StreamingLLM's context shift when over ``n_keep + window + interval`` entries (see the module docstring)."""
        form = self.form
        if not form.shifts or self.held <= form.n_keep + form.window + form.interval:
            return
        evict = self.held - form.n_keep - form.window
        self.llama_cpp.llama_memory_seq_rm(self.memory, 0, form.n_keep, form.n_keep + evict)
        self.llama_cpp.llama_memory_seq_add(self.memory, 0, form.n_keep + evict, -1, -evict)
        self.held -= evict
        self.compressions += 1

    def keep_rows(self, keep: list[int]) -> None:
        """``[]``: the sequence left (its entries stay, for reports, until the next ``begin_row``)."""
        if not keep:
            self.in_use = False

    def kv_bytes(self) -> int:
        return self.held * self.token_bytes

    def needed_bytes(self) -> int:
        return self.kv_bytes()

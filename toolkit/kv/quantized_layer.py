"""One layer of the KIVI-style quantized KV cache (:mod:`toolkit.kv.quantized`): full-precision sinks, quantized key
groups (per channel) and value groups (per token), and the full-precision residual of the newest tokens; crop
touches only the residual's tail, commit moves whole groups from the residual into the quantized part."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from toolkit.kv.quant_pack import Packed, dequantize, quantize


class QuantizedLayer(DynamicLayer):
    """One layer of a quantized cache: fp sinks, packed groups, fp residual (``self.keys`` / ``self.values``).

    Shapes: sinks and residual ``(batch, kv_heads, tokens, head_dim)`` in the model's dtype; quantized keys a
    :class:`~toolkit.kv.quant_pack.Packed` of ``(batch, kv_heads, head_dim, tokens)`` (groups along tokens), values
    of ``(batch, kv_heads, tokens, head_dim)`` (groups along channels). Absolute positions: sinks ``[0, sinks)``,
    quantized ``[q_start, q_start + q_len)``, residual ``[res_start, res_start + residual)``.
    """

    def __init__(self, bits: int, group: int):
        super().__init__()
        self.bits, self.group = bits, group
        self.sink_keys = self.sink_values = None
        self.qkeys: Packed | None = None
        self.qvalues: Packed | None = None
        self.q_start = self.res_start = 0
        self.shadow: tuple[int, int] = (0, 0)  # absolute positions appended again, quantized, in this forward

    # ------------------------------------------------------------------------------------------------ sizes
    @property
    def sinks(self) -> int:
        return 0 if self.sink_keys is None else self.sink_keys.shape[-2]

    @property
    def q_len(self) -> int:
        return 0 if self.qkeys is None else self.qkeys.length

    @property
    def residual(self) -> int:
        return self.keys.shape[-2] if self.is_initialized and self.keys.dim() == 4 else 0

    def max_length_held(self) -> int:
        return self.sinks + self.q_len + self.residual

    def get_seq_length(self) -> int:
        return self.max_length_held()

    def tensors(self) -> list[torch.Tensor]:
        out = [t for t in (self.sink_keys, self.sink_values) if t is not None]
        for packed in (self.qkeys, self.qvalues):
            if packed is not None:
                out += packed.tensors()
        if self.residual:
            out += [self.keys, self.values]
        return out

    # ------------------------------------------------------------------------------------------------ forward
    def quantize_keys(self, keys: torch.Tensor) -> Packed:
        """``(b, h, tokens, d)`` -> packed per-channel groups of ``group`` tokens."""
        return quantize(keys.transpose(-1, -2), self.bits, self.group)

    def quantize_values(self, values: torch.Tensor) -> Packed:
        """``(b, h, tokens, d)`` -> packed per-token groups of ``group`` channels."""
        return quantize(values, self.bits, self.group)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``(b, h, q, d)`` states to the residual; return the keys/values attention reads:
        ``[sinks, dequantized groups, shadow groups, residual]`` ``(b, h, sinks + q_len + shadow + residual, d)``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # dequantize into the incoming states' dtype: DynamicLayer's lazily set attributes are not ours to read
        # (transformers 5.24 stopped setting ``DynamicLayer.dtype``; see toolkit.kv.hf_surface)
        dtype = key_states.dtype
        if self.residual:
            self.keys = torch.cat((self.keys, key_states), dim=-2)
            self.values = torch.cat((self.values, value_states), dim=-2)
        else:
            self.keys, self.values = key_states, value_states
        parts_k, parts_v = [], []
        if self.sink_keys is not None:
            parts_k.append(self.sink_keys)
            parts_v.append(self.sink_values)
        if self.qkeys is not None:
            parts_k.append(dequantize(self.qkeys, dtype).transpose(-1, -2))
            parts_v.append(dequantize(self.qvalues, dtype))
        first, last = self.shadow
        if last > first:
            lo, hi = first - self.res_start, last - self.res_start
            parts_k.append(dequantize(self.quantize_keys(self.keys[:, :, lo:hi]), dtype).transpose(-1, -2))
            parts_v.append(dequantize(self.quantize_values(self.values[:, :, lo:hi]), dtype))
        if not parts_k:
            return self.keys, self.values
        return torch.cat((*parts_k, self.keys), dim=-2), torch.cat((*parts_v, self.values), dim=-2)

    # ------------------------------------------------------------------------------------------------ rollback
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``|tokens_to_remove|`` entries (all in the residual: only uncommitted tokens go)."""
        n = abs(tokens_to_remove)
        if n == 0 or not self.is_initialized:
            return
        if n > self.residual:
            raise ValueError(f"cannot crop {n} tokens: the full-precision residual holds {self.residual}")
        self.keys, self.values = self.keys[:, :, :-n], self.values[:, :, :-n]

    # ------------------------------------------------------------------------------------------------ commit
    def commit(self, sink_tokens: int, boundary: int, evict_before: int | None) -> bool:
        """Commit point: fill the sinks, quantize the residual's oldest tokens up to absolute position ``boundary``
        (whole groups), then drop whole quantized groups lying entirely before ``evict_before``. Returns whether
        anything was quantized or evicted."""
        changed = False
        if self.sinks < sink_tokens and self.residual:
            take = min(sink_tokens - self.sinks, self.residual)
            k, v = self.keys[:, :, :take], self.values[:, :, :take]
            self.sink_keys = k if self.sink_keys is None else torch.cat((self.sink_keys, k), dim=-2)
            self.sink_values = v if self.sink_values is None else torch.cat((self.sink_values, v), dim=-2)
            self.keys, self.values = self.keys[:, :, take:], self.values[:, :, take:]
            self.res_start += take
            self.q_start = self.res_start
        flush = boundary - self.res_start
        if flush > 0 and self.sinks >= sink_tokens:  # fewer than sink_tokens tokens so far: all are sinks
            qk = self.quantize_keys(self.keys[:, :, :flush])
            qv = self.quantize_values(self.values[:, :, :flush])
            self.qkeys = qk if self.qkeys is None else self.qkeys.cat(qk, -1)
            self.qvalues = qv if self.qvalues is None else self.qvalues.cat(qv, -2)
            self.keys, self.values = self.keys[:, :, flush:].contiguous(), self.values[:, :, flush:].contiguous()
            self.res_start += flush
            changed = True
        if evict_before is not None and self.q_len:
            groups = min(self.q_len, max(0, evict_before - self.q_start)) // self.group
            if groups:
                self.qkeys = self.qkeys.drop_tokens(groups * self.group, -1)
                self.qvalues = self.qvalues.drop_tokens(groups * self.group, -2)
                self.q_start += groups * self.group
                if not self.q_len:
                    self.qkeys = self.qvalues = None
                changed = True
        return changed

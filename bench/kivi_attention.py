"""Where a KIVI forward's time goes at a long context: one decoder layer's attention over the static form's parts.

Per layer, :class:`toolkit.kv.static_quant.QuantLayer` hands the attention a
:class:`~toolkit.kv.quant_attention.QuantKeys`: the packed groups, the full-precision slots and (for a verify forward)
the shadow groups quantized and dequantized in the forward, attended part by part. This times it for one row at
``--tokens`` packed tokens, eager and compiled (``torch.compile``), beside the form it replaced (every part dequantized
and concatenated, then SDPA) and SDPA over an uncompressed cache of the same length, for a decode forward (1 query)
and a verify forward (``--width`` queries). Prints a Markdown table (ms per layer; multiply by the model's layers for a
forward). Geometry defaults: the embedded SmolLM2-135M (3 KV heads, 9 query heads, head_dim 64), KIVI 4-bit,
groups of 32, fp32 buffers as the static cache holds them on CPU.

    PYTHONPATH=. .venv/bin/python bench/kivi_attention.py --tokens 4096
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from toolkit.kv.quant_attention import QuantKeys
from toolkit.kv.quant_pack import dequantize, quantize
from toolkit.kv.static_quant import shadow


def fp_parts(fk, fv, shadowed: int, bits: int, group: int):
    """The fp slots and (``shadowed`` tokens) the shadow: ``(keys, values)`` lists."""
    keys, values = [fk], [fv]
    if shadowed:
        sk, sv = shadow(fk[:, :, :shadowed], fv[:, :, :shadowed], bits, group)
        keys.append(sk)
        values.append(sv)
    return keys, values


def kivi_attention(qk, qv, fk, fv, query, mask, shadowed: int, bits: int, group: int):
    """What one :class:`~toolkit.kv.static_quant.QuantLayer` forward computes (:class:`QuantKeys`)."""
    keys, values = fp_parts(fk, fv, shadowed, bits, group)
    return QuantKeys(qk, qv, keys, values, mask).attend(query)


def concatenated_attention(qk, qv, fk, fv, query, mask, shadowed: int, bits: int, group: int):
    """The form :class:`QuantKeys` replaced: dequantized groups and fp parts concatenated, then SDPA."""
    keys, values = fp_parts(fk, fv, shadowed, bits, group)
    keys = [dequantize(qk, fk.dtype).transpose(-1, -2)] + keys
    values = [dequantize(qv, fv.dtype)] + values
    return F.scaled_dot_product_attention(query, torch.cat(keys, -2), torch.cat(values, -2), attn_mask=mask,
                                          enable_gqa=True)


def dense_attention(keys, values, query, mask):
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)


def timed(fn, *args, runs: int) -> float:
    """Median ms of ``runs`` calls after 3 warm-up calls."""
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="packed tokens per row")
    parser.add_argument("--fp-slots", type=int, default=200, help="sinks + residual + widest forward")
    parser.add_argument("--width", type=int, default=17, help="queries of a verify forward")
    parser.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    h, d, t, f, g = args.kv_heads, args.head_dim, args.tokens, args.fp_slots, args.group
    qk = quantize(torch.randn(1, h, t, d).transpose(-1, -2), args.bits, g)
    qv = quantize(torch.randn(1, h, t, d), args.bits, g)
    fk, fv = torch.randn(1, h, f, d), torch.randn(1, h, f, d)
    compiled_kivi = torch.compile(kivi_attention, dynamic=False)
    compiled_concat = torch.compile(concatenated_attention, dynamic=False)
    compiled_dense = torch.compile(dense_attention, dynamic=False)
    print("| forward | KIVI eager ms | KIVI compiled ms | concatenated + SDPA, compiled ms | uncompressed SDPA ms | "
          "KIVI compiled / uncompressed |\n|---|---|---|---|---|---|")
    for width in (1, args.width):
        shadowed = 0 if width == 1 else g * ((width - 1) // g + 1)
        span = t + f + shadowed
        query = torch.randn(1, args.q_heads, width, d)
        mask = torch.ones(1, 1, width, span, dtype=torch.bool)
        kivi_args = (qk, qv, fk, fv, query, mask, shadowed, args.bits, g)
        eager = timed(kivi_attention, *kivi_args, runs=args.runs)
        compiled = timed(compiled_kivi, *kivi_args, runs=args.runs)
        concat = timed(compiled_concat, *kivi_args, runs=args.runs)
        dense = timed(compiled_dense, torch.randn(1, h, span, d), torch.randn(1, h, span, d), query, mask,
                      runs=args.runs)
        print(f"| {width} quer{'y' if width == 1 else 'ies'} over {span} keys | {eager:.2f} | {compiled:.2f} | "
              f"{concat:.2f} | {dense:.2f} | {compiled / dense:.2f}x |")


if __name__ == "__main__":
    main()

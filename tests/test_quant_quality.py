"""Quantization-quality layer (slow, embedded model): every backend x precision that runs on this CPU, scored against
fp32 on held-out prose with the benchmark's protocol (``bench/quant_bench.py``: PPL from
:func:`eval.metrics.perplexity_sliding_window`, top-1 agreement from the same forwards), plus exact weight-byte order.

Thresholds sit between what each backend measures (see ``MEASURED``) and what a broken backend gives (a wrong
scale or packing sends agreement below 0.3 and the PPL ratio far above 2; a backend that silently left the weights
unquantized is caught by the byte check).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from toolkit.models import load_model, weight_bytes
from toolkit.recipe import ModelSpec

_BENCH = Path(__file__).resolve().parents[1] / "bench" / "quant_bench.py"
_spec = importlib.util.spec_from_file_location("quant_bench", _BENCH)
quant_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quant_bench)

# label -> (ModelSpec fields, max PPL ratio vs fp32, min top-1 agreement with fp32, max weight bytes / fp32's)
# MEASURED (2 x 384 tokens of GPL-3 / Apache-2.0, fp32 PPL 17.50), PPL ratio / top-1: bf16 0.995 / 0.978,
# bnb int8 1.026 / 0.926, bnb NF4 1.368 / 0.675, torchao int8 weight-only 0.995 / 0.971, torchao int4 g32
# 1.035 / 0.862, g64 1.494 / 0.662 (the GGUF source is Q4_1 with groups of 32, which g32 reproduces closely).
# The test scores most backends on shorter windows (the suite's time: a token costs ~6 ms on one thread at fp32,
# ~30 ms at bf16, ~125 ms at int8 dynamic): at 2 x 256 (fp32 PPL 19.22) bnb int8 1.014 / 0.920, torchao int8
# weight-only 0.989 / 0.969, g32 1.029 / 0.880, g64 1.468 / 0.653; at 2 x 128 (fp32 PPL 23.06) bf16 0.986 / 0.976
# and torchao int8 dynamic 1.017 / 0.866; at 2 x 64 (fp32 PPL 26.87) torchao int8 dynamic 1.041 / 0.810 (its
# activations go through torch._int_mm, ~80 ms per 128-token linear on this CPU: 14 s at 2 x 64, 32 s at 2 x 128,
# 190 s at 2 x 1024; its bounds allow for 126 predictions). NF4 stays at 2 x 384 (at 2 x 256 its ratio, 1.439, sits
# at the bound).
# At 2 x 1024 tokens (make bench-quant) every figure is within 0.015 of the 2 x 384 ones.
WINDOW_TOKENS = 384
SHORT_WINDOW = {"bf16": 128, "torchao int8 dynamic": 64, "bitsandbytes int8": 256, "torchao int8 weight-only": 256,
                "torchao int4 g32": 256, "torchao int4 g64": 256}
CASES = {
    "bf16": ({"precision": "bf16"}, 1.01, 0.95, 0.51),
    "bitsandbytes int8": ({"precision": "int8", "backend": "bitsandbytes"}, 1.04, 0.88, 0.45),
    "bitsandbytes int4": ({"precision": "int4", "backend": "bitsandbytes"}, 1.45, 0.66, 0.35),
    "torchao int8 weight-only": ({"precision": "int8", "backend": "torchao", "torchao_int8": "weight_only"},
                                 1.01, 0.94, 0.50),
    "torchao int8 dynamic": ({"precision": "int8", "backend": "torchao", "torchao_int8": "dynamic"},
                             1.08, 0.75, 0.50),
    "torchao int4 g32": ({"precision": "int4", "backend": "torchao", "torchao_group_size": 32}, 1.07, 0.84, 0.30),
    "torchao int4 g64": ({"precision": "int4", "backend": "torchao", "torchao_group_size": 64}, 1.60, 0.62, 0.30),
}


@pytest.fixture(scope="module")
def fp32_reference(embedded):
    """tokens -> (windows, fp32 quality on them, fp32 weight bytes), each window length computed once."""
    model, tokenizer = embedded
    computed = {}

    def reference(tokens: int):
        if tokens not in computed:
            windows = quant_bench.held_out_windows(tokenizer, tokens)
            quality = quant_bench.quality(model, windows)
            assert 10 < quality["ppl"] < 40, quality["ppl"]  # a working model on English prose
            computed[tokens] = windows, quality, weight_bytes(model)
        return computed[tokens]

    return reference


@pytest.mark.slow
@pytest.mark.heavy  # 5-15 s each on the embedded model; test_quant and test_gguf_native prove the formats on tiny ones
@pytest.mark.parametrize("label", list(CASES))
def test_backend_quality_against_fp32(fp32_reference, label):
    fields, max_ratio, min_top1, max_bytes = CASES[label]
    if fields.get("backend") and importlib.util.find_spec(fields["backend"]) is None:
        pytest.skip(f"{fields['backend']} is not installed")
    windows, reference, fp32_bytes = fp32_reference(SHORT_WINDOW.get(label, WINDOW_TOKENS))
    model, _ = load_model(ModelSpec(source="embedded", device="cpu", **fields), "target")
    q = quant_bench.quality(model, windows)
    ratio = q["ppl"] / reference["ppl"]
    top1 = (q["predictions"] == reference["predictions"]).float().mean().item()
    size = weight_bytes(model) / fp32_bytes
    assert ratio <= max_ratio, (label, ratio, top1)
    assert top1 >= min_top1, (label, ratio, top1)
    assert size <= max_bytes, (label, size)
    if fields["precision"] != "bf16":  # quantized: not fp32 compared with itself (int8 weight-only's PPL can tie)
        assert top1 < 0.995, (label, ratio, top1)

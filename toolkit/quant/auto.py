"""``backend: auto`` — per precision and device type, the backends in the order they were measured fastest.

Each entry carries the measurement it came from. CPU rows: ``bench/quant_bench.py`` (``make bench-quant``) on the
development machine (2-core AVX-512 BF16/VNNI/AMX CPU, embedded SmolLM2-135M, 300-token context, one thread, medians,
measured while other jobs shared the CPU: ratios are meaningful, absolute ms are noisy). CUDA rows were *not*
measured here (no GPU was available); they follow published batch-1 decode results and say so.

:func:`choose` walks a row in order and returns the first backend whose package is installed and which has a kernel
for the spec on the device (:func:`toolkit.quant.torchao.check_kernel`), so ``auto`` always loads when any backend can.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    """One backend's place in a row: its name and the evidence (a sentence with the numbers)."""

    backend: str
    evidence: str


TABLE: dict[tuple[str, str], tuple[Measured, ...]] = {
    ("int8", "cpu"): (
        Measured("torchao", "torchao int8 dynamic activation (torchao_int8: dynamic, the default): decode 194 ms, "
                            "verify-5 228 ms vs LLM.int8() 214 / 296 and fp32 138 / 229; PPL ratio 1.037, top-1 "
                            "0.890 vs LLM.int8() 1.019 / 0.921. torchao int8 weight-only: 276 / 346 ms, PPL ratio "
                            "1.004, top-1 0.965 (make bench-quant, interleaved rounds, 2026-11-21, 2-core "
                            "AVX-512/AMX CPU shared with other jobs, 1 thread: noisy)"),
        Measured("bitsandbytes", "LLM.int8(): decode 214 ms, verify-5 296 ms, PPL ratio 1.019 (same run)"),
    ),
    ("int4", "cpu"): (
        Measured("torchao", "torchao int4 group 32 (bf16, ATen _weight_int4pack_mm_for_cpu): decode 67 ms, verify-5 "
                            "114 ms vs NF4 101 / 165 and fp32 138 / 229; PPL ratio 1.042, top-1 0.868, 134 MiB vs "
                            "NF4 1.349 / 0.697, 162 MiB (make bench-quant, same run)"),
        Measured("bitsandbytes", "NF4: decode 101 ms, verify-5 165 ms, PPL ratio 1.349 (same run)"),
    ),
    ("int8", "cuda"): (
        Measured("torchao", "not measured here: bitsandbytes' own benchmark shows LLM.int8() slower than bf16 at "
                            "batch 1 on H100; torchao int8 weight-only reads half of bf16's bytes"),
        Measured("bitsandbytes", "fallback when torchao is not installed"),
    ),
    ("int4", "cuda"): (
        Measured("torchao", "not measured here: gpt-fast / torchao report int4 weight-only (tinygemm) at ~2x bf16 "
                            "decode on A100; bitsandbytes' benchmark shows NF4 slower than bf16 at batch 1 on H100"),
        Measured("bitsandbytes", "fallback when torchao is not installed or the GPU is older than sm80"),
    ),
}

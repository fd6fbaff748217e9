"""What this CPU is: its model and instruction-set flags (``lscpu``, or ``/proc/cpuinfo`` without it), read once per
process. CPU kernels differ by ISA (AVX2-only, AVX-512 with VNNI / BF16, AMX: ATen's int4 and bf16 paths, ggml's
repacked blocks), and the machines these figures come from change from one day to the next under the same model name
("AMD EPYC"), so what is measured per machine (the verify cost curves: :func:`toolkit.engine.cost.cost_key`) is keyed
by these flags, and every CPU result states them (:func:`toolkit.measure.harness.environment`)."""

from __future__ import annotations

import functools
import os
import subprocess

#: the instruction-set flags (``lscpu``'s names) a CPU figure depends on: AVX2-only and AVX-512 (VNNI / BF16) or AMX
#: machines differ by kernel, so every CPU result states which of these its machine has
CPU_ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                 "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def cpu_isa() -> dict:
    """This CPU as a CPU figure states it: ``{"model": lscpu's model name, "flags": which of`` :data:`CPU_ISA_FLAGS`
    ``it has, "cores": logical CPUs}``, read from ``lscpu`` (``/proc/cpuinfo`` where it is missing; ``"?"`` and no
    flags where neither is) once per process."""
    model, flags, cores = _cpu_fields()
    have = set(flags.split())
    return {"model": model, "flags": [f for f in CPU_ISA_FLAGS if f in have], "cores": cores}


@functools.cache
def cpu_vendor() -> str:
    """This CPU's vendor as ``/proc/cpuinfo``'s ``vendor_id`` gives it (``GenuineIntel``, ``AuthenticAMD``; ``""``
    where it is not given: another architecture, another OS). MKL chooses its code paths by it."""
    if not os.path.exists("/proc/cpuinfo"):
        return ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return ""


@functools.cache
def _cpu_fields() -> tuple[str, str, str]:
    """``(model name, flags, logical CPUs)`` as ``lscpu`` (or ``/proc/cpuinfo``) gives them."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False, timeout=30).stdout
        fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}
        model, flags, cores = fields.get("Model name", "?"), fields.get("Flags", ""), fields.get("CPU(s)", "?")
    except (OSError, subprocess.SubprocessError):
        model, flags, cores = "?", "", str(os.cpu_count() or "?")
    if not flags and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            info = [line.split(":", 1) for line in f if ":" in line]
        first = {k.strip(): v.strip() for k, v in reversed(info)}  # the first processor's fields win
        model, flags = first.get("model name", model), first.get("flags", "")
    return model, flags, cores


def cpu_line(cpu: dict | None = None) -> str:
    """``cpu`` (default: :func:`cpu_isa` of this machine) in one line for reports: ``AMD EPYC (2 CPUs); avx avx2 fma
    f16c``."""
    cpu = cpu or cpu_isa()
    return f"{cpu['model']} ({cpu['cores']} CPUs); {' '.join(cpu['flags']) or 'no AVX'}"

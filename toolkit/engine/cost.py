"""Measuring the target's verify cost curve (:class:`~toolkit.speculative.cost_model.VerifyCost`) through the
decoder's own forward, and caching it per model x weights x device x threads (JSON in the user cache directory:
``<cache_dir>/verify-cost/<key>.json``; ``$TOOLKIT_VERIFY_COST_DIR`` overrides the directory)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Self

import torch

from toolkit.cpu import cpu_isa
from toolkit.engine.forward import TargetForward
from toolkit.kv.static import capacity_for
from toolkit.quant import fp32_products, packed_fp32
from toolkit.speculative.cost_model import VerifyCost, extend

log = logging.getLogger("toolkit.engine")

#: a curve measured while other processes took more than this share of the machine's CPU time is not cached
#: (``$TOOLKIT_VERIFY_COST_MAX_LOAD`` overrides it: the test suite, whose workers load each other, sets 1)
NOISY_SHARE = 0.25
#: lengths timed by an eager measurement (others are interpolated linearly)
MEASURED_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CpuShare:
    """Share of the machine's CPU time that *other* processes used during a ``with`` block, in ``[0, 1]``:
    (busy jiffies of every CPU in ``/proc/stat`` - this process's user + system time) / (wall time x CPUs).
    ``share`` stays ``None`` where ``/proc/stat`` cannot be read (not Linux)."""

    def __enter__(self) -> Self:
        self.share = None
        self._start = (_busy_seconds(), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, mine, wall = _busy_seconds(), time.process_time(), time.perf_counter()
        if busy is None or self._start[0] is None:
            return
        others = (busy - self._start[0]) - (mine - self._start[1])
        self.share = min(1.0, max(0.0, others / ((wall - self._start[2]) * (os.cpu_count() or 1))))


def _busy_seconds() -> float | None:
    """Seconds all CPUs spent busy since boot (``/proc/stat``: every field but idle and iowait), or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_verify_cost(model, max_tokens: int = 16, context: int = 256, repeats: int = 5,
                        forward=None) -> VerifyCost:
    """Time forwards of 1..``max_tokens`` new tokens after ``context`` tokens (see the module docstring) through
    ``forward`` (a :class:`~toolkit.engine.forward.TargetForward`, eager by default) on the cache the decoder uses
    (the static cache where the model has one; rolled back after each forward by not accepting it). A compiled
    forward times every length (a length between CUDA graph buckets pays its bucket, so the curve comes out as
    steps); an eager one the lengths of :data:`MEASURED_LENGTHS` (others interpolated).

    Returns a :class:`VerifyCost` in milliseconds. Raises ``ValueError`` for ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    forward = forward or TargetForward(model)
    device = next(model.parameters()).device
    limit = getattr(model.config, "max_position_embeddings", None) or (context + max_tokens)
    context = max(1, min(context, limit - max_tokens))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    lengths = [n for n in MEASURED_LENGTHS if n < max_tokens] + [max_tokens]
    if forward.compiled:  # every length (bucketed shapes: up to the widest bucket, the curve's slope past it)
        lengths = list(range(1, min(max_tokens, forward.widths[-1] if forward.buckets else max_tokens) + 1))
    widest = forward.width_for(lengths[-1])
    # an eager engine does not keep the measurement's cache: later requests (a batch's rows too) would inherit its
    # 256-token context as capacity, and with it KV bytes; a compiled one keeps it, as its graphs were built for it
    cache = forward.cache_for(None, 1, capacity_for(context + widest), widest, keep=forward.compiled)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    with forward.attached() if cache.static else contextlib.nullcontext():
        prefilled, kwargs = cache.begin_row(context)
        forward.prefill(prompt, kwargs)
        cache.add_row(prefilled, context)
        for rep in range(repeats + 1):  # repetition 0 warms every length up (kernel selection, allocator, graphs)
            order = lengths[rep % len(lengths):] + lengths[:rep % len(lengths)]
            for n in order:
                tokens = torch.randint(0, vocab, (1, n), generator=gen).to(device)
                _sync(device)
                start = time.perf_counter()
                forward(cache, tokens)  # nothing accepted: the next forward writes the same slots
                _sync(device)
                if rep:
                    times[n].append((time.perf_counter() - start) * 1000)
                if not cache.static:
                    cache.accept(torch.zeros(1, dtype=torch.long, device=device), [0])
    medians = [statistics.median(times[n]) for n in lengths]
    if lengths[-1] < max_tokens:  # past the widest bucket: the last bucket's slope (VerifyCost.ms extrapolates)
        return VerifyCost(extend(medians, max_tokens), source="measured")
    return VerifyCost.from_points(lengths, medians, max_tokens, source="measured")


def cost_key(model) -> str:
    """What the curve depends on: architecture and sizes, weight formats, device (a CPU's model and instruction-set
    flags), torch threads and version, and which kernels dense layers run (:mod:`toolkit.quant.fp32_products`,
    :mod:`toolkit.quant.packed_fp32`)."""
    params = list(model.parameters())
    formats = sorted({f"{type(p.data).__name__}:{p.dtype}" for p in params})
    device = params[0].device
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        cpu = cpu_isa()  # the ISA flags too: machines named alike ("AMD EPYC") differ in kernels by them
        hardware = f"{platform.machine()} {cpu['model']} {' '.join(cpu['flags'])} x{torch.get_num_threads()}"
    parts = [model.config.to_json_string(use_diff=False), ",".join(formats), getattr(model, "toolkit_backend", ""),
             hardware, torch.__version__, str(sum(p.numel() for p in params))]
    if fp32_products.uses_fp32_products(model):  # bf16 layers widened to fp32: another curve
        parts.append(f"fp32-products from {fp32_products.FP32_PRODUCT_ROWS} rows")
    if packed_fp32.uses_packed_fp32(model):  # fp32 layers on oneDNN instead of MKL: another curve
        parts.append(f"{packed_fp32.KERNEL} r{packed_fp32.REVISION}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def load_or_measure(model, max_tokens: int = 16, cache_dir: Path | None = None, forward=None) -> VerifyCost:
    """The cached curve of ``model`` on this machine, measured (and cached atomically) on first use, through
    ``forward`` (:class:`~toolkit.engine.forward.TargetForward`; a compiled one has its own cache entry: its shapes
    and mode are in the key; so has a forward with a ``cost_tag``, the llama.cpp one's file, version, threads and KV
    cache types).

    ``cache_dir`` defaults to ``$TOOLKIT_VERIFY_COST_DIR`` or :func:`toolkit.resources.cache_dir`
    ``/ "verify-cost"``. A cache file that cannot be read or does not cover ``max_tokens`` is measured again. On a
    CPU, a curve measured while other processes used more than :data:`NOISY_SHARE` of the machine's CPU time
    (:class:`CpuShare`) is returned with ``source="measured under load"`` and not cached.
    """
    from toolkit.io import atomic_write_json
    from toolkit.resources import cache_dir as user_cache_dir

    key = cost_key(model) + "-static"
    if forward is not None and forward.compiled:
        shape = f"{forward.buckets}|{forward.widths}|{forward.mode}"
        key += "-compiled-" + hashlib.sha256(shape.encode()).hexdigest()[:8]
    tag = getattr(forward, "cost_tag", "")  # a forward outside torch (llama.cpp): its file, version, threads, types
    if tag:
        key += "-" + hashlib.sha256(tag.encode()).hexdigest()[:12]
    default = os.environ.get("TOOLKIT_VERIFY_COST_DIR") or user_cache_dir() / "verify-cost"
    path = Path(cache_dir or default) / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        if len(data["step_ms"]) >= max_tokens and all(x > 0 for x in data["step_ms"]):
            return VerifyCost([float(x) for x in data["step_ms"][:max_tokens]], key, "cache")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.info("measuring the verify cost curve of this model on this machine (once; cached in %s)", path.parent)
    with CpuShare() as load:
        cost = measure_verify_cost(model, max_tokens, forward=forward)
    cost.key = key
    device = next(model.parameters()).device
    limit = float(os.environ.get("TOOLKIT_VERIFY_COST_MAX_LOAD", NOISY_SHARE))
    if device.type == "cpu" and load.share is not None and load.share > limit:
        # a curve timed while other jobs held the cores is slower than this machine is and would be read back by
        # every later run (it once made a 12 ms step 799 ms): use it now, measure it again next time
        log.warning("the verify cost curve was measured while other processes used %.0f%% of the CPUs: used for "
                    "this run only, not cached", 100 * load.share)
        cost.source = "measured under load"
        return cost
    try:
        atomic_write_json(path, cost.to_dict())
    except OSError as exc:  # a read-only cache directory: use the curve, just do not keep it
        log.warning("could not cache the verify cost curve at %s: %s", path, exc)
    return cost

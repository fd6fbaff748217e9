"""The measured cost of verifying n tokens in one target forward, relative to a plain one-token step.

Why: what a round costs decides what it may verify. On a 2-core CPU a forward over 2-3 new tokens costs 1.1-2x a
one-token step in fp32 (the GEMM path for a handful of rows is poor, and it differs between machines), while in bf16
up to 9 tokens cost about one step. A fixed draft length K is right on one machine and wrong on the next, so the
curve is measured once per model x weight format x device x threads and cached (JSON) in the user cache directory:
``<cache_dir>/verify-cost/<key>.json``, where ``cache_dir`` is ``$TOOLKIT_CACHE_DIR`` or the XDG user cache
(``$TOOLKIT_VERIFY_COST_DIR`` overrides the whole directory; the test suite points it at a temporary one).

:func:`measure_verify_cost` runs the target over a random context of ``context`` tokens, then times forwards of
``n = 1 ... max_tokens`` new tokens (rolled back with ``crop`` after each), lengths interleaved within each repetition
so that a drift of a shared machine hits every length alike; the median over repetitions is kept. During decoding
:meth:`VerifyCost.observe` blends the times of real verify forwards in (an exponential average per length), so the
curve follows the context length and the machine's load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("toolkit.speculative")

#: lengths timed by the measurement (others are interpolated linearly)
MEASURED_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: weight of a new observation in the online average of a length's time
OBSERVE_WEIGHT = 0.05


@dataclass
class VerifyCost:
    """Time of one target forward over ``n`` new tokens, for ``n = 1 .. len(step_ms)``.

    Attributes:
        step_ms: milliseconds of a forward over n tokens at index ``n - 1`` (measured or interpolated).
        key: the cache key (model x weights x device x threads), for reports.
        source: ``measured`` (this process), ``cache`` (read from the cache file) or ``given``.
        learn: blend observed verify times in (:meth:`observe`); ``False`` keeps the curve as given.
    """

    step_ms: list[float]
    key: str = ""
    source: str = "given"
    learn: bool = True
    observed: dict[int, int] = field(default_factory=dict)

    @property
    def max_tokens(self) -> int:
        return len(self.step_ms)

    def relative(self, n: int) -> float:
        """Cost of verifying ``n`` tokens relative to a one-token step (``n`` past the curve: its last slope)."""
        return self.ms(n) / self.step_ms[0]

    @classmethod
    def from_points(cls, lengths: list[int], ms: list[float], max_tokens: int, **fields) -> VerifyCost:
        """The curve over ``1 .. max_tokens`` from forwards timed at ascending ``lengths`` (``ms`` each, the first
        length 1, the last >= ``max_tokens``), linear between them."""
        return cls(_interpolate(lengths, ms, max_tokens), **fields)

    def ms(self, n: int) -> float:
        if n < 1:
            raise ValueError(f"n: must be >= 1, got {n}")
        if n <= self.max_tokens:
            return self.step_ms[n - 1]
        slope = self.step_ms[-1] - self.step_ms[-2] if self.max_tokens > 1 else 0.0
        return self.step_ms[-1] + slope * (n - self.max_tokens)

    def cheapest_at_least(self, n: int, cap: int) -> int:
        """The forward length ``m`` in ``[n, cap]`` with the lowest time (``n`` itself on ties): verifying ``n``
        tokens padded to ``m`` costs ``ms(m)``."""
        best = n
        for m in range(n + 1, min(cap, self.max_tokens) + 1):
            if self.step_ms[m - 1] < self.step_ms[best - 1] * 0.98:  # 2%: not worth padding for noise
                best = m
        return best

    def observe(self, n: int, ms: float) -> None:
        """Blend a real forward of ``n`` tokens that took ``ms`` into the curve."""
        if self.learn and 1 <= n <= self.max_tokens and ms > 0:
            self.step_ms[n - 1] += OBSERVE_WEIGHT * (ms - self.step_ms[n - 1])
            self.observed[n] = self.observed.get(n, 0) + 1

    def to_dict(self) -> dict:
        return {"step_ms": [round(x, 3) for x in self.step_ms],
                "relative": [round(x / self.step_ms[0], 3) for x in self.step_ms], "key": self.key,
                "source": self.source}


def _interpolate(lengths: list[int], values: list[float], max_tokens: int) -> list[float]:
    out = []
    for n in range(1, max_tokens + 1):
        right = next(i for i, m in enumerate(lengths) if m >= n)
        if lengths[right] == n or right == 0:
            out.append(values[right])
            continue
        a, b = lengths[right - 1], lengths[right]
        out.append(values[right - 1] + (values[right] - values[right - 1]) * (n - a) / (b - a))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_verify_cost(model, max_tokens: int = 16, context: int = 256, repeats: int = 5,
                        engine=None) -> VerifyCost:
    """Time forwards of 1..``max_tokens`` new tokens after ``context`` tokens (see the module docstring); with a
    :class:`~toolkit.speculative.compiled.CompiledTarget` ``engine``, through its compiled forwards on its static
    cache (every length timed: a length between buckets pays its bucket, so the curve comes out as steps).

    Returns a :class:`VerifyCost` in milliseconds. Raises ``ValueError`` for ``max_tokens < 1``.
    """
    from transformers import DynamicCache

    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    device = next(model.parameters()).device
    limit = getattr(model.config, "max_position_embeddings", None) or (context + max_tokens)
    context = max(1, min(context, limit - max_tokens))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    lengths = [n for n in MEASURED_LENGTHS if n < max_tokens] + [max_tokens]
    if engine is not None:
        cache = engine.new_cache(context + max_tokens)
        engine.forward(cache, prompt, 0, 1)
        lengths = list(range(1, max_tokens + 1))
    else:
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for rep in range(repeats + 1):  # repetition 0 warms every length up (kernel selection, allocator)
        order = lengths[rep % len(lengths):] + lengths[:rep % len(lengths)]
        for n in order:
            tokens = torch.randint(0, vocab, (1, n), generator=gen).to(device)
            positions = torch.arange(context, context + n, device=device).unsqueeze(0)
            _sync(device)
            start = time.perf_counter()
            if engine is not None:
                engine.forward(cache, tokens, context, n)
            else:
                model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=n,
                      position_ids=positions)
            _sync(device)
            if rep:
                times[n].append((time.perf_counter() - start) * 1000)
            cache.crop(-n)
    medians = [statistics.median(times[n]) for n in lengths]
    return VerifyCost.from_points(lengths, medians, max_tokens, source="measured")


def cost_key(model) -> str:
    """What the curve depends on: architecture and sizes, weight formats, device, torch threads and version."""
    params = list(model.parameters())
    formats = sorted({f"{type(p.data).__name__}:{p.dtype}" for p in params})
    device = params[0].device
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"{platform.machine()} {_cpu_name()} x{torch.get_num_threads()}"
    parts = [model.config.to_json_string(use_diff=False), ",".join(formats), getattr(model, "toolkit_backend", ""),
             hardware, torch.__version__, str(sum(p.numel() for p in params))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def load_or_measure(model, max_tokens: int = 16, cache_dir: Path | None = None, engine=None) -> VerifyCost:
    """The cached curve of ``model`` on this machine, measured (and cached atomically) on first use; with a compiled
    ``engine``, the curve of its forwards (its own cache entry: buckets and backend in the key).

    ``cache_dir`` defaults to ``$TOOLKIT_VERIFY_COST_DIR`` or :func:`toolkit.resources.cache_dir`
    ``/ "verify-cost"``. A cache file that cannot be read or does not cover ``max_tokens`` is measured again.
    """
    from toolkit.io import atomic_write_json
    from toolkit.resources import cache_dir as user_cache_dir

    key = cost_key(model)
    if engine is not None:
        key += "-compiled-" + hashlib.sha256(f"{engine.widths}|{engine.mode}".encode()).hexdigest()[:8]
    default = os.environ.get("TOOLKIT_VERIFY_COST_DIR") or user_cache_dir() / "verify-cost"
    path = Path(cache_dir or default) / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        if len(data["step_ms"]) >= max_tokens and all(x > 0 for x in data["step_ms"]):
            return VerifyCost([float(x) for x in data["step_ms"][:max_tokens]], key, "cache")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.info("measuring the verify cost curve of this model on this machine (once; cached in %s)", path.parent)
    cost = measure_verify_cost(model, max_tokens, engine=engine)
    cost.key = key
    try:
        atomic_write_json(path, cost.to_dict())
    except OSError as exc:  # a read-only cache directory: use the curve, just do not keep it
        log.warning("could not cache the verify cost curve at %s: %s", path, exc)
    return cost

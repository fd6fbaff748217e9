"""The cost of verifying n tokens in one target forward, relative to a plain one-token step: :class:`VerifyCost`.

Why: what a round costs decides what it may verify. On a 2-core CPU a forward over 2-3 new tokens costs 1.1-2x a
one-token step in fp32 (the GEMM path for a handful of rows is poor, and it differs between machines), while in bf16
up to 9 tokens cost about one step. A fixed draft length K is right on one machine and wrong on the next, so the
curve is measured once per model x weight format x device x threads and cached (JSON) in the user cache directory:
``<cache_dir>/verify-cost/<key>.json``, where ``cache_dir`` is ``$TOOLKIT_CACHE_DIR`` or the XDG user cache
(``$TOOLKIT_VERIFY_COST_DIR`` overrides the whole directory; the test suite points it at a temporary one).

:func:`toolkit.engine.cost.measure_verify_cost` runs the target (through the decoder's own forward) over a random context of ``context`` tokens, then times forwards of
``n = 1 ... max_tokens`` new tokens (rolled back with ``crop`` after each), lengths interleaved within each repetition
so that a drift of a shared machine hits every length alike; the median over repetitions is kept
(:func:`toolkit.engine.cost.load_or_measure` caches it). During decoding
:meth:`VerifyCost.observe` blends the times of real verify forwards in (an exponential average per length), so the
curve follows the context length and the machine's load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("toolkit.speculative")

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


def extend(step_ms: list[float], max_tokens: int) -> list[float]:
    """``step_ms`` (ms of forwards over 1..len tokens) over ``1 .. max_tokens``, past its end by its last slope."""
    curve = VerifyCost(list(step_ms))
    return [curve.ms(n) for n in range(1, max_tokens + 1)]

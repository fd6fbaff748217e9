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
:meth:`VerifyCost.observe` learns from the times of real verify forwards, so the curve follows the context length and
the machine's load: a one-token step's time (every plain round times one) and the cost of the tokens past the first,
as the measured shape times one learned scale, read from every wider forward. One scale, not one average per length:
wide forwards are rare, and an average per length left them at the cached measurement (taken at a short context)
while the step followed the request's, so a 12-token verify of a 400-token context cost 1.2x the curve and rounds
verified more than pays (llama.cpp on 2 cores: 25 widths of 2-16 tokens, 7-25% over the curve, all one way).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("toolkit.speculative")

#: weight of a new observation in the online average of a one-token step's time
OBSERVE_WEIGHT = 0.05
#: weight of a wider forward's observation in the online average of the scale of the tokens past the first
EXTRA_WEIGHT = 0.1
#: a width whose measured extra cost is below this share of a step says nothing of the scale (a GPU's flat part)
MIN_EXTRA = 0.25
#: the learned scale of the extra tokens' cost stays within these bounds (against a stall timed as a forward)
EXTRA_SCALE_BOUNDS = (0.25, 4.0)


@dataclass
class VerifyCost:
    """Time of one target forward over ``n`` new tokens, for ``n = 1 .. len(step_ms)``.

    ``ms(n) = step + extra_scale * (step_ms[n - 1] - step_ms[0])``: the measured curve's shape, with the one-token
    step and the scale of the tokens past it learned online (:meth:`observe`; both start at the measurement).

    Attributes:
        step_ms: milliseconds of a forward over n tokens at index ``n - 1``, as measured (or interpolated).
        key: the cache key (model x weights x device x threads), for reports.
        source: ``measured`` (this process), ``cache`` (read from the cache file) or ``given``.
        learn: learn from observed verify times (:meth:`observe`); ``False`` keeps the curve as given.
        observed: forwards observed, by length.
        step: the learned milliseconds of a one-token forward (starts at ``step_ms[0]``).
        extra_scale: the learned scale of the measured cost of the tokens past the first.
    """

    step_ms: list[float]
    key: str = ""
    source: str = "given"
    learn: bool = True
    observed: dict[int, int] = field(default_factory=dict)
    step: float | None = None
    extra_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.step is None:
            self.step = self.step_ms[0]

    @property
    def max_tokens(self) -> int:
        return len(self.step_ms)

    def relative(self, n: int) -> float:
        """Cost of verifying ``n`` tokens relative to a one-token step (``n`` past the curve: its last slope)."""
        return self.ms(n) / self.ms(1)

    @classmethod
    def from_points(cls, lengths: list[int], ms: list[float], max_tokens: int, **fields) -> VerifyCost:
        """The curve over ``1 .. max_tokens`` from forwards timed at ascending ``lengths`` (``ms`` each, the first
        length 1, the last >= ``max_tokens``), linear between them."""
        return cls(_interpolate(lengths, ms, max_tokens), **fields)

    def ms(self, n: int) -> float:
        """Milliseconds of a forward over ``n`` tokens, as learned so far.

        Raises:
            ValueError: ``n < 1``.
        """
        return self.step + self.extra_scale * (self._measured(n) - self.step_ms[0])

    def _measured(self, n: int) -> float:
        if n < 1:
            raise ValueError(f"n: must be >= 1, got {n}")
        if n <= self.max_tokens:
            return self.step_ms[n - 1]
        slope = self.step_ms[-1] - self.step_ms[-2] if self.max_tokens > 1 else 0.0
        return self.step_ms[-1] + slope * (n - self.max_tokens)

    def observe(self, n: int, ms: float) -> None:
        """Learn from a real forward of ``n`` tokens that took ``ms``: a one-token step moves :attr:`step`, a wider
        one :attr:`extra_scale` (where the measured curve rises past the step there: :data:`MIN_EXTRA`)."""
        if not (self.learn and 1 <= n <= self.max_tokens and ms > 0):
            return
        self.observed[n] = self.observed.get(n, 0) + 1
        if n == 1:
            self.step += OBSERVE_WEIGHT * (ms - self.step)
            return
        extra = self.step_ms[n - 1] - self.step_ms[0]
        if extra > MIN_EXTRA * self.step_ms[0]:
            low, high = EXTRA_SCALE_BOUNDS
            scale = min(high, max(low, (ms - self.step) / extra))
            self.extra_scale += EXTRA_WEIGHT * (scale - self.extra_scale)

    def to_dict(self) -> dict:
        """The measured curve (what the cache holds) and, once forwards were observed, what was learned from them."""
        out = {"step_ms": [round(x, 3) for x in self.step_ms],
               "relative": [round(x / self.step_ms[0], 3) for x in self.step_ms], "key": self.key,
               "source": self.source}
        if self.observed:
            out["learned"] = {"step_ms": round(self.ms(1), 3), "extra_scale": round(self.extra_scale, 3),
                              "observed": dict(sorted(self.observed.items()))}
        return out


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

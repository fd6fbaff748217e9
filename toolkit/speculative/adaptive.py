"""Draft-length controllers: how many tokens the drafter proposes in the next round, and how many of them a round
verifies.

A controller has ``next_k()`` (most tokens to ask of the drafter), ``plan(confidence, proposed, sampled) -> (j, n)`` (verify
the first ``j`` proposed tokens in a forward of ``n >= j + 1`` tokens), ``update(drafted, accepted, confidence)``
after the round and ``timed(width, verify_ms, overhead_ms)`` with its measured times.

* :class:`ConstantK` — always K, every proposed token verified.
* :class:`EmaK` — an acceptance-EMA controller: after each round the EMA of the round's acceptance ratio is updated;
  K shrinks by one when the EMA < 0.5 and grows by one when > 0.85, within ``[k_min, k_max]``. The thresholds follow
  the heuristic of HF's ``num_assistant_tokens_schedule="heuristic"`` made smooth by the EMA.
"""

from __future__ import annotations

from dataclasses import dataclass


class _VerifyAll:
    """Verify every proposed token in a forward of exactly ``proposed + 1`` tokens; ignore timings."""

    uses_confidence = False

    def plan(self, confidence: list[float] | None, proposed: int, sampled: bool = False) -> tuple[int, int]:
        return proposed, proposed + 1

    def timed(self, width: int, verify_ms: float, overhead_ms: float) -> None:
        pass


@dataclass
class ConstantK(_VerifyAll):
    k: int

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, confidence: list[float] | None = None) -> None:
        pass


@dataclass
class EmaK(_VerifyAll):
    k: int
    k_min: int = 1
    k_max: int = 8
    decay: float = 0.7
    shrink_below: float = 0.5
    grow_above: float = 0.85
    ema: float | None = None

    def __post_init__(self) -> None:
        self.k = min(max(self.k, self.k_min), self.k_max)

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, confidence: list[float] | None = None) -> None:
        if drafted == 0:
            return
        ratio = accepted / drafted
        self.ema = ratio if self.ema is None else self.decay * self.ema + (1 - self.decay) * ratio
        if self.ema < self.shrink_below:
            self.k = max(self.k_min, self.k - 1)
        elif self.ema > self.grow_above:
            self.k = min(self.k_max, self.k + 1)


def make_controller(spec, cost=None, calibrator=None, widest: int | None = None):
    """Controller for a :class:`toolkit.recipe.SpecSpec`; ``adaptive: cost`` needs the target's verify ``cost``
    curve and a :class:`~toolkit.speculative.verify_length.Calibrator` (see
    :class:`~toolkit.speculative.verify_length.CostAwareK`)."""
    if spec.adaptive == "ema":
        return EmaK(spec.num_draft_tokens, spec.k_min, spec.k_max, spec.ema_decay)
    if spec.adaptive == "cost":
        from toolkit.speculative.verify_length import CostAwareK

        if cost is None or calibrator is None:
            raise ValueError("adaptive 'cost' needs the target's verify cost curve and a calibrator")
        return CostAwareK(cost, calibrator, spec.num_draft_tokens, widest or spec.num_draft_tokens + 1)
    return ConstantK(spec.num_draft_tokens)

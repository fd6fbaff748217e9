"""Choosing how many draft tokens a round verifies: the measured cost curve x calibrated acceptance estimates.

A round that verifies ``j`` draft tokens in a forward of ``n >= j + 1`` tokens commits, in expectation,

    E(j) = 1 + p_1 + p_1 p_2 + ... + p_1 ... p_j        tokens (the bonus/correction token plus the accepted prefix)

at a cost of ``ms(n) + overhead`` milliseconds, where ``p_i`` is the probability that draft token ``i`` is accepted
given that tokens ``1..i-1`` were. :class:`CostAwareK` picks the ``j`` (0 = a plain one-token step) with the most
expected tokens per millisecond — so a round never expects fewer tokens per unit time than a plain step — and the
forward length ``n``: the cheapest measured length ``>= j + 1`` (a verify of 5 tokens can cost less than one of 2;
the extra positions are padding whose cache entries are cropped with the rejected tail).

``p_i`` comes from the drafter's own confidence for token ``i`` (``Drafter.confidence()``: a draft probability, or
a match-length statistic for a model-free drafter), mapped through a :class:`Calibrator` that learns, online and
across calls, how often tokens of each confidence bin were actually accepted. Drafters without a confidence are
calibrated by draft position. Neither the choice of ``j`` nor padding changes what is accepted: the output is the
same as with any fixed K (greedy: token-identical to AR; sampling: the target's distribution).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.speculative.cost_model import VerifyCost

BINS = 20
#: pseudo-observations of a bin's prior (centred on the bin's raw confidence): how far the drafter's own estimate is
#: trusted before any outcome is seen
PRIOR_STRENGTH = 4.0
#: pseudo-tokens at the average acceptance level before a request's own tokens move its factor
REQUEST_PRIOR = 4.0
#: a bin's counts are scaled down past this many trials, so the estimate follows a drifting acceptance rate
MAX_TRIALS = 400.0


@dataclass
class Calibrator:
    """Online calibration of per-token acceptance estimates (Beta posteriors per confidence bin / draft position)."""

    success: list[float] = field(default_factory=lambda: [0.0] * BINS)
    trials: list[float] = field(default_factory=lambda: [0.0] * BINS)
    position_success: dict[int, float] = field(default_factory=dict)
    position_trials: dict[int, float] = field(default_factory=dict)
    request_accepted: float = 0.0
    request_expected: float = 0.0

    def begin_request(self) -> None:
        """Start a new request: its own acceptance level is learned afresh (see :meth:`request_factor`)."""
        self.request_accepted = self.request_expected = 0.0

    def request_factor(self) -> float:
        """How this request's tokens have been accepted relative to the calibrated estimates so far: accepted /
        expected with ``REQUEST_PRIOR`` pseudo-tokens at 1, within [0.25, 2]. Prompts differ (a chatty answer
        copies less than a code edit); the bins hold the average over requests."""
        ratio = (self.request_accepted + REQUEST_PRIOR) / (self.request_expected + REQUEST_PRIOR)
        return min(2.0, max(0.25, ratio))

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(BINS - 1, max(0, int(confidence * BINS)))

    def prob(self, confidence: float | None, position: int) -> float:
        """P(accepted | previous accepted) for a token of raw ``confidence`` (``None``: by ``position``, 1-based),
        this request's factor applied."""
        return min(1.0, self._average(confidence, position) * self.request_factor())

    def _average(self, confidence: float | None, position: int) -> float:
        if confidence is None:
            prior = 0.5
            s, t = self.position_success.get(position, 0.0), self.position_trials.get(position, 0.0)
        else:
            b = self._bin(confidence)
            prior = (b + 0.5) / BINS
            s, t = self.success[b], self.trials[b]
        return (PRIOR_STRENGTH * prior + s) / (PRIOR_STRENGTH + t)

    def observe(self, confidence: list[float] | None, verified: int, accepted: int) -> None:
        """Record a round: tokens ``1..min(accepted + 1, verified)`` were tested, the first ``accepted`` passed."""
        for i in range(min(accepted + 1, verified)):
            ok = 1.0 if i < accepted else 0.0
            self.request_expected += self._average(None if confidence is None else confidence[i], i + 1)
            self.request_accepted += ok
            if confidence is None:
                self._count(self.position_success, self.position_trials, i + 1, ok)
            else:
                b = self._bin(confidence[i])
                if self.trials[b] >= MAX_TRIALS:
                    self.success[b] *= 0.5
                    self.trials[b] *= 0.5
                self.success[b] += ok
                self.trials[b] += 1.0

    @staticmethod
    def _count(success: dict, trials: dict, key: int, ok: float) -> None:
        if trials.get(key, 0.0) >= MAX_TRIALS:
            success[key] *= 0.5
            trials[key] *= 0.5
        success[key] = success.get(key, 0.0) + ok
        trials[key] = trials.get(key, 0.0) + 1.0

    def to_dict(self) -> dict:
        return {"bins": [[round(s, 1), round(t, 1)] for s, t in zip(self.success, self.trials)],
                "positions": {p: [round(self.position_success[p], 1), round(t, 1)]
                              for p, t in sorted(self.position_trials.items())}}


@dataclass
class CostAwareK:
    """Draft-length controller that verifies the number of draft tokens with the most expected tokens per ms.

    Args:
        cost: the target's verify cost curve (:func:`toolkit.speculative.cost_model.load_or_measure`); real verify
            times are blended in as decoding goes.
        calibrator: acceptance calibration, shared by every call of one Generator.
        k: most draft tokens asked of the drafter per round.
        widest: most tokens one verify forward may hold (the plan's ``max_query_tokens``; padding stays within it).
    """

    cost: VerifyCost
    calibrator: Calibrator
    k: int
    widest: int
    overhead_ms: float = 0.0
    uses_confidence = True

    def __post_init__(self) -> None:
        self.calibrator.begin_request()  # one controller per generation call

    def next_k(self) -> int:
        return self.k

    def plan(self, confidence: list[float] | None, proposed: int, sampled: bool = False) -> tuple[int, int]:
        """``(j, n)``: verify the first ``j`` of ``proposed`` draft tokens in a forward of ``n >= j + 1`` tokens.

        ``sampled``: the draft tokens were sampled from the draft's distribution (speculative sampling). Then whether
        token ``i`` is verified may depend only on what was known before it was drawn (confidences ``1..i``, each
        read before its token), never on later tokens: ``j`` is the first length after which one more token stops
        paying (a stopping rule), not the best length over the whole chain — which would make the decision to
        verify token ``i`` depend on token ``i`` itself through the later confidences, and bias the output.
        """
        expected, chain = 1.0, 1.0
        best_j, best_n = 0, self.cost.cheapest_at_least(1, self.widest)
        best_rate = expected / (self.cost.ms(best_n) + self.overhead_ms)
        for j in range(1, min(proposed, self.widest - 1) + 1):
            chain *= self.calibrator.prob(None if confidence is None else confidence[j - 1], j)
            expected += chain
            n = self.cost.cheapest_at_least(j + 1, self.widest)
            rate = expected / (self.cost.ms(n) + self.overhead_ms)
            if rate > best_rate:
                best_j, best_n, best_rate = j, n, rate
            elif sampled:
                break
        return best_j, best_n

    def update(self, drafted: int, accepted: int, confidence: list[float] | None = None) -> None:
        if drafted:
            self.calibrator.observe(confidence, drafted, accepted)

    def timed(self, width: int, verify_ms: float, overhead_ms: float) -> None:
        """A round's verify forward of ``width`` tokens took ``verify_ms``; its bookkeeping ``overhead_ms``."""
        self.cost.observe(width, verify_ms)
        self.overhead_ms += 0.1 * (overhead_ms - self.overhead_ms)

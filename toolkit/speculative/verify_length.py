"""Choosing how many draft tokens a round verifies: the measured cost curve x calibrated acceptance estimates.

A round that verifies ``j`` draft tokens in a forward of ``n >= j + 1`` tokens commits, in expectation,

    E(j) = 1 + p_1 + p_1 p_2 + ... + p_1 ... p_j        tokens (the bonus/correction token plus the accepted prefix)

at a cost of ``ms(n) + overhead`` milliseconds, where ``p_i`` is the probability that draft token ``i`` is accepted
given that tokens ``1..i-1`` were. :class:`~toolkit.engine.planner.CostAwareK` picks the ``j`` (0 = a plain one-token
step) with the most expected tokens per millisecond — so a round never expects fewer tokens per unit time than a
plain step — and the forward length ``n``: the cheapest measured length ``>= j + 1`` (:mod:`toolkit.engine.planner`,
one rule for one row and for batches).

``p_i`` comes from the drafter's own confidence for token ``i`` (``Drafter.confidence()``: a draft probability, or
a match-length statistic for a model-free drafter), mapped through a :class:`Calibrator` that learns, online and
across calls, how often tokens of each confidence bin were actually accepted. Drafters without a confidence are
calibrated by draft position. Each request moves the estimates by its own offset on the logit scale, and the
planner feeds the calibrator every verified token plus, for deterministic drafts, the first one a round left
unverified (:meth:`~toolkit.engine.planner.CostAwareK.update`: the target's next token tests it for free). Where the
number of tokens to *draft* is chosen before any is drawn (a draft network over a batch), the choice reads
:meth:`Calibrator.optimistic`, an upper confidence bound, so that a draft length the estimates have rarely seen still
gets tried: an estimate learned only from what is drafted is never corrected if a pessimistic prior stops all
drafting. Neither the choice of ``j`` nor padding changes what is accepted: the output is
the same as with any fixed K (greedy: token-identical to AR; sampling: the target's distribution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


BINS = 20
#: pseudo-observations of a bin's prior (centred on the bin's raw confidence): how far the drafter's own estimate is
#: trusted before any outcome is seen
PRIOR_STRENGTH = 4.0
#: step of the request's logit offset per tested token (online logistic recalibration: Platt 1999, as an SGD step)
REQUEST_STEP = 0.3
#: the request's logit offset stays within +-this (an odds factor of at most e^3 ~ 20 either way)
REQUEST_CLIP = 3.0
#: a bin's counts are scaled down past this many trials, so the estimate follows a drifting acceptance rate
MAX_TRIALS = 400.0
#: weight of the exploration bonus of :meth:`Calibrator.optimistic`: UCB1's sqrt(2 ln t / n) (Auer et al. 2002)
EXPLORATION = 2.0


@dataclass
class Calibrator:
    """Online calibration of per-token acceptance estimates (Beta posteriors per confidence bin / draft position)."""

    success: list[float] = field(default_factory=lambda: [0.0] * BINS)
    trials: list[float] = field(default_factory=lambda: [0.0] * BINS)
    position_success: dict[int, float] = field(default_factory=dict)
    position_trials: dict[int, float] = field(default_factory=dict)
    request_shift: float = 0.0
    decisions: int = 0  # draft-length decisions taken on optimistic estimates (UCB1's t)

    def begin_request(self) -> None:
        """Start a new request: its own acceptance level is learned afresh (see :attr:`request_shift`)."""
        self.request_shift = 0.0

    def _shifted(self, p: float) -> float:
        """``p`` moved by this request's offset on the logit scale: prompts differ (a chatty answer copies less than
        a code edit) and the bins hold the average over requests. On the logit scale, not as a factor on ``p``: a
        request whose low-confidence drafts do better than average must not make a 0.8 bin certain (a factor of
        1.26 did, and 11 tokens were verified and rejected), and one rejection must not sink a 0.95 bin."""
        if self.request_shift == 0.0:
            return p
        p = min(max(p, 1e-6), 1 - 1e-6)
        return 1.0 / (1.0 + (1 - p) / p * math.exp(-self.request_shift))

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(BINS - 1, max(0, int(confidence * BINS)))

    def prob(self, confidence: float | None, position: int) -> float:
        """P(accepted | previous accepted) for a token of raw ``confidence`` (``None``: by ``position``, 1-based),
        this request's offset applied."""
        return self._shifted(self._average(confidence, position))

    def optimistic(self, position: int) -> float:
        """An upper confidence bound of P(draft token ``position`` (1-based) accepted | the ones before it were), for
        choosing how many tokens to draft before any is drawn: :meth:`prob` by position plus
        ``sqrt(EXPLORATION * ln(1 + decisions) / (PRIOR_STRENGTH + trials))``, in [0, 1].

        The bonus is large while a position has few outcomes and shrinks as they come; while none come (nothing is
        drafted) it grows slowly with the decisions taken, so drafting is tried again now and then. The count of
        tokens drafted never changes what is accepted, so exploring leaves the output's distribution alone.

        Raises:
            ValueError: ``position < 1``.
        """
        if position < 1:
            raise ValueError(f"position: must be >= 1, got {position}")
        trials = PRIOR_STRENGTH + self.position_trials.get(position, 0.0)
        bonus = math.sqrt(EXPLORATION * math.log1p(self.decisions) / trials)
        return min(1.0, self.prob(None, position) + bonus)

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
            predicted = self.prob(None if confidence is None else confidence[i], i + 1)
            self.request_shift = max(-REQUEST_CLIP, min(REQUEST_CLIP,
                                                        self.request_shift + REQUEST_STEP * (ok - predicted)))
            if confidence is None:
                self._count(self.position_success, self.position_trials, i + 1, ok)
            else:
                self._count(self.success, self.trials, self._bin(confidence[i]), ok)

    @staticmethod
    def _count(success: dict | list, trials: dict | list, key: int, ok: float) -> None:
        """One outcome into a bin (a list index) or a draft position (a dict key, created at zero)."""
        if isinstance(trials, dict):
            success.setdefault(key, 0.0)
            trials.setdefault(key, 0.0)
        if trials[key] >= MAX_TRIALS:
            success[key] *= 0.5
            trials[key] *= 0.5
        success[key] += ok
        trials[key] += 1.0

    def to_dict(self) -> dict:
        return {"bins": [[round(s, 1), round(t, 1)] for s, t in zip(self.success, self.trials)],
                "positions": {p: [round(self.position_success[p], 1), round(t, 1)]
                              for p, t in sorted(self.position_trials.items())}}

"""How many draft tokens a round verifies, for one row or a batch: one rule, with a stopping rule for sampled drafts.

A round over ``B`` rows that verifies ``n`` draft tokens per row runs a forward of width ``m >= n + 1`` and commits, in
expectation,

    E(n) = sum_r w_r (1 + c_r1 + c_r1 c_r2 + ... + c_r1 ... c_rn)      (row r's chain stops at its own proposal)

tokens, where ``c_ri`` is the calibrated probability that row ``r``'s draft token ``i`` is accepted given the ones
before it (:class:`~toolkit.speculative.verify_length.Calibrator`) and ``w_r`` weighs the row (1, or while a batch
drains, its share of the work left). :func:`most_per_ms` picks the ``n`` with the most expected tokens per
millisecond of ``ms(B, m) + extra(n)``: ``ms`` is the measured cost of a forward (:class:`ForwardCost`: the target's
verify cost curve for one row, learned online for batches), ``m`` the cheapest width that holds ``n + 1`` tokens (a
forward of 5 tokens can cost less than one of 3; bucketed CUDA graphs make the curve a staircase), ``extra`` what
drafting ``n`` tokens costs where it is not free (a draft model's steps). ``n = 0`` is a plain one-token step, so a
round never expects fewer tokens per unit time than AR decoding.

Where drafting costs time (a draft model or EAGLE head over a batch), :meth:`CostAwareK.draft_steps` applies the same
rule *before* drafting, to choose how many tokens to draft, with the drafter's acceptance per position. It reads an
upper confidence bound of it (:meth:`~toolkit.speculative.verify_length.Calibrator.optimistic`): acceptance is learned
only from rounds that draft, so a prior saying that drafting never pays would otherwise never meet the draft's real
acceptance (issue 46: 4 rows drafted 0.00 tokens per round with a draft the target accepted every time).

**Stopping rule** (lossless sampling): when draft tokens were *sampled* from q, whether token ``i`` is verified may
depend only on what was known before it was drawn — the confidences ``c_1..c_i``, each read before its token — never
on later ones, which depend on token ``i`` itself. So with sampled drafts ``n`` is the first length after which one
more token stops paying, not the best length over the whole chain (which would bias the output: ``tests/
test_verify_length.py`` and ``tests/test_batch_verify_length.py`` catch exactly that). Greedy drafts may use the best.

Controllers (the recipe's ``spec.adaptive``): :class:`CostAwareK` (``cost``) plans by this rule;
:class:`ConstantK` (``constant``) and :class:`EmaK` (``ema``) verify every proposed token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.verify_length import Calibrator

#: weight of a new observation in :class:`ForwardCost`'s moving averages of batched forwards
BATCH_OBSERVE_WEIGHT = 0.3
#: a wider forward is chosen over a narrower one only when the curve prices it at least 10% cheaper: a curve point is
#: one measurement, and five measurements of fp32's curve on the 2-core AVX2 EPYC (2026-12-07, one process,
#: bench/reports/verify-padding-margin-avx2/) put the 6-token forward at 0.90-1.14x the 5-token one, while 4 against 3
#: tokens read 0.78-0.84x every time; at a 2% margin a K = 4 round padded to 6 on one run's 5% dip and ran 0.98x
PAD_MARGIN = 0.90
#: tokens per row a padded forward may reach on an uncompressed cache (:func:`verify_room`)
PAD_ROOM = 8


@dataclass
class ForwardCost:
    """Milliseconds of one target forward over ``rows x width`` tokens.

    One row reads the target's verify cost curve (``curve.ms(width)``, measured on this machine and learned from
    real verify times). Batches start from the curve at ``rows * width`` tokens and learn what batched forwards really
    take: a ``(rows, width)`` once seen is predicted by its own moving average, an unseen one by the curve times the
    observed/predicted ratio of the nearest narrower width seen (wide batched forwards cost more than one sequence of
    as many tokens: every row attends to its own history).
    """

    curve: VerifyCost
    seen: dict = field(default_factory=dict)  # (rows, width) -> ms, moving average
    ratio: dict = field(default_factory=dict)  # width -> observed / curve, moving average

    def ms(self, rows: int, width: int) -> float:
        if rows == 1:
            return self.curve.ms(width)
        if (rows, width) in self.seen:
            return self.seen[(rows, width)]
        narrower = [w for w in self.ratio if w <= width]
        return self.curve.ms(rows * width) * (self.ratio[max(narrower)] if narrower else 1.0)

    def cheapest(self, rows: int, width: int, widest: int, price: Callable[[int], float] | None = None) -> int:
        """The forward width ``m`` in ``[width, widest]`` with the lowest cost (``width`` itself on near-ties);
        ``price``: ``m -> ms`` read instead of :meth:`ms` (a plan prices each width once)."""
        price = price or (lambda m: self.ms(rows, m))
        best, best_ms = width, price(width)
        for m in range(width + 1, widest + 1):
            ms = price(m)
            if ms < best_ms * PAD_MARGIN:
                best, best_ms = m, ms
        return best

    def observe(self, rows: int, width: int, ms: float) -> None:
        """Blend a forward of ``(rows, width)`` that took ``ms`` in (nothing when the curve is fixed)."""
        if not self.curve.learn or ms <= 0:
            return
        if rows == 1:
            self.curve.observe(width, ms)
            return
        old = self.seen.get((rows, width))
        self.seen[(rows, width)] = ms if old is None else old + BATCH_OBSERVE_WEIGHT * (ms - old)
        ratio = ms / self.curve.ms(rows * width)
        self.ratio[width] = ratio if width not in self.ratio else \
            self.ratio[width] + BATCH_OBSERVE_WEIGHT * (ratio - self.ratio[width])


def most_per_ms(weights: list[float], tokens: list[int], longest: int, prob: Callable[[int, int], float],
                forward_ms: Callable[[int], tuple[float, int]], extra_ms: Callable[[int], float] = lambda n: 0.0,
                stopping: bool = False, floor: float | None = PAD_MARGIN) -> tuple[int, int]:
    """``(n, m)``: the ``n`` in ``0 .. longest`` with the most expected committed tokens per ms, and the forward width
    ``m`` it runs at (see the module docstring).

    Args:
        weights: per row, how much its tokens count.
        tokens: per row, how many draft tokens it has (its chain stops there).
        longest: the most draft tokens a row may verify.
        prob: ``prob(row, j)`` — P(draft token ``j`` (1-based) of ``row`` accepted | the ones before it were), in
            ``[0, 1]``.
        forward_ms: ``forward_ms(n) -> (ms, m)`` — the cheapest forward holding ``n + 1`` tokens per row.
        extra_ms: milliseconds of drafting ``n`` tokens, non-decreasing in ``n``.
        stopping: stop at the first ``n`` after which ``n + 1`` stops paying (sampled drafts).
        floor: a promise that ``forward_ms`` of any longer ``n`` is at least ``floor`` times this one's (true of the
            cheapest-width rule: a narrower start can only add wider choices, and a wider width is taken only when
            :data:`PAD_MARGIN` cheaper). The search then stops where even every remaining draft token accepted could
            not beat the best rate — the same answer, without pricing a long proposal's hopeless tail (a lookup
            match's 16 tokens of low confidence, half the rounds of an open question). ``None``: price every ``n``.
    """
    ms, width = forward_ms(0)
    best, best_width, best_rate = 0, width, sum(weights) / (extra_ms(0) + ms)
    chains, expected = [1.0] * len(weights), sum(weights)
    for n in range(1, longest + 1):
        for i, w in enumerate(weights):
            if n <= tokens[i]:
                chains[i] *= prob(i, n)
                expected += w * chains[i]
        ms, width = forward_ms(n)
        extra = extra_ms(n)
        rate = expected / (extra + ms)
        if rate > best_rate:
            best, best_width, best_rate = n, width, rate
        elif stopping:
            break
        if floor is not None and n < longest:
            most = expected + sum(w * c * max(0, min(t, longest) - n) for w, c, t in zip(weights, chains, tokens))
            if most / (extra + floor * ms) < best_rate:
                break
    return best, best_width


@dataclass
class _VerifyAll:
    """Verify every proposed token, in the cheapest forward that holds them: ``1 + the longest proposal`` tokens, or
    a wider forward where the target's measured ``cost`` says it takes :data:`PAD_MARGIN` less (the extra positions
    verify nothing). A verify cost curve need not rise: on a 2-core AVX2 CPU the embedded fp32 model's 3-token forward
    took 97 ms and its 6-token one 73 (the GEMM library's small-row paths), so a constant K = 2 paid the dearest width.

    Args:
        cost: the target's forward cost (:class:`ForwardCost`), or ``None``: always exactly ``1 + longest`` tokens.
        widest: most tokens one forward may hold per row (padding stays within it).
    """

    cost: ForwardCost | None = field(default=None, kw_only=True)
    widest: int = field(default=0, kw_only=True)
    uses_confidence = False

    def plan(self, rows: list, weights: list[float]) -> tuple[int, int]:
        """``(n, m)``: every row's whole proposal (``n`` its longest), in a forward of ``m >= n + 1`` tokens."""
        longest = max((len(r.proposal) for r in rows), default=0)
        if longest == 0 or self.cost is None:  # a plain step is never padded (a wider forward verifies nothing)
            return longest, longest + 1
        return longest, self.cost.cheapest(len(rows), longest + 1, max(self.widest, longest + 1))

    def update(self, rows: list, verified: int, accepted: list[int], next_ids: list[int]) -> None:
        pass

    def timed(self, rows: int, width: int, verify_ms: float, overhead_ms: float) -> None:
        """A round's forward of ``(rows, width)`` took ``verify_ms``: learned into ``cost`` where there is one."""
        if self.cost is not None:
            self.cost.observe(rows, width, verify_ms)


@dataclass
class ConstantK(_VerifyAll):
    """K draft tokens asked every round, all of them verified."""

    num_draft_tokens: int

    def next_k(self) -> int:
        return self.num_draft_tokens


@dataclass
class EmaK(_VerifyAll):
    """An acceptance-EMA controller (HF's ``num_assistant_tokens_schedule="heuristic"`` made smooth): after each round
    the EMA of its acceptance ratio moves; K shrinks by one below ``shrink_below`` and grows by one above
    ``grow_above``, within ``[k_min, k_max]``."""

    num_draft_tokens: int
    k_min: int = 1
    k_max: int = 8
    decay: float = 0.7
    shrink_below: float = 0.5
    grow_above: float = 0.85
    ema: float | None = None

    def __post_init__(self) -> None:
        self.num_draft_tokens = min(max(self.num_draft_tokens, self.k_min), self.k_max)

    def next_k(self) -> int:
        return self.num_draft_tokens

    def update(self, rows: list, verified: int, accepted: list[int], next_ids: list[int]) -> None:
        for row, a in zip(rows, accepted):
            drafted = min(len(row.proposal), verified)
            if drafted == 0:
                continue
            ratio = a / drafted
            self.ema = ratio if self.ema is None else self.decay * self.ema + (1 - self.decay) * ratio
            if self.ema < self.shrink_below:
                self.num_draft_tokens = max(self.k_min, self.num_draft_tokens - 1)
            elif self.ema > self.grow_above:
                self.num_draft_tokens = min(self.k_max, self.num_draft_tokens + 1)


@dataclass
class CostAwareK:
    """Verify the number of draft tokens with the most expected tokens per ms (:func:`most_per_ms`), with the
    stopping rule when any row's drafts were sampled.

    Args:
        cost: the target's forward cost (:class:`ForwardCost`, or its single-row :class:`VerifyCost` curve).
        calibrator: acceptance calibration, shared by every call of one SpeculativeLM.
        num_draft_tokens: most draft tokens asked of the drafter per round.
        widest: most tokens one forward may hold per row (padding stays within it).
    """

    cost: ForwardCost | VerifyCost
    calibrator: Calibrator
    num_draft_tokens: int
    widest: int
    overhead_ms: float = 0.0
    uses_confidence = True

    def __post_init__(self) -> None:
        if isinstance(self.cost, VerifyCost):
            self.cost = ForwardCost(self.cost)
        self.calibrator.begin_request()  # one controller per generation call

    def next_k(self) -> int:
        return self.num_draft_tokens

    def _forward_ms(self, rows: int) -> Callable[[int], tuple[float, int]]:
        """``n -> (ms, m)``: the cheapest forward over ``rows`` rows holding ``n + 1`` tokens each, with the round's
        bookkeeping; each width priced once per plan (a plan asks for every ``n`` up to the longest proposal, and the
        curve does not change within it)."""
        price = functools.cache(lambda m: self.cost.ms(rows, m))

        def forward_ms(n: int) -> tuple[float, int]:
            width = self.cost.cheapest(rows, n + 1, max(self.widest, n + 1), price)
            return price(width) + self.overhead_ms, width

        return forward_ms

    def plan(self, rows: list, weights: list[float]) -> tuple[int, int]:
        """``(n, m)``: verify the first ``n`` draft tokens of every row in a forward of ``m >= n + 1`` tokens."""
        def prob(i: int, j: int) -> float:
            confidence = rows[i].confidence
            return self.calibrator.prob(None if confidence is None else confidence[j - 1], j)

        tokens = [len(r.proposal) for r in rows]
        longest = min(max(tokens, default=0), self.widest - 1)
        if longest == 0:  # nothing to verify: a plain one-token step, never padded (a wider forward verifies nothing)
            return 0, 1
        return most_per_ms(weights, tokens, longest, prob, self._forward_ms(len(rows)),
                           stopping=any(r.q is not None for r in rows))

    def draft_steps(self, weights: list[float], limits: list[int], step_ms: float, acceptance: Calibrator) -> int:
        """How many tokens to draft for every row when one draft step over them costs ``step_ms``: the count with the
        most expected tokens per ms of drafting and verifying (0: a plain step), decided before any token is drawn,
        so the output's distribution does not depend on it (see the module docstring).

        Args:
            weights: per row, how much its tokens count (:func:`batch_weights`).
            limits: per row, the most draft tokens it can still commit (its chain stops there).
            step_ms: milliseconds of one draft step over the rows (> 0 charges drafting; 0 is free drafting).
            acceptance: the drafter's acceptance by draft position, read optimistically
                (:meth:`~toolkit.speculative.verify_length.Calibrator.optimistic`); counts this decision.
        """
        acceptance.decisions += 1
        tokens = [max(0, x) for x in limits]
        longest = min(self.num_draft_tokens, self.widest - 1)
        steps, _ = most_per_ms(weights, tokens, longest, lambda i, j: acceptance.optimistic(j),
                               self._forward_ms(len(weights)), lambda n: n * step_ms)
        return steps

    def update(self, rows: list, verified: int, accepted: list[int], next_ids: list[int]) -> None:
        """Learn from a round: each row's verified draft tokens, and, for a deterministic draft whose verified tokens
        were all accepted, the first one left unverified, which the target's own next token ``next_ids[r]`` tests
        for free (it is accepted exactly when the target chooses it: greedy, or sampled with probability p(token),
        which is the acceptance probability of a draft with q = 1). Without that a confidence bin whose estimate fell
        below what pays is never verified again, so never corrected: a copy the target follows token by token stayed
        unverified for the rest of a request (issue 50, the repeat suite)."""
        for row, a, nxt in zip(rows, accepted, next_ids):
            drafted = min(len(row.proposal), verified)
            if row.q is None and a == drafted < len(row.proposal):
                drafted, a = drafted + 1, a + (nxt == row.proposal[drafted])
            if drafted:
                self.calibrator.observe(row.confidence, drafted, a)

    def timed(self, rows: int, width: int, verify_ms: float, overhead_ms: float) -> None:
        """A round's forward of ``(rows, width)`` took ``verify_ms``; its bookkeeping ``overhead_ms``."""
        self.cost.observe(rows, width, verify_ms)
        self.overhead_ms += 0.1 * (overhead_ms - self.overhead_ms)


def verify_room(max_query_tokens: int, policies: tuple = ()) -> int:
    """The widest forward a round may run, in tokens per row: ``max_query_tokens`` (K + 1 for a chain), widened to
    :data:`PAD_ROOM` where no KV ``policies`` (target's, draft's) is set — an uncompressed cache holds a padded
    forward's extra positions until the commit point drops them; a compressing policy's window or residual is sized
    to ``max_query_tokens`` and stays so."""
    return max_query_tokens if any(p is not None for p in policies) else max(max_query_tokens, PAD_ROOM)


def reads_cost(spec) -> bool:
    """Whether the controller of ``spec`` reads the target's verify cost curve: the cost-aware verify length, and a
    chain drafter's constant / ema K (to pick the width); not AR, not token trees (their width is the tree's)."""
    return spec.adaptive == "cost" or (spec.config.speculates and not spec.tree)


def make_controller(spec, cost=None, calibrator=None, widest: int | None = None):
    """The controller of a recipe's ``spec`` (``adaptive``: ``constant``, ``ema`` or ``cost``); ``cost`` needs the
    target's forward ``cost`` and a :class:`~toolkit.speculative.verify_length.Calibrator`; ``constant`` and ``ema``
    read ``cost``, where given, only to run a wider forward where it is cheaper (:class:`_VerifyAll`).

    Raises:
        ValueError: ``adaptive: cost`` without ``cost`` or ``calibrator``.
    """
    widest = widest or spec.num_draft_tokens + 1
    if spec.adaptive == "cost":
        if cost is None or calibrator is None:
            raise ValueError("adaptive 'cost' needs the target's verify cost curve and a calibrator")
        return CostAwareK(cost, calibrator, spec.num_draft_tokens, widest)
    cost = ForwardCost(cost) if isinstance(cost, VerifyCost) else cost  # constant / ema: only to pick the width
    room = dict(cost=cost, widest=widest) if cost is not None else {}
    if spec.adaptive == "ema":
        return EmaK(spec.num_draft_tokens, spec.k_min, spec.k_max, spec.ema_decay, **room)
    return ConstantK(spec.num_draft_tokens, **room)


def batch_weights(left: list[int], draining: bool) -> list[float]:
    """How much each row's tokens count, given the tokens ``left`` to each row's limit. While requests wait every row
    counts alike (a row that finishes early frees its place); once none waits (``draining``) the batch ends with its
    longest row, so a row counts in proportion to its work left against the most any row has left."""
    return [x / max(left) for x in left] if draining and left and max(left) > 0 else [1.0] * len(left)

"""Batched speculation with the cost-aware planner: batches draft where it pays, and sampling stays lossless when the
verify width truncates sampled drafts.

Exploration (``test_a_batch_learns_that_its_draft_pays``): how many tokens a batch drafts is decided before any is
drawn, from the draft's acceptance per position learned from earlier rounds. A draft whose prior (1/2 per position)
says drafting never pays must still be tried, or its real acceptance is never seen and the batch never speculates.

Lossless truncation (``test_sampled_drafts_truncated_by_the_cost_curve_keep_the_target_law``): the regime the
planner's stopping rule exists for (``toolkit.engine.planner.CostAwareK.plan``): a weak first draft token that would be
verified only because a confident second one follows. The probe drafter samples the first token from
q = 1/2 on the target's least and most likely tokens, and announces a confident second token only after the least
likely one. The cost curve makes verifying one token never pay and two tokens pay only behind a confident second.
Choosing the best width over the whole chain then verifies the first token exactly when it is the unlikely one, and
the committed token no longer follows the target; a planner that decides token by token, knowing only what preceded
each, never verifies here and stays exact.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from conftest import batch_decoder, tiny_llama
from scipy.stats import chisquare
from test_decoder import make_prompt

from toolkit.speculative.drafters.rows import RowDrafters
from toolkit.recipe import GenerationSpec
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import DraftModel

V = 12
#: ms of a verify forward over n = 1, 2, 3, ... tokens: width 2 (one draft) never pays, width 3 pays only when the
#: second draft token is confident (expected 1 + 0.525 + 0.525 * 0.975 = 2.04 tokens vs 1.8 ms; 1.55 after a weak one)
CURVE = [1.0, 3.0, 1.8] + [50.0] * 13
DRAWS = 600  # the old planner failed this with p = 2.8e-19 at 1,200 draws


#: a flat verify cost curve (ms of a forward over n = 1..16 tokens: 4 tokens cost 1.08x one, 16 tokens 1.4x) and a
#: draft step of 60 ms: at the prior's acceptance of 1/2 per position drafting never pays for 4 rows (4 tokens per
#: 108 ms plainly; 6 expected per 178.7 ms with one draft token) nor for one row, at the real acceptance of a draft
#: that is the target itself (1) it does (16 tokens per 320 ms with three)
FLAT_MS = [100.0 + 8.0 * (n - 1) / 3 for n in range(1, 17)]
DRAFT_STEP_MS = 60.0


class FixedStepDraft(DraftModel):
    """A batch draft model whose step costs :data:`DRAFT_STEP_MS` whatever the machine does."""

    def step_ms(self, rows: int) -> float:
        return DRAFT_STEP_MS


def _drafted_per_round(target, batch_size: int, prompts: list) -> tuple[float, float]:
    """(draft tokens verified per round, tau) of sampled decoding with the target as its own draft."""
    gen = GenerationSpec(max_new_tokens=16, do_sample=True, ignore_eos=True, seed=3)
    decoder = batch_decoder(target, FixedStepDraft(target, do_sample=True, seed=gen.seed),
                            VerifyCost(list(FLAT_MS), learn=False), num_draft_tokens=3, batch_size=batch_size)
    rows = decoder.decode_batch(prompts, gen)
    rounds = sum(s.rounds for _, s in rows)
    return sum(s.drafted for _, s in rows) / rounds, sum(s.committed for _, s in rows) / rounds


def test_a_batch_learns_that_its_draft_pays():
    """Issue 46: 4 rows with a sampled draft model under the cost-aware planner and a flat curve drafted 0.00 tokens
    per round: the draft's acceptance was never observed, as nothing was drafted while the prior said no."""
    target = tiny_llama(seed=0, initializer_range=0.2)
    prompts = [make_prompt(seed) for seed in range(4)]
    batch, batch_tau = _drafted_per_round(target, 4, prompts)
    alone, _ = _drafted_per_round(target, 1, prompts)
    assert batch > 1.0 and batch_tau > 2.0, (batch, batch_tau)  # the target accepts its own draft every time
    assert batch > 0.5 * alone, (batch, alone)


_LAWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {prefix: its next-token law}


def _next_token_law(target, ids: tuple) -> torch.Tensor:
    """The target's next-token distribution after ``ids``, computed once per prefix (the draws share prefixes)."""
    laws = _LAWS.setdefault(target, {})
    if ids not in laws:
        with torch.no_grad():
            laws[ids] = target(torch.tensor([ids])).logits[0, -1].softmax(-1)
    return laws[ids]


class TruncationProbe(RowDrafters):
    """A row drafter (the protocol of :mod:`toolkit.speculative.drafters.rows`) that drafts two sampled tokens
    per row: the first from q = 1/2 on the target's least / most likely next token (confidence 0.5, known before it
    is drawn), the second uniform, with confidence 0.99 after the least likely first token and 0.01 otherwise."""

    def __init__(self, target, seed: int):
        super().__init__(lambda: None, trees=False)
        self.target, self.generator = target, torch.Generator().manual_seed(seed)

    def commit_rows(self, rows, accepted, features=None):
        pass

    def propose_rows(self, rows, num_draft_tokens, read=True):
        self.propose(rows, num_draft_tokens)

    def propose(self, rows, rooms):
        for row, room in zip(rows, rooms):
            p = _next_token_law(self.target, tuple(row.ids))
            low, high = int(p.argmin()), int(p.argmax())
            q1 = torch.zeros(V)
            q1[[low, high]] = 0.5
            q2 = torch.full((V,), 1.0 / V)
            first = int(torch.multinomial(q1, 1, generator=self.generator))
            second = int(torch.multinomial(q2, 1, generator=self.generator))
            row.proposal = [first, second][:room]
            row.confidence = [0.5, 0.99 if first == low else 0.01][:room]
            row.q = torch.stack([q1, q2])[:room]


@pytest.mark.slow
def test_sampled_drafts_truncated_by_the_cost_curve_keep_the_target_law():
    target = tiny_llama(seed=4, vocab=V, initializer_range=0.3)
    prompt = make_prompt(2, vocab=V, length=6)
    with torch.no_grad():  # the law of the 2nd new token (the 1st comes from the prefill, the 2nd from a round)
        p1 = target(prompt).logits[0, -1].softmax(-1).double()
        seq = torch.cat([prompt.expand(V, -1), torch.arange(V).view(-1, 1)], dim=1)
        p2 = (p1[:, None] * target(seq).logits[:, -1].softmax(-1).double()).sum(0).numpy()
    counts = np.zeros(V)
    for draw in range(DRAWS):  # a fresh decoder per draw: its calibration holds only the prior, as in a first round
        gen = GenerationSpec(max_new_tokens=4, do_sample=True, ignore_eos=True, seed=draw)  # room for 2
        decoder = batch_decoder(target, TruncationProbe(target, seed=draw), VerifyCost(list(CURVE), learn=False),
                                num_draft_tokens=2, batch_size=1)
        [(ids, _)] = decoder.decode_batch([prompt], gen)
        counts[ids[1]] += 1
    assert chisquare(counts, p2 / p2.sum() * counts.sum()).pvalue > 0.01, (counts, p2 * counts.sum())


def test_a_plan_prices_each_draft_length_as_the_forward_cost_rule_does():
    """The planner prices the widths once per plan; every draft length must still get ForwardCost.cheapest's width
    (the cheapest holding it, a wider one only when 10% cheaper) and its cost, for one row (the curve, staircases
    included) and for batches (learned costs), and past the controller's widest width."""
    from toolkit.engine.planner import CostAwareK, ForwardCost
    from toolkit.speculative.verify_length import Calibrator

    rng = np.random.default_rng(0)
    for case in range(40):
        steps = np.cumsum(rng.uniform(-3.0, 6.0, 24)) + 60.0  # ups and downs: paddings that pay and ones that do not
        cost = ForwardCost(VerifyCost([float(x) for x in steps], learn=False))
        cost.seen[(2, 3)], cost.ratio[2] = 40.0, 1.3  # a batch width learned online
        widest = int(rng.integers(2, 12))
        controller = CostAwareK(cost, Calibrator(), widest - 1, widest, overhead_ms=0.5)
        for rows in (1, 2, 3):
            price = controller._forward_ms(rows)
            for n in range(widest + 2):
                width = cost.cheapest(rows, n + 1, max(widest, n + 1))
                assert price(n) == (cost.ms(rows, width) + 0.5, width), (case, rows, n)


def test_the_plan_stops_pricing_where_no_tail_can_pay_with_the_same_answer():
    """``most_per_ms`` stops once every remaining draft token accepted could not beat the best rate (``floor``):
    over random curves (staircases and dips), acceptance chains, proposals, rows, overheads and drafting costs, the
    plan equals the one that prices every length, and it does stop early on a low-confidence long proposal."""
    from toolkit.engine.planner import CostAwareK, ForwardCost, most_per_ms
    from toolkit.speculative.verify_length import Calibrator

    rng = np.random.default_rng(1)
    stopped = 0
    for case in range(300):
        steps = np.cumsum(rng.uniform(-3.0, 8.0, 24)) + 40.0
        cost = ForwardCost(VerifyCost([float(x) for x in steps], learn=False))
        widest = int(rng.integers(2, 18))
        controller = CostAwareK(cost, Calibrator(), widest - 1, widest, overhead_ms=float(rng.uniform(0, 2)))
        rows = int(rng.integers(1, 4))
        weights = [float(x) for x in rng.uniform(0.2, 1.0, rows)]
        tokens = [int(x) for x in rng.integers(0, widest + 3, rows)]
        longest = min(max(tokens), widest - 1)
        probs = rng.uniform(0.0, 1.0, (rows, 30)) ** float(rng.choice([0.2, 1.0, 4.0]))
        step_ms = float(rng.choice([0.0, rng.uniform(0.5, 10.0)]))
        calls = []

        def prob(i, j):
            calls.append(j)
            return float(probs[i, j - 1])

        args = (weights, tokens, longest, prob, controller._forward_ms(rows), lambda n: n * step_ms)
        every = most_per_ms(*args, floor=None)
        calls.clear()
        assert most_per_ms(*args) == every, case
        stopped += bool(calls) and max(calls) < longest
    assert stopped > 50  # the bound does cut plans short
    # one row, 16 tokens of 0.3 each on a curve where 2 tokens cost 1.85 steps: after the third, even 13 more tokens
    # all accepted (1.42 + 0.027 * 13 expected) cannot beat a plain step
    cost = ForwardCost(VerifyCost([10.0, 18.5] + [18.5 + 6.0 * k for k in range(1, 15)], learn=False))
    controller = CostAwareK(cost, Calibrator(), 16, 17)
    priced = []
    plan = most_per_ms([1.0], [16], 16, lambda i, j: priced.append(j) or 0.3, controller._forward_ms(1))
    assert plan == (0, 1) and max(priced) == 3

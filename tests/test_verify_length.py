"""The cost-aware verify length: the measured cost curve, its cache, the calibrated choice of how many draft tokens a
round verifies (0 = a plain step, padding to a cheaper width), and that none of it changes the output."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import perturbed_copy, tiny_llama, tiny_neox
from test_decoder import INIT, hf_greedy, make_prompt, speculate

from toolkit.engine.cost import load_or_measure, measure_verify_cost
from toolkit.engine.planner import PAD_ROOM, ConstantK, CostAwareK, ForwardCost, verify_room
from toolkit.kv import make_policy
from toolkit.recipe import KVSpec
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import DraftModel, NGramDrafter
from toolkit.speculative.verify_length import Calibrator

FLAT = [10.0] * 16                                      # verifying 16 tokens costs one step: always draft
# n tokens cost n^2 steps: never worth it, even for sure drafts and whatever the round's measured bookkeeping
# (under a linear price sure drafts amortize that bookkeeping: test_batch's twin drafted on CI, stop 66)
STEEP = [100.0 * n * n for n in range(1, 17)]
DIP = [10.0, 19.0, 20.0, 13.0, 13.5, 14.0] + [20.0] * 10  # 4 tokens cheaper than 2 (the fp32 shape of issue 22)


def controller(curve, k=8, widest=9, **kw) -> CostAwareK:
    return CostAwareK(VerifyCost(list(curve), learn=False), Calibrator(), k, widest, **kw)


def plan(ctl: CostAwareK, confidence: list[float] | None, proposed: int, sampled: bool = False) -> tuple[int, int]:
    """``(j, n)`` the controller picks for one row of ``proposed`` draft tokens with ``confidence`` (``sampled``: drafts
    drawn from a q, whose planning follows the stopping rule)."""
    row = SimpleNamespace(proposal=[0] * proposed, confidence=confidence,
                          q=torch.zeros(proposed, 1) if sampled else None)
    return ctl.plan([row], [1.0])


# ------------------------------------------------------------------------------------------------------ the curve
def test_measured_curve_covers_every_length_and_is_cached(tmp_path):
    model = tiny_llama(seed=0)
    cost = measure_verify_cost(model, max_tokens=9, context=32, repeats=2)
    assert len(cost.step_ms) == 9 and all(ms > 0 for ms in cost.step_ms) and cost.relative(1) == 1.0
    first = load_or_measure(model, 9, cache_dir=tmp_path)
    assert first.source == "measured" and len(list(tmp_path.iterdir())) == 1
    again = load_or_measure(model, 9, cache_dir=tmp_path)
    assert again.source == "cache" and again.step_ms == pytest.approx(first.step_ms, abs=1e-3)
    (path,) = tmp_path.iterdir()
    path.write_text("{not json")  # a damaged cache file is measured again, not trusted
    assert load_or_measure(model, 9, cache_dir=tmp_path).source == "measured"
    assert json.loads(path.read_text())["key"] == first.key
    other = tiny_neox(seed=0)  # another model: another key
    load_or_measure(other, 9, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2


def test_a_curve_measured_under_load_is_used_but_not_cached(tmp_path, monkeypatch):
    """Other processes' share of the CPUs above the limit (here: any share at all) marks the curve and keeps it out
    of the cache, so the next run measures again instead of reading a slow machine's curve forever."""
    monkeypatch.setenv("TOOLKIT_VERIFY_COST_MAX_LOAD", "-1")
    cost = load_or_measure(tiny_llama(seed=0), 4, cache_dir=tmp_path)
    assert cost.source == "measured under load" and len(cost.step_ms) == 4 and not list(tmp_path.iterdir())


def test_measuring_the_curve_leaves_later_requests_their_own_cache_size():
    """The measurement's cache (256 tokens of context) is not kept by an eager engine: a short request, a batch's
    rows too, would otherwise inherit its capacity and its KV bytes."""
    from toolkit.engine.forward import TargetForward
    from toolkit.kv.static import capacity_for

    model = tiny_llama(seed=0)
    engine = TargetForward(model)
    measure_verify_cost(model, max_tokens=4, context=300, repeats=1, forward=engine)
    small = engine.cache_for(None, 1, capacity_for(20), 4)
    assert capacity_for(300 + 4) > capacity_for(20) and small.capacity == capacity_for(20)
    assert engine.cache_for(None, 1, capacity_for(20), 4) is small  # a request's own cache is still kept and reused


def test_curve_extrapolates_and_picks_cheaper_padding():
    cost = VerifyCost(list(DIP))
    widths = ForwardCost(cost)  # the planner's cheapest-width rule, one row on this curve
    assert widths.cheapest(1, 2, 9) == 4 and widths.cheapest(1, 5, 9) == 5
    assert widths.cheapest(1, 2, 3) == 2  # padding stays within the widest forward the plan allows
    assert cost.ms(20) == pytest.approx(20.0)  # past the curve: its last slope (flat here)
    with pytest.raises(ValueError):
        cost.ms(0)


def test_the_curve_learns_the_step_and_one_scale_for_the_tokens_past_it():
    cost = VerifyCost([10.0, 20.0, 30.0, 40.0])
    for _ in range(300):  # steps got slower (a longer context): every width pays it
        cost.observe(1, 12.0)
    assert cost.ms(1) == pytest.approx(12.0) and cost.ms(4) == pytest.approx(42.0)
    for _ in range(300):  # 3-token forwards cost 1.5x the measured extra: widths never observed follow
        cost.observe(3, 12.0 + 1.5 * 20.0)
    assert cost.extra_scale == pytest.approx(1.5)
    assert cost.ms(2) == pytest.approx(27.0) and cost.ms(4) == pytest.approx(57.0) and cost.ms(6) == pytest.approx(87.0)
    assert cost.relative(4) == pytest.approx(57.0 / 12.0)
    assert cost.step_ms == [10.0, 20.0, 30.0, 40.0]  # the measurement (what the cache holds) stays as measured
    assert cost.to_dict()["learned"] == {"step_ms": 12.0, "extra_scale": 1.5, "observed": {1: 300, 3: 300}}

    flat = VerifyCost([10.0, 10.5, 11.0, 30.0])  # a GPU's flat part: its extra is noise, no scale is read from it
    flat.observe(2, 50.0)
    assert flat.extra_scale == 1.0 and flat.ms(4) == pytest.approx(30.0)
    stalled = VerifyCost([10.0, 20.0])
    stalled.observe(2, 10_000.0)  # a stall timed as a forward moves the scale by a bounded step
    assert stalled.extra_scale == pytest.approx(1.0 + 0.1 * (4.0 - 1.0))
    fixed = VerifyCost([10.0, 20.0], learn=False)
    fixed.observe(1, 50.0), fixed.observe(2, 50.0)
    assert fixed.ms(1) == 10.0 and fixed.ms(2) == 20.0 and not fixed.observed


# ------------------------------------------------------------------------------------------------------ the choice
def test_confident_drafts_on_a_flat_curve_are_verified_whole():
    assert plan(controller(FLAT), [0.9] * 8, 8) == (8, 9)


def test_unlikely_drafts_on_a_steep_curve_give_a_plain_step():
    assert plan(controller(STEEP), [0.3] * 8, 8) == (0, 1)
    assert plan(controller(STEEP), None, 0) == (0, 1)


def test_short_draft_is_padded_to_the_cheaper_width():
    assert plan(controller(DIP), [0.9], 1) == (1, 4)  # 1 draft token in a forward of 4: cheaper than of 2
    assert plan(controller(DIP), [0.9, 0.05], 2) == (2, 4)  # a second token rides along for free


def test_a_constant_k_runs_at_the_cheapest_width_that_holds_it():
    """A constant K verifies every proposed token, at the cheapest width the curve gives (the AVX2 fp32 shape: 3
    tokens dearer than 4), exactly ``K + 1`` without a curve, and a plain step unpadded."""
    padded = ConstantK(2, cost=ForwardCost(VerifyCost(list(DIP), learn=False)), widest=7)
    assert plan(padded, None, 1) == (1, 4) and plan(padded, None, 2) == (2, 4)
    assert plan(padded, None, 0) == (0, 1)
    assert plan(ConstantK(2, cost=ForwardCost(VerifyCost(list(DIP), learn=False)), widest=3), None, 2) == (2, 3)
    assert plan(ConstantK(2), None, 1) == (1, 2)  # no curve: no padding


def test_padding_room_only_on_uncompressed_caches():
    streaming = make_policy(KVSpec.from_dict({"policy": "streaming", "sink_tokens": 4, "window": 24}, "kv"))
    assert verify_room(3, (None, None)) == PAD_ROOM and verify_room(17, (None, None)) == 17
    assert verify_room(3, (streaming, None)) == 3 and verify_room(3, (None, streaming)) == 3


def test_a_padded_constant_k_gives_ar_greedy_output():
    target = tiny_llama(seed=0, **INIT)
    prompt = make_prompt(0)
    ctl = ConstantK(2, cost=ForwardCost(VerifyCost(list(DIP), learn=False)), widest=7)
    ids, stats, _ = speculate(target, DraftModel(perturbed_copy(target, scale=0.1, seed=1)), prompt, ctl)
    assert ids == hf_greedy(target, prompt, len(ids))
    assert stats.accepted > 0 and stats.tokens_per_round > 1
    assert stats.verify_tokens == 4 * stats.rounds  # every round verified its 2 drafts in a forward of 4


def test_every_choice_expects_at_least_a_plain_steps_rate():
    for curve in (FLAT, STEEP, DIP):
        ctl = controller(curve)
        for p in (0.05, 0.3, 0.6, 0.95):
            j, n = plan(ctl, [p] * 8, 8)
            expected = sum(ctl.calibrator.prob(p, 1) ** i for i in range(j + 1))
            assert expected / ctl.cost.ms(1, n) >= 1 / ctl.cost.ms(1, 1) - 1e-9


def test_sampled_drafts_use_a_stopping_rule():
    """With sampled drafts the decision for token i may not look at later confidences (they depend on token i):
    where the rate dips at 2 tokens (a jump in the curve) and recovers later, the chain stops at 1 instead of
    verifying all 8."""
    ctl = controller([10.0, 11.0, 30.0, 30.5, 31.0, 31.5, 32.0, 32.5, 33.0])
    assert plan(ctl, [0.99] * 8, 8, sampled=False)[0] == 8
    assert plan(ctl, [0.99] * 8, 8, sampled=True)[0] == 1


def test_calibration_learns_the_real_acceptance_and_each_request_its_own_level():
    cal = Calibrator()
    for _ in range(200):  # tokens reported at 0.9: 6 tested per 3 rounds, 4 of them accepted
        cal.observe([0.9, 0.9, 0.9], verified=3, accepted=0)
        cal.observe([0.9, 0.9, 0.9], verified=3, accepted=1)
        cal.observe([0.9, 0.9, 0.9], verified=3, accepted=3)
    cal.begin_request()
    assert cal.prob(0.9, 1) == pytest.approx(4 / 6, abs=0.02)
    for _ in range(30):  # this request accepts nothing
        cal.observe([0.9], verified=1, accepted=0)
    assert cal.request_shift < -1.5 and cal.prob(0.9, 1) < 0.2
    cal.begin_request()
    assert cal.request_shift == 0.0 and 0.55 < cal.prob(0.9, 1) < 4 / 6  # the bin's level, lowered by those 30


@pytest.mark.parametrize("confidence", [[0.3], None], ids=["bin", "position"])
def test_a_bin_and_a_position_forget_old_outcomes_so_the_estimate_follows_a_drift(confidence):
    from toolkit.speculative.verify_length import MAX_TRIALS

    cal = Calibrator()
    for _ in range(2000):  # accepted every time, then rejected every time
        cal.observe(confidence, verified=1, accepted=1)
    for _ in range(int(MAX_TRIALS)):
        cal.observe(confidence, verified=1, accepted=0)
    cal.begin_request()
    trials = cal.trials[6] if confidence else cal.position_trials[1]
    assert MAX_TRIALS / 2 <= trials <= MAX_TRIALS + 1  # halved past the cap, whatever was seen before
    assert cal.prob(confidence and confidence[0], 1) < 0.3  # without forgetting: 2000 / 2400 = 0.83


def test_the_targets_next_token_tests_the_first_unverified_deterministic_draft():
    def observed(verified: int, accepted: int, next_id: int, sampled: bool = False) -> list[tuple[int, int]]:
        ctl = controller(FLAT)
        row = SimpleNamespace(proposal=[5, 6, 7], confidence=[0.9, 0.9, 0.9],
                              q=torch.zeros(3, 8) if sampled else None)
        ctl.update([row], verified, [accepted], [next_id])
        b = Calibrator._bin(0.9)
        return [(int(ctl.calibrator.success[b]), int(ctl.calibrator.trials[b]))]

    assert observed(0, 0, 5) == [(1, 1)]  # a plain step whose token is the draft's first: an acceptance, free
    assert observed(0, 0, 9) == [(0, 1)]  # ... or not the draft's first: a rejection
    assert observed(1, 1, 6) == [(2, 2)]  # the verified token and the next one
    assert observed(1, 0, 9) == [(0, 1)]  # a rejection ends the chain: nothing past it is known
    assert observed(3, 3, 1) == [(3, 3)]  # nothing left unverified
    assert observed(0, 0, 5, sampled=True) == [(0, 0)]  # sampled drafts: acceptance is min(1, p/q), not p


def test_a_bin_that_fell_below_what_pays_is_verified_again_once_the_target_follows_it():
    """The calibration has seen 40 rejections at confidence 0.9, so under a curve where 2 tokens cost 1.5 steps no
    draft is verified; the drafter (an oracle, reporting 0.9) is right every time. Plain steps whose token is the
    draft's first raise the bin and the request's offset, and verifying starts again within the request."""
    target = tiny_llama(seed=0, **INIT)
    prompt = make_prompt(0)
    reference = prompt[0].tolist() + hf_greedy(target, prompt, 60)

    class Oracle(NGramDrafter):
        def propose(self, input_ids, num_draft_tokens):
            n = input_ids.shape[1]
            return torch.tensor([reference[n:n + num_draft_tokens]]), None

        def confidence(self):
            return [0.9] * 4

    ctl = controller([10.0, 15.0, 19.0, 22.0, 25.0] + [40.0] * 4, k=4, widest=5)
    for _ in range(40):
        ctl.calibrator.observe([0.9], verified=1, accepted=0)
    assert plan(ctl, [0.9] * 4, 4) == (0, 1)  # as it starts: nothing pays
    ids, stats, _ = speculate(target, Oracle(), prompt, ctl, max_new_tokens=60)
    assert ids == reference[prompt.shape[1]:]
    assert stats.accepted > 20 and stats.tokens_per_round > 1.5 and stats.plain_steps < stats.rounds / 2


def test_optimistic_acceptance_is_high_where_little_was_seen_and_comes_back():
    cal = Calibrator()
    cal.decisions = 1
    assert cal.optimistic(1) > cal.prob(None, 1) == 0.5  # nothing seen yet: worth a try
    for _ in range(100):  # position 1 always rejected
        cal.observe(None, verified=1, accepted=0)
    seen = cal.optimistic(1)
    assert cal.prob(None, 1) < seen < 0.2
    cal.decisions = 10**6  # a long time without drafting: the bound rises again, so it is tried again
    assert cal.optimistic(1) > seen + 0.3
    with pytest.raises(ValueError, match="position"):
        cal.optimistic(0)


def test_draft_steps_try_a_draft_the_prior_says_never_pays_and_stop_once_it_fails():
    """4 rows, a flat curve (10 ms a forward), a draft step of 6 ms: at the prior's acceptance of 1/2 per position no
    draft length pays (6 expected tokens per 16 ms with one, against 4 per 10 ms), so a planner reading the prior
    never drafts and never learns otherwise. Read optimistically, the first rounds draft; once the draft is seen to
    fail they stop."""
    ctl, acceptance = controller(FLAT), Calibrator()
    steps = ctl.draft_steps([1.0] * 4, [8] * 4, 6.0, acceptance)
    assert steps > 0 and acceptance.decisions == 1
    for _ in range(200):  # every first draft token rejected
        acceptance.observe(None, verified=steps, accepted=0)
    assert ctl.draft_steps([1.0] * 4, [8] * 4, 6.0, acceptance) == 0
    assert ctl.draft_steps([1.0] * 4, [0] * 4, 0.0, Calibrator()) == 0  # no room left: a plain step


# ---------------------------------------------------------------------------------------------------- outputs unchanged
@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
@pytest.mark.parametrize("curve", [FLAT, STEEP, DIP], ids=["flat", "steep", "dip"])
def test_greedy_output_is_ar_whatever_the_curve(make, curve):
    target = make(seed=0, **INIT)
    draft = perturbed_copy(target, scale=0.1, seed=1)
    prompt = make_prompt(0)
    reference = hf_greedy(target, prompt, 40)

    class FreeSteps(DraftModel):  # the verify curve alone decides (a draft step's cost would be charged too)
        def step_ms(self, rows: int) -> float:
            return 0.0

    ids, stats, _ = speculate(target, FreeSteps(draft), prompt, controller(curve, k=6, widest=7))
    assert ids == reference
    assert stats.target_forwards == stats.rounds + 1
    if curve is STEEP:
        assert stats.drafted == 0 and stats.plain_steps == stats.rounds
    else:
        assert stats.accepted > 0


@pytest.mark.parametrize("kv", [
    {"policy": "streaming", "sink_tokens": 4, "window": 24, "compress_interval": 4},
    {"policy": "quantized", "quant_bits": 4, "quant_group_size": 16, "residual_length": 12},
    {"policy": "l2norm", "budget": 40, "compress_interval": 4},
], ids=lambda kv: kv["policy"])
def test_padding_and_plain_steps_under_compressed_caches_match_the_same_policy_ar(kv):
    target = tiny_llama(seed=0, **INIT)
    base = make_prompt(9, length=6)[0]
    prompt = torch.cat([base, base, base[:3]]).view(1, -1)
    policy = make_policy(KVSpec.from_dict(kv, "kv"))
    from test_kv_streaming import run as run_with_policy  # (model, drafter, policy, prompt, new_tokens)

    ar, _ = run_with_policy(target, None, make_policy(KVSpec.from_dict(kv, "kv")), prompt, 60)
    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.stats import GenerationStats

    class OneToken(NGramDrafter):  # proposes one token: under the DIP curve it is verified padded to 4
        def propose(self, input_ids, num_draft_tokens):
            tokens, _ = super().propose(input_ids, num_draft_tokens)
            return tokens[:, :1], None

    stats = GenerationStats()
    loop = SpeculativeDecoder(target, OneToken(), controller(DIP, k=6, widest=7), policy)
    ids = [t for c in loop.decode(prompt, GenerationSpec(max_new_tokens=60, ignore_eos=True), stats) for t in c]
    assert ids == ar
    assert stats.drafted > 0 and stats.verify_tokens > stats.drafted + stats.rounds  # padding ran


def test_round_time_breakdown_adds_up():
    target = tiny_llama(seed=0, **INIT)
    base = make_prompt(9, length=6)[0]
    prompt = torch.cat([base, base, base[:3]]).view(1, -1)
    _, stats, _ = speculate(target, NGramDrafter(), prompt, controller(FLAT))
    split = stats.round_ms
    assert stats.draft_ms > 0 and stats.target_ms > 0 and stats.overhead_ms > 0
    total = stats.draft_ms + stats.target_ms + stats.overhead_ms
    assert total <= stats.total_ms - stats.ttft_ms + 1e-6  # the rounds' parts never exceed the decode time
    assert 0 < split["overhead_pct"] < 100


# ------------------------------------------------------------------------------------------------------ sampling
def _marginals(target, prompt, draft, make_controller, runs: int) -> tuple[np.ndarray, np.ndarray]:
    """Empirical distribution of the 2nd and 3rd generated tokens over ``runs`` seeds, and the exact one."""
    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.stats import GenerationStats

    vocab = target.config.vocab_size
    counts = np.zeros((2, vocab))
    for seed in range(runs):
        gen = GenerationSpec(max_new_tokens=4, do_sample=True, ignore_eos=True, seed=seed)
        drafter = DraftModel(draft, do_sample=True, generator=torch.Generator().manual_seed(10_000 + seed))
        loop = SpeculativeDecoder(target, drafter, make_controller())
        ids = [t for c in loop.decode(prompt, gen, GenerationStats()) for t in c]
        counts[0, ids[1]] += 1
        counts[1, ids[2]] += 1
    with torch.no_grad():
        p1 = target(prompt).logits[0, -1].softmax(-1)
        seq1 = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab).view(-1, 1)], dim=1)
        p2 = target(seq1).logits[:, -1].softmax(-1)  # (t1, t2)
        joint12 = p1[:, None] * p2
        seq2 = torch.cat([seq1.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(vocab).view(-1, 1)], dim=1)
        p3 = target(seq2).logits[:, -1].softmax(-1).view(vocab, vocab, vocab)
        exact = np.stack([joint12.sum(0).double().numpy(), (joint12[:, :, None] * p3).sum((0, 1)).double().numpy()])
        exact /= exact.sum(1, keepdims=True)
    return counts, exact


class _PeekingController(CostAwareK):
    """A planted bug: verifies the draft only when its first token is the target's favourite — the choice depends
    on the sampled token itself (what the stopping rule forbids), so that token comes out too often."""

    def plan(self, rows, weights):
        proposed = len(rows[0].proposal)
        return (proposed, proposed + 1) if self.peek() else (0, 1)


@pytest.mark.slow
@pytest.mark.heavy  # ~23 s of 1,000 draws; test_batch_verify_length's law test runs the same stopping rule
def test_sampling_with_cost_aware_verify_length_is_lossless():
    from scipy.stats import chisquare

    target = tiny_llama(seed=4, vocab=12, initializer_range=0.3)
    draft = perturbed_copy(target, scale=0.3, seed=5)
    prompt = make_prompt(2, vocab=12, length=6)
    curve = [10.0, 11.0, 30.0, 30.5]  # the rate dips at 2 tokens and recovers at 3: the lookahead would differ
    counts, exact = _marginals(target, prompt, draft, lambda: controller(curve, k=2, widest=3), 1000)
    for row in range(2):
        assert chisquare(counts[row], exact[row] * counts[row].sum()).pvalue > 0.01


@pytest.mark.slow
@pytest.mark.heavy  # ~10 s; the power check of the test above
def test_the_sampling_test_catches_a_verify_length_that_peeks_at_the_drafted_tokens():
    from scipy.stats import chisquare

    target = tiny_llama(seed=4, vocab=12, initializer_range=0.3)
    draft = copy.deepcopy(target)  # q = p: every verified token is accepted, so the peek's bias is plain to see
    prompt = make_prompt(2, vocab=12, length=6)
    seen: dict = {}
    favourite: dict = {}  # prefix -> the target's argmax after it (the draws share their prefixes)
    original = DraftModel.propose_rows

    def spy(self, rows, num_draft_tokens, read=True):  # remember the drafted token and the target's favourite
        original(self, rows, num_draft_tokens, read)
        prefix = tuple(rows[0].ids)
        if prefix not in favourite:
            with torch.no_grad():
                favourite[prefix] = int(target(torch.tensor([prefix])).logits[0, -1].argmax())
        seen["best"] = favourite[prefix]
        seen["first"] = rows[0].proposal[0] if rows[0].proposal else -1

    def make():
        ctl = _PeekingController(VerifyCost([10.0] * 4, learn=False), Calibrator(), 2, 3)
        ctl.peek = lambda: seen["first"] == seen["best"]
        return ctl

    DraftModel.propose_rows = spy
    try:
        counts, exact = _marginals(target, prompt, draft, make, 400)
    finally:
        DraftModel.propose_rows = original
    # seeded draws: p = 5e-5 at 400 of them (the lossless test above asserts p > 0.01 at 1,000)
    assert chisquare(counts[0], exact[0] * counts[0].sum()).pvalue < 1e-3

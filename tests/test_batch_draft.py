"""A draft model drafting for a whole batch (toolkit/speculative/drafters/draft_model.py): every row's greedy
output is its prompt's output alone, the draft cache keeps exactly each row's committed prefix after ragged
acceptance, and sampling per row stays lossless with the draft's q."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import batch_decoder, hf_forward, perturbed_copy, tiny_llama
from test_batch import prompts
from test_decoder import INIT, hf_greedy, make_prompt
from transformers import DynamicCache

import toolkit
from toolkit.recipe import GenerationSpec
from toolkit.engine.rows import Row
from toolkit.speculative.drafters import DraftModel
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.stats import GenerationStats

SLOW_VERIFY = [1000.0] * 256  # a verify forward costs far more than a draft step: every round drafts K


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(seed=0, **INIT)
    batch = prompts(7)
    return target, perturbed_copy(target, scale=0.05), batch, [hf_greedy(target, p, 24) for p in batch]


def test_every_row_equals_its_prompt_alone_with_a_draft_model(setup):
    target, draft, batch, alone = setup
    per_round = {}
    for threshold in (None, 0.6):
        decoder = batch_decoder(target, DraftModel(draft, confidence_threshold=threshold),
                                VerifyCost(list(SLOW_VERIFY), learn=False), num_draft_tokens=5, batch_size=3)
        rows = decoder.decode_batch(batch, GenerationSpec(max_new_tokens=24, ignore_eos=True))
        for (ids, stats), ref in zip(rows, alone):  # 7 prompts through 3 slots: rows leave and join
            assert ids == ref
            assert stats.new_tokens == 24 and stats.committed == stats.accepted + stats.rounds
            assert 0 < stats.accepted < stats.drafted  # the perturbed draft is right often, not always
            assert stats.draft_forwards >= stats.rounds  # its prefill, then one per drafted step
        per_round[threshold] = sum(s.drafted for _, s in rows) / sum(s.rounds for _, s in rows)
    assert per_round[None] > 4.0 > per_round[0.6]  # K = 5 but near the token limit; low confidence stops early


def test_each_row_drafts_as_the_single_sequence_draft_model(setup):
    """Drafting free and every draft verified (K = 5), each row drafts and accepts exactly what the single-sequence
    draft-model drafter does with K = 5: its draft cache after ragged rounds is its committed prefix."""
    from test_decoder import speculate

    from toolkit.engine.planner import ConstantK

    class FreeSteps(DraftModel):
        def step_ms(self, rows: int) -> float:
            return 0.0

    target, draft, batch, alone = setup
    singles = [speculate(target, DraftModel(draft), p, ConstantK(5), max_new_tokens=24) for p in batch]
    decoder = batch_decoder(target, FreeSteps(draft), VerifyCost([1.0] * 256, learn=False), num_draft_tokens=5,
                            batch_size=3)
    rows = decoder.decode_batch(batch, GenerationSpec(max_new_tokens=24, ignore_eos=True))
    for (ids, stats), (ref, ref_stats, _) in zip(rows, singles):
        assert ids == ref
        assert (stats.drafted, stats.accepted) == (ref_stats.drafted, ref_stats.accepted)


def test_the_target_as_its_own_draft_is_always_accepted(setup):
    """The draft cache after ragged rounds holds exactly each row's committed tokens: with the target's own weights
    as draft, every drafted token is the target's (one stale or missing entry would change a proposal)."""
    target, _, batch, alone = setup
    decoder = batch_decoder(target, DraftModel(target), VerifyCost(list(SLOW_VERIFY), learn=False),
                            num_draft_tokens=4, batch_size=4)
    rows = decoder.decode_batch(batch, GenerationSpec(max_new_tokens=24, ignore_eos=True))
    for (ids, stats), ref in zip(rows, alone):
        assert ids == ref and stats.accepted == stats.drafted > 0


def test_draft_cache_rolls_back_to_each_rows_committed_prefix(setup):
    _, draft, batch, _ = setup
    drafter = DraftModel(draft)
    drafter.start(3, 256, 8, GenerationSpec())
    rows = []
    with drafter.attached():
        for i, p in enumerate(batch[:3]):
            ids = p[0].tolist()
            rows.append(Row(i, len(ids), ids + [7], GenerationStats(), None, 0.0, [7]))
            drafter.join(rows[-1])  # its prompt prefilled into the draft's static cache
        drafter.propose_rows(rows, [4, 2, 4])  # row 1 keeps 2 proposals of the 4 steps drafted
        assert [len(r.proposal) for r in rows] == [4, 2, 4]
        accepted = [3, 2, 0]
        drafter.commit_rows(rows, accepted)
        for row, a in zip(rows, accepted):
            row.ids += row.proposal[:a] + [5]  # the target's correction / bonus token
        # held: the old ids, plus the accepted drafts that were fed back (at most steps - 1 = 3)
        held = [len(r.ids) - 1 - a + min(a, 3) for r, a in zip(rows, accepted)]
        assert drafter.cache.lengths[:3].tolist() == held == drafter.cache.held
        layer = drafter.cache.layers[0]
        for r, row in enumerate(rows):
            fresh = DynamicCache()
            with torch.no_grad():
                hf_forward(draft, input_ids=torch.tensor([row.ids[:held[r]]]), past_key_values=fresh, use_cache=True)
            torch.testing.assert_close(layer.keys[r, :, :held[r]], fresh.layers[0].keys[0], rtol=1e-4, atol=1e-5)
        drafter.propose_rows(rows, [2, 2, 2])  # the catch-up feeds each row its missing 1 or 2 tokens
        assert drafter.cache.lengths[:3].tolist() == [len(r.ids) + 1 for r in rows]


def test_sampling_per_row_with_a_compiled_draft_model_follows_the_target():
    """Rows' tokens follow the target, and the draft's q enters the rejection sampling: a draft token is accepted
    with probability sum_x min(p(x), q(x)) (Leviathan et al.), not the sum_x p(x) q(x) of a one-hot verification
    (which is lossless too, so only the acceptance tells them apart). Target and draft both compiled on their static
    caches (dynamo's eager backend: the graphs the CPU compiles, without code generation)."""
    from scipy.stats import binomtest, chisquare

    from toolkit.engine.forward import TargetForward

    target = tiny_llama(seed=4, vocab=12, initializer_range=0.3)
    draft = tiny_llama(seed=9, vocab=12, initializer_range=0.3)
    forward = TargetForward(target, compile=True, backend="eager")
    draft_forward = TargetForward(draft, compile=True, backend="eager", name="draft")
    prompt = make_prompt(2, vocab=12, length=6)
    with torch.no_grad():  # the law of the 2nd token (the 1st from the prefill, the 2nd from a drafted round)
        p1 = target(prompt).logits[0, -1].softmax(-1).double()
        seq = torch.cat([prompt.expand(12, -1), torch.arange(12).view(-1, 1)], dim=1)
        p2_given = target(seq).logits[:, -1].softmax(-1).double()  # (first token, vocab)
        q2_given = draft(seq).logits[:, -1].softmax(-1).double()
    p2 = (p1[:, None] * p2_given).sum(0).numpy()
    alpha = float((p1 * torch.minimum(p2_given, q2_given).sum(-1)).sum())
    counts, accepted = np.zeros(12), 0
    for chunk in range(50):  # 400 rows, 8 per forward, every row its own seeds
        gen = GenerationSpec(max_new_tokens=3, do_sample=True, ignore_eos=True, seed=chunk * 8)  # room for 1 draft
        drafter = DraftModel(draft, do_sample=True, seed=gen.seed, forward=draft_forward)
        decoder = batch_decoder(target, drafter, VerifyCost(list(SLOW_VERIFY), learn=False), num_draft_tokens=1,
                                batch_size=8, forward=forward)
        for ids, stats in decoder.decode_batch([prompt] * 8, gen):
            counts[ids[1]] += 1
            accepted += stats.accepted
            assert stats.drafted == 1
    assert chisquare(counts, p2 / p2.sum() * counts.sum()).pvalue > 0.01
    assert binomtest(accepted, 400, alpha).pvalue > 0.001
    assert draft_forward.compile_s and forward.compile_s  # the compiled graphs ran


def test_generate_batch_runs_draft_model_recipes_batched(setup):
    target, draft, batch, alone = setup
    recipe = toolkit.Recipe.from_dict({"name": "draft-batch", "target": {"device": "cpu"}, "draft": {"device": "cpu"},
                                       "spec": {"drafter": "draft_model", "num_draft_tokens": 4},
                                       "generation": {"max_new_tokens": 24, "ignore_eos": True}})
    generator = toolkit.build(recipe, target=target, tokenizer=None, draft_model=draft)
    assert generator.batchable
    rows = generator.generate_batch(batch[:4], batch_size=4)
    assert [r.token_ids for r in rows] == alone[:4]


def test_batched_calls_learn_the_draft_acceptance_together(setup):
    """What a batch draft model's acceptance taught one batched call (how many tokens are worth drafting) is where the
    next call starts, as the planner's calibration is; ``forget`` drops both."""
    target, draft, batch, alone = setup
    recipe = toolkit.Recipe.from_dict({"name": "draft-batch-cost", "target": {"device": "cpu"},
                                       "draft": {"device": "cpu"},
                                       "spec": {"drafter": "draft_model", "num_draft_tokens": 4, "adaptive": "cost"},
                                       "generation": {"max_new_tokens": 24, "ignore_eos": True}})
    lm = toolkit.build(recipe, target=target, tokenizer=None, draft_model=draft)
    assert [r.token_ids for r in lm.generate_batch(batch[:4], batch_size=4)] == alone[:4]
    first = lm.draft_acceptance.decisions
    assert first > 0
    assert [r.token_ids for r in lm.generate_batch(batch[:4], batch_size=4)] == alone[:4]
    assert lm.draft_acceptance.decisions > first
    lm.forget()
    assert lm.draft_acceptance.decisions == 0


def test_a_compressed_draft_cache_batches_too(setup):
    """Every draft KV policy has a static form, so a draft model whose cache evicts (L2-norm, compacted at commit
    points between catch-up chunks) drafts for a whole batch; the output is still each prompt's greedy text."""
    target, draft, batch, alone = setup
    recipe = toolkit.Recipe.from_dict({"name": "draft-batch-l2", "target": {"device": "cpu"}, "draft": {"device": "cpu"},
                                       "draft_kv": {"policy": "l2norm", "budget": 12, "sink_tokens": 2,
                                                    "protect_recent": 4, "compress_interval": 4, "skip_layers": []},
                                       "spec": {"drafter": "draft_model", "num_draft_tokens": 4},
                                       "generation": {"max_new_tokens": 24, "ignore_eos": True}})
    generator = toolkit.build(recipe, target=target, tokenizer=None, draft_model=draft)
    assert generator.batchable and generator.capabilities.draft_static is None
    rows = generator.generate_batch(batch[:4], batch_size=4)
    assert [r.token_ids for r in rows] == alone[:4]
    assert sum(r.stats.accepted for r in rows) > 0 and all(r.stats.compressions_draft > 0 for r in rows)

"""Hand-built logits for the accept/reject rules of toolkit/speculative/verify.py (deterministic cases)."""

from __future__ import annotations

import pytest
import torch

from toolkit.speculative.verify import greedy_accept, process_logits, speculative_sample

VOCAB = 6


def one_hot_logits(tokens: list[int], vocab: int = VOCAB, high: float = 5.0) -> torch.Tensor:
    """Logits ``(len(tokens), vocab)`` whose argmax in row i is ``tokens[i]``."""
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = high
    return logits


# ------------------------------------------------------------------------------------------------------ greedy
def test_greedy_all_accepted_bonus_is_argmax_of_last_row():
    draft = torch.tensor([3, 1, 4])
    logits = one_hot_logits([3, 1, 4, 5])
    num_accepted, next_token = greedy_accept(draft, logits)
    assert int(num_accepted) == 3
    assert int(next_token) == 5  # bonus = argmax of row K


@pytest.mark.parametrize("reject_at", [0, 1, 2, 3])
def test_greedy_rejection_at_position_j(reject_at):
    target = [2, 0, 5, 1, 3]  # argmax per row, K = 4
    draft = torch.tensor(target[:4])
    draft[reject_at] = (draft[reject_at] + 1) % VOCAB  # the draft disagrees at position j only
    num_accepted, next_token = greedy_accept(draft, one_hot_logits(target))
    assert int(num_accepted) == reject_at
    assert int(next_token) == target[reject_at]  # the target's correction at the first mismatch


def test_greedy_later_match_after_mismatch_is_not_accepted():
    target = [2, 0, 5]
    draft = torch.tensor([2, 4, 5])  # position 2 matches again but comes after a rejection
    num_accepted, next_token = greedy_accept(draft, one_hot_logits(target))
    assert int(num_accepted) == 1
    assert int(next_token) == 0


def test_greedy_zero_draft_tokens_is_a_plain_step():
    num_accepted, next_token = greedy_accept(torch.empty(0, dtype=torch.long), one_hot_logits([4]))
    assert int(num_accepted) == 0 and int(next_token) == 4


# ------------------------------------------------------------------------------------------------------ sampling
def random_probs(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g).mul(1.5).softmax(-1)


def test_speculative_sample_p_equals_q_accepts_everything():
    K = 4
    p = random_probs(K + 1, seed=1)
    g = torch.Generator().manual_seed(0)
    bonus_counts = torch.zeros(VOCAB)
    for trial in range(200):
        draft = torch.multinomial(p[:K], 1, generator=g).squeeze(-1)
        num_accepted, next_token = speculative_sample(draft, p[:K].clone(), p, generator=g)
        assert int(num_accepted) == K  # p(x)/q(x) = 1 -> always accepted
        bonus_counts[int(next_token)] += 1
    # the bonus token is drawn from p's last row: its most likely token must be the most frequent
    assert int(bonus_counts.argmax()) == int(p[K].argmax())


@pytest.mark.parametrize("reject_at", [0, 1, 2])
def test_speculative_sample_rejects_where_p_has_no_mass(reject_at):
    K = 3
    p = random_probs(K + 1, seed=2)
    q = random_probs(K, seed=3)
    draft = torch.multinomial(p[:K], 1, generator=torch.Generator().manual_seed(4)).squeeze(-1)
    bad = int((draft[reject_at] + 1) % VOCAB)
    draft[reject_at] = bad
    p[reject_at, bad] = 0.0  # the target never emits the draft's token here
    p[reject_at] /= p[reject_at].sum()
    q[:reject_at] = p[:reject_at]  # earlier positions: q == p, always accepted
    q[reject_at, bad] = 0.9  # the draft puts mass where p has none
    q[reject_at] /= q[reject_at].sum()
    for seed in range(50):
        num_accepted, next_token = speculative_sample(draft, q, p, generator=torch.Generator().manual_seed(seed))
        assert int(num_accepted) == reject_at
        assert int(next_token) != bad  # the correction comes from max(0, p - q), where `bad` has no mass
        residual = (p[reject_at] - q[reject_at]).clamp_min(0)
        assert residual[int(next_token)] > 0


def test_speculative_sample_residual_distribution():
    """On rejection at position 0 the committed token follows norm(max(0, p - q)), not p."""
    p = torch.tensor([[0.40, 0.30, 0.20, 0.10, 0.00, 0.00], [1 / 6] * 6])
    q = torch.tensor([[0.00, 0.10, 0.30, 0.10, 0.50, 0.00]])
    draft = torch.tensor([4])  # p(4) = 0 -> always rejected
    expected = (p[0] - q[0]).clamp_min(0)
    expected /= expected.sum()  # [0.4, 0.2, 0, 0, 0, 0] / 0.6
    g = torch.Generator().manual_seed(123)
    n = 6000
    counts = torch.zeros(6)
    for _ in range(n):
        num_accepted, next_token = speculative_sample(draft, q, p, generator=g)
        assert int(num_accepted) == 0
        counts[int(next_token)] += 1
    freq = counts / n
    assert counts[2:].sum() == 0  # tokens where q >= p never come from the residual
    assert torch.allclose(freq, expected, atol=0.025), (freq, expected)
    assert abs(freq[0] - p[0, 0]) > 0.15  # distinguishable from sampling p itself (0.40 vs 0.667)


def test_speculative_sample_deterministic_draft_is_one_hot_q():
    """draft_probs=None (n-gram drafter): accept with probability p(x), else sample norm(p minus x)."""
    p = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    draft = torch.tensor([1])
    g = torch.Generator().manual_seed(7)
    accepted = 0
    n = 4000
    for _ in range(n):
        num_accepted, next_token = speculative_sample(draft, None, p, generator=g)
        if int(num_accepted) == 1:
            accepted += 1
            assert int(next_token) == 3  # bonus from p's last row (one-hot at 3)
        else:
            assert int(next_token) == 0  # residual max(0, p - onehot(1)) is all on token 0
    assert abs(accepted / n - 0.75) < 0.03


def test_speculative_sample_is_reproducible_under_a_seed():
    p = random_probs(4, seed=5)
    q = random_probs(3, seed=6)
    draft = torch.tensor([0, 1, 2])
    runs = [[tuple(map(int, speculative_sample(draft, q, p, generator=g)))
             for _ in range(30)] for g in (torch.Generator().manual_seed(9), torch.Generator().manual_seed(9))]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------------------ processing
def test_process_logits_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    full = process_logits(logits)
    assert torch.allclose(full, logits.softmax(-1))
    top2 = process_logits(logits, top_k=2)
    assert (top2[0, 2:] == 0).all() and torch.allclose(top2.sum(), torch.tensor(1.0))
    # top-p: the smallest set of most likely tokens reaching the mass (0.64 for token 0 alone)
    assert (process_logits(logits, top_p=0.5)[0, 1:] == 0).all()
    kept = process_logits(logits, top_p=0.9)[0]
    assert (kept[:3] > 0).all() and (kept[3:] == 0).all()  # 0.64 + 0.24 = 0.88 < 0.9 -> a third token
    cold = process_logits(logits, temperature=0.5)
    assert cold[0, 0] > full[0, 0]


# ------------------------------------------------------------------------------------------------ batched greedy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batched_greedy_accept_on_host_matches_a_plain_reading(dtype):
    """The decoder's batched greedy acceptance on CPU logits (NumPy's argmax and prefix count) against the rule read
    row by row in Python: the first maximal index (logits with ties on purpose), the agreeing prefix of each row's
    own drafts only (padding after them never accepted), then the target's token after that prefix."""
    from types import SimpleNamespace

    from toolkit.engine.accept import accept, greedy

    g = torch.Generator().manual_seed(0)
    gen = SimpleNamespace(do_sample=False)
    for case in range(200):
        rows, width = 1 + case % 4, 1 + case % 6
        logits = torch.randint(0, 3, (rows, width, VOCAB), generator=g).to(dtype)  # many ties
        best = [[max(range(VOCAB), key=lambda v: (float(logits[r, i, v]), -v)) for i in range(width)]
                for r in range(rows)]
        assert greedy(logits).tolist() == best
        drafted = torch.randint(0, width, (rows,), generator=g)
        inputs = torch.randint(0, VOCAB, (rows, width), generator=g)
        for r in range(rows):  # drafts that agree for a while, then maybe not
            agree = int(torch.randint(0, width, (), generator=g))
            inputs[r, 1:1 + agree] = torch.tensor(best[r][:agree], dtype=torch.long)
        result = accept(logits, inputs, drafted, drafted.tolist(), gen, [None] * rows)
        assert result.dtype == torch.long and result.shape == (rows, 2)
        for r in range(rows):
            kept = 0
            while kept < int(drafted[r]) and int(inputs[r, kept + 1]) == best[r][kept]:
                kept += 1
            assert result[r].tolist() == [kept, best[r][kept]]

"""Statistical equivalence: speculative sampling commits tokens distributed exactly as the target's samples.

Toy model: a first-order Markov chain over a small vocabulary. The target's next-token distribution after token s is
``P[s]`` and the draft's is ``Q[s]`` (random, deliberately different). A "sequence" starts after state ``s0``; each
round drafts K tokens from Q (batched ahead of time for speed: the draft tokens are i.i.d. given the chain, so drawing
them from a table is exactly what a draft model would do), then the REAL ``speculative_sample`` decides acceptance
and the next token. Rounds repeat until two tokens are committed. Under lossless sampling, token 1 ~ P[s0] and
(token 1, token 2) ~ P[s0][x1] * P[x1][x2]; a chi-square goodness-of-fit test must not reject that (p > 0.01), while
the same test must reject deliberately wrong samplers (p < 1e-6).

Cost: a Python loop costs ~0.4 ms per sequence on 2 CPU cores (40 s for 1e5), so the 1e5 draws call the real
function batched with ``torch.vmap`` (~4 s); a 5e3-sequence per-call loop with a seeded generator cross-checks it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from toolkit.speculative.verify import speculative_sample

VOCAB = 8
K = 2
N = 100_000
S0 = 0


@pytest.fixture(scope="module")
def chain():
    g = torch.Generator().manual_seed(2024)
    P = torch.randn(VOCAB, VOCAB, generator=g).softmax(-1)
    Q = torch.randn(VOCAB, VOCAB, generator=g).softmax(-1)
    return P, Q


def draft_rows(prev: torch.Tensor, draft: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows ``table[context]`` for each draft position: the state before d_1 is ``prev``, before d_i it is d_{i-1}."""
    states = torch.cat([prev.view(1), draft[:-1]])
    return table[states]


def draft_paths(Q: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """``(n, V, K)``: for every sequence and every possible start state s, a K-token path of the draft chain from s.

    Vectorized inverse-CDF sampling; each sequence later uses the path of its actual start state only, so every
    used path is an independent draw from the draft chain.
    """
    cq = Q.cumsum(-1)
    cq[:, -1] = 1.0 + 1e-6  # guard the last bucket against rounding
    uniforms = torch.rand(n, VOCAB, K, generator=g)
    state = torch.arange(VOCAB).expand(n, VOCAB)
    path = []
    for j in range(K):
        u = uniforms[:, :, j:j + 1]
        state = (u > cq[state]).sum(-1)  # first index whose cumulative mass exceeds u
        path.append(state)
    return torch.stack(path, dim=-1)


def run_sequences(P, Q, n: int, sampler, seed: int = 0) -> np.ndarray:
    """First two committed tokens of ``n`` speculative sequences, one ``sampler`` call per round.

    ``sampler`` has speculative_sample's signature; it is called once per round of every sequence, in a Python
    loop with a seeded ``torch.Generator`` (the real call path of the decoder).
    """
    g = torch.Generator().manual_seed(seed)
    paths = [draft_paths(Q, n, g), draft_paths(Q, n, g)]  # round 1, round 2
    out = np.empty((n, 2), dtype=np.int64)
    for i in range(n):
        committed: list[int] = []
        state = S0
        for rnd in range(2):
            draft = paths[rnd][i, state]  # (K,)
            states = torch.cat([draft.new_tensor([state]), draft])
            num_accepted, next_token = sampler(draft, Q[states[:-1]], P[states], g)
            a = int(num_accepted)
            committed.extend(draft[:a].tolist() + [int(next_token)])
            if len(committed) >= 2:
                break
            state = committed[-1]
        out[i] = committed[:2]
    return out


def run_sequences_batched(P, Q, n: int, sampler, seed: int = 0) -> np.ndarray:
    """Same process as :func:`run_sequences`, with ``sampler`` batched over sequences by ``torch.vmap``.

    vmap runs the real function's ops on a batch dimension (``randomness="different"``: independent draws per
    sequence, from the global RNG seeded here). Round 2 runs only for the sequences whose round 1 committed a single
    token (a rejection at position 0).
    """
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    batched = torch.vmap(lambda d, q, p: sampler(d, q, p, None), randomness="different")
    out = np.empty((n, 2), dtype=np.int64)
    for start in range(0, n, 25_000):
        m = min(25_000, n - start)
        paths = [draft_paths(Q, m, g), draft_paths(Q, m, g)]
        draft = paths[0][:, S0]  # (m, K)
        states = torch.cat([torch.full((m, 1), S0), draft], dim=1)
        a, nxt = batched(draft, Q[states[:, :-1]], P[states])
        first = torch.where(a >= 1, draft[:, 0], nxt)
        second = torch.where(a >= 2, draft[:, 1], nxt)  # a == 1: the token after d_1 is the round's next token
        redo = (a == 0).nonzero().squeeze(-1)
        if redo.numel():
            s1 = nxt[redo]
            draft2 = paths[1][redo, s1]
            states2 = torch.cat([s1.view(-1, 1), draft2], dim=1)
            a2, nxt2 = batched(draft2, Q[states2[:, :-1]], P[states2])
            second[redo] = torch.where(a2 >= 1, draft2[:, 0], nxt2)
        out[start:start + m, 0] = first.numpy()
        out[start:start + m, 1] = second.numpy()
    return out


def chisquare_p(observed_counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square goodness of fit, merging cells whose expected count is < 5 into one cell."""
    n = observed_counts.sum()
    expected = expected_probs * n
    small = expected < 5
    if small.any():
        observed_counts = np.append(observed_counts[~small], observed_counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(chisquare(observed_counts, expected).pvalue)


def first_and_joint_pvalues(tokens: np.ndarray, P: torch.Tensor) -> tuple[float, float]:
    Pn = P.double().numpy()
    p_first = Pn[S0] / Pn[S0].sum()
    first_counts = np.bincount(tokens[:, 0], minlength=VOCAB)
    joint = (p_first[:, None] * Pn / Pn.sum(-1, keepdims=True)).reshape(-1)
    joint_counts = np.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB)
    return chisquare_p(first_counts, p_first), chisquare_p(joint_counts, joint / joint.sum())


# ------------------------------------------------------------------------------------------------- wrong samplers
def always_accept(draft_tokens, draft_probs, target_probs, generator):
    """Bug: every draft token accepted -> the committed tokens follow q, not p (real function, p replaced by q)."""
    fake_p = torch.cat([draft_probs, target_probs[-1:]], dim=0)
    return speculative_sample(draft_tokens, draft_probs, fake_p, generator)


def resample_from_p(draft_tokens, draft_probs, target_probs, generator):
    """Bug: the right acceptance test, but on rejection sample from p instead of norm(max(0, p - q))."""
    num_accepted, _ = speculative_sample(draft_tokens, draft_probs, target_probs, generator)
    next_token = torch.multinomial(target_probs[num_accepted], 1, generator=generator)[0]
    return num_accepted, next_token


# ------------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def correct_tokens(chain):
    P, Q = chain
    return run_sequences_batched(P, Q, N, speculative_sample, seed=1)


def test_draft_and_target_differ_enough(chain):
    P, Q = chain
    tv = 0.5 * (P[S0] - Q[S0]).abs().sum()
    assert tv > 0.2  # otherwise the test could not tell p from q


def test_rejections_and_acceptances_both_happen(chain):
    P, Q = chain
    g = torch.Generator().manual_seed(5)
    accepted = []
    for _ in range(500):
        draft = torch.multinomial(Q[S0], 1, generator=g)
        draft = torch.cat([draft, torch.multinomial(Q[int(draft)], 1, generator=g)])
        states = torch.tensor([S0, int(draft[0]), int(draft[1])])
        a, _ = speculative_sample(draft, Q[states[:-1]], P[states], g)
        accepted.append(int(a))
    assert 0 in accepted and K in accepted


def test_first_token_and_joint_match_target(chain, correct_tokens):
    P, _ = chain
    assert len(correct_tokens) >= 100_000
    p_first, p_joint = first_and_joint_pvalues(correct_tokens, P)
    assert p_first > 0.01, p_first
    assert p_joint > 0.01, p_joint


def test_per_call_loop_with_generator_matches_target(chain):
    """The decoder's own call path (one call per round, seeded torch.Generator), fewer draws."""
    P, Q = chain
    tokens = run_sequences(P, Q, 5_000, speculative_sample, seed=4)
    p_first, p_joint = first_and_joint_pvalues(tokens, P)
    assert p_first > 0.01 and p_joint > 0.01, (p_first, p_joint)


@pytest.mark.parametrize("wrong", [always_accept, resample_from_p], ids=["always_accept", "resample_from_p"])
def test_chisquare_detects_a_wrong_sampler(chain, wrong):
    P, Q = chain
    tokens = run_sequences_batched(P, Q, 50_000, wrong, seed=2)
    p_first, p_joint = first_and_joint_pvalues(tokens, P)
    assert p_first < 1e-6 and p_joint < 1e-6, (p_first, p_joint)


def test_always_accept_follows_the_draft(chain):
    """Sanity check of the wrong sampler itself: its first token follows q, so the harness measures what it claims."""
    P, Q = chain
    tokens = run_sequences_batched(P, Q, 20_000, always_accept, seed=6)
    q_first = Q[S0].double().numpy()
    assert chisquare_p(np.bincount(tokens[:, 0], minlength=VOCAB), q_first / q_first.sum()) > 0.01

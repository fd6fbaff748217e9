"""Lossless sampling over a token tree (toolkit/speculative/tree_verify.py): chi-square tests on a toy vocabulary.

A toy target over V = 6 tokens: p(x1) and p(x2 | x1) fixed random tables. Each draw runs one tree round from the
root (the first committed token) and reads the first two output tokens (when the round commits only one, the
second comes from the target itself, as the next round would). Their joint distribution must be p(x1) p(x2 | x1)
over all 36 cells (chi-square, 1.6 x 10^4 draws), for

* a deterministic tree (one-hot drafts: top-k children, suffix continuations);
* a tree whose root children are drawn *without replacement* from a draft q (Jeon et al. 2024) and whose second
  level children i.i.d. from q (SpecInfer), with the matching ``draft_probs`` rows.

A sampler with a planted bug (no residual after a rejection: the next sibling is judged against p itself) must be
rejected by the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from toolkit.speculative import tree_verify
from toolkit.speculative.tree import TokenTree
from toolkit.speculative.tree_verify import tree_speculative_sample

V = 6
DRAWS = 16_000  # a walk is ~0.6 ms of tensor operations (no host read): 16k draws ~10 s


@pytest.fixture(scope="module")
def tables():
    g = torch.Generator().manual_seed(0)
    p1 = torch.softmax(torch.randn(V, generator=g) * 1.2, -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 1.2, -1)  # p2[x1] = p(x2 | x1)
    p3 = torch.softmax(torch.randn(V, V, V, generator=g) * 1.2, -1)
    q1 = torch.softmax(torch.randn(V, generator=g), -1)
    q2 = torch.softmax(torch.randn(V, V, generator=g), -1)
    return p1, p2, p3, q1, q2


def target_rows(tree: TokenTree, p1, p2, p3) -> torch.Tensor:
    rows = [p1]
    tokens, parents = tree.token_list(), tree.parent_list()
    for i, parent in enumerate(parents):
        rows.append(p2[tokens[i]] if parent < 0 else p3[tokens[parent], tokens[i]])
    return torch.stack(rows)


def first_two(path_tokens: list[int], nxt: int, p2, rng: np.random.Generator) -> tuple[int, int]:
    """``p2``: the rows of p(x2 | x1) as float64 numpy arrays summing to 1."""
    out = path_tokens + [nxt]
    if len(out) == 1:
        out.append(int(rng.choice(V, p=p2[out[0]])))
    return out[0], out[1]


def deterministic_tree() -> TokenTree:
    # root children 0, 2, 4; below 0: 1, 3; below 2: 5
    return TokenTree(torch.tensor([0, 2, 4, 1, 3, 5]), torch.tensor([-1, -1, -1, 0, 0, 1]))


class StochasticTrees:
    """Trees of two root children drawn without replacement from q1 and two children drawn i.i.d. from q2[x] below
    the first one, with the matching ``draft_probs`` rows. The draws' tokens are sampled up front in one vectorized
    pass (inverse CDF, an RNG stream of their own, independent of the sampler's); each call returns the next tree."""

    def __init__(self, q1, q2, draws: int, seed: int = 3):
        rng = np.random.default_rng(seed)
        rest = q1.expand(V, V).clone()  # rest[x]: q1 without x, renormalized (the second child's law)
        rest[torch.arange(V), torch.arange(V)] = 0
        rest = rest / rest.sum(-1, keepdim=True)
        self.probs = [torch.stack([q1, rest[x], q2[x], q2[x]]) for x in range(V)]

        def pick(probs: np.ndarray) -> np.ndarray:  # one token per row of probs (draws, V)
            cdf = np.cumsum(probs, -1)
            return np.minimum((rng.random(len(probs))[:, None] * cdf[:, -1:] >= cdf).sum(-1), V - 1)

        first = pick(np.broadcast_to(q1.double().numpy(), (draws, V)))
        second = pick(rest.double().numpy()[first])
        below = [pick(q2.double().numpy()[first]) for _ in range(2)]
        self.tokens = iter(np.stack([first, second, *below], 1).tolist())
        self.parents = torch.tensor([-1, -1, 0, 0])

    def __call__(self, q1, q2, g: torch.Generator) -> TokenTree:
        tokens = next(self.tokens)
        return TokenTree(torch.tensor(tokens), self.parents, draft_probs=self.probs[tokens[0]])


def walk(tree: TokenTree, rows: torch.Tensor, g: torch.Generator) -> tuple[list[int], int]:
    """The accepted path's node indices and the next token of one sampled walk (the round's one read)."""
    deepest, nxt = tree_speculative_sample(tree, rows, g).tolist()
    return tree.path_to(deepest - 1), nxt


def run(tables, make_tree, draws: int = DRAWS) -> np.ndarray:
    p1, p2, p3, q1, q2 = tables
    g = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(2)
    p2_rows = [row.double().numpy() / float(row.double().sum()) for row in p2]
    counts = np.zeros((V, V))
    rows_of = {}  # the target rows of each tree (a function of its tokens and parents), built once
    for _ in range(draws):
        tree = make_tree(q1, q2, g)
        tokens = tree.token_list()
        key = (tuple(tokens), tuple(tree.parent_list()))
        if key not in rows_of:
            rows_of[key] = target_rows(tree, p1, p2, p3)
        path, nxt = walk(tree, rows_of[key], g)
        a, b = first_two([tokens[i] for i in path], nxt, p2_rows, rng)
        counts[a, b] += 1
    return counts


def p_value(tables, counts: np.ndarray) -> float:
    p1, p2 = tables[0], tables[1]
    expected = (p1[:, None] * p2).double().numpy().ravel()
    expected = expected / expected.sum() * counts.sum()
    return float(chisquare(counts.ravel(), expected).pvalue)


@pytest.fixture(scope="module")
def det_tree():
    return deterministic_tree()


@pytest.mark.slow
@pytest.mark.heavy  # ~18 s; test_static_tree's sampling test runs tree rounds through the same acceptance
def test_deterministic_tree_sampling_is_lossless(tables, det_tree):
    counts = run(tables, lambda q1, q2, g: det_tree)
    assert p_value(tables, counts) > 1e-3


@pytest.mark.slow  # a new tree every draw
@pytest.mark.heavy  # ~14 s; as above
def test_stochastic_tree_sampling_is_lossless(tables):
    counts = run(tables, StochasticTrees(tables[3], tables[4], DRAWS))
    assert p_value(tables, counts) > 1e-3


@pytest.mark.slow
@pytest.mark.heavy  # ~6 s; the power check of the two above
def test_a_sampler_without_the_residual_is_detected(tables, det_tree, monkeypatch):
    monkeypatch.setattr(tree_verify, "residual", lambda p, q: p)
    counts = run(tables, lambda q1, q2, g: det_tree, draws=6_000)  # the bug's bias is large: 6k draws suffice
    assert p_value(tables, counts) < 1e-6


def test_identical_draft_accepts_the_first_child():
    """p == q at the root: the first root child is always accepted (acceptance probability 1)."""
    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(5)), -1)
    tree = TokenTree(torch.tensor([3, 1]), torch.tensor([-1, -1]), draft_probs=torch.stack([p, p]))
    g = torch.Generator().manual_seed(0)
    rows = torch.stack([p, p, p])
    for _ in range(200):
        path, _ = walk(tree, rows, g)
        assert path == [0]

"""Token trees: the candidates of one tree-speculation round, their attention mask and positions.

A token tree (SpecInfer, Miao et al. 2024; Medusa tree attention, Cai et al. 2024; EAGLE-2, Li et al. 2024) holds
``n`` draft nodes below the *root*, the last committed token. One target forward scores the root and every node
(``n + 1`` queries) under a tree attention mask: a node sees the committed cache, the root, its ancestors and
itself, never its siblings or cousins. Verification then accepts one root-to-node path
(:mod:`toolkit.engine.accept`, :mod:`toolkit.speculative.tree_verify`) and the caches keep exactly that path's
entries, gathered into place on the static cache (:mod:`toolkit.kv.static_tree`).

Conventions (the contract for every drafter's ``propose_tree``):

* node ``i`` (0-based) has token ``tokens[i]``, parent ``parents[i]`` (``-1`` = the root, i.e. a child of the last
  committed token; otherwise an index ``< i``: parents come before children) and ``depth[i]`` = ``1`` for children of
  the root, ``depth[parent] + 1`` below;
* the verify forward's query ``0`` is the root and query ``i + 1`` is node ``i``; the root sits at absolute position
  ``L = committed - 1`` (the cache's logical length: it holds every committed token but the last) and node ``i`` at
  ``L + depth[i]``;
* a chain of K tokens is the tree ``parents = [-1, 0, 1, ..., K - 2]``, ``depth = [1, ..., K]``;
* ``draft_probs`` (optional, ``(n, vocab)`` float): for sampling, row ``i`` is the distribution node ``i``'s token
  was drawn from *after* the generation's temperature / top-k / top-p processing, conditioned on the siblings
  listed before it (``q`` itself for i.i.d. siblings as in SpecInfer; ``q`` with the earlier siblings removed and
  renormalized for sampling without replacement). ``None`` = every token was chosen deterministically (top-k
  children, suffix-tree frequencies): verification then treats each node as a one-hot draft, which is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    """Draft candidates of one round as a tree below the last committed token (see the module docstring).

    Attributes:
        tokens: ``(n,)`` long, the node token ids.
        parents: ``(n,)`` long, parent index (``-1`` = root), ``parents[i] < i``.
        depth: ``(n,)`` long, ``1`` for root children; computed from ``parents`` when ``None``.
        draft_probs: ``(n, vocab)`` processed draft distributions, or ``None`` (deterministic proposal).

    Raises:
        ValueError: shapes disagree, a parent index is not ``< i`` / ``>= -1``, or ``depth`` contradicts ``parents``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    _parents: list[int] = field(init=False, repr=False)
    _tokens: list[int] = field(init=False, repr=False)
    _depth: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).view(-1)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).view(-1).cpu()
        n = self.tokens.shape[0]
        if self.parents.shape[0] != n:
            raise ValueError(f"parents has {self.parents.shape[0]} entries for {n} tokens")
        self._parents = self.parents.tolist()
        self._tokens = self.tokens.tolist()
        depth = []
        for i, p in enumerate(self._parents):
            if not -1 <= p < i:
                raise ValueError(f"parents[{i}] = {p}: a parent must be -1 (the root) or an earlier node (< {i})")
            depth.append(1 if p < 0 else depth[p] + 1)
        if self.depth is not None:
            given = torch.as_tensor(self.depth, dtype=torch.long).view(-1).tolist()
            if given != depth:
                raise ValueError(f"depth {given} contradicts parents (expected {depth})")
        self._depth = depth
        self.depth = torch.tensor(depth, dtype=torch.long)
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for {n} nodes")

    @classmethod
    def chain(cls, tokens, draft_probs: torch.Tensor | None = None) -> TokenTree:
        """The linear draft ``tokens`` ``(K,)`` as a tree (each node the child of the one before)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).view(-1)
        return cls(tokens, torch.arange(-1, tokens.shape[0] - 1), draft_probs=draft_probs)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def max_depth(self) -> int:
        return max(self._depth, default=0)

    def token_list(self) -> list[int]:
        return self._tokens

    def parent_list(self) -> list[int]:
        return self._parents

    def depth_list(self) -> list[int]:
        return self._depth

    def children(self) -> dict[int, list[int]]:
        """``{node: [child indices in order]}`` with ``-1`` for the root."""
        out: dict[int, list[int]] = {-1: []}
        for i, p in enumerate(self._parents):
            out.setdefault(p, []).append(i)
            out.setdefault(i, [])
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (``[]`` for ``node = -1``)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self._parents[node]
        return path[::-1]

    def mask_rows(self) -> list[list[int]]:
        """The tree attention mask over ``[root, nodes]`` as host lists of 0 / 1 (``(n + 1) x (n + 1)``): row ``r``
        (query ``r``) sees column ``c`` iff ``c`` is ``r`` itself or one of its ancestors (the root included). The
        committed cache before the root is visible to every query and is not part of this mask."""
        rows = [[1] + [0] * len(self)]
        for i, p in enumerate(self._parents):
            rows.append(rows[p + 1][:])
            rows[-1][i + 1] = 1
        return rows

    def mask(self, device=None) -> torch.Tensor:
        """:meth:`mask_rows` as a boolean ``(n + 1, n + 1)`` tensor (True = attend)."""
        return torch.tensor(self.mask_rows(), dtype=torch.bool, device=device)


@dataclass(frozen=True)
class TreeShape:
    """Size limits of a draft tree (EAGLE-2's dynamic tree, Li et al. 2024).

    Attributes:
        budget: most nodes per tree (the target verifies ``budget + 1`` tokens per round).
        depth: most tokens on a root-to-leaf path (the most draft tokens one round can accept).
        topk: children considered per expanded node, and nodes expanded per level (model drafters).
    """

    budget: int = 16
    depth: int = 5
    topk: int = 4

"""The drafter contract: the :class:`DrafterProtocol` / :class:`TreeDrafterProtocol` the decode loop relies on, and a
:class:`Drafter` base class with the stateless defaults.

The decode loop calls, per generation::

    reset()                                    once, before the prefill (install hooks, empty caches)
    propose(input_ids, K) -> (tokens, logits)  per round: input_ids (1, n) = every committed token, prompt included;
                                               tokens (1, k) with 0 <= k <= K; logits (k, vocab) raw draft logits
                                               (processed by the verifier like the target's) or None (deterministic
                                               drafter: a one-hot q under sampling)
    propose_row(ids, K) -> (tokens, logits)    what the decode loop calls instead: the same on host lists (ids: the
                                               row's committed tokens, read-only; tokens: a list). Default: propose on
                                               a tensor of ids; a :class:`HostDrafter` implements it natively
    confidence() -> [p_1..p_k] | None          after propose: the drafter's estimate of P(token i accepted | tokens
                                               1..i-1 accepted); the loop calibrates it and picks the verify length
    commit(num_accepted)                       after verification of the first k' <= k tokens: roll back the rest
    propose_tree / commit_tree                 tree drafters, when the recipe sets spec.tree
    close()                                    once, in a finally: remove what reset installed on shared models

and reads ``forwards`` (draft model forwards since ``reset``) and ``cache`` (the drafter's KV cache, whose bytes are
reported, or ``None``). ``tests/test_drafter_contract.py`` checks every registered drafter against these protocols.

A :class:`Drafter` is also the decoder's row drafter (:class:`~toolkit.speculative.drafters.rows.RowDrafter`) of one
row: its base class serves the row protocol through :class:`~toolkit.speculative.drafters.rows.RowDrafters` over
itself, so one instance decodes one request at a time; a batch gives every row its own instance (``RowDrafters``
with a maker).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class DrafterProtocol(Protocol):
    forwards: int

    @property
    def cache(self) -> Any: ...

    def reset(self) -> None: ...

    def propose(self, input_ids: torch.Tensor, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def confidence(self) -> list[float] | None: ...

    def commit(self, num_accepted: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class TreeDrafterProtocol(DrafterProtocol, Protocol):
    def propose_tree(self, input_ids: torch.Tensor, budget: int, depth: int, topk: int): ...

    def commit_tree(self, accepted_nodes: list[int]) -> None: ...


class Drafter:
    """Base class: a drafter with no state, no cache and no confidence estimate. Subclasses implement
    :meth:`propose` (and may override the rest)."""

    #: model forwards run by this drafter since the last reset (0 for model-free drafters)
    forwards: int = 0
    #: the drafter's KV cache (``None``: it keeps none)
    cache: Any = None

    def reset(self) -> None:
        self.forwards = 0

    def propose(self, input_ids: torch.Tensor, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def propose_row(self, ids: list[int], num_draft_tokens: int) -> tuple[list[int], torch.Tensor | None]:
        """:meth:`propose` for the decode loop, on a row's committed token ids as a host list (read-only: the loop
        keeps appending to it): ``(tokens, logits)`` with ``tokens`` a list of at most ``num_draft_tokens`` ids.
        Here through :meth:`propose` on a ``(1, n)`` tensor of ``ids``."""
        from toolkit.speculative.drafters.rows import ids_tensor

        tokens, logits = self.propose(ids_tensor(ids), num_draft_tokens)
        return tokens[0].tolist(), logits

    def confidence(self) -> list[float] | None:
        """Per-token acceptance estimates of the last proposal (``None``: no estimate)."""
        return None

    def commit(self, num_accepted: int) -> None:
        pass

    def close(self) -> None:
        """Release what ``reset`` set up on shared objects (e.g. hooks on the target); called once per generation."""

    # ---------------------------------------------------------------------- the row protocol, for one row
    features: tuple[int, ...] = ()
    compile_ms = 0.0
    #: an instance serves one row (a batch gives each row its own: RowDrafters)
    batches = False
    device_proposals = None

    @property
    def trees(self) -> bool:
        return isinstance(self, TreeDrafterProtocol)

    @property
    def _rows(self):
        rows = self.__dict__.get("_row_protocol")
        if rows is None:
            from toolkit.speculative.drafters.rows import RowDrafters

            rows = self.__dict__["_row_protocol"] = RowDrafters(lambda: self)
        return rows

    def start(self, rows: int, capacity: int, widest: int, gen, tree=None) -> None:
        """A call of at most ``rows`` rows. Raises ValueError for more than one: an instance drafts one request at a
        time (a batch takes ``RowDrafters(maker)``)."""
        if rows > 1:
            raise ValueError("batch_size: a single drafter instance decodes one sequence at a time (pass "
                             "RowDrafters(lambda: drafter) with a maker for batches)")
        self._rows.start(rows, capacity, widest, gen)

    def begin(self, row) -> None:
        self._rows.begin(row)

    def join(self, row, features=None) -> None:
        pass

    def remove(self, keep: list[int]) -> None:
        pass

    def step_ms(self, rows: int) -> float | None:
        return None

    def attached(self):
        return self._rows.attached()

    def draft_cache(self, row):
        return self.cache

    def propose_rows(self, rows: list, num_draft_tokens: list[int], read: bool = True) -> None:
        self._rows.propose_rows(rows, num_draft_tokens)

    def commit_rows(self, rows: list, accepted: list[int], features=None) -> None:
        self._rows.commit_rows(rows, accepted)

    def propose_tree_row(self, row, budget: int, depth: int, topk: int):
        return self._rows.propose_tree_row(row, budget, depth, topk)

    def commit_tree_row(self, row, path: list[int], features=None) -> None:
        self._rows.commit_tree_row(row, path)

    def close_row(self, row) -> None:
        self._rows.close_row(row)


class HostDrafter(Drafter):
    """A model-free drafter that reads and proposes host token lists (lookup, suffix): :meth:`propose_row` is its
    implementation and :meth:`propose` (the tensor contract) wraps it, so a decode round drafts without building a
    tensor of the sequence or of the proposal. Subclasses implement ``propose_row(ids, K) -> (tokens, None)``.

    Why: on a CPU every tensor made and read back between two target forwards is host time on the critical path;
    inside the llama.cpp backend's decode loop (a 12-13 ms one-token step on the 2-core AVX2 EPYC) the two of them
    took ~90 us of a round's ~0.9 ms of host work, the forward having just streamed the weights through the caches.
    """

    def propose(self, input_ids: torch.Tensor, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`propose_row` on ``input_ids`` ``(1, n)``: ``(tokens (1, k), None)``."""
        tokens, _ = self.propose_row(input_ids[0].tolist(), num_draft_tokens)
        return torch.tensor([tokens], dtype=torch.long).view(1, -1), None

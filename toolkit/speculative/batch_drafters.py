"""How a batch's rows get their draft tokens (:mod:`toolkit.speculative.batch`).

A batch drafter serves every row in flight, in the batch's row order:

* ``join(row)`` — a request joined at the end of the batch (its prompt and first token in ``row.ids``);
* ``remove(keep)`` — only the rows ``keep`` (indices, in the new order) stay;
* ``propose(rows, rooms)`` — set each row's ``proposal`` (at most ``rooms[i]`` tokens), ``confidence`` (the
  drafter's confidence per token or ``None``) and ``q`` (``(len(proposal), vocab)`` draft probabilities when draft
  tokens are sampled, else ``None``: a one-hot q);
* ``commit(rows, accepted)`` — after verification: row ``i`` kept the first ``accepted[i]`` of its proposal;
* ``close(row)`` — the row is done (counts its draft forwards into its stats);
* ``step_ms(rows)`` — milliseconds one draft step costs the batch (``None`` when drafting is free next to a target
  forward: model-free drafters), used to choose how many steps to draft.

:class:`RowDrafters` gives every row its own model-free drafter (n-gram, prompt lookup, suffix: their state is
host-side, so a batch loops over rows); :class:`~toolkit.speculative.batch_draft.BatchDraftModel` runs a draft LM
over all rows in one forward per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class RowDrafters:
    """One drafter per row, made by ``make()`` (``None``: autoregressive rows); persistent drafters (suffix, lookup)
    share their memory across rows through ``fork()`` in ``make``.

    Args:
        make: ``() -> drafter | None`` for a new request.
    """

    def __init__(self, make: Callable):
        self.make = make

    def join(self, row) -> None:
        row.drafter = self.make()
        if row.drafter is not None:
            row.drafter.reset()

    def remove(self, keep: list[int]) -> None:
        pass  # the drafters live on the rows

    def step_ms(self, rows: int) -> float | None:
        return None

    def propose(self, rows: list, rooms: list[int]) -> None:
        for row, room in zip(rows, rooms):
            row.proposal, row.confidence, row.q = [], None, None
            if row.drafter is not None and room > 0:
                tokens, _ = row.drafter.propose(torch.tensor([row.ids]), room)
                row.proposal = tokens[0].tolist()
                row.confidence = row.drafter.confidence()

    def commit(self, rows: list, accepted: list[int]) -> None:
        for row, a in zip(rows, accepted):
            if row.drafter is not None and row.proposal:
                row.drafter.commit(a)

    def close(self, row) -> None:
        if row.drafter is not None:
            row.stats.draft_forwards = row.drafter.forwards
            row.drafter.close()

"""How the decoder's rows get their draft tokens (:mod:`toolkit.engine.decoder`), one row or a batch.

A row drafter serves every row in flight, in the decoder's row order:

* ``begin(row)`` — a request is about to be prefilled (its prompt in ``row.ids``): a drafter whose hooks must see
  the prompt's forward sets them up here;
* ``join(row)`` — the request joined at the end of the batch (its prompt and first token in ``row.ids``);
* ``remove(keep)`` — only the rows ``keep`` (indices, in the new order) stay;
* ``propose(rows, num_draft_tokens)`` — set each row's ``proposal`` (at most ``num_draft_tokens[i]`` tokens),
  ``confidence`` (the drafter's confidence per token or ``None``) and ``q`` (``(len(proposal), vocab)`` draft
  probabilities when draft tokens are sampled, else ``None``: a one-hot q);
* ``commit(rows, accepted)`` — after verification: row ``i`` kept the first ``accepted[i]`` of its proposal;
* ``close(row)`` — the row is done (counts its draft forwards into its stats);
* ``step_ms(rows)`` — milliseconds one draft step costs the batch (``None`` when drafting is free next to a target
  forward: model-free drafters), used to choose how many steps to draft, with ``acceptance`` (per position);
* ``attached()`` — a context manager around a whole batched call (an EAGLE head's feature hook on the target).

:class:`RowDrafters` gives every row its own single-sequence drafter (:mod:`toolkit.speculative.drafters`: the
model-free ones, whose state is host-side; and, one request at a time, draft models with compressed caches,
cross-tokenizer drafts, EAGLE heads): a batch loops over rows. :class:`ModelBatchDrafter` is the base of the drafters
that run a network over all rows in one forward per step: a draft LM
(:class:`~toolkit.speculative.drafters.draft_model_rows.BatchDraftModel`) or an EAGLE head
(:class:`~toolkit.speculative.drafters.eagle_rows.BatchEagle`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from toolkit.speculative.verify import process_logits, sample_token
from toolkit.speculative.verify_length import Calibrator

#: weight of a new timing in the moving average of a draft step's milliseconds
STEP_OBSERVE_WEIGHT = 0.3


class RowDrafters:
    """One single-sequence drafter per row, made by ``make()`` (``None``: autoregressive rows); persistent drafters
    (suffix, lookup) share their memory across rows through ``fork()`` in ``make``.

    Args:
        make: ``() -> drafter | None`` for a new request.
        gen: the generation settings: under sampling, a drafter's draft logits become the row's ``q`` (processed like
            the target's, so that p and q are comparable); ``None``: greedy.
    """

    def __init__(self, make: Callable, gen=None):
        self.make, self.gen = make, gen

    def begin(self, row) -> None:
        """The row's drafter, reset before the prefill (an EAGLE head's feature hook sees the prompt's forward)."""
        row.drafter = self.make()
        if row.drafter is not None:
            row.drafter.reset()

    def join(self, row) -> None:
        pass  # the drafter was made in begin()

    def remove(self, keep: list[int]) -> None:
        pass  # the drafters live on the rows

    def step_ms(self, rows: int) -> float | None:
        return None

    def attached(self):
        return contextlib.nullcontext()

    def propose(self, rows: list, num_draft_tokens: list[int]) -> None:
        gen = self.gen
        for row, n in zip(rows, num_draft_tokens):
            row.proposal, row.confidence, row.q = [], None, None
            if row.drafter is not None and n > 0:
                tokens, logits = row.drafter.propose(torch.tensor([row.ids]), n)
                row.proposal = tokens[0].tolist()
                row.confidence = row.drafter.confidence() if row.proposal else None
                if gen is not None and gen.do_sample and logits is not None and row.proposal:
                    row.q = process_logits(logits[: len(row.proposal)], gen.temperature, gen.top_k, gen.top_p)

    def commit(self, rows: list, accepted: list[int]) -> None:
        for row, a in zip(rows, accepted):
            if row.drafter is not None and row.proposal:
                row.drafter.commit(a)

    def close(self, row) -> None:
        if row.drafter is not None:
            row.stats.draft_forwards = row.drafter.forwards
            row.drafter.close()


class ModelBatchDrafter:
    """What the drafters running a network over the whole batch share: sampling settings, a generator per row
    (row ``i`` of a call seeded ``seed + 1 + i``), the per-position acceptance learned from the rounds
    (``acceptance``, a :class:`Calibrator` by position: P(a drafted token is committed), which the planner reads
    optimistically to choose how many tokens to draft) and the cost of one draft step (:meth:`step_ms`).

    Args:
        do_sample / temperature / top_k / top_p / seed: as the subclasses.
        acceptance: the :class:`Calibrator` to learn in, kept by the caller across calls (a SpeculativeLM keeps one,
            so a batched call starts from what earlier calls learned); ``None``: a fresh one.

    Subclasses implement ``_probe(rows)`` (one forward over ``(rows, 1)`` tokens, for timing) and the protocol's
    ``join`` / ``propose`` / ``commit``; they call :meth:`_observe_time` with what their steps took.
    """

    def __init__(self, *, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, acceptance: Calibrator | None = None):
        self.do_sample, self.temperature, self.top_k, self.top_p = do_sample, temperature, top_k, top_p
        self.seed = seed
        self.acceptance = acceptance if acceptance is not None else Calibrator()
        self.acceptance.begin_request()  # one drafter per batched call
        self._step_ms: dict[int, float] = {}  # rows -> ms of one draft forward, moving average
        self._generators: list[torch.Generator | None] = []

    def attached(self):
        return contextlib.nullcontext()

    def begin(self, row) -> None:
        pass  # rows join after their prefill (join)

    def close(self, row) -> None:
        pass  # the row's slots go with remove()

    def _join_generator(self, row, device: torch.device) -> None:
        seeded = torch.Generator(device=device).manual_seed(self.seed + 1 + row.index) if self.do_sample else None
        self._generators.append(seeded)

    def _remove_generators(self, keep: list[int]) -> None:
        self._generators = [self._generators[i] for i in keep]

    def _sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of ``probs`` ``(B, vocab)``, each with its row's generator."""
        return torch.stack([sample_token(probs[i:i + 1], g)[0] for i, g in enumerate(self._generators)])

    @torch.inference_mode()
    def step_ms(self, rows: int) -> float | None:
        """Milliseconds one draft step costs a round over ``rows`` rows: a drafting round's whole drafting time (the
        catch-up forward, the steps, the host work between them) per forward, a moving average over the rounds;
        before the first, one probe forward over ``(rows, 1)`` tokens (timed after a warm-up one)."""
        if rows not in self._step_ms:
            for _ in range(2):
                started = time.perf_counter()
                self._probe(rows)
            self._step_ms[rows] = (time.perf_counter() - started) * 1000
        return self._step_ms[rows]

    def _probe(self, rows: int) -> None:
        raise NotImplementedError

    def _observe_time(self, rows: int, ms: float) -> None:
        old = self._step_ms.get(rows)
        self._step_ms[rows] = ms if old is None else old + STEP_OBSERVE_WEIGHT * (ms - old)

    def _observe_acceptance(self, rows: list, accepted: list[int]) -> None:
        """Learn P(the s-th drafted token is committed): drafts the round did not verify (a narrower width paid
        more) count as misses, so steps the verify width keeps cutting stop being drafted."""
        for row, a in zip(rows, accepted):
            if row.proposal:
                self.acceptance.observe(None, len(row.proposal), a)

"""The one drafter protocol of the decoder (:mod:`toolkit.engine.decoder`): a :class:`RowDrafter` serves every row in
flight, in the decoder's row order, whether the call decodes one sequence (one row) or a batch.

A call::

    start(rows, capacity, widest, gen, tree)  the call begins: at most ``rows`` rows at once, requests of up to
                                         ``capacity`` positions, target forwards of up to ``widest`` tokens per row;
                                         ``gen`` its generation settings; ``tree``: the
                                         :class:`~toolkit.speculative.tree.TreeShape` of token-tree rounds (``None``:
                                         chains; a drafter allocates its caches here)
    begin(row)                           a request is about to be prefilled (its prompt in ``row.ids``)
    join(row, features)                  it joined at the end of the batch (prompt and first token in ``row.ids``);
                                         ``features`` ``(1, n, F)``: the target's hidden states of the prompt's
                                         prefill when the drafter asks for any (:attr:`RowDrafter.features`), else
                                         ``None``
    propose_rows(rows, num_draft_tokens, read)  each row's ``proposal`` (at most ``num_draft_tokens[i]`` tokens),
                                         ``confidence`` (per token, or ``None``) and ``q`` (``(len(proposal), vocab)``
                                         draft probabilities of sampled drafts, else ``None``: a one-hot q); with
                                         ``read=False`` a drafter whose tokens are on the device may leave them there
                                         (``device_proposals`` ``(B, steps)``; the proposals then are placeholders of
                                         the right lengths, and no confidence), and the decoder reads them with the
                                         round's one transfer
    commit_rows(rows, accepted, features) after verification: row ``i`` kept the first ``accepted[i]`` of its
                                         proposal; ``features`` ``(B, W, F)`` of the verify forward (or ``None``)
    remove(keep)                         only the rows ``keep`` (indices, in the new order) stay
    close_row(row)                       the row is done (its draft forwards into its stats)
    step_ms(rows)                        ms of one draft step over ``rows`` rows (``None``: drafting is free next to a
                                         target forward), with ``acceptance`` (per position) the decoder's planner
                                         chooses how many steps to draft
    draft_cache(row)                     the cache whose bytes are reported as the row's draft KV (or ``None``)
    attached()                           a context manager around the whole call

``batches`` says whether one instance serves several rows (a single-sequence drafter serves one); and, for token
trees (one row; :mod:`toolkit.engine.tree`), ``propose_tree_row(row, budget, depth, topk)`` /
``commit_tree_row(row, path, features)`` where :attr:`RowDrafter.trees` says the drafter proposes trees.

:attr:`RowDrafter.features` is how a drafter asks for the target's hidden states: indices into HF's
``hidden_states`` (:func:`toolkit.engine.forward.select_hidden`); the decoder's target forward, compiled or eager,
then returns them with its logits (an EAGLE head's input: no forward hooks). :attr:`RowDrafter.compile_ms` counts
what the drafter's own compiled forwards spent compiling (kept out of a request's timings).

Who implements it: every single-sequence :class:`~toolkit.speculative.drafters.base.Drafter` (the model-free ones and
the cross-tokenizer draft) is a row drafter of ONE row (its base class delegates to :class:`RowDrafters`);
:class:`RowDrafters` gives every row of a batch its own single-sequence drafter; the drafters that run a network,
:class:`~toolkit.speculative.drafters.draft_model.DraftModel` and
:class:`~toolkit.speculative.drafters.eagle.EagleDrafter`, draft for all rows in one forward per step (one row is a
batch of one), on their base :class:`ModelDrafter`. The registry builds one of these for every config.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from toolkit.speculative.verify import process_logits, sample_token
from toolkit.speculative.verify_length import Calibrator

#: weight of a new timing in the moving average of a draft step's milliseconds
STEP_OBSERVE_WEIGHT = 0.3


def ids_tensor(ids: list[int]) -> torch.Tensor:
    """A row's token ids as the ``(1, n)`` long tensor a drafter's ``propose`` takes, through NumPy: ``torch.tensor``
    parses a nested list element by element (600 ids: 73 us against 12, every round of a model-free drafter)."""
    return torch.from_numpy(np.array(ids, dtype=np.int64)).view(1, -1)


@runtime_checkable
class RowDrafter(Protocol):
    features: tuple[int, ...]
    compile_ms: float

    @property
    def trees(self) -> bool: ...

    def start(self, rows: int, capacity: int, widest: int, gen, tree=None) -> None: ...

    def begin(self, row) -> None: ...

    def join(self, row, features: torch.Tensor | None) -> None: ...

    def remove(self, keep: list[int]) -> None: ...

    def propose_rows(self, rows: list, num_draft_tokens: list[int], read: bool = True) -> None: ...

    def commit_rows(self, rows: list, accepted: list[int], features: torch.Tensor | None) -> None: ...

    def close_row(self, row) -> None: ...

    def step_ms(self, rows: int) -> float | None: ...

    def draft_cache(self, row) -> Any: ...

    def attached(self): ...


class RowDrafters:
    """One single-sequence drafter per row, made by ``make()`` (``None``: autoregressive rows); persistent drafters
    (suffix, lookup) share their memory across rows through ``fork()`` in ``make``.

    Args:
        make: ``() -> drafter | None`` for a new request.
        trees: whether the drafters ``make`` builds propose token trees (``None``: ask one of them).

    Under sampling (``gen`` of :meth:`start`), a drafter's draft logits become the row's ``q`` (processed like the
    target's, so that p and q are comparable).
    """

    features: tuple[int, ...] = ()
    compile_ms = 0.0
    batches = True
    device_proposals = None  # host-side drafters: proposals are host lists

    def __init__(self, make: Callable, trees: bool | None = None):
        self.make, self.gen, self._trees = make, None, trees

    @property
    def trees(self) -> bool:
        if self._trees is None:
            from toolkit.speculative.drafters.base import TreeDrafterProtocol

            self._trees = isinstance(self.make(), TreeDrafterProtocol)
        return self._trees

    def start(self, rows: int, capacity: int, widest: int, gen, tree=None) -> None:
        self.gen = gen

    def begin(self, row) -> None:
        """The row's drafter, reset before the prefill."""
        row.drafter = self.make()
        if row.drafter is not None:
            row.drafter.reset()

    def join(self, row, features=None) -> None:
        pass  # the drafter was made in begin()

    def remove(self, keep: list[int]) -> None:
        pass  # the drafters live on the rows

    def step_ms(self, rows: int) -> float | None:
        return None

    def attached(self):
        return contextlib.nullcontext()

    def draft_cache(self, row):
        return getattr(row.drafter, "cache", None)

    def propose_rows(self, rows: list, num_draft_tokens: list[int], read: bool = True) -> None:
        gen = self.gen
        for row, n in zip(rows, num_draft_tokens):
            row.proposal, row.confidence, row.q = [], None, None
            if row.drafter is not None and n > 0:
                row.proposal, logits = row.drafter.propose_row(row.ids, n)
                row.confidence = row.drafter.confidence() if row.proposal else None
                if gen is not None and gen.do_sample and logits is not None and row.proposal:
                    row.q = process_logits(logits[: len(row.proposal)], gen.temperature, gen.top_k, gen.top_p)

    def commit_rows(self, rows: list, accepted: list[int], features=None) -> None:
        for row, a in zip(rows, accepted):
            if row.drafter is not None and row.proposal:
                row.drafter.commit(a)

    def propose_tree_row(self, row, budget: int, depth: int, topk: int):
        return row.drafter.propose_tree(ids_tensor(row.ids), budget=budget, depth=depth, topk=topk)

    def commit_tree_row(self, row, path: list[int], features=None) -> None:
        row.drafter.commit_tree(path)

    def close_row(self, row) -> None:
        if row.drafter is not None:
            row.stats.draft_forwards = row.drafter.forwards
            row.drafter.close()


class ModelDrafter:
    """What the drafters running a network over all rows share: sampling settings, a generator per row (row ``i``
    of a call seeded ``seed + 1 + i``, or one ``generator`` for every row), the per-position acceptance learned from
    the rounds (``acceptance``, a :class:`Calibrator` by position: P(a drafted token is committed), which the planner
    reads optimistically to choose how many tokens to draft) and the cost of one draft step (:meth:`step_ms`).

    Args:
        do_sample / temperature / top_k / top_p / seed: how draft tokens are chosen (the target's settings, so that p
            and q are comparable).
        generator: one ``torch.Generator`` for every row's draft samples (one-row use); ``None``: one per row.
        acceptance: the :class:`Calibrator` to learn in, kept by the caller across calls (a SpeculativeLM keeps one,
            so a call starts from what earlier calls learned); ``None``: a fresh one.

    Subclasses implement ``_probe(rows)`` (one draft step over ``rows`` rows, for timing) and the protocol's
    ``start`` / ``join`` / ``remove`` / ``propose_rows`` / ``commit_rows``; they call :meth:`_observe_time` with what
    their steps took.
    """

    features: tuple[int, ...] = ()
    trees = True
    batches = True

    def __init__(self, *, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, generator: torch.Generator | None = None, acceptance: Calibrator | None = None):
        self.do_sample, self.temperature, self.top_k, self.top_p = do_sample, temperature, top_k, top_p
        self.seed, self.generator = seed, generator
        self.acceptance = acceptance if acceptance is not None else Calibrator()
        self.compile_ms = 0.0
        self.device_proposals: torch.Tensor | None = None  # (B, steps): this round's tokens, left on the device
        self._step_ms: dict[int, float] = {}  # rows -> ms of one draft forward, moving average
        self._generators: list[torch.Generator | None] = []

    def attached(self):
        return contextlib.nullcontext()

    def begin(self, row) -> None:
        pass  # rows join after their prefill (join)

    def close_row(self, row) -> None:
        pass  # the row's slots go with remove()

    def _start_rows(self) -> None:
        """A new call: one acceptance request, no rows."""
        self.acceptance.begin_request()
        self._generators = []

    def _join_generator(self, row, device: torch.device) -> None:
        if self.generator is not None or not self.do_sample:
            self._generators.append(self.generator)
            return
        self._generators.append(torch.Generator(device=device).manual_seed(self.seed + 1 + row.index))

    def _remove_generators(self, keep: list[int]) -> None:
        self._generators = [self._generators[i] for i in keep]

    def _new_round(self, rows: list, num_draft_tokens: list[int]) -> int:
        """A round starts: every row's proposal, confidences and ``q`` emptied, nothing drafted on the device yet;
        returns the round's draft steps (the most any row asks for)."""
        self._steps, self.device_proposals = 0, None
        for row in rows:
            row.proposal, row.confidence, row.q = [], None, None
        return max(num_draft_tokens, default=0)

    def _sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of ``probs`` ``(B, vocab)``, each with its row's generator."""
        return torch.stack([sample_token(probs[i:i + 1], g)[0] for i, g in enumerate(self._generators)])

    @torch.inference_mode()
    def step_ms(self, rows: int) -> float | None:
        """Milliseconds one draft step costs a round over ``rows`` rows: a drafting round's whole drafting time (the
        catch-up forward, the steps, the host work between them) per forward, a moving average over the rounds;
        before the first, one probe step over ``(rows, 1)`` tokens (timed after a warm-up one)."""
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

    def _hand_over(self, rows: list, num_draft_tokens: list[int], drafted: list, confidences: list,
                   probs: list, read: bool = True) -> None:
        """Give each row its proposal from the round's steps (``drafted`` / ``confidences``: ``(B,)`` per step,
        ``probs``: ``(B, vocab)`` per step under sampling): ONE device-to-host read of every token and confidence,
        or (``read=False``) none: the tokens stay on the device (:attr:`device_proposals`) and the rows get
        placeholders of their proposals' lengths, which the decoder's round read replaces."""
        steps = len(drafted)
        q = torch.stack(probs, 1) if self.do_sample else None  # (B, steps, vocab)
        if read:
            both = torch.stack([torch.stack(drafted, 1).to(torch.float64), torch.stack(confidences, 1).double()])
            tokens, conf = both.tolist()  # the drafter's one read of the round
        else:
            self.device_proposals = torch.stack(drafted, 1)
            tokens, conf = [[0] * steps] * len(rows), None
        for i, row in enumerate(rows):
            n = min(num_draft_tokens[i], steps)
            row.proposal, row.confidence = [int(t) for t in tokens[i][:n]], None if conf is None else conf[i][:n]
            row.q = None if q is None else q[i, :n]
            row.stats.draft_forwards += steps

"""A request in flight (:class:`Row`) and when it is finished (:func:`finish`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from toolkit.speculative.stats import GenerationStats


@dataclass
class Row:
    """One request in flight.

    Attributes:
        index: its place in the input order.
        prompt_len: prompt tokens.
        ids: committed token ids, prompt included (host-side).
        new_ids: the generated ones.
        stats: its statistics.
        generator: its sampling ``torch.Generator`` (seeded ``seed + index``), ``None`` under greedy.
        started: ``time.perf_counter()`` at its start.
        drafter: its own single-sequence drafter, where the row drafter gives each row one.
        proposal: this round's draft tokens (host-side list), set by the row drafter.
        confidence: the drafter's confidence per draft token (``None``: none).
        q: draft probabilities ``(len(proposal), vocab)`` of sampled drafts (``None``: deterministic drafts).
        checked: new ids already checked for stop conditions.
        compile_ms: milliseconds of its rounds spent compiling the target's forward (kept out of its times).
    """

    index: int
    prompt_len: int
    ids: list[int]
    stats: GenerationStats
    generator: torch.Generator | None
    started: float
    new_ids: list[int] = field(default_factory=list)
    drafter: object = None
    proposal: list[int] = field(default_factory=list)
    confidence: list[float] | None = None
    q: torch.Tensor | None = None
    checked: int = 0
    compile_ms: float = 0.0


def finish(new_ids: list[int], before: int, limit: int, eos: set[int],
           should_stop: Callable[[list[int]], int | None] | None, stats: GenerationStats) -> bool:
    """Truncate ``new_ids`` in place at the first stop condition among the tokens added since ``before``: an EOS id
    (kept in the output), a stop string (``should_stop(new_ids)`` returns the cut length), or ``limit`` tokens
    (never more, even when a round accepts past it). Sets ``stats.finish_reason`` (``eos``, ``stop_string``,
    ``length``); returns whether the request is done."""
    for i in range(before, len(new_ids)):
        if new_ids[i] in eos:
            del new_ids[i + 1:]
            stats.finish_reason = "eos"
            break
    if should_stop is not None:
        cut = should_stop(new_ids)
        if cut is not None:
            del new_ids[cut:]
            stats.finish_reason = "stop_string"
    if len(new_ids) >= limit:
        del new_ids[limit:]
        stats.finish_reason = stats.finish_reason or "length"
        return True
    return bool(stats.finish_reason)

"""Per-call statistics of a speculative generation and the result object returned by ``generate``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """Counters and timings of one ``generate`` call.

    Units: times in milliseconds, memory in bytes, throughput in generated tokens per second.
    ``accepted_at[i]`` counts rounds whose draft token at position i (0-based) was accepted; ``drafted_at[i]``
    counts rounds that drafted a token at position i, so ``accepted_at[i] / drafted_at[i]`` is the acceptance
    curve by draft position. ``committed = accepted + rounds`` (one target token per round, bonus or correction),
    before truncation at ``max_new_tokens`` / EOS / stop strings.

    Where a round's time goes (sums over rounds, ms; the prefill is TTFT and not in them): ``draft_ms`` the drafter's
    proposal, ``target_ms`` the verify forward up to the accepted count on the host (the round's one sync),
    ``overhead_ms`` everything else of the round (choosing the verify length, rollback, commit, bookkeeping).
    ``verify_tokens`` sums the widths of the verify forwards (padding included); ``plain_steps`` counts rounds that
    verified no draft token (a one-token step).

    ``compile_ms`` is what the call waited for ``torch.compile`` to build the target's graphs (their first use in
    the process: while measuring the verify cost curve, or in a round). It is in none of the other times: the call's
    wall time is ``total_ms + compile_ms`` (plus a verify cost measurement), and ``tpot_ms`` and ``throughput``
    describe decoding alone. ``SpeculativeLM.warm_up`` compiles ahead, after which calls report 0.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    target_forwards: int = 0
    draft_forwards: int = 0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    kv_bytes_target: int = 0
    kv_bytes_draft: int = 0
    peak_kv_bytes_target: int = 0
    peak_kv_bytes_needed_target: int = 0  # of the peak: what the target's rows held (a cache sized to them)
    peak_kv_bytes_draft: int = 0
    peak_kv_bytes_batch: int = 0  # peak KV bytes of the batch this request was decoded in (0: decoded alone)
    compressions_target: int = 0
    compressions_draft: int = 0
    finish_reason: str = ""
    draft_ms: float = 0.0
    target_ms: float = 0.0
    overhead_ms: float = 0.0
    verify_tokens: int = 0
    plain_steps: int = 0
    compile_ms: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """tau = tokens committed per round (1.0 for autoregressive decoding)."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first, in ms (compiling excluded)."""
        return (self.total_ms - self.ttft_ms) / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0

    @property
    def throughput(self) -> float:
        """Generated tokens per second over the whole call (prefill included, compiling excluded: ``compile_ms``)."""
        return self.new_tokens / (self.total_ms / 1000.0) if self.total_ms > 0 else 0.0

    @property
    def round_ms(self) -> dict:
        """Mean milliseconds per round: ``draft``, ``target``, ``overhead``, and ``overhead_pct`` of the round."""
        return round_summary([self])

    def record_time(self, draft_ms: float, target_ms: float, round_ms: float, width: int) -> None:
        """Add one round's times (ms) and verify width (tokens)."""
        self.draft_ms += draft_ms
        self.target_ms += target_ms
        self.overhead_ms += max(0.0, round_ms - draft_ms - target_ms)
        self.verify_tokens += width

    def record_round(self, drafted: int, accepted: int) -> None:
        """Count one draft + verify round that proposed ``drafted`` tokens and accepted ``accepted`` of them."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.committed += accepted + 1
        self.plain_steps += drafted == 0
        self.draft_lengths.append(drafted)
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("draft_lengths")
        data.update(acceptance_rate=self.acceptance_rate, tokens_per_round=self.tokens_per_round,
                    tpot_ms=self.tpot_ms, throughput=self.throughput, round_ms=self.round_ms)
        return data


def round_summary(stats_list) -> dict:
    """Where a round's time went over several calls' :class:`GenerationStats`: mean ms per round of ``draft``,
    ``target`` (the verify forward) and ``overhead`` (the rest of the round), and ``overhead_pct`` of the round."""
    rounds = sum(s.rounds for s in stats_list) or 1
    draft, target, overhead = (sum(getattr(s, f) for s in stats_list) for f in ("draft_ms", "target_ms", "overhead_ms"))
    total = draft + target + overhead
    return {"draft": draft / rounds, "target": target / rounds, "overhead": overhead / rounds,
            "overhead_pct": 100.0 * overhead / total if total > 0 else 0.0}


def acceptance_summary(stats_list) -> dict:
    """Aggregate :class:`~toolkit.speculative.stats.GenerationStats` of several calls into acceptance metrics.

    Returns alpha (accepted / drafted), tau (committed / rounds), the per-position curve
    ``accepted_at[i] / drafted_at[i]``, and forward counts. ``consistent`` is the result of
    :func:`check_acceptance` on every call.
    """
    width = max([len(s.drafted_at) for s in stats_list] + [0])
    acc_at, dr_at = [0] * width, [0] * width
    totals = dict(rounds=0, drafted=0, accepted=0, committed=0, new_tokens=0, target_forwards=0, draft_forwards=0)
    problems = []
    for s in stats_list:
        for key in totals:
            totals[key] += getattr(s, key)
        for i, (a, d) in enumerate(zip(s.accepted_at, s.drafted_at)):
            acc_at[i] += a
            dr_at[i] += d
        problems += check_acceptance(s)
    return {
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
        "tokens_per_round": totals["committed"] / totals["rounds"] if totals["rounds"] else 0.0,
        **totals,
        "accepted_at": acc_at, "drafted_at": dr_at,
        "curve": [a / d if d else 0.0 for a, d in zip(acc_at, dr_at)],
        "consistent": not problems, "problems": problems[:5],
    }


def check_acceptance(stats) -> list[str]:
    """Invariants of one call's counters; returns the violated ones (empty list = consistent).

    accepted <= drafted; committed = accepted + rounds (one target token per round: the bonus token when all K
    were accepted, else the correction, counted once); per-position counts sum to the totals and never exceed
    each other; one target forward per round plus the prefill; new tokens <= committed + 1 (the prefill token).
    """
    out = []
    if stats.accepted > stats.drafted:
        out.append(f"accepted {stats.accepted} > drafted {stats.drafted}")
    if stats.committed != stats.accepted + stats.rounds:
        out.append(f"committed {stats.committed} != accepted {stats.accepted} + rounds {stats.rounds}")
    if sum(stats.accepted_at) != stats.accepted or sum(stats.drafted_at) != stats.drafted:
        out.append("per-position counts do not sum to accepted/drafted")
    if any(a > d for a, d in zip(stats.accepted_at, stats.drafted_at)):
        out.append("accepted_at[i] > drafted_at[i]")
    if any(later > earlier for earlier, later in zip(stats.accepted_at, stats.accepted_at[1:])):
        out.append("accepted_at not non-increasing (position i+1 accepted without position i)")
    if stats.target_forwards != stats.rounds + 1:
        out.append(f"target_forwards {stats.target_forwards} != rounds {stats.rounds} + 1 (prefill)")
    if stats.new_tokens > stats.committed + 1:
        out.append(f"new_tokens {stats.new_tokens} > committed {stats.committed} + 1")
    return out


@dataclass
class GenerationResult:
    """What ``SpeculativeLM.generate`` returns: the new text, its token ids (prompt excluded) and the statistics."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: GenerationStats

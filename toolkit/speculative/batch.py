"""Batched speculative decoding: up to ``batch_size`` sequences per target forward, each row accepting its own number
of draft tokens (ragged acceptance), rows leaving when they finish and waiting requests joining (continuous batching).

One round over the ``B`` active rows::

    propose      every row gets up to K draft tokens: model-free drafters each row from its own state; a draft
                 model or EAGLE head in one forward per step over all rows (``batch_draft``, ``batch_eagle``), as
                 many steps as pay for themselves (its measured step cost + the verify cost vs expected
                 acceptance; 0 steps = a plain step)
    width W      one verify width for the batch, 1 + the draft tokens it verifies: the W with the most expected
                 committed tokens (summed over rows, calibrated confidences) per millisecond of a forward over B x W
                 tokens (the target's verify cost curve); W = 1 is a batched plain step
    verify       ONE target forward over (B, W): row r = [its last token, its drafts, padding] at its own positions,
                 attending to its own cache slots (:class:`~toolkit.speculative.batch_cache.BatchCache`: written at
                 each row's own offset, no holes)
    accept       greedy: the longest prefix each row's target agrees with; sampling: lossless rejection sampling per row
    commit       every row keeps 1 + accepted of its W new slots; rows that hit EOS / a stop string / their token
                 limit leave, the next waiting requests are prefilled and join

Greedy output of every row is the target's own greedy output for that prompt (fp32: token-identical to decoding it
alone; tested), whatever the batch composition. Supported here: model-free drafters (``lookup``, ``ngram``,
``suffix``), draft models sharing the target's vocabulary (``draft_model``, ``self``; uncompressed draft cache) and
EAGLE heads (:mod:`toolkit.speculative.batch_eagle`), with the uncompressed KV cache, StreamingLLM (absolute
positions, exact window) or the KIVI-quantized cache per row (each row as it decodes alone under the policy), or
L2-norm / head-aware eviction per row (:mod:`toolkit.speculative.batch_evict`: as alone when the rounds commit
alike);
:meth:`toolkit.generator.Generator.generate_batch` runs other recipes one request at a time and says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from toolkit.dtypes import mask_dtype
from toolkit.kv import ops as kv_ops
from toolkit.speculative.batch_cache import BatchCache
from toolkit.speculative.batch_drafters import RowDrafters
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.decoder import SpeculativeDecoder
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.verify import process_logits, sample_token, speculative_sample
from toolkit.speculative.verify_length import Calibrator

#: weight of a new observation in :class:`BatchCost`'s moving averages
BATCH_OBSERVE_WEIGHT = 0.3


@dataclass
class BatchCost:
    """Milliseconds of one batched verify forward over ``rows x width`` tokens, learned online.

    Starts from the target's single-sequence curve (``curve.ms(rows * width)``, :mod:`toolkit.speculative.cost_model`)
    and corrects it by what batched forwards really take: a forward of ``(rows, width)`` once seen is predicted by
    its own moving average, an unseen one by the curve times the observed/predicted ratio of the nearest narrower
    width seen (wide batched forwards cost more than a single sequence of as many tokens: every row attends to its
    own history). Kept apart from ``curve``, which the single-sequence decoder goes on using.
    """

    curve: VerifyCost
    seen: dict = field(default_factory=dict)  # (rows, width) -> ms, moving average
    ratio: dict = field(default_factory=dict)  # width -> observed / curve, moving average

    def ms(self, rows: int, width: int) -> float:
        if (rows, width) in self.seen:
            return self.seen[(rows, width)]
        narrower = [w for w in self.ratio if w <= width]
        return self.curve.ms(rows * width) * (self.ratio[max(narrower)] if narrower else 1.0)

    def observe(self, rows: int, width: int, ms: float) -> None:
        """Blend a batched forward that took ``ms`` in (nothing when the curve is fixed: ``curve.learn`` false)."""
        if not self.curve.learn or ms <= 0:
            return
        old = self.seen.get((rows, width))
        self.seen[(rows, width)] = ms if old is None else old + BATCH_OBSERVE_WEIGHT * (ms - old)
        ratio = ms / self.curve.ms(rows * width)
        self.ratio[width] = ratio if width not in self.ratio else \
            self.ratio[width] + BATCH_OBSERVE_WEIGHT * (ratio - self.ratio[width])


@dataclass
class Row:
    """One request in flight: its index in the input order, committed ids, stats, generator; this round's proposal
    with its confidences and draft probabilities ``q`` ``(len(proposal), vocab)`` (``None``: one-hot), set by the
    batch drafter (:mod:`toolkit.speculative.batch_drafters`), and the row's own drafter where it has one."""

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
    checked: int = 0  # new ids already checked for stop conditions


class BatchDecoder:
    """Decode many prompts with batched draft-then-verify rounds (see the module docstring).

    Args:
        target: the HF causal LM (batch dimension used).
        drafter: a batch drafter (:mod:`toolkit.speculative.batch_drafters`: e.g. a
            :class:`~toolkit.speculative.batch_draft.BatchDraftModel`), or ``() -> drafter`` making a model-free
            drafter for each new request (``None`` for AR), run per row by :class:`RowDrafters`.
        cost: the target's verify cost curve (milliseconds of a forward over n tokens), or a :class:`BatchCost`
            kept across calls (learned batched costs).
        calibrator: shared acceptance calibration of the drafters' confidences.
        num_draft_tokens: most draft tokens per row per round (K).
        batch_size: most rows per forward.
        policy: the target's KV policy, applied per row: ``None`` (uncompressed), a
            :class:`~toolkit.kv.streaming.StreamingLLM` with ``batch_rows`` (absolute positions, exact window), a
            :class:`~toolkit.kv.quantized.QuantizedKV` (:mod:`toolkit.speculative.batch_quant`) or a
            :class:`~toolkit.kv.l2norm.L2Norm` / :class:`~toolkit.kv.head_aware.HeadAware`
            (:mod:`toolkit.speculative.batch_evict`).
    """

    def __init__(self, target, drafter, cost: VerifyCost | BatchCost,
                 calibrator: Calibrator | None = None,
                 num_draft_tokens: int = 8, batch_size: int = 8, policy=None):
        self.target = target
        self.drafters = drafter if hasattr(drafter, "step_ms") else RowDrafters(drafter)  # a batch drafter, or a maker
        self.cost = cost if isinstance(cost, BatchCost) else BatchCost(cost)
        self.calibrator = calibrator or Calibrator()
        self.k, self.batch_size, self.policy = num_draft_tokens, batch_size, policy
        if policy is not None and not getattr(policy, "batch_rows", False):
            raise ValueError(f"BatchDecoder: the KV policy {type(policy).__name__} does not run per row in a batch")
        self.device = next(target.parameters()).device
        self.dtype = mask_dtype(target)

    # ------------------------------------------------------------------------------------------------ requests
    def _start(self, index: int, input_ids: torch.Tensor, gen) -> tuple[Row, DynamicCache]:
        """Prefill one request alone (every layer's full prompt: a plain ``DynamicCache``, or the policy's cache with
        its mask, committed); its first token comes from the target (the prompt's last position)."""
        started = time.perf_counter()
        ids = input_ids[0].tolist()
        cache = DynamicCache() if self.policy is None else kv_ops.new_cache(self.policy, self.target)
        generator = torch.Generator(device=self.device).manual_seed(gen.seed + index) if gen.do_sample else None
        extra = {} if self.policy is None else kv_ops.model_inputs(
            cache, torch.arange(len(ids), device=self.device).view(1, -1))
        logits = self.target(input_ids=input_ids.to(self.device), past_key_values=cache, use_cache=True,
                             logits_to_keep=1, **extra).logits[0, -1]
        if self.policy is not None:
            kv_ops.commit(cache)
        first = int(self._choose(logits, gen, generator))
        stats = GenerationStats(prompt_tokens=len(ids), target_forwards=1)
        stats.ttft_ms = (time.perf_counter() - started) * 1000
        return Row(index, len(ids), ids + [first], stats, generator, started, [first]), cache

    @staticmethod
    def _choose(logits: torch.Tensor, gen, generator) -> torch.Tensor:
        if gen.do_sample:
            return sample_token(process_logits(logits.view(1, -1), gen.temperature, gen.top_k, gen.top_p),
                                generator)[0]
        return logits.argmax(-1)

    # ------------------------------------------------------------------------------------------------ a round
    def _propose(self, rows: list[Row], limit: int, draining: bool) -> None:
        steps = self._draft_steps(rows, limit, draining)
        self.drafters.propose(rows, [min(steps, limit - len(row.new_ids) - 1) for row in rows])

    @staticmethod
    def _weights(rows: list[Row], limit: int, draining: bool) -> list[float]:
        """How much a row's tokens count. While requests wait, every row's alike (a row that finishes early frees
        its place). Once none waits (``draining``), the batch ends with its longest row, so a row's tokens count in
        proportion to the work it has left against the most any row has left: speculating on rows far ahead of the
        others would shorten nothing."""
        left = [limit - len(r.new_ids) for r in rows]
        return [x / max(left) for x in left] if draining else [1.0] * len(rows)

    def _draft_steps(self, rows: list[Row], limit: int, draining: bool) -> int:
        """How many tokens to draft per row: K for free drafters; for a draft model or EAGLE head, the count with the
        most expected committed tokens per ms of drafting (its step cost) plus verifying (0: a plain step)."""
        step_ms = self.drafters.step_ms(len(rows))
        if step_ms is None:
            return self.k
        acceptance = self.drafters.acceptance
        return self._most_per_ms(self._weights(rows, limit, draining), [limit - len(r.new_ids) - 1 for r in rows],
                                 self.k, lambda i, j: acceptance.prob(None, j), lambda n: n * step_ms)

    def _width(self, rows: list[Row], limit: int, draining: bool) -> int:
        """The verify width with the most expected committed tokens per ms over the batch (1 = a plain step),
        rows weighted by :meth:`_weights`, each draft token by its calibrated confidence. When draft tokens were
        sampled (a row has ``q``), the width grows only while one more token pays — the stopping rule of
        :meth:`~toolkit.speculative.verify_length.CostAwareK.plan`: verifying token ``j`` then depends only on what
        was known before it was drawn, never on the confidences that follow it (which depend on it)."""
        def prob(i: int, j: int) -> float:
            confidence = rows[i].confidence
            return self.calibrator.prob(None if confidence is None else confidence[j - 1], j)

        tokens = [len(r.proposal) for r in rows]
        sampled = any(r.q is not None for r in rows)
        return 1 + self._most_per_ms(self._weights(rows, limit, draining), tokens, max(tokens, default=0), prob,
                                     stopping=sampled)

    def _most_per_ms(self, weight: list[float], tokens: list[int], longest: int, prob: Callable[[int, int], float],
                     extra_ms: Callable[[int], float] = lambda n: 0.0, stopping: bool = False) -> int:
        """The ``n`` in ``0 .. longest`` with the most expected committed tokens per ms of ``extra_ms(n)`` plus a
        verify forward over ``(rows, n + 1)``: row ``i`` (weight ``weight[i]``) commits 1 token, plus its first
        ``min(n, tokens[i])`` draft tokens each with the chained probability ``prob(i, j)`` (``j`` 1-based).
        ``stopping``: the first ``n`` after which ``n + 1`` stops paying, not the best over the whole range (for
        sampled draft tokens, see :meth:`_width`). The verify width and the number of draft steps are both chosen by
        this rule."""
        rows = len(weight)
        best, best_rate = 0, sum(weight) / (extra_ms(0) + self.cost.ms(rows, 1))
        chains, expected = [1.0] * rows, sum(weight)
        for n in range(1, longest + 1):
            for i in range(rows):
                if n <= tokens[i]:
                    chains[i] *= prob(i, n)
                    expected += weight[i] * chains[i]
            rate = expected / (extra_ms(n) + self.cost.ms(rows, n + 1))
            if rate > best_rate:
                best, best_rate = n, rate
            elif stopping:
                break
        return best

    def _verify(self, rows: list[Row], batch: BatchCache, width: int, gen) -> list[tuple[int, int]]:
        """One forward over (B, width); returns each row's ``(accepted, next token)``."""
        inputs = torch.tensor([[r.ids[-1]] + (r.proposal[:width - 1] + [r.ids[-1]] * width)[:width - 1]
                               for r in rows], device=self.device)
        out = self.target(input_ids=inputs, past_key_values=batch.cache, use_cache=True, logits_to_keep=width,
                          **batch.forward_inputs(width, self.dtype))
        logits = out.logits
        drafted = [min(len(r.proposal), width - 1) for r in rows]
        if not gen.do_sample:
            best = logits.argmax(-1)
            draft = torch.tensor([r.proposal[:d] + [-1] * (width - 1 - d) for r, d in zip(rows, drafted)],
                                 device=self.device).view(len(rows), width - 1)
            accepted = (best[:, :width - 1] == draft).long().cumprod(1).sum(1)
            nxt = best.gather(1, accepted.view(-1, 1)).view(-1)
            return list(zip(accepted.tolist(), nxt.tolist()))
        results = []
        for i, (row, d) in enumerate(zip(rows, drafted)):
            p = process_logits(logits[i, : d + 1], gen.temperature, gen.top_k, gen.top_p)
            draft = torch.tensor(row.proposal[:d], dtype=torch.long, device=self.device)
            a, t = speculative_sample(draft, None if row.q is None else row.q[:d], p, row.generator)
            results.append((int(a), int(t)))
        return results

    # ------------------------------------------------------------------------------------------------ the loop
    def decode(self, prompts: list[torch.Tensor], gen, eos_token_ids: list[int] = (),
               should_stop: Callable[[list[int]], int | None] | None = None) -> list[tuple[list[int], GenerationStats]]:
        """Generate after each of ``prompts`` (``(1, prompt_len)`` each); returns ``(new ids, stats)`` in input
        order. Stops every row as :meth:`SpeculativeDecoder.decode` does (``max_new_tokens``, EOS, stop strings)."""
        with kv_ops.attached(self.policy, self.target), self.drafters.attached():  # for this call only
            return self._decode(prompts, gen, eos_token_ids, should_stop)

    @torch.inference_mode()
    def _decode(self, prompts, gen, eos_token_ids, should_stop) -> list[tuple[list[int], GenerationStats]]:
        eos = set() if gen.ignore_eos else set(eos_token_ids)
        limit = gen.max_new_tokens
        waiting = list(enumerate(prompts))
        rows: list[Row] = []
        layers = self.target.config.get_text_config(decoder=True).num_hidden_layers
        batch = self._new_cache(layers)
        done: dict[int, tuple[list[int], GenerationStats]] = {}
        peak_kv = 0  # bytes of the batch cache's buffers (allocated capacity) after the largest verify forward
        while waiting or rows:
            while waiting and len(rows) < self.batch_size:
                row, prefill = self._start(*waiting.pop(0), gen)
                if SpeculativeDecoder._finish(row.new_ids, 0, limit, eos, should_stop, row.stats):
                    done[row.index] = self._close(row)
                    continue
                rows.append(row)
                self.drafters.join(row)
                evicted = 0 if self.policy is None else prefill.get_seq_length() - prefill.physical_length(0)
                batch.join(prefill, len(row.ids), evicted)
            if not rows:
                continue
            peak_kv = max(peak_kv, self._round(rows, batch, gen, limit, draining=not waiting))
            finished = [i for i, r in enumerate(rows) if self._finished(r, limit, eos, should_stop)]
            if finished:
                for i in finished:
                    done[rows[i].index] = self._close(rows[i])
                keep = [i for i in range(len(rows)) if i not in finished]
                rows = [rows[i] for i in keep]
                batch.remove(keep)
                self.drafters.remove(keep)
        for _, stats in done.values():
            stats.peak_kv_bytes_batch = peak_kv
        return [done[i] for i in range(len(prompts))]

    def _new_cache(self, layers: int) -> BatchCache:
        """The batch's target cache: uncompressed, StreamingLLM, KIVI-quantized, L2-norm or head-aware per row."""
        from toolkit.kv.l2norm import L2Norm
        from toolkit.kv.quantized import QuantizedKV

        if isinstance(self.policy, QuantizedKV):
            from toolkit.speculative.batch_quant import QuantBatchCache

            return QuantBatchCache(layers, self.device, self.policy)
        if isinstance(self.policy, L2Norm):
            from toolkit.speculative.batch_evict import EvictBatchCache

            return EvictBatchCache(layers, self.device, self.policy, self.target)
        return BatchCache(layers, self.device, streaming=self.policy)

    def _round(self, rows: list[Row], batch: BatchCache, gen, limit: int, draining: bool = False) -> int:
        """Propose, verify, accept and commit once for every row; returns the batch cache's bytes after the verify
        forward (its allocated buffers: the round's peak)."""
        started = time.perf_counter()
        self._propose(rows, limit, draining)
        width = self._width(rows, limit, draining)
        drafted_at = time.perf_counter()
        results = self._verify(rows, batch, width, gen)
        verified_at = time.perf_counter()
        peak_kv = batch.kv_bytes()
        batch.accept(torch.tensor([a + 1 for a, _ in results], device=self.device))
        batch.compress()  # the commit point: StreamingLLM rows past their budget drop what no query sees again
        self.drafters.commit(rows, [a for a, _ in results])
        for row, (accepted, nxt) in zip(rows, results):
            drafted = min(len(row.proposal), width - 1)
            committed = row.proposal[:accepted] + [nxt]
            row.checked = len(row.new_ids)
            row.ids += committed
            row.new_ids += committed
            if drafted:
                self.calibrator.observe(row.confidence, drafted, accepted)
            row.stats.record_round(drafted, accepted)
            row.stats.target_forwards += 1
        share = 1.0 / len(rows)  # a round's time is shared by its rows
        for row in rows:
            row.stats.record_time((drafted_at - started) * 1000 * share, (verified_at - drafted_at) * 1000 * share,
                                  (time.perf_counter() - started) * 1000 * share, width)
        self.cost.observe(len(rows), width, (verified_at - drafted_at) * 1000)
        return peak_kv

    @staticmethod
    def _finished(row: Row, limit: int, eos: set[int], should_stop) -> bool:
        """Truncate the row at its first stop condition among this round's tokens; whether it is done."""
        return SpeculativeDecoder._finish(row.new_ids, row.checked, limit, eos, should_stop, row.stats)

    def _close(self, row: Row) -> tuple[list[int], GenerationStats]:
        row.stats.new_tokens = len(row.new_ids)
        row.stats.total_ms = (time.perf_counter() - row.started) * 1000
        self.drafters.close(row)
        return row.new_ids, row.stats

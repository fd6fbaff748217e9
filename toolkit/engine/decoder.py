"""The speculative decode loop of B >= 1 rows (Leviathan et al., 2023; Chen et al., 2023), in gpt-fast's shape.

One decoder for one sequence and for batches (a sequence is one row). A round over the rows in flight::

    propose   every row gets up to K draft tokens (the one row-drafter protocol of
              :mod:`toolkit.speculative.drafters.rows`: a drafter per row, or a draft model / EAGLE head over all rows
              in one forward per step)
    plan      the controller picks n, the draft tokens every row verifies, and the forward width m >= n + 1
              (:mod:`toolkit.engine.planner`: the measured cost curve x calibrated acceptance, with the stopping rule
              for sampled drafts; n = 0 is a plain one-token step)
    verify    ONE target forward over (B, m): row r = [its last committed token, its drafts, padding], on the
              target's cache (:mod:`toolkit.kv.rows`; compiled on the static cache: :mod:`toolkit.engine.forward`)
    accept    on the device (:mod:`toolkit.engine.accept`): greedy prefix match or lossless rejection sampling
    sync      the round's ONE device-to-host transfer: each row's accepted count and next token
    commit    cache.accept(kept) (rollback = not advancing past the kept tokens), the commit point (the only place a
              KV policy compresses), the drafters roll back; rows hitting EOS / a stop string / their limit leave,
              waiting requests are prefilled alone and join (continuous batching)

Drafts reach the device as one host-to-device copy of the round's inputs (model-free drafters are host-side; a draft
network reads its round's tokens back once); nothing else is read back (``tests/test_host_syncs.py`` counts). Between
rounds every row's cache represents its committed tokens but the last, whose position is the next forward's first.
Positions are absolute. A drafter that reads the target's hidden states (an EAGLE head) says which
(``drafter.features``): the prefill and every verify forward return them with the logits, from the same (compiled)
graph, and the drafter gets them at ``join`` / ``commit_rows``.

Greedy output of every row is the target's own greedy output for its prompt (fp32: token-identical to AR and to the
prompt decoded alone, whatever the batch); sampling reproduces the target's distribution (chi-square tests).

Token trees (``tree`` and a drafter whose ``trees`` is true) run one row on the same cache and forward
(:mod:`toolkit.engine.tree`): the tree's nodes are written at the row's next slots under a tree mask, and the accepted
path is gathered into place before the commit point.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from toolkit.engine.accept import accept, choose, kept
from toolkit.engine.forward import TargetForward
from toolkit.engine.planner import ConstantK, CostAwareK, batch_weights
from toolkit.engine.rows import Row, finish
from toolkit.kv.contract import policy_attached
from toolkit.kv.static import StaticKV, capacity_for
from toolkit.speculative.drafters.rows import RowDrafter, RowDrafters
from toolkit.speculative.stats import GenerationStats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeDecoder:
    """Draft-then-verify decoding of one sequence or a batch (see the module docstring).

    Args:
        target: HF causal LM whose distribution the output follows exactly (greedy: token-identical output).
        drafter: ``None`` (autoregressive decoding) or a row drafter
            (:class:`~toolkit.speculative.drafters.rows.RowDrafter`): what the registry builds for every config — a
            draft model or EAGLE head over any number of rows, a single-sequence
            :class:`~toolkit.speculative.drafters.Drafter` (one request at a time), or
            :class:`~toolkit.speculative.drafters.rows.RowDrafters` giving every row its own.
        controller: how many draft tokens to ask and verify (:mod:`toolkit.engine.planner`; default K = 4).
        target_policy: the target cache's KV policy (``None`` = uncompressed).
        tree: :class:`~toolkit.speculative.tree.TreeShape` for token trees (a drafter with ``propose_tree``; one row,
            on the static cache).
        forward: the target's :class:`~toolkit.engine.forward.TargetForward` (default: eager).
        batch_size: most rows per forward (continuous batching past it).

    Raises:
        TypeError: a drafter that is not a row drafter; ``tree`` with a drafter that proposes no trees.
        ValueError: ``batch_size > 1`` with token trees (or, at the first call, a single-sequence drafter instance).
        ConfigError: ``tree`` where the static cache does not hold ``target_policy`` on ``target`` (``spec.tree``).
    """

    def __init__(self, target, drafter=None, controller=None, target_policy=None, tree=None,
                 forward: TargetForward | None = None, batch_size: int = 1):
        from toolkit.engine.tree import check_tree_support

        self.target, self.target_policy, self.batch_size = target, target_policy, batch_size
        if drafter is not None and (isinstance(drafter, type) or not isinstance(drafter, RowDrafter)):
            raise TypeError(f"drafter: {type(drafter).__name__} is not a row drafter (toolkit.speculative.drafters."
                            "rows.RowDrafter); a maker of single-sequence drafters is RowDrafters(maker)")
        if tree is not None and drafter is not None and not drafter.trees:
            raise TypeError(f"tree: {type(drafter).__name__} proposes no token trees (no propose_tree/commit_tree)")
        self.tree = tree if drafter is not None else None
        if self.tree is not None:
            check_tree_support(target_policy, target, "target")
        if batch_size > 1 and self.tree is not None:
            raise ValueError("batch_size: token trees decode one sequence at a time")
        if batch_size > 1:
            from toolkit.kv.rows import static_why

            why = static_why(target_policy, target)
            if why:
                raise ValueError(f"batch_size: requests cannot share a batch here ({why}); decode them one at a time")
        self.drafter = drafter
        self.controller = controller or ConstantK(4)
        self.forward = forward or TargetForward(target)
        self.device = next(target.parameters()).device
        self.cache = None
        self._drafting_now = None  # the row drafter of the call in progress (its caches' bytes are reported)
        self._pinned = None  # CUDA: the pinned staging buffer of the rounds' inputs

    # ------------------------------------------------------------------------------------------------ public
    def decode(self, input_ids: torch.Tensor, gen, stats: GenerationStats, eos_token_ids=(),
               should_stop: Callable[[list[int]], int | None] | None = None) -> Iterator[list[int]]:
        """Generate after ``input_ids`` ``(1, prompt_len)``; yields the newly committed ids of every round (the
        first chunk is the prefill's token). ``stats`` is filled in place; ``stats.finish_reason`` is ``length``,
        ``eos`` or ``stop_string``. Stops at ``gen.max_new_tokens`` (never more), an EOS id (kept; ignored when
        ``gen.ignore_eos``) or where ``should_stop(new_ids)`` returns a cut length (stop strings)."""
        run = self._run([input_ids], gen, eos_token_ids, should_stop, [stats])
        try:
            for _, chunk in run:
                yield chunk
        finally:  # a caller that stops early closes the loop now (hooks on shared models come off)
            run.close()

    def decode_batch(self, prompts: list[torch.Tensor], gen, eos_token_ids=(),
                     should_stop: Callable[[list[int]], int | None] | None = None,
                     ) -> list[tuple[list[int], GenerationStats]]:
        """Generate after each of ``prompts`` (``(1, prompt_len)`` each), ``batch_size`` rows per forward; returns
        ``(new ids, stats)`` in input order (each row stops as :meth:`decode` does)."""
        stats = [GenerationStats() for _ in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        for index, chunk in self._run(prompts, gen, eos_token_ids, should_stop, stats):
            out[index].extend(chunk)
        return list(zip(out, stats))

    # ------------------------------------------------------------------------------------------------ set-up
    def _drafting(self, gen, rows: int, capacity: int, widest: int):
        """The row drafter of this call, started for it (``rows`` at once, requests of up to ``capacity`` positions,
        forwards of up to ``widest`` tokens)."""
        drafting = self.drafter if self.drafter is not None else RowDrafters(lambda: None, trees=False)
        drafting.start(rows, capacity, widest, gen, tree=self.tree)
        return drafting

    def _widest(self) -> int:
        """The widest forward after the prefill (tokens per row)."""
        controller = self.controller
        if self.drafter is None:
            return 1  # autoregressive: one token per forward
        if isinstance(controller, CostAwareK):
            widest = controller.widest
        else:  # every proposed token, or a padded width (a constant / ema K given the cost curve: its room)
            widest = max(getattr(controller, "k_max", 0) + 1, controller.next_k() + 1, getattr(controller, "widest", 0))
        if self.tree is not None:
            widest = max(widest, self.tree.budget + 1)
        return self.forward.width_for(widest) if self.forward.compiled else widest

    def _call_shape(self, prompts: list[torch.Tensor], gen) -> tuple[int, int, int]:
        """``(rows, capacity, widest)`` of a call: rows at once, positions per request (rounded up to the static
        cache's step), tokens per row of the widest forward after the prefill."""
        widest = self._widest()
        longest = max(p.shape[-1] for p in prompts) + gen.max_new_tokens + widest
        return min(self.batch_size, len(prompts)), capacity_for(longest), widest

    def _new_cache(self, prompts: list[torch.Tensor], gen):
        return self.forward.cache_for(self.target_policy, *self._call_shape(prompts, gen))

    # ------------------------------------------------------------------------------------------------ the loop
    @torch.inference_mode()  # cheaper than no_grad: no version counters or view tracking (~5% on CPU here)
    def _run(self, prompts, gen, eos_token_ids, should_stop, stats: list[GenerationStats]):
        self.cache = self._new_cache(prompts, gen)
        drafting = self._drafting(gen, *self._call_shape(prompts, gen))
        self._drafting_now = drafting
        attention = self.forward.attached() if isinstance(self.cache, StaticKV) else \
            policy_attached(self.target_policy, self.target)
        rows: list[Row] = []
        try:
            with attention, drafting.attached():
                yield from self._loop(prompts, gen, eos_token_ids, should_stop, stats, drafting, rows)
        finally:
            for row in rows:  # a caller that stopped iterating early: release what the drafters set up
                drafting.close_row(row)

    def _loop(self, prompts, gen, eos_token_ids, should_stop, stats, drafting, rows: list[Row]):
        eos = set() if gen.ignore_eos else set(eos_token_ids)
        limit = gen.max_new_tokens
        waiting = list(range(len(prompts)))
        peak_kv = 0
        while waiting or rows:
            while waiting and len(rows) < self.batch_size:
                row, features = self._start(waiting.pop(0), prompts, gen, stats, drafting)
                finished = finish(row.new_ids, 0, limit, eos, should_stop, row.stats)
                self._track_memory(row)
                yield row.index, row.new_ids[:]
                if finished:
                    self._close(row, drafting, peak_kv if len(prompts) > 1 else 0)
                    self.cache.keep_rows(list(range(self.cache.rows - 1)))
                    continue
                rows.append(row)
                drafting.join(row, features)
            if not rows:
                continue
            if self.tree is not None:
                from toolkit.engine.tree import tree_round

                round_ids = tree_round(self, rows[0], gen, limit, drafting)
                chunks = [round_ids] if round_ids is not None else self._round(rows, gen, limit, drafting,
                                                                                draining=not waiting)
            else:
                chunks = self._round(rows, gen, limit, drafting, draining=not waiting)
            peak_kv = max(peak_kv, self.cache.kv_bytes())
            done = []
            for i, (row, chunk) in enumerate(zip(rows, chunks)):
                before = len(row.new_ids)
                row.ids += chunk
                row.new_ids += chunk
                finished = finish(row.new_ids, before, limit, eos, should_stop, row.stats)
                self._track_memory(row)
                if len(row.new_ids) > before:
                    yield row.index, row.new_ids[before:]
                if finished:
                    done.append(i)
            if done:
                for i in done:
                    self._close(rows[i], drafting, peak_kv if len(prompts) > 1 else 0)
                keep = [i for i in range(len(rows)) if i not in done]
                rows[:] = [rows[i] for i in keep]
                self.cache.keep_rows(keep)
                drafting.remove(keep)

    def _start(self, index: int, prompts, gen, stats: list[GenerationStats], drafting):
        """Prefill one request alone into the cache's next row; its first token comes from the target alone. The
        row drafter hears of it before the prefill (``begin``) and after it (``join``, with the prompt's hidden
        states where it asks for them). Returns ``(row, features or None)``."""
        _sync(self.device)
        started = time.perf_counter()
        prompt = prompts[index].view(1, -1)
        input_ids, length = prompt.to(self.device), prompt.shape[-1]
        generator = torch.Generator(device=self.device).manual_seed(gen.seed + index) if gen.do_sample else None
        row = Row(index, length, prompt[0].tolist(), stats[index], generator, started)
        drafting.begin(row)
        prefilled, kwargs = self.cache.begin_row(length)
        logits = self.forward.prefill(input_ids, kwargs, drafting.features)
        logits, features = logits if drafting.features else (logits, None)
        self.cache.add_row(prefilled, length)
        first = int(choose(logits.view(1, -1), gen, generator)[0])  # the prefill's one sync
        row.ids.append(first)
        row.new_ids.append(first)
        row.stats.prompt_tokens, row.stats.target_forwards = length, row.stats.target_forwards + 1
        _sync(self.device)
        row.stats.ttft_ms = (time.perf_counter() - started) * 1000
        return row, features

    def _round(self, rows: list[Row], gen, limit: int, drafting, draining: bool) -> list[list[int]]:
        """Propose, plan, verify, accept and commit once for every row; returns each row's committed ids."""
        started = time.perf_counter()
        draft_limits = [limit - len(r.new_ids) - 1 for r in rows]  # draft tokens that can still be committed
        num_draft_tokens = self.controller.next_k() if self.drafter is not None else 0
        compiled = drafting.compile_ms
        drafting.propose_rows(rows, self._draft_steps(rows, draft_limits, drafting, num_draft_tokens, draining),
                              read=self.controller.uses_confidence)  # else a draft network's tokens stay on device
        drafted_at = time.perf_counter()
        draft_compile_ms = drafting.compile_ms - compiled  # the drafter's own graphs compiling: not drafting
        n, width = (self.controller.plan(rows, batch_weights(draft_limits, draining)) if self.drafter is not None
                    else (0, 1))
        drafted = [min(len(r.proposal), n) for r in rows]
        on_device = drafting.device_proposals
        inputs, counts = self._verify_inputs(rows, drafted, width, on_device)
        compiled = self.forward.compile_ms
        logits = self.forward(self.cache, inputs, drafting.features)
        logits, features = logits if drafting.features else (logits, None)
        result = accept(logits, inputs, counts, drafted, gen, rows)
        accepted, next_ids = self._read(result, rows, on_device)
        verified_at = time.perf_counter()
        compile_ms = self.forward.compile_ms - compiled  # a first call compiled: not the forward's cost
        self.cache.accept(kept(result), [a + 1 for a in accepted])
        self.cache.commit()
        drafting.commit_rows(rows, list(accepted), features)
        self.controller.update(rows, n, list(accepted), list(next_ids))
        chunks = []
        for row, d, a, nxt in zip(rows, drafted, accepted, next_ids):
            chunks.append(row.proposal[:a] + [nxt])
            row.stats.record_round(d, a)
            row.stats.target_forwards += 1
        ended = time.perf_counter()
        verify_ms, share = (verified_at - drafted_at) * 1000 - compile_ms, 1.0 / len(rows)
        compile_ms += draft_compile_ms
        for row in rows:  # a round's time is shared by its rows; each waited for a compile
            row.compile_ms += compile_ms
            row.stats.record_time(((drafted_at - started) * 1000 - draft_compile_ms) * share, verify_ms * share,
                                  ((ended - started) * 1000 - compile_ms) * share, width)
        self.controller.timed(len(rows), width, verify_ms, (ended - verified_at) * 1000)
        return chunks

    def _verify_inputs(self, rows: list[Row], drafted: list[int], width: int, on_device: torch.Tensor | None):
        """The verify forward's inputs ``(B, width)`` (row r: its last committed token, its first ``drafted[r]``
        draft tokens, then padding with the last token) and the draft counts ``(B,)``, on the device: from the
        rows' host proposals (the round's one upload), or, where a draft network left its tokens on the device
        (``on_device`` ``(B, steps)``), assembled there from them and the uploaded last tokens."""
        if on_device is None:
            return self._stage([[r.ids[-1]] + r.proposal[:d] + [r.ids[-1]] * (width - 1 - d)
                                for r, d in zip(rows, drafted)], drafted)  # the round's one upload
        last, counts = self._stage([[r.ids[-1]] for r in rows], drafted)
        drafts = on_device[:, : width - 1]
        if drafts.shape[1] < width - 1:
            drafts = torch.cat([drafts, last.expand(-1, width - 1 - drafts.shape[1])], 1)
        keep = torch.arange(width - 1, device=drafts.device)[None, :] < counts[:, None]
        return torch.cat([last, torch.where(keep, drafts, last)], 1), counts

    @staticmethod
    def _read(result: torch.Tensor, rows: list[Row], on_device: torch.Tensor | None) -> tuple[tuple, tuple]:
        """The round's one device-to-host transfer: each row's accepted count and next token (``result`` ``(B, 2)``),
        and the draft tokens left on the device, which become the rows' proposals."""
        if on_device is None:
            return tuple(zip(*result.tolist()))
        values = torch.cat([result, on_device], 1).tolist()
        for row, v in zip(rows, values):
            row.proposal = v[2: 2 + len(row.proposal)]
        return tuple(zip(*[v[:2] for v in values]))

    def _stage(self, inputs: list[list[int]], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The round's inputs ``(B, W)`` and draft counts ``(B,)`` as long tensors on the target's device, in one
        flat buffer (two contiguous views: the compiled graphs were traced on contiguous inputs). On CUDA through a
        pinned staging buffer and an asynchronous copy: a pageable copy would wait for the GPU's queue, a hidden sync
        (the buffer is free again by the round's device-to-host read)."""
        rows, width = len(inputs), len(inputs[0])
        if self.device.type == "cpu":  # NumPy builds and slices it without ATen calls (a round's host time on a CPU)
            flat = np.array([t for row in inputs for t in row] + counts, dtype=np.int64)
            return torch.from_numpy(flat[: rows * width].reshape(rows, width)), torch.from_numpy(flat[rows * width:])
        flat = torch.tensor([t for row in inputs for t in row] + counts, dtype=torch.long)
        if self.device.type == "cuda":
            if self._pinned is None or self._pinned.numel() < flat.numel():
                self._pinned = torch.empty(max(flat.numel(), 4096), dtype=torch.long).pin_memory()
            staging = self._pinned[: flat.numel()]
            staging.copy_(flat)
            flat = staging.to(self.device, non_blocking=True)
        return flat[: rows * width].view(rows, width), flat[rows * width:]

    def _draft_steps(self, rows: list[Row], draft_limits: list[int], drafting, num_draft_tokens: int,
                     draining: bool) -> list[int]:
        """Draft tokens to ask per row: K for free drafters (and under planners that do not weigh costs); for a draft
        model or EAGLE head under the cost-aware planner, what pays given its measured step
        (:meth:`toolkit.engine.planner.CostAwareK.draft_steps`; 0: plain)."""
        costed = num_draft_tokens and isinstance(self.controller, CostAwareK)
        step_ms = drafting.step_ms(len(rows)) if costed else None
        if step_ms is not None:
            num_draft_tokens = self.controller.draft_steps(batch_weights(draft_limits, draining), draft_limits,
                                                           step_ms, drafting.acceptance)
        return [max(0, min(num_draft_tokens, limit)) for limit in draft_limits]

    # ------------------------------------------------------------------------------------------------ reports
    def _track_memory(self, row: Row) -> None:
        stats = row.stats
        if self.cache.rows <= 1:
            stats.kv_bytes_target = self.cache.kv_bytes()
            stats.peak_kv_bytes_target = max(stats.peak_kv_bytes_target, stats.kv_bytes_target)
            stats.peak_kv_bytes_needed_target = max(stats.peak_kv_bytes_needed_target, self.cache.needed_bytes())
        cache = self._drafting_now.draft_cache(row) if self._drafting_now is not None else None
        if cache is not None:
            stats.kv_bytes_draft = cache.kv_bytes()
            stats.peak_kv_bytes_draft = max(stats.peak_kv_bytes_draft, stats.kv_bytes_draft)

    def _close(self, row: Row, drafting, peak_batch: int) -> None:
        stats = row.stats
        stats.new_tokens = len(row.new_ids)
        stats.compressions_target = self.cache.compressions
        stats.peak_kv_bytes_batch = peak_batch
        draft_cache = drafting.draft_cache(row)
        if draft_cache is not None:
            stats.compressions_draft = draft_cache.compressions
        drafting.close_row(row)
        _sync(self.device)
        stats.compile_ms += row.compile_ms
        stats.total_ms = (time.perf_counter() - row.started) * 1000 - row.compile_ms

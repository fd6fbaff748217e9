"""A draft LM drafting for every row of a batch at once: one draft forward per step over ``(B, 1)`` tokens, from its
own ragged cache (:class:`~toolkit.kv.ragged.BatchCache`), with exact per-row rollback.

A round (see the batch drafter protocol in :mod:`toolkit.speculative.drafters.rows`)::

    prefill    rows drafting for the first time: the prompt alone into the row's empty slots (a row that only
               ever takes plain steps never pays it)
    catch up   ONE forward over (B, c): row r feeds the committed tokens its draft cache has not seen (1 or 2 after
               a speculative round, more after plain steps), padded to the widest c; its next-token logits are
               read at its own last real input
    draft      steps - 1 forwards over (B, 1), each row feeding the token it just drafted (greedy argmax, or a
               sample from q = the processed draft distribution, with the row's own generator)
    commit     row r keeps in the draft cache its committed prefix: what it held, plus its drafted tokens the
               target accepted that were fed (``min(accepted, steps - 1)``); the rest lies past its length and is
               overwritten by its next forward (no copy, no recomputation)

The number of steps is chosen by the decoder from :meth:`BatchDraftModel.step_ms` (what a draft forward over B rows
takes: a probe forward, then the moving average of the drafting rounds) and the acceptance per draft position
(``acceptance``, learned from the rounds, read optimistically so that a length rarely drafted is tried again: see
:meth:`toolkit.engine.planner.CostAwareK.draft_steps`), so that drafting pays: ``0`` steps makes the round a batched
plain step.
This is the draft-model path of HF assisted generation (Leviathan et al., 2023) over a batch, with vLLM's rule that
the draft length shrinks as the batch grows (a draft step over B rows costs more as B grows, a verify token costs
more once the target stops being memory-bound).

Only a draft with the target's vocabulary and an uncompressed draft cache runs here (``drafter: draft_model`` or
``self``); cross-tokenizer drafting and compressed draft caches decode one request at a time.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from toolkit.dtypes import mask_dtype
from toolkit.kv.ragged import BatchCache
from toolkit.speculative.drafters.rows import ModelBatchDrafter
from toolkit.speculative.verify import process_logits


class BatchDraftModel(ModelBatchDrafter):
    """A causal LM sharing the target's vocabulary, drafting for a whole batch (see the module docstring).

    Args:
        model: the draft LM (any precision the toolkit loads; its batch dimension is used).
        do_sample / temperature / top_k / top_p: how draft tokens are chosen (the target's settings, so that p and q
            are comparable).
        seed: row ``i`` of a call samples its draft tokens with a generator seeded ``seed + 1 + i``.
        confidence_threshold: a row stops drafting in a round once the draft's top probability falls below it (HF
            dynamic speculation); ``None`` drafts every step.
        acceptance: as :class:`~toolkit.speculative.drafters.rows.ModelBatchDrafter`.
    """

    def __init__(self, model, *, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, confidence_threshold: float | None = None, acceptance=None):
        super().__init__(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         acceptance=acceptance)
        self.model, self.confidence_threshold = model, confidence_threshold
        self.device = next(model.parameters()).device
        self.dtype = mask_dtype(model)
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self.cache = BatchCache(layers, self.device)
        self._steps = 0  # draft forwards of the current round (the catch-up and the steps after it)

    # ------------------------------------------------------------------------------------------------ rows
    def join(self, row) -> None:
        """A new row: its draft cache stays empty until the row first drafts (:meth:`_prefill`), so rounds that
        only take plain steps never pay a draft prefill."""
        self.cache.join_empty()
        self._join_generator(row, self.device)

    def remove(self, keep: list[int]) -> None:
        self.cache.remove(keep)
        self._remove_generators(keep)

    def _probe(self, rows: int) -> None:
        self.model(input_ids=torch.zeros(rows, 1, dtype=torch.long, device=self.device), use_cache=False,
                   logits_to_keep=1)

    # ------------------------------------------------------------------------------------------------ a round
    @torch.inference_mode()
    def propose(self, rows: list, num_draft_tokens: list[int]) -> None:
        """Draft ``max(num_draft_tokens)`` steps for every row (row ``i`` keeps at most ``num_draft_tokens[i]``
        tokens)."""
        num_draft_tokens = list(num_draft_tokens)
        steps = max(num_draft_tokens, default=0)  # most draft steps (forwards) of the batch
        self._steps = 0
        for row in rows:
            row.proposal, row.confidence, row.q = [], None, None
        if steps == 0:
            return
        self._prefill(rows)  # once per row: not a per-step cost
        started = time.perf_counter()
        logits = self._catch_up(rows)
        live = [n > 0 for n in num_draft_tokens]
        drafted, confidences, probs = [], [], []
        for step in range(steps):
            p = process_logits(logits, self.temperature, self.top_k, self.top_p)  # (B, vocab)
            token = self._choose(logits, p)
            drafted.append(token)
            confidences.append(p.max(-1).values)
            probs.append(p)
            if self.confidence_threshold is not None:
                for i, c in enumerate(confidences[-1].tolist()):
                    if c < self.confidence_threshold and live[i]:
                        live[i] = False  # this row's proposal ends with this token
                        num_draft_tokens[i] = min(num_draft_tokens[i], step + 1)
            if step + 1 == steps or not any(live[i] and num_draft_tokens[i] > step + 1 for i in range(len(rows))):
                break
            logits = self._forward(token.view(-1, 1), torch.ones(len(rows), dtype=torch.long, device=self.device))
        self._steps = len(drafted)
        self._observe_time(len(rows), (time.perf_counter() - started) * 1000 / len(drafted))  # catch-up + steps
        tokens, conf = torch.stack(drafted, 1).tolist(), torch.stack(confidences, 1).tolist()
        q = torch.stack(probs, 1) if self.do_sample else None  # (B, steps, vocab)
        for i, row in enumerate(rows):
            n = min(num_draft_tokens[i], len(drafted))
            row.proposal, row.confidence = tokens[i][:n], conf[i][:n]
            row.q = None if q is None else q[i, :n]
            row.stats.draft_forwards += len(drafted)

    def commit(self, rows: list, accepted: list[int]) -> None:
        """Keep each row's committed prefix in the draft cache (see the module docstring)."""
        fed = max(0, self._steps - 1)  # drafted tokens fed back (the last one never is)
        self._observe_acceptance(rows, accepted)
        kept = torch.tensor([min(a, fed) for a in accepted], device=self.device)
        self.cache.rollback(self.cache.lengths - fed + kept)

    # ------------------------------------------------------------------------------------------------ forwards
    def _prefill(self, rows: list) -> None:
        """Prefill alone, into its empty row, every row drafting for the first time: its prompt (``row.ids`` but
        its first generated token)."""
        for r in torch.nonzero(self.cache.lengths == 0).flatten().tolist():
            prompt = torch.tensor([rows[r].ids[:rows[r].prompt_len]], device=self.device)
            prefill = DynamicCache()
            self.model(input_ids=prompt, past_key_values=prefill, use_cache=True, logits_to_keep=1)
            self.cache.fill(r, prefill, prompt.shape[1] + 1)
            rows[r].stats.draft_forwards += 1

    def _catch_up(self, rows: list) -> torch.Tensor:
        """Feed every row the committed tokens its cache lacks; returns next-token logits ``(B, vocab)``."""
        held = self.cache.lengths.tolist()
        pending = [row.ids[h:] for row, h in zip(rows, held)]
        width = max(len(p) for p in pending)
        inputs = torch.tensor([p + [p[-1]] * (width - len(p)) for p in pending], device=self.device)
        counts = torch.tensor([len(p) for p in pending], device=self.device)
        return self._forward(inputs, counts)

    def _forward(self, inputs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One draft forward over ``inputs`` ``(B, width)`` (row ``r``'s first ``counts[r]`` real); the cache keeps
        those; returns each row's logits at its last real input ``(B, vocab)``."""
        width = inputs.shape[1]
        out = self.model(input_ids=inputs, past_key_values=self.cache.cache, use_cache=True, logits_to_keep=width,
                         **self.cache.forward_inputs(width, self.dtype))
        self.cache.accept(counts)
        last = (counts - 1).view(-1, 1, 1).expand(-1, 1, out.logits.shape[-1])
        return out.logits.gather(1, last)[:, 0]

    def _choose(self, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return self._sample(probs) if self.do_sample else logits.argmax(-1)

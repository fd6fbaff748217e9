"""An EAGLE head drafting for every row of a batch at once (Li et al. 2024, EAGLE / EAGLE-3): one head forward per
step over ``(B, 1)``, from a ragged head cache (:class:`~toolkit.kv.ragged.BatchCache` with one layer),
fed with the features the target's batched forwards leave in a hook.

The head cache of row ``r`` holds its *true pairs* ``(feature_t, token_{t+1})`` at positions ``0 .. fed[r] - 1``
(as :class:`~toolkit.speculative.drafters.eagle.EagleDrafter` does for one sequence). A round::

    catch up   ONE head forward over (B, p): row r feeds its pending true pairs (the prompt's features after its
               prefill; then the 1 + accepted features of each verify forward since it last drafted), padded to the
               widest; its first draft token comes from its last real output
    draft      steps - 1 head forwards over (B, 1): the head's own output paired with the token it just drafted, at
               the next position (greedy argmax over the draft vocabulary, or a sample from q = the head's
               distribution in the target vocabulary, zero outside the draft vocabulary)
    commit     every row's head cache goes back to its true pairs (the draft steps lie past its length and are
               overwritten); the verify forward's features of the row's last committed token and its accepted
               drafts become its pending pairs

The feature hook is installed for a whole batched call (:meth:`BatchEagle.attached`), so a request's prefill — run
alone when it joins — leaves its prompt's features for :meth:`BatchEagle.join`, and every batched verify forward
leaves ``(B, W, F)`` features for :meth:`BatchEagle.commit`. The number of steps is chosen by the decoder from the
head's step cost and the learned acceptance (:class:`~toolkit.speculative.drafters.rows.ModelBatchDrafter`).
"""

from __future__ import annotations

import contextlib
import time

import torch

from toolkit.eagle.features import FeatureHook
from toolkit.kv.ragged import BatchCache
from toolkit.speculative.drafters.rows import ModelBatchDrafter
from toolkit.speculative.verify import process_logits


class _RaggedHeadCache:
    """The head attention's cache interface (``len``, ``append``) over one :class:`BatchCache` layer."""

    def __init__(self, batch: BatchCache):
        self.layer = batch.cache.layers[0]

    def __len__(self) -> int:
        return 0  # the head always gets an explicit mask: its causal default is never built

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.update(k, v)


class BatchEagle(ModelBatchDrafter):
    """An EAGLE head over a batch (see the module docstring).

    Args:
        target: the HF causal LM being decoded (its feature layer(s) get the hook during a batched call).
        head: a loaded :class:`~toolkit.eagle.head.EagleHead` (EAGLE-1 or EAGLE-3) on the target's device.
        do_sample / temperature / top_k / top_p / seed / acceptance: as :class:`ModelBatchDrafter`.
    """

    def __init__(self, target, head, *, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, acceptance=None):
        super().__init__(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         acceptance=acceptance)
        self.target, self.head = target, head
        self.device = head.lm_head.weight.device
        self.dtype = next(head.parameters()).dtype
        self.cache = BatchCache(1, self.device)
        self.pending: list[torch.Tensor] = []  # per row: features (p, F) of the true pairs not yet fed
        self.hook: FeatureHook | None = None
        self._fed: torch.Tensor | None = None  # (B,) true pairs after this round's catch-up

    @contextlib.contextmanager
    def attached(self):
        """The target's feature hook, for one batched call."""
        self.hook = FeatureHook(self.target, self.head.config.feature_layers)
        try:
            yield self
        finally:
            self.hook.close()
            self.hook = None

    # ------------------------------------------------------------------------------------------------ rows
    def join(self, row) -> None:
        """A new row, right after its prefill: the prompt's features become its pending pairs."""
        if self.hook is None:
            raise RuntimeError("BatchEagle.join outside attached(): no feature hook installed")
        self.pending.append(self.hook.features()[0, :row.prompt_len])
        self.cache.join_empty()
        self._join_generator(row, self.device)

    def remove(self, keep: list[int]) -> None:
        self.cache.remove(keep)
        self.pending = [self.pending[i] for i in keep]
        self._remove_generators(keep)

    def _probe(self, rows: int) -> None:
        tokens = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        x = torch.zeros(rows, 1, self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        out, _ = self.head(x, tokens, tokens)
        self.head.logits(out)

    # ------------------------------------------------------------------------------------------------ a round
    @torch.inference_mode()
    def propose(self, rows: list, num_draft_tokens: list[int]) -> None:
        """Draft ``max(num_draft_tokens)`` steps for every row (row ``i`` keeps at most ``num_draft_tokens[i]``
        tokens)."""
        steps = max(num_draft_tokens, default=0)  # draft steps (head forwards) of the batch
        self._fed = None
        for row in rows:
            row.proposal, row.confidence, row.q = [], None, None
        if steps == 0:
            return
        started = time.perf_counter()
        last = self._catch_up(rows)
        self._fed = self.cache.lengths.clone()
        drafted, confidences, probs = [], [], []
        for step in range(steps):
            token, confidence, q = self._choose(self.head.logits(last))
            drafted.append(token)
            confidences.append(confidence)
            probs.append(q)
            if step + 1 == steps:
                break
            tok = token.view(-1, 1)
            out = self._forward(self.head.step_input(last[:, None], tok), tok,
                                torch.ones(len(rows), dtype=torch.long, device=self.device))
            last = out[:, 0]
        self._observe_time(len(rows), (time.perf_counter() - started) * 1000 / steps)  # catch-up + steps - 1
        tokens, conf = torch.stack(drafted, 1).tolist(), torch.stack(confidences, 1).tolist()
        for i, row in enumerate(rows):
            n = min(num_draft_tokens[i], steps)
            row.proposal, row.confidence = tokens[i][:n], conf[i][:n]
            row.q = torch.stack([q[i] for q in probs[:n]]) if self.do_sample else None
            row.stats.draft_forwards += steps

    def commit(self, rows: list, accepted: list[int]) -> None:
        """Back to the true pairs; the verify forward's features of each row's committed tokens become pending."""
        self._observe_acceptance(rows, accepted)
        if self._fed is not None:
            self.cache.rollback(self._fed)
        features = self.hook.features()  # (B, W, F): the batched verify forward just run
        for i, a in enumerate(accepted):
            self.pending[i] = torch.cat([self.pending[i], features[i, :a + 1]])

    # ------------------------------------------------------------------------------------------------ forwards
    def _catch_up(self, rows: list) -> torch.Tensor:
        """Feed every row its pending true pairs; returns each row's last real output ``(B, H)``."""
        fed = self.cache.lengths.tolist()
        counts = [p.shape[0] for p in self.pending]
        width = max(counts)
        features = torch.stack([torch.cat([p, p[-1:].expand(width - len(p), -1)]) for p in self.pending])
        tokens = torch.tensor([row.ids[f + 1:f + 1 + c] + [row.ids[-1]] * (width - c)
                               for row, f, c in zip(rows, fed, counts)], device=self.device)
        count = torch.tensor(counts, device=self.device)
        out = self._forward(self.head.input_features(features.to(self.dtype), tokens), tokens, count)
        self.pending = [p[:0] for p in self.pending]
        return out[torch.arange(len(rows), device=self.device), count - 1]

    def _forward(self, x: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One head forward over ``x`` ``(B, width, H)`` at each row's next positions; the cache keeps each row's
        first ``counts[r]``; returns the outputs ``(B, width, H)``."""
        inputs = self.cache.forward_inputs(x.shape[1], self.dtype)
        out, _ = self.head(x, tokens, inputs["position_ids"], _RaggedHeadCache(self.cache),
                           inputs["attention_mask"] == 0)
        self.cache.accept(counts)
        return out

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Head logits ``(B, draft_vocab)`` -> (target token ids ``(B,)``, top probability ``(B,)``, q ``(B, vocab)``
        or None under greedy)."""
        if not self.do_sample:
            probs = torch.softmax(logits.float(), -1)
            best = probs.argmax(-1)
            return self.head.draft_to_target[best], probs.gather(1, best[:, None])[:, 0], None
        q = process_logits(self.head.to_target_vocab(logits), self.temperature, self.top_k, self.top_p)
        return self._sample(q), q.max(-1).values, q

"""EAGLE drafter: drafts from the target's own features with a one-layer head (Li et al. 2024, EAGLE; EAGLE-3), for
every row in flight at once (one sequence is a batch of one).

The features come from the target's own forwards, compiled or eager, without hooks: the drafter asks for them
through :attr:`EagleDrafter.features` (indices into HF's ``hidden_states``: the last layer's output after the final
norm for EAGLE-1, three layers' outputs for EAGLE-3; :func:`toolkit.eagle.features.hidden_indices`), and the decoder's
target forward returns them with its logits (:func:`toolkit.engine.forward.select_hidden`): the prefill's to
:meth:`EagleDrafter.join`, each verify forward's to :meth:`EagleDrafter.commit_rows`.

The head cache of row ``r`` holds its *true pairs* ``(feature_t, token_{t+1})`` at positions ``0 .. fed - 1`` on a
static cache (:func:`toolkit.eagle.static_head.head_cache`, kept and reused by later calls it can hold); the head's
step is compiled where the target's forward is, on CUDA graphs where the target's is
(:class:`~toolkit.eagle.static_head.HeadForward`). A round::

    catch up   ONE head step over (B, p): row r feeds its pending true pairs (the prompt's features after its
               prefill; then the 1 + accepted features of each verify forward since it last drafted), padded to the
               widest; its first draft token comes from its last real output
    draft      steps - 1 head steps over (B, 1): the head's own output paired with the token it just drafted, at the
               next position (greedy argmax over the draft vocabulary, or a sample from q = the head's distribution in
               the target vocabulary, zero outside the draft vocabulary)
    hand over  ONE device-to-host read of every drafted token and its confidence
    commit     every row's head cache goes back to its true pairs (the draft steps lie past its length and are
               overwritten); the verify forward's features of the row's last committed token and its accepted drafts
               become its pending pairs

Tree rounds (EAGLE-2 dynamic trees, one row; the tree decoder of :mod:`toolkit.engine.tree`): the same static head
cache and step. ``propose_tree_row`` catches up as a chain round does, then expands each level's chosen nodes in ONE
head step appended to the row's tree region under a tree mask (:mod:`toolkit.kv.static_tree`: a node sees the true
pairs, its ancestors and itself, at position ``last true pair + depth``); ``commit_tree_row`` rolls the region back
and keeps the tree verify forward's features of the root and the accepted path as pending pairs. Trees are
deterministic top-k proposals (one-hot drafts to verification: lossless under sampling too).

Draft tokens come from the head's (reduced) draft vocabulary; under sampling q is the head's distribution scattered
into the target vocabulary, exactly zero outside the draft vocabulary, so speculative sampling stays lossless.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from toolkit.eagle.features import hidden_indices
from toolkit.eagle.head import EagleHead
from toolkit.eagle.static_head import HeadForward, head_cache
from toolkit.engine.forward import CUDA_BATCH_SIZES, CUDA_WIDTHS, bucket
from toolkit.kv.static_tree import TreeInputs
from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD, DrafterConfig, register_drafter
from toolkit.speculative.drafters.rows import ModelDrafter
from toolkit.speculative.verify import process_logits


@dataclass
class EagleConfig(DrafterConfig):
    """``drafter: eagle`` — an EAGLE feature-level head: ``draft.source`` is the head directory (or ``embedded``
    for the head shipped for the embedded target), ``draft.precision`` its dtype (fp32, bf16 or fp16) or
    int8 (torchao int8 weight-only linears at bf16 activations: :mod:`toolkit.eagle.precision`)."""

    name = "eagle"
    draft = DRAFT_EAGLE_HEAD
    tree = True
    batch = True  # one head step per draft step over the batch
    vllm_method = "eagle"
    sglang_algorithm = "EAGLE"


@register_drafter(EagleConfig)
class EagleDrafter(ModelDrafter):
    """Feature-level drafter over a loaded :class:`toolkit.eagle.head.EagleHead` (see the module docstring).

    Args:
        target: the HF causal LM being decoded (its config gives the feature layers' indices).
        head: the head (:func:`toolkit.eagle.checkpoint.load_head`), any float dtype on the target's device.
        do_sample / temperature / top_k / top_p / seed / generator / acceptance: as
            :class:`~toolkit.speculative.drafters.rows.ModelDrafter`.
        compile / backend / buckets: compile the head's step (:class:`~toolkit.eagle.static_head.HeadForward`;
            ``buckets`` default: on CUDA, where the step is a CUDA graph).

    Raises:
        ValueError: feature layers the target's hidden states cannot give (see
            :func:`~toolkit.eagle.features.hidden_indices`).
    """

    def __init__(self, target, head: EagleHead, *, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, generator: torch.Generator | None = None, acceptance=None,
                 compile: bool = False, backend: str = "inductor", buckets: bool | None = None):
        super().__init__(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         generator=generator, acceptance=acceptance)
        self.target, self.head = target, head
        self.features = hidden_indices(target, head.config.feature_layers)
        self.device = head.lm_head.weight.device
        self.dtype = next(head.parameters()).dtype
        self.step = HeadForward(head, compile=compile, backend=backend, buckets=buckets)
        self.cache = None  # the head's static cache
        self.pending: list[torch.Tensor] = []  # per row: features (p, F) of the true pairs not yet fed
        self._held: list[int] = []  # per row: true pairs (and, during a round, draft steps) in the head cache
        self._steps = 0
        self._region = 0  # a tree round's expanded nodes in the head cache

    @classmethod
    def from_config(cls, config: EagleConfig, context) -> EagleDrafter:
        return cls(context.target, context.draft_model, do_sample=context.do_sample, temperature=context.temperature,
                   top_k=context.top_k, top_p=context.top_p, seed=context.seed, acceptance=context.acceptance,
                   compile=context.compile, backend=context.backend)

    # ------------------------------------------------------------------------------------------------ rows
    def start(self, rows: int, capacity: int, widest: int, gen, tree=None) -> None:
        """The head cache of this call: static rows; token trees (``tree``, a
        :class:`~toolkit.speculative.tree.TreeShape`) widen its forwards to an expansion region (``depth - 1`` levels
        of ``topk`` nodes)."""
        self._start_rows()
        self.pending, self._held, self._region = [], [], 0
        if tree is not None:
            region = (tree.depth - 1) * tree.topk
            capacity, widest = capacity + max(0, region - widest), max(widest, region)
        static = self.step.static_span
        if static:  # rows for the batch bucket; room for a step padded to its width bucket past any row's entries
            rows = bucket(rows, CUDA_BATCH_SIZES)  # the target's cache_for refused more rows than the largest
            capacity += CUDA_WIDTHS[-1]
        cached = self.cache
        if cached is not None and cached.allocated >= rows and cached.fits(capacity) and cached.widest >= widest \
                and cached.static_span == static:
            cached.keep_rows([])  # the same buffers: compiled graphs and captured CUDA graphs keep their addresses
        else:
            self.cache = head_cache(self.head, rows, capacity, widest, static_span=static)

    def draft_cache(self, row):
        return self.cache

    def join(self, row, features: torch.Tensor | None = None) -> None:
        """A new row, right after its prefill: the prompt's features ``(1, n, F)`` become its pending pairs.

        Raises:
            RuntimeError: no features (the decoder's forward was not asked for :attr:`features`)."""
        if features is None:
            raise RuntimeError("EagleDrafter.join: no features of the prompt (the target forward must return the "
                               "hidden states this drafter asks for)")
        self.pending.append(features[0, :row.prompt_len])
        self._held.append(0)
        self.cache.add_row(self.cache.begin_row(0)[0], 0)  # an empty row: true pairs come with the catch-up
        self._join_generator(row, self.device)

    def remove(self, keep: list[int]) -> None:
        self.cache.keep_rows(keep)
        self.pending = [self.pending[i] for i in keep]
        self._held = [self._held[i] for i in keep]
        self._remove_generators(keep)

    def _probe(self, rows: int) -> None:
        tokens = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        x = torch.zeros(rows, 1, self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        out, _ = self.head(x, tokens, tokens)
        self.head.logits(out)

    # ------------------------------------------------------------------------------------------------ a round
    @torch.inference_mode()
    def propose_rows(self, rows: list, num_draft_tokens: list[int], read: bool = True) -> None:
        """Draft ``max(num_draft_tokens)`` steps for every row (row ``i`` keeps at most ``num_draft_tokens[i]``)."""
        steps = self._new_round(rows, num_draft_tokens)  # draft steps (head steps) of the batch
        if steps == 0:
            return
        started, compiled = time.perf_counter(), self.step.compile_ms
        last, logits = self._catch_up(rows)
        ones = torch.ones(len(rows), dtype=torch.long, device=self.device)
        drafted, confidences, probs = [], [], []
        for step in range(steps):
            token, confidence, q = self._choose(logits)
            drafted.append(token)
            confidences.append(confidence)
            probs.append(q)
            if step + 1 == steps:
                break
            last, logits = self.step(self.cache, last[:, None], token.view(-1, 1), ones, [1] * len(rows), False)
        self._steps = steps
        self._held = [h + steps - 1 for h in self._held]
        compile_ms = self.step.compile_ms - compiled
        self.compile_ms += compile_ms
        self._observe_time(len(rows), ((time.perf_counter() - started) * 1000 - compile_ms) / steps)
        self._hand_over(rows, num_draft_tokens, drafted, confidences, probs, read)

    def commit_rows(self, rows: list, accepted: list[int], features: torch.Tensor | None = None) -> None:
        """Back to the true pairs; the verify forward's features of each row's committed tokens become pending."""
        self._observe_acceptance(rows, accepted)
        drafted = max(0, self._steps - 1)  # head steps past the true pairs
        if drafted:
            self.cache.accept(torch.full((len(rows),), -drafted, device=self.device), [-drafted] * len(rows))
            self._held = [h - drafted for h in self._held]
        self._steps = 0
        for i, a in enumerate(accepted):  # a copy: the forward's outputs may be overwritten (CUDA graphs)
            self.pending[i] = torch.cat([self.pending[i], features[i, :a + 1]])

    def _catch_up(self, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row its pending true pairs; returns each row's last real output ``(B, H)`` and its logits."""
        counts = [p.shape[0] for p in self.pending]
        width = max(counts)
        features = torch.stack([torch.cat([p, p[-1:].expand(width - len(p), -1)]) for p in self.pending])
        tokens = torch.tensor([row.ids[f + 1:f + 1 + c] + [row.ids[-1]] * (width - c)
                               for row, f, c in zip(rows, self._held, counts)], device=self.device)
        out = self.step(self.cache, features, tokens, torch.tensor(counts, device=self.device), counts, True)
        self._held = [h + c for h, c in zip(self._held, counts)]
        self.pending = [p[:0] for p in self.pending]
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

    # ------------------------------------------------------------------------------------------------ trees
    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Head logits ``(m, draft_vocab)`` -> target-vocabulary log-probabilities ``(m, vocab)`` (``-inf``
        outside)."""
        return self.head.to_target_vocab(torch.log_softmax(logits.float(), dim=-1))

    @torch.inference_mode()
    def propose_tree_row(self, row, budget: int, depth: int, topk: int):
        """EAGLE-2 dynamic tree after the row's committed tokens: at most ``budget`` nodes, ``depth`` levels, ``topk``
        children per expanded node. Head steps: the catch-up over the pending true pairs, then one per level below
        the first over the (at most ``topk``) expanded nodes, appended to the head cache's tree region (entry ``k``
        at position ``true pairs - 1 + depth``, depth offset ``depth - 1``). Returns a ``TokenTree``
        (``draft_probs = None``)."""
        from toolkit.speculative.tree import TreeShape
        from toolkit.speculative.tree_dynamic import build_dynamic_tree

        device, started, compiled = self.device, time.perf_counter(), self.step.compile_ms
        root, root_logits = self._catch_up([row])
        row.stats.draft_forwards += 1
        outputs: dict[int, torch.Tensor] = {-1: root[0]}
        parents: list[int] = []  # per region entry: its parent's region index (-1: the root, the last true pair)
        offsets: list[int] = []  # per region entry: depth - 1
        region_of: dict[int, int] = {}

        def expand(nodes: list[int], tokens: list[int], node_parents: list[int], depths: list[int]) -> torch.Tensor:
            m = len(nodes)
            for node, parent, d in zip(nodes, node_parents, depths):
                region_of[node] = len(parents)
                parents.append(region_of.get(parent, -1))
                offsets.append(d - 1)
            region = TreeInputs.build(parents, offsets, m, rooted=False, device=device)
            source = torch.stack([outputs[p] for p in node_parents]).unsqueeze(0)  # (1, m, H)
            out, logits = self.step(self.cache, source, torch.tensor([tokens], device=device),
                                    torch.full((1,), m, dtype=torch.long, device=device), [m], False, tree=region)
            row.stats.draft_forwards += 1
            for r, node in enumerate(nodes):
                outputs[node] = out[0, r]
            return self._log_probs(logits[0])

        tree, _ = build_dynamic_tree(self._log_probs(root_logits)[0], expand, TreeShape(budget, depth, topk), depth)
        self._region = len(parents)
        compile_ms = self.step.compile_ms - compiled
        self.compile_ms += compile_ms
        self._observe_time(1, (time.perf_counter() - started) * 1000 - compile_ms)
        return tree

    def commit_tree_row(self, row, path: list[int], features: torch.Tensor | None = None) -> None:
        """Roll the tree region back (true pairs only); the tree verify forward's features of the root and the
        accepted path's nodes become the row's pending pairs."""
        if self._region:
            self.cache.accept(torch.full((1,), -self._region, device=self.device), [-self._region])
            self._region = 0
        self.pending[0] = features[0, [0] + [node + 1 for node in path]]

"""A small causal LM as drafter (also the target's own weights at low precision: the ``self`` drafter), drafting for
every row in flight at once — one sequence is a batch of one — on its own cache, through the decoder's forward engine.

The draft network runs on the same engine as the target (:class:`~toolkit.engine.forward.TargetForward`): on its
own static cache (:class:`~toolkit.kv.static.StaticKV`, gpt-fast's layout) its forwards are compiled where the
recipe compiles (CPU: a graph for one-token steps and one for wider forwards; CUDA: CUDA graphs over buckets), and
rollback is moving per-row lengths; a draft KV policy has its static form there too. A draft the static cache does not
hold (:func:`~toolkit.kv.rows.static_why`) drafts chains one request at a time on the policy's single-sequence cache
(:class:`~toolkit.kv.rows.SingleRowCache`), eager.

A round (the row protocol of :mod:`toolkit.speculative.drafters.rows`)::

    join       a request's prompt is prefilled alone into the next row of the draft cache
    catch up   ONE forward over (B, c): row r feeds the committed tokens its draft cache has not seen (1 or 2 after
               a speculative round, more after plain steps), padded to the widest c; its next-token logits are read
               at its own last real input (a KIVI static cache, whose fp residual holds one forward's tokens between
               commit points, takes them in forwards of at most its widest, each followed by a commit point)
    draft      steps - 1 forwards over (B, 1), each row feeding the token it just drafted (greedy argmax, or a
               sample from q = the processed draft distribution, with the row's own generator)
    hand over  ONE device-to-host read of every drafted token and its confidence
    commit     row r keeps in the draft cache its committed prefix: what it held, plus its drafted tokens the target
               accepted that were fed (``min(accepted, steps - 1)``); the rest lies past its length and is
               overwritten by its next forward (no copy, no recomputation)

The number of steps is the decoder's: K, or under the cost-aware planner what pays given :meth:`DraftModel.step_ms`
(a probe step, then the moving average of drafting rounds) and the acceptance per draft position (vLLM's rule that
the draft length shrinks as the batch grows). This is HF assisted generation's draft-model path (Leviathan et al.,
2023) over a batch.

Token trees (one row, :meth:`DraftModel.propose_tree_row`): an EAGLE-2 dynamic tree
(:mod:`toolkit.speculative.tree_dynamic`) on the same static cache and forward: the catch-up, then one draft forward
per level over the expanded nodes, appended to the row's tree region under a tree mask
(:mod:`toolkit.kv.static_tree`); after verification the accepted path's expanded nodes are gathered into place and
the rest rolled back (``keep_tree``, then lengths). Tree children are the top-k of q (chosen, not sampled), so
sampling verification treats them as one-hot drafts (lossless).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from toolkit.checks import check_float
from toolkit.engine.forward import TargetForward
from toolkit.kv.contract import policy_attached
from toolkit.kv.static import StaticKV, capacity_for
from toolkit.kv.static_tree import TreeInputs
from toolkit.speculative.drafters.registry import DRAFT_MODEL, DRAFT_TARGET, DrafterConfig, register_drafter
from toolkit.speculative.drafters.rows import ModelDrafter
from toolkit.speculative.verify import process_logits

#: most tokens one catch-up forward feeds per row where forwards are not bounded otherwise (bucketed CUDA graphs
#: bound it by their widest bucket, a StreamingLLM ring and a KIVI residual by the widest forward they leave room for)
CATCH_UP_CHUNK = 512


@dataclass
class DraftModelConfig(DrafterConfig):
    """``drafter: draft_model`` — the recipe's ``draft`` section is a small causal LM sharing the target's vocabulary.

    Attributes:
        confidence_threshold: stop drafting a round early when the draft's top probability falls below this (HF
            dynamic speculation), in [0, 1]; ``None`` drafts all K.
    """

    name = "draft_model"
    draft = DRAFT_MODEL
    tree = True
    batch = True  # one draft forward per step over the batch
    hf_baseline = "assisted"
    vllm_method = "draft_model"
    sglang_algorithm = "STANDALONE"
    confidence_threshold: float | None = None

    def validate(self, prefix: str) -> None:
        if self.confidence_threshold is not None:
            check_float(f"{prefix}.confidence_threshold", self.confidence_threshold, low=0.0, high=1.0)

    def engine_gaps(self, engine: str) -> list[tuple[str, str]]:
        if self.confidence_threshold is None:
            return []
        return [("confidence_threshold", (f"{self.confidence_threshold} — early stop of a drafting round on low "
                                          "draft confidence"))]


@dataclass
class SelfDraftConfig(DraftModelConfig):
    """``drafter: self`` — the target's own weights at ``draft.precision`` (e.g. int4) draft for it."""

    name = "self"
    draft = DRAFT_TARGET


@register_drafter(SelfDraftConfig)
@register_drafter(DraftModelConfig)
class DraftModel(ModelDrafter):
    """A causal LM sharing the target's vocabulary, drafting for every row (see the module docstring).

    Args:
        model: the draft LM (any precision the toolkit loads, any device).
        policy: KV policy of the draft cache (``None`` = uncompressed; a policy without a static form drafts one
            request at a time).
        do_sample / temperature / top_k / top_p / seed / generator / acceptance: as
            :class:`~toolkit.speculative.drafters.rows.ModelDrafter`.
        confidence_threshold: a row stops drafting in a round once the draft's top probability falls below it (HF
            dynamic speculation; one host read per step); ``None`` drafts every step.
        forward: the draft network's :class:`~toolkit.engine.forward.TargetForward` (compiled or eager; a
            SpeculativeLM keeps one, so its static cache and graphs serve every call); default: eager.
    """

    def __init__(self, model, policy=None, *, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, generator: torch.Generator | None = None,
                 confidence_threshold: float | None = None, acceptance=None, forward: TargetForward | None = None):
        super().__init__(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         generator=generator, acceptance=acceptance)
        self.model, self.policy, self.confidence_threshold = model, policy, confidence_threshold
        self.forward = forward or TargetForward(model, name="draft")
        self.device = next(model.parameters()).device
        self.cache = None
        self._held: list[int] = []  # per row: tokens its draft cache represents (host-side)
        self._steps = 0  # draft forwards of the current round (the catch-up and the steps after it)
        self._chunk = CATCH_UP_CHUNK
        self._region, self._region_of = 0, {}  # a tree round's expanded nodes: how many, candidate -> region index

    @classmethod
    def from_config(cls, config: DraftModelConfig, context):
        """The draft LM drafter; across tokenizers when the context carries a draft tokenizer (another vocabulary)."""
        if context.draft_tokenizer is not None:
            from toolkit.speculative.drafters.cross_tokenizer import CrossTokenizerDrafter

            return CrossTokenizerDrafter(context.draft_model, context.draft_tokenizer, context.tokenizer,
                                         context.draft_policy)
        return cls(context.draft_model, context.draft_policy, do_sample=context.do_sample,
                   temperature=context.temperature, top_k=context.top_k, top_p=context.top_p, seed=context.seed,
                   confidence_threshold=config.confidence_threshold, acceptance=context.acceptance,
                   forward=context.draft_forward)

    # ------------------------------------------------------------------------------------------------ rows
    def start(self, rows: int, capacity: int, widest: int, gen, tree=None) -> None:
        """The draft cache of this call: the engine's static cache (kept across calls) where it holds the policy,
        else the policy's single-sequence cache (drafts the static cache does not hold: one row, chains). Token
        trees (``tree``, a :class:`~toolkit.speculative.tree.TreeShape`) widen what it holds between commit points to
        a catch-up (at most 2 tokens after a tree round) and an expansion region (``depth - 1`` levels of ``topk``
        nodes).

        Raises:
            ValueError: ``rows > 1`` where the draft cache holds one sequence.
            ConfigError: ``tree`` where the static cache does not hold the draft (``spec.tree``).
        """
        self._start_rows()
        self._held = []
        if tree is not None:
            from toolkit.engine.tree import check_tree_support

            check_tree_support(self.policy, self.model, "draft")
            region = 2 + (tree.depth - 1) * self.forward.width_for(tree.topk)
            capacity, widest = capacity_for(capacity + max(0, region - widest)), max(widest, region)
        self.cache = self.forward.cache_for(self.policy, rows, capacity, widest)
        static, self._chunk = isinstance(self.cache, StaticKV), CATCH_UP_CHUNK
        if not static and rows > 1:
            raise ValueError("batch_size: a draft cache without a static form holds one sequence; decode one at a time")
        if static and (self.cache.ringed or getattr(self.cache, "pending_limit", None)):
            self._chunk = self.cache.widest
        elif static and self.forward.compiled and self.forward.buckets:
            self._chunk = self.forward.widths[-1]

    def attached(self):
        """The draft's attention for the call: the static engine's, or the draft policy's."""
        if isinstance(self.cache, StaticKV):
            return self.forward.attached()
        return policy_attached(self.policy, self.model)

    def draft_cache(self, row):
        return self.cache

    @torch.inference_mode()
    def join(self, row, features=None) -> None:
        """A new row: its prompt (``row.ids`` but its first generated token) prefilled alone into the draft cache."""
        prefilled, kwargs = self.cache.begin_row(row.prompt_len)
        prompt = torch.tensor([row.ids[:row.prompt_len]], device=self.device)
        self.forward.prefill(prompt, kwargs)
        self.cache.add_row(prefilled, row.prompt_len)
        self._held.append(row.prompt_len)
        row.stats.draft_forwards += 1
        self._join_generator(row, self.device)

    def remove(self, keep: list[int]) -> None:
        self.cache.keep_rows(keep)
        self._held = [self._held[i] for i in keep]
        self._remove_generators(keep)

    def _probe(self, rows: int) -> None:
        zeros = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self.model(input_ids=zeros, position_ids=zeros, use_cache=False, logits_to_keep=1)

    # ------------------------------------------------------------------------------------------------ a round
    @torch.inference_mode()
    def propose_rows(self, rows: list, num_draft_tokens: list[int], read: bool = True) -> None:
        """Draft ``max(num_draft_tokens)`` steps for every row (row ``i`` keeps at most ``num_draft_tokens[i]``)."""
        num_draft_tokens = list(num_draft_tokens)
        steps = self._new_round(rows, num_draft_tokens)  # most draft steps (forwards) of the batch
        if steps == 0:
            return
        started, compiled = time.perf_counter(), self.forward.compile_ms
        logits = self._catch_up(rows)
        ones = torch.ones(len(rows), dtype=torch.long, device=self.device)
        live = [n > 0 for n in num_draft_tokens]
        drafted, confidences, probs = [], [], []
        for step in range(steps):
            p = process_logits(logits, self.temperature, self.top_k, self.top_p)  # (B, vocab)
            token = self._sample(p) if self.do_sample else logits.argmax(-1)
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
            logits = self._forward(token.view(-1, 1), ones, [1] * len(rows))
        self._steps = len(drafted)
        compile_ms = self.forward.compile_ms - compiled
        self.compile_ms += compile_ms
        self._observe_time(len(rows), ((time.perf_counter() - started) * 1000 - compile_ms) / len(drafted))
        self._hand_over(rows, num_draft_tokens, drafted, confidences, probs,
                        read or self.confidence_threshold is not None)

    def commit_rows(self, rows: list, accepted: list[int], features=None) -> None:
        """Keep each row's committed prefix in the draft cache (see the module docstring)."""
        fed = max(0, self._steps - 1)  # drafted tokens fed back (the last one never is)
        self._observe_acceptance(rows, accepted)
        if fed:
            self._rollback([fed - min(a, fed) for a in accepted])
        self.cache.commit()

    # ------------------------------------------------------------------------------------------------ forwards
    def _catch_up(self, rows: list) -> torch.Tensor:
        """Feed every row the committed tokens its cache lacks (in forwards of at most ``_chunk`` tokens per row,
        right-aligned so that every row's last token is in the last one); returns next-token logits ``(B, vocab)``."""
        pending = [row.ids[h:] for row, h in zip(rows, self._held)]
        longest = max(len(p) for p in pending)
        chunks = -(-longest // self._chunk)
        end = chunks * self._chunk  # the right-aligned layout's length
        for j in range(chunks):
            parts = [p[max(0, j * self._chunk - end + len(p)):max(0, (j + 1) * self._chunk - end + len(p))]
                     for p in pending]
            width = max(len(x) for x in parts)
            counts = [len(x) for x in parts]
            inputs = torch.tensor([x + [x[-1] if x else 0] * (width - len(x)) for x in parts], device=self.device)
            logits = self._forward(inputs, torch.tensor(counts, device=self.device), counts)
            if getattr(self.cache, "pending_limit", None):
                self.cache.commit()  # committed tokens: a cache holding few between commit points packs them now
        return logits

    def _forward(self, inputs: torch.Tensor, counts: torch.Tensor, counts_host: list[int]) -> torch.Tensor:
        """One draft forward over ``inputs`` ``(B, width)`` (row ``r``'s first ``counts[r]`` real, ``counts`` also on
        the host); the cache keeps those; returns each row's logits at its last real input ``(B, vocab)``."""
        logits = self.forward(self.cache, inputs)
        self.cache.accept(counts, counts_host)
        self._held = [h + c for h, c in zip(self._held, counts_host)]
        last = (counts - 1).clamp_min(0).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
        return logits.gather(1, last)[:, 0]

    def _rollback(self, drops: list[int]) -> None:
        """Forget the last ``drops[r]`` entries of each row: on the static cache its lengths move back (StaticKV's
        ``accept`` adds its counts to them: negative counts are the rollback, and nothing is moved); on a
        single-sequence cache the policy's cache is cropped."""
        if isinstance(self.cache, StaticKV):
            self.cache.accept(-torch.tensor(drops, device=self.device), [-d for d in drops])
        elif drops[0]:
            self.cache.cache.crop(-drops[0])
            self.cache.length -= drops[0]
        self._held = [h - d for h, d in zip(self._held, drops)]

    # ------------------------------------------------------------------------------------------------ trees
    @torch.inference_mode()
    def propose_tree_row(self, row, budget: int, depth: int, topk: int):
        """EAGLE-2 dynamic tree after the row's committed tokens: at most ``budget`` nodes, ``depth`` levels. Draft
        forwards: the catch-up, then one per level below the first over the (at most ``topk``) expanded nodes, whose
        entries stay in the draft cache's tree region until :meth:`commit_tree_row`."""
        started, compiled = time.perf_counter(), self.forward.compile_ms
        tree = _dynamic_tree(self, row, budget, depth, topk)
        compile_ms = self.forward.compile_ms - compiled
        self.compile_ms += compile_ms
        self._observe_time(1, (time.perf_counter() - started) * 1000 - compile_ms)
        return tree

    def commit_tree_row(self, row, path: list[int], features=None) -> None:
        """Keep the accepted path's expanded nodes (gathered behind the committed tokens, in depth order); roll back
        the rest of the tree region."""
        region = self._region
        kept = [self._region_of[node] for node in path if node in self._region_of]  # ascending: parents first
        if region:
            order = kept + [k for k in range(region) if k not in kept]
            self.cache.keep_tree(torch.tensor(order, device=self.device), behind=region)
            self._rollback([region - len(kept)])
        self._region = 0
        self.cache.commit()


def _dynamic_tree(drafter: DraftModel, row, budget: int, depth: int, topk: int):
    """The tree of :meth:`DraftModel.propose_tree_row` (one row, on the static draft cache): after the catch-up the
    draft cache holds every committed token, and the expanded nodes form the tree region after them (region entry
    ``k`` at position ``committed - 1 + depth``, its depth offset ``depth - 1``)."""
    from toolkit.speculative.tree import TreeShape
    from toolkit.speculative.tree_dynamic import build_dynamic_tree

    device = drafter.device
    root = drafter._catch_up([row])[0]
    row.stats.draft_forwards += 1
    parents: list[int] = []  # per region entry: its parent's region index (-1: the root, a committed token)
    offsets: list[int] = []  # per region entry: depth - 1
    region_of: dict[int, int] = {}  # candidate index -> region index

    def expand(nodes: list[int], tokens: list[int], node_parents: list[int], depths: list[int]) -> torch.Tensor:
        m = len(nodes)
        for node, parent, d in zip(nodes, node_parents, depths):
            region_of[node] = len(parents)
            parents.append(region_of.get(parent, -1))
            offsets.append(d - 1)
        region = TreeInputs.build(parents, offsets, m, rooted=False, device=device)
        logits = drafter.forward(drafter.cache, torch.tensor([tokens], device=device), tree=region)
        drafter.cache.accept(torch.full((1,), m, dtype=torch.long, device=device), [m])
        drafter._held[0] += m
        row.stats.draft_forwards += 1
        return torch.log_softmax(logits[0].float(), dim=-1)

    tree, kept = build_dynamic_tree(torch.log_softmax(root.float(), dim=-1), expand, TreeShape(budget, depth, topk),
                                    depth)
    drafter._region = len(parents)
    drafter._region_of = {new: region_of[old] for new, old in enumerate(kept) if old in region_of}
    return tree

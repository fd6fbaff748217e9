"""A small causal LM as drafter (also the target's own weights at low precision: the ``self`` drafter)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from toolkit.checks import check_float
from toolkit.kv.contract import new_cache, policy_attached
from toolkit.speculative.drafters.base import Drafter
from toolkit.speculative.drafters.registry import DRAFT_MODEL, DRAFT_TARGET, DrafterConfig, register_drafter
from toolkit.speculative.tree import TokenTree, TreeShape, expansion_mask
from toolkit.speculative.tree_dynamic import build_dynamic_tree
from toolkit.speculative.verify import process_logits, sample_token


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
    batch = True  # in one draft forward per step over the batch (toolkit.speculative.drafters.draft_model_rows)
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
        return [("confidence_threshold", f"{self.confidence_threshold} — early stop of a drafting round on low "
                 "draft confidence")]


@dataclass
class SelfDraftConfig(DraftModelConfig):
    """``drafter: self`` — the target's own weights at ``draft.precision`` (e.g. int4) draft for it."""

    name = "self"
    draft = DRAFT_TARGET


@register_drafter(SelfDraftConfig)
@register_drafter(DraftModelConfig)
class DraftModel(Drafter):
    """A small causal LM proposing tokens autoregressively from its own persistent KV cache.

    Args:
        model: HF causal LM sharing the target's vocabulary (any precision, any device).
        policy: KV compression policy of the draft cache (``None`` = uncompressed).
        do_sample / temperature / top_k / top_p: how draft tokens are chosen (greedy argmax or a sample from the
            processed distribution q).
        confidence_threshold: stop the round early once the draft's top probability falls below it (HF dynamic
            speculation); ``None`` drafts all K.
        generator: ``torch.Generator`` on the draft's device used for sampling.

    Tree proposals (:meth:`propose_tree`): an EAGLE-2 dynamic tree (:mod:`toolkit.speculative.tree_dynamic`), one
    draft forward per level over the expanded nodes under a tree attention mask; :meth:`commit_tree` keeps the
    accepted path's draft entries with ``cache.keep_tail``. Tree children are the top-k of q (chosen,
    not sampled), so sampling verification treats them as one-hot drafts (lossless).

    Cache bookkeeping: ``cached`` is the number of sequence tokens represented in the draft cache. ``propose`` feeds
    the committed tokens the cache has not seen (one or two per round), then drafts; ``commit`` crops the cache
    back to the committed prefix (``crop(-n)``), so a rejection costs no recomputation.
    """

    def __init__(self, model, policy=None, *, do_sample=False, temperature=1.0, top_k=0, top_p=1.0,
                 confidence_threshold=None, generator=None):
        self.model = model
        self.policy = policy
        self.do_sample = do_sample
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.confidence_threshold = confidence_threshold
        self.generator = generator
        self.device = next(model.parameters()).device
        self.cache = None
        self.cached = 0
        self._proposed_until = 0
        self._confidence: list[float] | None = None

    @classmethod
    def from_config(cls, config: DraftModelConfig, context):
        """The draft LM drafter; across tokenizers when the context carries a draft tokenizer (another vocabulary)."""
        if context.draft_tokenizer is not None:
            from toolkit.speculative.drafters.cross_tokenizer import CrossTokenizerDrafter

            return CrossTokenizerDrafter(context.draft_model, context.draft_tokenizer, context.tokenizer,
                                         context.draft_policy)
        device = next(context.draft_model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(context.seed + 1) if context.do_sample else None
        return cls(context.draft_model, context.draft_policy, do_sample=context.do_sample,
                   temperature=context.temperature, top_k=context.top_k, top_p=context.top_p,
                   confidence_threshold=config.confidence_threshold, generator=generator)

    def reset(self) -> None:
        super().reset()
        self.close()
        self._scope = contextlib.ExitStack()
        self._scope.enter_context(policy_attached(self.policy, self.model))
        self.cache = new_cache(self.policy, self.model)
        self.cached = 0
        self._proposed_until = 0

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the draft over ``tokens`` ``(1, m)`` at the next positions; returns last-position logits ``(vocab,)``."""
        positions = torch.arange(self.cached, self.cached + tokens.shape[1], device=self.device).unsqueeze(0)
        out = self.model(input_ids=tokens, past_key_values=self.cache, use_cache=True, logits_to_keep=1,
                         **self.cache.forward_kwargs(positions))
        self.cached += tokens.shape[1]
        self.forwards += 1
        return out.logits[0, -1]

    @torch.no_grad()
    def propose(self, input_ids: torch.Tensor, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        committed = input_ids.shape[1]
        self._committed_before = committed
        if num_draft_tokens == 0:
            return input_ids.new_empty((1, 0)), None
        logits = self._forward(input_ids[:, self.cached:].to(self.device))
        tokens, all_logits, confidence = [], [], []
        for step in range(num_draft_tokens):
            all_logits.append(logits)
            probs = process_logits(logits, self.temperature, self.top_k, self.top_p)
            token = sample_token(probs.unsqueeze(0), self.generator)[0] if self.do_sample else logits.argmax()
            tokens.append(token)
            confidence.append(probs.max())  # known before the token is drawn: see CostAwareK.plan
            if self.confidence_threshold is not None and probs.max().item() < self.confidence_threshold:
                break
            if step + 1 < num_draft_tokens:
                logits = self._forward(token.view(1, 1))
        self._confidence = torch.stack(confidence)
        return torch.stack(tokens).view(1, -1), torch.stack(all_logits)

    def confidence(self) -> list[float] | None:
        """The draft's top probability at each drafted position (q(token) under greedy), read before the token is
        sampled so that a verify length chosen from it keeps sampling lossless (a host sync: the loop asks only when
        its controller uses it)."""
        return None if self._confidence is None else self._confidence.tolist()

    def close(self) -> None:
        """Undo what :meth:`reset` installed on the draft model (the policy's attention hook, if any)."""
        scope, self._scope = getattr(self, "_scope", None), None
        if scope is not None:
            scope.close()

    def commit(self, num_accepted: int) -> None:
        """Roll the draft cache back to the committed prefix: everything after ``committed - 1`` tokens goes."""
        committed = self._committed_before + num_accepted + 1
        keep = min(self.cached, committed - 1)
        if keep < self.cached:
            self.cache.crop(keep - self.cached)
            self.cached = keep
        self.cache.commit()

    # ------------------------------------------------------------------------------------------------ trees
    @torch.no_grad()
    def propose_tree(self, input_ids: torch.Tensor, budget: int, depth: int, topk: int) -> TokenTree:
        """EAGLE-2 dynamic tree after ``input_ids`` ``(1, n)``: at most ``budget`` nodes, ``depth`` levels.

        Draft forwards: one over the committed tokens the cache has not seen, then one per level below the first
        over the (at most ``topk``) expanded nodes. Expanded nodes' entries stay in the draft cache until
        :meth:`commit_tree`.
        """
        committed = input_ids.shape[1]
        self._committed_before = committed
        fresh = input_ids[:, self.cached:].to(self.device)
        self._fresh = fresh.shape[1]
        root = self._forward(fresh)
        fed: list[int] = []  # candidate indices whose entries were appended to the draft cache, in order
        offset_of: dict[int, int] = {}
        parent_of: dict[int, int] = {}

        def expand(nodes: list[int], tokens: list[int], parents: list[int], depths: list[int]) -> torch.Tensor:
            m = len(nodes)
            visible = expansion_mask(parents, offset_of, parent_of, len(fed))  # over the entries fed this round
            positions = (committed - 1 + torch.tensor(depths, device=self.device)).unsqueeze(0)
            inputs = self.cache.forward_kwargs(positions, tree_mask=visible.to(self.device))
            out = self.model(input_ids=torch.tensor([tokens], device=self.device), past_key_values=self.cache,
                             use_cache=True, logits_to_keep=m, **inputs)
            self.forwards += 1
            for node, parent in zip(nodes, parents):
                offset_of[node], parent_of[node] = len(fed), parent
                fed.append(node)
            return torch.log_softmax(out.logits[0].float(), dim=-1)

        tree, kept = build_dynamic_tree(torch.log_softmax(root.float(), dim=-1), expand,
                                        TreeShape(budget, depth, topk), depth)
        self._tree_fed = {new: offset_of[old] for new, old in enumerate(kept) if old in offset_of}
        return tree

    def commit_tree(self, accepted_nodes: list[int]) -> None:
        """Keep the committed tokens fed this round and the accepted path's expanded nodes; drop the rest."""
        path_fed = [self._tree_fed[node] for node in accepted_nodes if node in self._tree_fed]
        keep = list(range(self._fresh)) + [self._fresh + off for off in path_fed]
        self.cache.keep_tail(keep)
        self.cached = self._committed_before + len(path_fed)
        self.cache.commit()

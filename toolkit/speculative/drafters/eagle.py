"""EAGLE drafter: drafts from the target's own features with a one-layer head (Li et al. 2024, EAGLE; EAGLE-3).

Protocol with the decode loop (unchanged loop; see :mod:`toolkit.engine.decoder`):

* ``reset()`` installs a forward hook on the target's feature layer(s) (:class:`toolkit.eagle.features.FeatureHook`)
  and empties the head's KV cache; ``close()`` removes the hook (the loop calls it in a ``finally``).
* The prefill forward leaves the prompt's features in the hook: positions ``0..n-1``.
* ``propose(sequence, K)``: the head cache holds one *true pair* ``(feature_t, token_{t+1})`` per committed position
  whose feature is known, at position ``t``. It is cropped back to those (dropping last round's draft steps), the
  pending true pairs are appended, and K draft steps run: step 1 reads the last true pair's output, step s feeds the
  head's own output paired with draft token s-1 at the next position.
* Each verify forward leaves the features of ``[last committed, d_1..d_k]`` in the hook; ``commit(a)`` keeps the
  first ``a + 1`` of them as the next pending pairs (their next tokens are ``d_1..d_a`` and the bonus token).

Tree rounds (EAGLE-2 dynamic trees, Li et al. 2024; the tree decoder of ``toolkit.speculative.tree``):
``propose_tree`` grows the tree with :func:`toolkit.speculative.tree_dynamic.build_dynamic_tree`, expanding each
level's chosen nodes in ONE head forward under a tree mask (a node sees the true pairs, its ancestors and itself, at
position ``last true pair + depth``); ``commit_tree(path)`` keeps the verify forward's features of the root and the
accepted path. Trees are deterministic top-k proposals (``draft_probs = None``), which verification treats as
one-hot drafts: lossless under sampling too.

Draft tokens come from the head's (reduced) draft vocabulary; ``draft_logits`` ``(k, vocab)`` are the head's logits
scattered into the target vocabulary with ``-inf`` elsewhere, so q is exactly zero outside the draft vocabulary
and speculative sampling stays lossless. Under greedy decoding ``draft_logits`` is ``None`` (not needed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.eagle.features import FeatureHook
from toolkit.eagle.head import EagleHead, HeadCache
from toolkit.speculative.drafters.base import Drafter
from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD, DrafterConfig, register_drafter
from toolkit.speculative.verify import process_logits, sample_token


@dataclass
class EagleConfig(DrafterConfig):
    """``drafter: eagle`` — an EAGLE feature-level head: ``draft.source`` is the head directory (or ``embedded``
    for the head shipped for the embedded target), ``draft.precision`` its dtype (fp32, bf16 or fp16)."""

    name = "eagle"
    draft = DRAFT_EAGLE_HEAD
    tree = True
    batch = True  # in one head forward per step over the batch (toolkit.speculative.drafters.eagle_rows)
    vllm_method = "eagle"
    sglang_algorithm = "EAGLE"


@register_drafter(EagleConfig)
class EagleDrafter(Drafter):
    """Feature-level drafter over a loaded :class:`toolkit.eagle.head.EagleHead`.

    Args:
        target: the HF causal LM being decoded (its decoder layers get the hook; batch size 1).
        head: the head (:func:`toolkit.eagle.checkpoint.load_head`), any float dtype on the target's device.
        do_sample / temperature / top_k / top_p / generator: how draft tokens are chosen (argmax, or a sample from q
            processed exactly as the verifier processes it).
    """

    def __init__(self, target, head: EagleHead, *, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None):
        self.target = target
        self.head = head
        self.do_sample = do_sample
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = generator
        self.dtype = next(head.parameters()).dtype
        self.hook: FeatureHook | None = None
        self.head_cache = HeadCache()
        self.fed = 0  # true pairs in the head cache (positions 0..fed-1)
        self.pending: torch.Tensor | None = None  # features (1, p, F) of positions fed..fed+p-1
        self._confidence: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config: EagleConfig, context) -> EagleDrafter:
        device = next(context.target.parameters()).device
        generator = torch.Generator(device=device).manual_seed(context.seed + 1) if context.do_sample else None
        return cls(context.target, context.draft_model, do_sample=context.do_sample,
                   temperature=context.temperature, top_k=context.top_k, top_p=context.top_p, generator=generator)

    def reset(self) -> None:
        super().reset()
        self.close()
        self.hook = FeatureHook(self.target, self.head.config.feature_layers)
        self.head_cache = HeadCache()
        self.fed = 0
        self.pending = None

    def close(self) -> None:
        if self.hook is not None:
            self.hook.close()
            self.hook = None

    @property
    def cache(self) -> HeadCache:
        """The head's KV cache (its ``kv_bytes()`` is what the decoder reports as draft KV bytes)."""
        return self.head_cache

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Head output logits ``(d,)`` -> (target token id (), full logits or None, the head's top probability ())."""
        if not self.do_sample:
            best = logits.argmax()
            return self.head.draft_to_target[best], None, torch.softmax(logits.float(), -1)[best]
        full = self.head.to_target_vocab(logits)
        probs = process_logits(full, self.temperature, self.top_k, self.top_p)
        token = sample_token(probs.unsqueeze(0), self.generator)[0]
        return token, full, probs.max()  # known before the token is drawn: see CostAwareK.plan

    @torch.inference_mode()
    def propose(self, input_ids: torch.Tensor, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if num_draft_tokens == 0:
            return input_ids.new_empty((1, 0)), None
        head, device = self.head, self.head.lm_head.weight.device
        last = self._feed_pending(input_ids)
        drafted, all_logits, confidence = [], [], []
        for step in range(num_draft_tokens):
            token, full, prob = self._choose(head.logits(last[0, -1]))
            drafted.append(token)
            all_logits.append(full)
            confidence.append(prob)
            if step + 1 == num_draft_tokens:
                break
            tok = token.view(1, 1)
            position = torch.tensor([[self.fed + step]], device=device)
            last, _ = head(head.step_input(last, tok), tok, position, self.head_cache)
            self.forwards += 1
        self._confidence = torch.stack(confidence)
        tokens_out = torch.stack(drafted).view(1, -1)
        return tokens_out, (torch.stack(all_logits) if self.do_sample else None)

    def confidence(self) -> list[float] | None:
        """The head's top probability at each drafted position (a host sync: asked only by cost-aware controllers)."""
        return None if self._confidence is None else self._confidence.tolist()

    def _feed_pending(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Crop the head cache to the true pairs, append the pending ones; returns the last output ``(1, 1, H)``."""
        committed = input_ids.shape[1]
        if self.hook is None:
            raise RuntimeError("EagleDrafter.propose before reset(): no feature hook installed")
        if self.pending is None and self.fed == 0:  # first round: the prefill's features
            self.pending = self.hook.features()
        head, device = self.head, self.head.lm_head.weight.device
        self.head_cache.crop(self.fed)
        pending = self.pending.to(device=device, dtype=self.dtype)
        p = pending.shape[1]
        if self.fed + p != committed - 1:
            raise RuntimeError(f"EAGLE drafter out of step: {self.fed} + {p} features for {committed} tokens")
        tokens = input_ids[:, self.fed + 1: self.fed + p + 1].to(device)
        positions = torch.arange(self.fed, self.fed + p, device=device).unsqueeze(0)
        out, _ = head(head.input_features(pending, tokens), tokens, positions, self.head_cache)
        self.forwards += 1
        self.fed += p
        self.pending = None
        return out[:, -1:]

    def _log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """Head outputs ``(m, H)`` -> target-vocabulary log-probabilities ``(m, vocab)`` (``-inf`` outside)."""
        return self.head.to_target_vocab(torch.log_softmax(self.head.logits(out).float(), dim=-1))

    @torch.inference_mode()
    def propose_tree(self, input_ids: torch.Tensor, budget: int, depth: int, topk: int):
        """EAGLE-2 dynamic tree after ``input_ids`` ``(1, n)``: at most ``budget`` nodes, ``depth`` levels, ``topk``
        children per expanded node. Head forwards: one over the pending true pairs, then one per level below the
        first over the (at most ``topk``) expanded nodes. Returns a ``TokenTree`` (``draft_probs = None``)."""
        from toolkit.speculative.tree import TreeShape, expansion_mask
        from toolkit.speculative.tree_dynamic import build_dynamic_tree

        head, device = self.head, self.head.lm_head.weight.device
        root = self._feed_pending(input_ids)
        base = len(self.head_cache)  # == self.fed: true pairs only
        outputs: dict[int, torch.Tensor] = {-1: root[0, 0]}
        offset_of: dict[int, int] = {}
        parent_of: dict[int, int] = {}

        def expand(nodes: list[int], tokens: list[int], parents: list[int], depths: list[int]) -> torch.Tensor:
            fed_now = len(self.head_cache)
            visible = expansion_mask(parents, offset_of, parent_of, fed_now, prefix=base, device=device)
            tok = torch.tensor([tokens], device=device)
            prev = torch.stack([outputs[p] for p in parents]).unsqueeze(0)  # (1, m, H)
            positions = (base - 1 + torch.tensor(depths, device=device)).unsqueeze(0)
            out, _ = head(head.step_input(prev, tok), tok, positions, self.head_cache, visible)
            self.forwards += 1
            for row, (node, parent) in enumerate(zip(nodes, parents)):
                offset_of[node], parent_of[node] = fed_now + row, parent
                outputs[node] = out[0, row]
            return self._log_probs(out[0])

        tree, _ = build_dynamic_tree(self._log_probs(root[0])[0], expand, TreeShape(budget, depth, topk), depth)
        return tree

    def commit_tree(self, accepted_nodes: list[int]) -> None:
        """Keep the tree verify forward's features of the root and the accepted path's nodes."""
        rows = [0] + [node + 1 for node in accepted_nodes]
        self.pending = self.hook.features()[:, rows]
        self.head_cache.crop(self.fed)

    def commit(self, num_accepted: int) -> None:
        """Keep the verify forward's features of the last committed token and the ``num_accepted`` drafts."""
        self.pending = self.hook.features()[:, : num_accepted + 1]
        self.head_cache.crop(self.fed)

"""The speculative decode loop (Leviathan et al., 2023; Chen et al., 2023), in the shape of gpt-fast's loop.

One round::

    draft K tokens            drafter.propose(committed, K)            -> d_1..d_k          (k <= K)
    verify in ONE forward     target([x_last, d_1..d_k])               -> logits for k+1 positions
    accept                    greedy_accept / speculative_sample        -> a accepted + 1 target token
    roll back                 target_cache.crop(-(k - a)); drafter.commit(a)
    commit point              kv_ops.commit(target_cache)              (the only place compression may run)

Invariant between rounds: the committed sequence has n tokens and the target cache represents the first n - 1 of
them; the last committed token is the first input of the next verify forward. Positions are absolute
(``position_ids`` = n - 1 ... n - 1 + k), so a compressed cache that is physically shorter still sees the right
rotary phases. With ``drafter=None`` the same loop is plain autoregressive decoding (k = 0 every round).

Tree rounds (``tree`` settings given and the drafter has ``propose_tree``): the drafter proposes a
:class:`~toolkit.speculative.tree.TokenTree` of n nodes below the last committed token; ONE target forward scores
``[x_last, nodes]`` under the tree attention mask at positions ``n_committed - 1 + depth``; verification accepts one
root-to-node path (:mod:`toolkit.speculative.tree_verify`); the target cache keeps exactly the root's and the path's
entries (:func:`toolkit.kv.ops.keep_tail`, a gather over the appended tail) and the drafter is told the path
(``commit_tree``). A chain never goes through this code: linear drafting stays on the loop above.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from toolkit.kv import ops as kv_ops
from toolkit.models.capabilities import check_tree_support
from toolkit.speculative.adaptive import ConstantK
from toolkit.speculative.drafters.base import Drafter, TreeDrafterProtocol
from toolkit.speculative.params import DecodeParams
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.tree import TreeShape
from toolkit.speculative.tree_verify import greedy_tree_accept, tree_speculative_sample
from toolkit.speculative.verify import greedy_accept, process_logits, sample_token, speculative_sample


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeDecoder:
    """Draft-then-verify decoding of one sequence (batch size 1).

    Args:
        target: HF causal LM whose distribution the output follows exactly (greedy: token-identical output).
        drafter: a :class:`~toolkit.speculative.drafters.Drafter`, or ``None`` for autoregressive decoding.
        controller: draft-length controller with ``next_k()`` / ``update(drafted, accepted)``.
        target_policy: KV compression policy of the target cache (``None`` = uncompressed).
        tree: :class:`~toolkit.speculative.tree.TreeShape` (node budget, depth, top-k) for tree speculation with a
            drafter that implements ``propose_tree``; ``None`` = linear drafting.
        engine: a :class:`~toolkit.speculative.compiled.CompiledTarget` of ``target``: every target forward runs on
            its static cache, compiled per width bucket (uncompressed caches and chains only); ``None`` = eager.

    Raises:
        TypeError: ``tree`` with a drafter that proposes no trees.
        ValueError: ``engine`` together with a KV policy or token trees.
    """

    def __init__(self, target, drafter: Drafter | None = None, controller=None, target_policy=None,
                 tree: TreeShape | None = None, engine=None):
        self.target = target
        self.drafter = drafter
        if tree is not None and drafter is not None and not isinstance(drafter, TreeDrafterProtocol):
            raise TypeError(f"tree: {type(drafter).__name__} proposes no token trees (no propose_tree/commit_tree)")
        self.tree = tree if drafter is not None else None
        if self.tree is not None:
            check_tree_support(target, "target")
        self.controller = controller or ConstantK(4)
        self.target_policy = target_policy
        self.device = next(target.parameters()).device
        if engine is not None and (target_policy is not None or self.tree is not None):
            raise ValueError("engine: the compiled static engine holds uncompressed caches and chains only (no KV "
                             "policy, no token trees)")
        self.engine = engine
        self.cache = None

    # ------------------------------------------------------------------------------------------------ internals
    def _target_forward(self, tokens: torch.Tensor, start: int, logits_to_keep: int) -> torch.Tensor:
        """Target forward over ``tokens`` ``(1, q)`` at absolute positions ``start..start+q-1``.

        Returns logits ``(logits_to_keep, vocab)`` for the last positions.
        """
        if self.engine is not None:
            return self.engine.forward(self.cache, tokens, start, logits_to_keep)
        positions = torch.arange(start, start + tokens.shape[1], device=self.device).unsqueeze(0)
        out = self.target(input_ids=tokens, past_key_values=self.cache, use_cache=True,
                          logits_to_keep=logits_to_keep, **kv_ops.model_inputs(self.cache, positions))
        return out.logits[0]

    def _tree_round(self, sequence: torch.Tensor, depth: int, gen, generator, stats) -> list[int]:
        """One tree round (see the module docstring); returns the committed ids (path tokens + the next token)."""
        start = time.perf_counter()
        committed = sequence.shape[1]
        shape = self.tree
        tree = self.drafter.propose_tree(sequence, budget=shape.budget, depth=depth, topk=shape.topk)
        drafted_at = time.perf_counter()
        n = len(tree)
        tokens = tree.tokens.to(self.device)
        verify_input = torch.cat([sequence[:, -1:], tokens.view(1, -1)], dim=1)
        positions = tree.positions(committed - 1, self.device)
        inputs = kv_ops.model_inputs(self.cache, positions, tree_mask=tree.mask(self.device))
        out = self.target(input_ids=verify_input, past_key_values=self.cache, use_cache=True,
                          logits_to_keep=n + 1, **inputs)
        target_logits = out.logits[0]
        stats.target_forwards += 1
        if gen.do_sample:
            p = process_logits(target_logits, gen.temperature, gen.top_k, gen.top_p)
            path, next_id = tree_speculative_sample(tree, p, generator)
        else:
            path, next_id = greedy_tree_accept(tree, target_logits)
        verified_at = time.perf_counter()
        kv_ops.keep_tail(self.cache, [0] + [i + 1 for i in path])
        kv_ops.commit(self.cache)
        self.drafter.commit_tree(path)
        stats.record_round(n, len(path))
        tokens = tree.token_list()
        ids = [tokens[i] for i in path] + [next_id]
        stats.record_time((drafted_at - start) * 1000, (verified_at - drafted_at) * 1000,
                          (time.perf_counter() - start) * 1000, n + 1)
        return ids

    def _track_memory(self, stats: GenerationStats) -> None:
        stats.kv_bytes_target = kv_ops.kv_bytes(self.cache)
        stats.peak_kv_bytes_target = max(stats.peak_kv_bytes_target, stats.kv_bytes_target)
        draft_cache = self.drafter.cache if self.drafter is not None else None
        if draft_cache is not None:
            stats.kv_bytes_draft = kv_ops.kv_bytes(draft_cache)
            stats.peak_kv_bytes_draft = max(stats.peak_kv_bytes_draft, stats.kv_bytes_draft)

    # ------------------------------------------------------------------------------------------------ the loop
    def decode(self, input_ids: torch.Tensor, gen: DecodeParams, stats: GenerationStats,
               eos_token_ids: list[int] = (), should_stop: Callable[[list[int]], int | None] | None = None,
               ) -> Iterator[list[int]]:
        """Generate after ``input_ids`` ``(1, prompt_len)``; yields the newly committed token ids of every round.

        Stops after ``gen.max_new_tokens`` tokens (never more, even when a round accepts past the limit), after an
        EOS id (kept in the output; ignored when ``gen.ignore_eos``), or where ``should_stop(new_ids)`` returns a
        cut length (stop strings). ``stats`` is filled in place; ``stats.finish_reason`` is ``length``, ``eos`` or
        ``stop_string``.
        """
        # Hooks on shared models live exactly as long as this generation, also when the caller stops iterating early.
        with kv_ops.attached(self.target_policy, self.target):
            try:
                yield from self._decode(input_ids, gen, stats, eos_token_ids, should_stop)
            finally:
                if self.drafter is not None:
                    self.drafter.close()

    @torch.inference_mode()  # cheaper than no_grad: no version counters or view tracking (~5% on CPU here)
    def _decode(self, input_ids, gen, stats, eos_token_ids, should_stop) -> Iterator[list[int]]:
        _sync(self.device)
        start_time = time.perf_counter()
        generator = None
        if gen.do_sample:
            generator = torch.Generator(device=self.device).manual_seed(gen.seed)
        eos = set() if gen.ignore_eos else set(eos_token_ids)
        limit = gen.max_new_tokens

        def choose(logits: torch.Tensor) -> torch.Tensor:
            if gen.do_sample:
                return sample_token(process_logits(logits, gen.temperature, gen.top_k, gen.top_p), generator)
            return logits.argmax(-1)

        # Prefill: the whole prompt in one forward, the first token from the target alone.
        prompt_len = input_ids.shape[1]
        if self.engine is not None:
            self.cache = self.engine.new_cache(prompt_len + limit)
        else:
            self.cache = kv_ops.new_cache(self.target_policy, self.target)
        if self.drafter is not None:
            self.drafter.reset()
        stats.prompt_tokens = prompt_len
        input_ids = input_ids.to(self.device)
        first = choose(self._target_forward(input_ids, 0, 1))
        stats.target_forwards += 1
        kv_ops.commit(self.cache)
        sequence = torch.cat([input_ids, first.view(1, 1)], dim=1)
        new_ids: list[int] = [int(first)]
        _sync(self.device)
        stats.ttft_ms = (time.perf_counter() - start_time) * 1000
        self._track_memory(stats)

        finished = self._finish(new_ids, 0, limit, eos, should_stop, stats)
        yield new_ids[:]
        while not finished:
            room = limit - len(new_ids) - 1  # draft tokens that can still be committed before the limit
            round_ids = None
            if self.tree is not None and min(self.tree.depth, room) > 0:
                round_ids = self._tree_round(sequence, min(self.tree.depth, room), gen, generator, stats)
            if round_ids is None:  # a chain (a drafter that proposed no tree falls back to one, too)
                round_ids = self._chain_round(sequence, room, choose, gen, generator, stats)
            bookkeeping = time.perf_counter()
            sequence = torch.cat([sequence, sequence.new_tensor([round_ids])], dim=1)
            before = len(new_ids)
            new_ids.extend(round_ids)
            finished = self._finish(new_ids, before, limit, eos, should_stop, stats)
            self._track_memory(stats)
            stats.overhead_ms += (time.perf_counter() - bookkeeping) * 1000
            yield new_ids[before:]
        if self.drafter is not None:
            stats.draft_forwards = self.drafter.forwards
            stats.compressions_draft = kv_ops.compressions(self.drafter.cache)
        stats.compressions_target = kv_ops.compressions(self.cache)
        stats.new_tokens = len(new_ids)
        _sync(self.device)
        stats.total_ms = (time.perf_counter() - start_time) * 1000

    def _chain_round(self, sequence: torch.Tensor, room: int, choose, gen, generator,
                     stats: GenerationStats) -> list[int]:
        """One round over a chain of at most ``min(K, room)`` draft tokens after ``sequence`` ``(1, n)``: propose,
        let the controller choose how many to verify (0 = a plain one-token step) and the forward's width, verify,
        roll both caches back to the accepted tokens. Returns the round's committed ids."""
        start = time.perf_counter()
        committed = sequence.shape[1]
        asked = min(self.controller.next_k(), room) if self.drafter is not None else 0
        draft_tokens, draft_logits, confidence = sequence.new_empty((1, 0)), None, None
        if asked > 0:
            draft_tokens, draft_logits = self.drafter.propose(sequence, asked)
            draft_tokens = draft_tokens.to(self.device)
            confidence = self.drafter.confidence() if self.controller.uses_confidence else None
        drafted_at = time.perf_counter()
        sampled = gen.do_sample and draft_logits is not None  # drafts drawn from q: see CostAwareK.plan
        k, width = self.controller.plan(confidence, draft_tokens.shape[1], sampled)
        if k == 0 and width == 1:  # a plain step: no verify machinery
            accepted, next_id = 0, int(choose(self._target_forward(sequence[:, -1:], committed - 1, 1)[0]))
            draft_tokens = draft_tokens[:, :0]
        else:
            draft_tokens = draft_tokens[:, :k]
            padding = sequence[:, -1:].expand(1, width - k - 1)  # positions past the draft: cropped below
            verify_input = torch.cat([sequence[:, -1:], draft_tokens, padding], dim=1)
            target_logits = self._target_forward(verify_input, committed - 1, width)[: k + 1]
            if gen.do_sample:
                p = process_logits(target_logits, gen.temperature, gen.top_k, gen.top_p)
                q = None if draft_logits is None else process_logits(
                    draft_logits[:k].to(self.device), gen.temperature, gen.top_k, gen.top_p)
                num_accepted, next_token = speculative_sample(draft_tokens[0], q, p, generator)
            else:
                num_accepted, next_token = greedy_accept(draft_tokens[0], target_logits)
            accepted, next_id = torch.stack([num_accepted, next_token]).tolist()  # the round's one host sync
        verified_at = time.perf_counter()
        stats.target_forwards += 1
        # Roll back: drop the rejected draft tokens (and padding) from the target cache; the drafter rolls back its own.
        if width - accepted - 1 > 0:
            self.cache.crop(accepted + 1 - width)
        kv_ops.commit(self.cache)
        if asked > 0:
            self.drafter.commit(accepted)
        self.controller.update(k, accepted, confidence)
        stats.record_round(k, accepted)
        ids = draft_tokens[0, :accepted].tolist() + [next_id]
        end = time.perf_counter()
        verify_ms = (verified_at - drafted_at) * 1000
        stats.record_time((drafted_at - start) * 1000, verify_ms, (end - start) * 1000, width)
        self.controller.timed(width, verify_ms, (end - verified_at) * 1000)
        return ids

    @staticmethod
    def _finish(new_ids: list[int], before: int, limit: int, eos: set[int],
                should_stop: Callable[[list[int]], int | None] | None, stats: GenerationStats) -> bool:
        """Truncate ``new_ids`` in place at the first stop condition among the tokens added since ``before``."""
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

"""SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications",
NeurIPS 2025; vLLM's ``suffix`` method): a model-free drafter with memory across requests.

Two suffix tries (:mod:`toolkit.speculative.drafters.suffix_trie`):

* the *request* trie indexes the current prompt and output as they grow;
* the *global* trie indexes earlier requests' outputs (each preceded by the last ``PROMPT_CONTEXT`` prompt tokens,
  so the first output tokens can match the chat template's assistant header); at most ``max_cached_requests`` of
  them, the oldest removed first when a new one is added.

Each round the longest suffix of the committed sequence found in a trie (``m`` tokens, at most ``depth // 2``)
selects a node; its observed continuations, with empirical probabilities ``count(child) / sum(counts of the
children)`` multiplied along a path, grow a speculation tree best-first (highest path probability first) while a
path probability stays >= ``min_token_prob``, at most ``ceil(max_spec_factor * m)`` tokens deep (the paper's
adaptive speculation length: long matches are trusted with long drafts) and within the round's node budget (the
chain of :meth:`propose` is that many tokens; a tree spends its extra nodes on alternative branches, so it contains
the chain). Of the request and
global candidates, the tree with the larger expected number of accepted tokens (sum of its path probabilities, the
paper's score) is proposed. ``propose`` returns the tree's most probable chain (linear speculation).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from toolkit.checks import check_float, check_int
from toolkit.speculative.drafters.base import HostDrafter
from toolkit.speculative.drafters.registry import DrafterConfig, register_drafter
from toolkit.speculative.drafters.suffix_trie import RemembersRequests, RequestMemory, SuffixTrie, TrieNode
from toolkit.speculative.tree import TokenTree


@dataclass
class SuffixConfig(DrafterConfig):
    """``drafter: suffix`` — SuffixDecoding (see the module docstring).

    Attributes:
        max_spec_factor: at most ``ceil(max_spec_factor * match length)`` draft tokens (> 0).
        min_token_prob: smallest path probability of a drafted token, in [0, 1].
        max_cached_requests: earlier requests kept in memory (0 = none), 0..100000.
        suffix_depth: longest indexed substring in tokens (matches use at most half), 4..1024.
    """

    name = "suffix"
    tree = True
    persistent = True
    batch = True
    hf_baseline = "prompt_lookup"
    vllm_method = "suffix"
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 16
    suffix_depth: int = 48

    def validate(self, prefix: str) -> None:
        check_float(f"{prefix}.max_spec_factor", self.max_spec_factor, low=0.0, high=1000.0, low_open=True)
        check_float(f"{prefix}.min_token_prob", self.min_token_prob, low=0.0, high=1.0)
        check_int(f"{prefix}.max_cached_requests", self.max_cached_requests, low=0, high=100000)
        check_int(f"{prefix}.suffix_depth", self.suffix_depth, low=4, high=1024)

    def engine_params(self, engine: str) -> dict:
        """vLLM's suffix decoding (``SpeculativeConfig.suffix_decoding_*``, the same four knobs); SGLang has none."""
        if engine != "vllm":
            return {}
        return {"suffix_decoding_max_spec_factor": self.max_spec_factor,
                "suffix_decoding_min_token_prob": self.min_token_prob,
                "suffix_decoding_max_cached_requests": self.max_cached_requests,
                "suffix_decoding_max_tree_depth": self.suffix_depth}


@register_drafter(SuffixConfig)
class SuffixDrafter(RemembersRequests, HostDrafter):
    """Suffix-trie drafter with a bounded memory of earlier requests (see the module docstring).

    Args:
        max_spec_factor: speculation length = ``ceil(max_spec_factor * match length)`` tokens per path (> 0).
        min_token_prob: smallest path probability of a proposed node, in [0, 1].
        max_cached_requests: earlier requests kept in the global trie (0 = no memory across requests).
        depth: longest indexed substring in tokens (>= 4); matches use at most ``depth // 2`` tokens.

    One instance serves many ``generate`` calls: ``reset()`` (start of a generation) moves the previous request
    into the global trie.
    """

    def __init__(self, max_spec_factor: float = 1.0, min_token_prob: float = 0.1, max_cached_requests: int = 16,
                 depth: int = 48):
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.max_cached_requests, self.depth = max_cached_requests, depth
        self.memory = RequestMemory(depth, max_cached_requests)
        self._tokens: list[int] = []
        self._prompt_len = None
        self._request = None

    @classmethod
    def from_config(cls, config: SuffixConfig, context) -> SuffixDrafter:
        return cls(config.max_spec_factor, config.min_token_prob, config.max_cached_requests, config.suffix_depth)

    def fork(self) -> SuffixDrafter:
        """A drafter for another request in flight at the same time (batched decoding) sharing this one's global
        trie: what either archives, both draw from."""
        other = SuffixDrafter(self.max_spec_factor, self.min_token_prob, self.max_cached_requests, self.depth)
        other.memory = self.memory
        return other

    @property
    def global_trie(self) -> SuffixTrie:
        """The trie of earlier requests (shared with forks)."""
        return self.memory.trie

    # ------------------------------------------------------------------------------------------------ state
    def reset(self) -> None:
        """Archive the previous request (if any) in the global trie; start an empty request trie."""
        super().reset()
        self._archive()
        self._tokens, self._prompt_len = [], None
        self._request = SuffixTrie(self.depth)
        self._request_cursor = self._request.cursor()
        self._global_cursor = self.global_trie.matcher()

    def _sync(self, ids: list[int]) -> None:
        """Feed the committed tokens not seen yet to both cursors (the prompt on the first call)."""
        if self._request is None:
            self.reset()
        if self._prompt_len is None:
            self._prompt_len = max(0, len(ids) - 1)  # the decoder's first call: prompt + first token
        new = ids[len(self._tokens):]
        for token in new:
            self._request_cursor.append(token)
            self._global_cursor.append(token)
        self._tokens.extend(new)

    # ------------------------------------------------------------------------------------------------ drafting
    def _grow(self, node: TrieNode, match: int, max_nodes: int, max_depth: int, chain: bool) -> tuple[list, float]:
        """Best-first speculation tree below ``node`` (only the likeliest child per node if ``chain``):
        ``([(token, parent index, path probability)], score = sum of path probabilities)``."""
        max_depth = min(max_depth, math.ceil(self.max_spec_factor * match))
        out, score = [], 0.0
        heap: list = []
        counter = 0

        def push(trie_node: TrieNode, parent: int, prob: float, depth: int) -> None:
            nonlocal counter
            if depth > max_depth or not trie_node.children:
                return
            total = sum(child.count for child in trie_node.children.values())
            items = trie_node.children.items()
            if chain:
                items = [max(items, key=lambda item: item[1].count)]
            for token, child in items:
                p = prob * child.count / total
                if p >= self.min_token_prob:
                    heapq.heappush(heap, (-p, counter, token, child, parent, depth))
                    counter += 1

        push(node, -1, 1.0, 1)
        while heap and len(out) < max_nodes:
            neg, _, token, child, parent, depth = heapq.heappop(heap)
            out.append((token, parent, -neg))
            score -= neg
            push(child, len(out) - 1, -neg, depth + 1)
        return out, score

    def _best(self, max_nodes: int, max_depth: int, chain: bool = False) -> list:
        best, best_score = [], 0.0
        max_match = self.depth // 2
        for cursor, min_count in ((self._request_cursor, 2), (self._global_cursor, 1)):
            node, match = cursor.longest_match(max_match, min_count)
            if node is None:
                continue
            nodes, score = self._grow(node, match, max_nodes, max_depth, chain)
            if score > best_score:
                best, best_score = nodes, score
        return best

    def propose_tree(self, input_ids: torch.Tensor, budget: int, depth: int, topk: int = 0) -> TokenTree:
        """A frequency-scored speculation tree of at most ``budget`` nodes and ``depth`` levels (``topk`` unused)."""
        self._sync(input_ids[0].tolist())
        nodes = self._best(budget, depth)
        return TokenTree(torch.tensor([t for t, _, _ in nodes], dtype=torch.long),
                         torch.tensor([p for _, p, _ in nodes], dtype=torch.long))

    def commit_tree(self, accepted_nodes: list[int]) -> None:
        """Nothing to roll back: the tries index committed tokens only."""

    def propose_row(self, ids: list[int], num_draft_tokens: int) -> tuple[list[int], None]:
        """The most probable chain of the speculation tree after ``ids`` (every committed token), at most
        ``num_draft_tokens`` tokens."""
        self._sync(ids)
        return [t for t, _, _ in self._best(num_draft_tokens, num_draft_tokens, chain=True)], None

    def memory_nodes(self) -> int:
        """Trie nodes held (global + request): the drafter's memory in nodes."""
        return self.global_trie.nodes + (self._request.nodes if self._request is not None else 0)

"""Lookup drafting: prompt lookup (Saxena 2023) with the longest match anywhere in the request, plus a suffix-trie
memory of earlier requests (SuffixDecoding, Oliaro et al. 2025), whichever is expected to give more tokens this
round, with a per-token acceptance estimate for the cost-aware verify length.

Each round, for the committed sequence ``x_1..x_n``:

* **request** — the longest suffix of the sequence (up to ``max_match`` tokens) that occurred earlier in the prompt or
  output, the most recent occurrence on ties; the draft is what followed that occurrence, read on through the draft
  itself when the occurrence runs into the present (periodic text). HF's prompt lookup instead takes the *first*
  occurrence of at most 2-3 tokens.
* **memory** — the longest match in a suffix trie over earlier requests' outputs (``max_cached_requests`` of them,
  oldest dropped first; :mod:`toolkit.speculative.drafters.suffix_trie`), continued by the most frequent child.

Acceptance of the next token rises steeply with the match length ``m`` (measured over the ``short`` training suite's
greedy outputs: 0.22 at m = 1, 0.51 at 2, 0.67 at 3, 0.84 at 5-7, 0.96 at >= 16) and falls where the equally long
earlier matches disagree on what comes next. The drafter reports for draft token ``i`` the estimate
``sigmoid(prior_bias + prior_slope * ln(m + i) + prior_share * share)``, ``share`` being the fraction of the equally
long matches (memory: of the observed continuations) that agree with the token; the decode loop calibrates these
online and verifies as many tokens as pay (:mod:`toolkit.speculative.verify_length`). Of the two candidates the one
with the larger expected accepted length (the sum of the running products of the estimates) is proposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.checks import check_float, check_int
from toolkit.speculative.drafters.base import HostDrafter
from toolkit.speculative.drafters.registry import DrafterConfig, register_drafter
from toolkit.speculative.drafters.suffix_trie import RemembersRequests, RequestMemory

#: occurrences of the last token examined per round (the most recent ones)
MAX_OCCURRENCES = 256


@dataclass
class LookupConfig(DrafterConfig):
    """``drafter: lookup`` — longest-match prompt lookup over the request plus a memory of earlier requests.

    Attributes:
        max_match: longest match looked for, in tokens (1..256).
        max_cached_requests: earlier requests kept in the memory trie (0 = no memory across requests), 0..100000.
        memory_depth: longest substring indexed by the memory trie, in tokens (4..1024; matches use half).
        prior_bias / prior_slope / prior_share: the acceptance estimate of a drafted token,
            ``sigmoid(bias + slope * ln(match length) + share_weight * share)`` where ``share`` is the fraction of the
            equally long earlier matches that continue with that token, before online calibration (fitted by
            logistic regression on the ``short`` and ``repeat`` suites' greedy outputs: ``bench/fit_lookup_prior.py``).
    """

    name = "lookup"
    persistent = True
    batch = True
    hf_baseline = "prompt_lookup"
    vllm_method = "suffix"
    max_match: int = 32
    max_cached_requests: int = 16
    memory_depth: int = 48
    prior_bias: float = -1.79  # bench/fit_lookup_prior.py (fp32, short + repeat suites)
    prior_slope: float = 1.22
    prior_share: float = 1.30

    def validate(self, prefix: str) -> None:
        check_int(f"{prefix}.max_match", self.max_match, low=1, high=256)
        check_int(f"{prefix}.max_cached_requests", self.max_cached_requests, low=0, high=100000)
        check_int(f"{prefix}.memory_depth", self.memory_depth, low=4, high=1024)
        check_float(f"{prefix}.prior_bias", self.prior_bias, low=-20.0, high=20.0)
        check_float(f"{prefix}.prior_slope", self.prior_slope, low=0.0, high=20.0)
        check_float(f"{prefix}.prior_share", self.prior_share, low=0.0, high=20.0)

    def engine_params(self, engine: str) -> dict:
        """The nearest vLLM method is suffix decoding: its memory of earlier requests and its tree depth carry over;
        the match-length prior and the cost-aware length do not (:meth:`engine_gaps`; the export also warns of the
        cost-aware length)."""
        if engine != "vllm":
            return {}
        return {"suffix_decoding_max_cached_requests": self.max_cached_requests,
                "suffix_decoding_max_tree_depth": self.memory_depth}

    def engine_gaps(self, engine: str) -> list[tuple[str, str]]:
        """The longest-match search and the match-length prior (how many drafted tokens are worth verifying) have
        no vLLM setting: its suffix decoding matches through its own tree and gates drafts by
        ``suffix_decoding_min_token_prob`` / ``suffix_decoding_max_spec_factor`` (left at vLLM's defaults)."""
        if engine != "vllm":
            return []
        return [("max_match", f"{self.max_match} — the longest match looked for in the request (vLLM's suffix "
                 "decoding matches through its tree, depth suffix_decoding_max_tree_depth)"),
                ("prior_bias / prior_slope / prior_share",
                 f"{self.prior_bias} / {self.prior_slope} / {self.prior_share} — the per-token acceptance estimate "
                 "from the match length that sets how many drafted tokens are verified (vLLM gates suffix drafts by "
                 "suffix_decoding_min_token_prob / suffix_decoding_max_spec_factor, left at its defaults)")]


@register_drafter(LookupConfig)
class LookupDrafter(RemembersRequests, HostDrafter):
    """See the module docstring. One instance serves every ``generate`` call of a SpeculativeLM: ``reset()`` moves the
    previous request into the memory trie.

    Args: the fields of :class:`LookupConfig`.
    """

    def __init__(self, max_match: int = 32, max_cached_requests: int = 16, memory_depth: int = 48,
                 prior_bias: float = -1.79, prior_slope: float = 1.22, prior_share: float = 1.30):
        self.max_match, self.max_cached_requests = max_match, max_cached_requests
        self.prior_bias, self.prior_slope, self.prior_share = prior_bias, prior_slope, prior_share
        self.memory = RequestMemory(memory_depth, max_cached_requests)
        self._tokens: list[int] = []
        self._where: dict[int, list[int]] = {}
        self._prompt_len: int | None = None
        self._memory_cursor = self.memory.trie.matcher()
        self._confidence: list[float] | None = None
        self._features: list[tuple[int, float]] = []

    @classmethod
    def from_config(cls, config: LookupConfig, context) -> LookupDrafter:
        return cls(config.max_match, config.max_cached_requests, config.memory_depth, config.prior_bias,
                   config.prior_slope, config.prior_share)

    def fork(self) -> LookupDrafter:
        """A drafter for another request in flight at the same time (batched decoding) that shares this one's memory
        of earlier requests: what either archives, both draw from."""
        other = LookupDrafter(self.max_match, self.max_cached_requests, self.memory.depth, self.prior_bias,
                              self.prior_slope, self.prior_share)
        other.memory = self.memory
        other._memory_cursor = other.memory.trie.matcher()
        return other

    # ------------------------------------------------------------------------------------------------ state
    def reset(self) -> None:
        """Archive the previous request (if any) in the memory trie; start an empty request."""
        super().reset()
        self._archive()
        self._tokens, self._where, self._prompt_len = [], {}, None
        self._memory_cursor = self.memory.trie.matcher()

    def _sync(self, ids: list[int]) -> None:
        """Index the committed tokens not seen yet (the whole prompt on the first call)."""
        if self._prompt_len is None:
            self._prompt_len = max(0, len(ids) - 1)  # the decoder's first call: prompt + first token
        for token in ids[len(self._tokens):]:
            self._where.setdefault(token, []).append(len(self._tokens))
            self._tokens.append(token)
            self._memory_cursor.append(token)

    # ------------------------------------------------------------------------------------------------ drafting
    def _estimate(self, match: int, share: float = 1.0) -> float:
        """``sigmoid(bias + slope * ln(match) + share_weight * share)``: the prior acceptance estimate of a token
        that continues a match of ``match`` tokens, ``share`` of whose equally long occurrences it agrees with."""
        z = self.prior_bias + self.prior_slope * math.log(match) + self.prior_share * share
        return 1.0 / (1.0 + math.exp(-z))

    def _request_candidate(self, num_draft_tokens: int) -> tuple[list[int], list[float]]:
        """The continuation of the longest (most recent on ties) earlier match of the sequence's suffix, with each
        token's estimate from the match length and the share of the equally long matches that agree with it."""
        seq = self._tokens
        last = len(seq) - 1
        best_len, ties = 0, []
        for at in reversed(self._where.get(seq[last], [])[-MAX_OCCURRENCES - 1:]):
            if at >= last:
                continue
            length = 1
            while length < self.max_match and at - length >= 0 and seq[at - length] == seq[last - length]:
                length += 1
            if length > best_len:
                best_len, ties = length, [at]
            elif length == best_len:
                ties.append(at)
        if best_len == 0:
            return [], []
        tokens: list[int] = []
        features: list[tuple[int, float]] = []
        for i in range(num_draft_tokens):  # read on through the draft itself where the occurrence runs into the present
            def next_of(at: int) -> int:
                j = at + 1 + i
                return seq[j] if j <= last else tokens[j - last - 1]

            token = next_of(ties[0])
            agree = [at for at in ties if next_of(at) == token]
            features.append((best_len + i, len(agree) / len(ties)))
            tokens.append(token)
            ties = agree
        return tokens, features

    def _memory_candidate(self, num_draft_tokens: int) -> tuple[list[int], list[tuple[int, float]]]:
        """The most frequent continuation of the longest match in the memory of earlier requests."""
        node, match = self._memory_cursor.longest_match(self.memory.depth // 2)
        tokens: list[int] = []
        features: list[tuple[int, float]] = []
        while node is not None and node.children and len(tokens) < num_draft_tokens \
                and match + len(tokens) < self.memory.depth:
            total = sum(child.count for child in node.children.values())
            token, node = max(node.children.items(), key=lambda item: item[1].count)
            features.append((match + len(tokens), node.count / total))
            tokens.append(token)
        return tokens, features

    @staticmethod
    def _expected(confidence: list[float]) -> float:
        total, chain = 0.0, 1.0
        for p in confidence:
            chain *= p
            total += chain
        return total

    def propose_row(self, ids: list[int], num_draft_tokens: int) -> tuple[list[int], None]:
        """At most ``num_draft_tokens`` tokens of the better candidate after ``ids`` (every committed token); none
        when nothing matches."""
        self._sync(ids)
        tokens, features = self._request_candidate(num_draft_tokens)
        confidence = [self._estimate(m, share) for m, share in features]
        if self.max_cached_requests:
            other, other_features = self._memory_candidate(num_draft_tokens)
            other_confidence = [self._estimate(m, share) for m, share in other_features]
            if self._expected(other_confidence) > self._expected(confidence):
                tokens, features, confidence = other, other_features, other_confidence
        self._features, self._confidence = features, confidence
        return tokens, None

    def confidence(self) -> list[float] | None:
        return self._confidence

    def match_features(self) -> list[tuple[int, float]]:
        """``[(match length, share)]`` of each token of the last proposal: what :meth:`_estimate` reads (the
        prior's fitting script ``bench/fit_lookup_prior.py`` reads them too)."""
        return self._features

    def memory_nodes(self) -> int:
        """Nodes of the memory trie: the drafter's memory across requests."""
        return self.memory.trie.nodes

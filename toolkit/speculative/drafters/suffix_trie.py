"""A depth-bounded suffix trie over token ids with occurrence counts: the data structure of SuffixDecoding
(Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications", NeurIPS 2025).

Every suffix of every inserted sequence is a path from the root, truncated at ``depth`` tokens; a node's ``count`` is
the number of occurrences of the substring it spells (each (start, length) pair of an inserted sequence increments
exactly one node). The children of the node matched by the current context give the observed continuations and
their frequencies, from which a drafter reads a tree of likely next tokens.

Sequences are inserted token by token through a :class:`TrieCursor` (``depth`` dictionary steps per token, so the
growing output of a request is indexed as it is generated) and removed with :meth:`SuffixTrie.remove` (bounded
memory: the counts of that sequence's substrings are decremented and emptied nodes deleted).
"""

from __future__ import annotations

from collections import OrderedDict


class TrieNode:
    """A trie node: ``count`` occurrences of the substring it spells, ``children`` by next token id."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, TrieNode] = {}


class SuffixTrie:
    """Suffix trie of bounded ``depth`` (tokens) with occurrence counts.

    Args:
        depth: longest substring indexed (>= 2); a match of ``m`` tokens can then be continued by at most
            ``depth - m`` tokens.
    """

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = TrieNode()
        self.nodes = 0  # nodes besides the root (memory accounting)

    def cursor(self) -> TrieCursor:
        """A cursor that inserts a new sequence token by token."""
        return TrieCursor(self, insert=True)

    def matcher(self) -> TrieCursor:
        """A cursor that follows a sequence without inserting it (matches against what is indexed)."""
        return TrieCursor(self, insert=False)

    def insert(self, tokens: list[int]) -> None:
        """Index every suffix of ``tokens`` (depth-bounded)."""
        cursor = self.cursor()
        for token in tokens:
            cursor.append(token)

    def remove(self, tokens: list[int]) -> None:
        """Undo :meth:`insert` of the same ``tokens``: decrement their substrings' counts, delete emptied nodes.

        Raises:
            KeyError: ``tokens`` were not inserted (a substring is missing).
        """
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start: start + self.depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    self.nodes -= _size(child)
                    break
                node = child


def _size(node: TrieNode) -> int:
    stack, total = [node], 0
    while stack:
        n = stack.pop()
        total += 1
        stack.extend(n.children.values())
    return total


class TrieCursor:
    """The nodes spelling every suffix (shorter than the trie depth) of a sequence fed token by token.

    ``active`` lists ``(node, length)`` from the shortest suffix to the longest. With ``insert=True`` the fed
    sequence is indexed (missing nodes created, counts incremented); else only existing paths are followed.
    """

    def __init__(self, trie: SuffixTrie, insert: bool):
        self.trie, self.insert = trie, insert
        self.active: list[tuple[TrieNode, int]] = []

    def append(self, token: int) -> None:
        trie = self.trie
        active = []
        for node, length in [(trie.root, 0)] + self.active:
            child = node.children.get(token)
            if child is None:
                if not self.insert:
                    continue
                child = node.children[token] = TrieNode()
                trie.nodes += 1
            if self.insert:
                child.count += 1
            if length + 1 < trie.depth:
                active.append((child, length + 1))
        self.active = active

    def longest_match(self, max_length: int, min_count: int = 1) -> tuple[TrieNode | None, int]:
        """The longest suffix (<= ``max_length`` tokens) with a continuation and ``count >= min_count``.

        Returns ``(node, length)`` or ``(None, 0)``.
        """
        for node, length in reversed(self.active):
            if length <= max_length and node.children and node.count >= min_count:
                return node, length
        return None, 0


#: prompt tokens stored before each archived output (so its first tokens can match the chat template's header)
PROMPT_CONTEXT = 8


class RequestMemory:
    """A bounded memory of earlier requests in one suffix trie (SuffixDecoding's global tree): each archived
    request's output, preceded by its last :data:`PROMPT_CONTEXT` prompt tokens; past ``limit`` requests the oldest is
    removed. The drafters of concurrent requests (batched decoding) share one memory.

    Args:
        depth: the trie's depth (longest indexed substring, tokens).
        limit: most requests kept (0 = none: nothing is archived).
    """

    def __init__(self, depth: int, limit: int):
        self.trie, self.limit = SuffixTrie(depth), limit
        self.requests: OrderedDict[int, list[int]] = OrderedDict()
        self._next_id = 0

    @property
    def depth(self) -> int:
        return self.trie.depth

    def archive(self, tokens: list[int], prompt_len: int) -> None:
        """Keep ``tokens`` (prompt + output) from ``PROMPT_CONTEXT`` tokens before the output on."""
        stored = tokens[max(0, prompt_len - PROMPT_CONTEXT):]
        if self.limit == 0 or len(stored) <= PROMPT_CONTEXT:
            return
        self.trie.insert(stored)
        self.requests[self._next_id] = stored
        self._next_id += 1
        while len(self.requests) > self.limit:
            _, old = self.requests.popitem(last=False)
            self.trie.remove(old)


class RemembersRequests:
    """Mixin of the drafters that keep a :class:`RequestMemory`: at the end of a request (``close``, or the next
    ``reset``) its tokens are archived once. The drafter sets ``memory``, ``_tokens`` (prompt + output so far) and
    ``_prompt_len`` (``None`` once archived or before the first call)."""

    memory: RequestMemory
    _tokens: list[int]
    _prompt_len: int | None

    @property
    def cached_requests(self) -> OrderedDict[int, list[int]]:
        """The earlier requests held in memory (oldest first)."""
        return self.memory.requests

    def close(self) -> None:
        """The request is over: archive it in the memory of earlier requests (shared with forks)."""
        self._archive()

    def _archive(self) -> None:
        """Add the current request to the memory of earlier requests, once."""
        prompt_len, self._prompt_len = self._prompt_len, None
        if prompt_len is not None:
            self.memory.archive(self._tokens, prompt_len)

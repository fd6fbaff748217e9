"""Drafters (one file each): cheap proposers of the next K tokens, behind one narrow interface (HF's CandidateGenerator shape).

The decode loop only calls:

* ``reset()`` at the start of a generation;
* ``propose(input_ids, num_draft_tokens) -> (tokens, draft_logits | None)`` with ``input_ids`` of shape ``(1, n)``
  (every committed token, prompt included). ``tokens`` has shape ``(1, k)`` with ``0 <= k <= num_draft_tokens``;
  ``draft_logits`` has shape ``(k, vocab)`` (raw logits, processed by the verifier exactly like the target's), or
  ``None`` for a deterministic drafter (a one-hot q under sampling);
* ``commit(num_accepted)`` after verification, so a stateful drafter rolls back what the target rejected.

Tree drafters also implement ``propose_tree(input_ids, budget, depth, topk) -> TokenTree`` (at most ``budget`` nodes,
``depth`` levels; see :class:`toolkit.speculative.tree.TokenTree` for the node/parent/depth/draft_probs contract)
and ``commit_tree(accepted_nodes)`` (the accepted path's node indices, root child first). The decode loop uses them
when the recipe sets ``spec.tree: true``.

Drafters here:

* :class:`DraftModel` — any HF causal LM at any precision (also the target's own weights at int8/int4, the
  ``self`` drafter), with a persistent KV cache that is rolled back with ``crop``, never rebuilt.
* :class:`NGramDrafter` — prompt lookup decoding (Saxena, 2023; HF ``prompt_lookup_num_tokens``): find the most
  recent earlier occurrence of the last n tokens (n from ``max_ngram`` down to ``min_ngram``) in prompt + output
  and propose what followed it. No model.
* :class:`SuffixDrafter` — SuffixDecoding (Oliaro et al., 2025): suffix tries over the request and over earlier
  requests' outputs (bounded memory), frequency-scored chains or trees, speculation length adapted to the match
  length. No model.
"""

from toolkit.speculative.drafters.base import Drafter
from toolkit.speculative.drafters.draft_model import DraftModel
from toolkit.speculative.drafters.ngram import NGramDrafter
from toolkit.speculative.drafters.suffix import SuffixDrafter

__all__ = ["Drafter", "DraftModel", "NGramDrafter", "SuffixDrafter"]

"""Drafters (one file each): cheap proposers of the next K tokens, behind one declared contract.

The contract (:class:`~toolkit.speculative.drafters.base.DrafterProtocol`, and
:class:`~toolkit.speculative.drafters.base.TreeDrafterProtocol` for token trees) is in
:mod:`toolkit.speculative.drafters.base`. Each file holds a config dataclass (only that drafter's fields) and the
drafter class registered for it (:mod:`toolkit.speculative.drafters.registry`); the import lines at the bottom of
this module are the registrations. To add a drafter: write one file like ``ngram.py`` and add one import here.

Drafters here:

* :class:`DraftModel` — any HF causal LM at any precision (also the target's own weights at int8/int4, the
  ``self`` drafter), drafting for every row at once on its own static cache, compiled where the recipe compiles;
  rollback moves per-row lengths.
* :class:`EagleDrafter` — an EAGLE-1 / EAGLE-3 head reading the target's hidden states, which the target's own
  (compiled) forward returns with its logits; the head's step compiled too.
* :class:`NGramDrafter` — prompt lookup decoding (Saxena, 2023; HF ``prompt_lookup_num_tokens``): find the most
  recent earlier occurrence of the last n tokens (n from ``max_ngram`` down to ``min_ngram``) in prompt + output
  and propose what followed it. No model.
* :class:`LookupDrafter` — the longest earlier match of the sequence's suffix anywhere in the request (most recent
  on ties) or in a suffix-trie memory of earlier requests, with a per-token acceptance estimate from the match length
  for the cost-aware verify length. No model.
* :class:`SuffixDrafter` — SuffixDecoding (Oliaro et al., 2025): suffix tries over the request and over earlier
  requests' outputs (bounded memory), frequency-scored chains or trees, speculation length adapted to the match
  length. No model.
"""

from toolkit.speculative.drafters.base import Drafter, DrafterProtocol, TreeDrafterProtocol
from toolkit.speculative.drafters.rows import RowDrafter, RowDrafters

# The registrations, one line per drafter (registration order = the order of the allowed names in errors).
from toolkit.speculative.drafters.draft_model import DraftModel, DraftModelConfig, SelfDraftConfig  # noqa: E402
from toolkit.speculative.drafters.eagle import EagleConfig, EagleDrafter  # noqa: E402
from toolkit.speculative.drafters.lookup import LookupConfig, LookupDrafter  # noqa: E402
from toolkit.speculative.drafters.ngram import NgramConfig, NGramDrafter  # noqa: E402
from toolkit.speculative.drafters.none import NoDrafterConfig  # noqa: E402
from toolkit.speculative.drafters.registry import (
                                                   DrafterConfig,
                                                   DrafterContext,
                                                   build_drafter,
                                                   config_type,
                                                   drafter_names,
                                                   register_drafter,
)
from toolkit.speculative.drafters.suffix import SuffixConfig, SuffixDrafter  # noqa: E402

__all__ = ["Drafter", "DrafterProtocol", "TreeDrafterProtocol", "RowDrafter", "RowDrafters", "DrafterConfig", "DrafterContext", "build_drafter",
           "config_type", "drafter_names", "register_drafter", "DraftModel", "DraftModelConfig", "SelfDraftConfig",
           "NGramDrafter", "NgramConfig", "SuffixDrafter", "SuffixConfig", "EagleDrafter", "EagleConfig",
           "NoDrafterConfig", "LookupDrafter", "LookupConfig"]

"""Target/draft tokenizer compatibility."""

from __future__ import annotations

from toolkit.errors import TokenizerMismatchError


def check_same_vocab(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers map the same strings to the same ids."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise TokenizerMismatchError(
            f"target {target_name!r} and draft {draft_name!r} do not share a tokenizer vocabulary "
            f"({len(target_tokenizer)} vs {len(draft_tokenizer)} entries); speculative decoding needs the draft to "
            "emit the target's token ids"
        )

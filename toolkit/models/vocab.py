"""Target/draft vocabulary compatibility: the same tokenizer, and the same number of logits."""

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


def model_vocab_size(model) -> int | None:
    """Rows of ``model``'s output layer (``config.vocab_size`` of its text config), or ``None`` when unknown."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) else None


def check_same_vocab_size(target, draft, target_name: str, draft_name: str, field: str = "draft.source") -> None:
    """Raise :class:`TokenizerMismatchError` naming ``field`` when target and draft models have different
    ``vocab_size`` (a draft that shares the tokenizer but pads or resizes its embedding emits logits of another
    width, which speculative sampling cannot compare with the target's)."""
    sizes = model_vocab_size(target), model_vocab_size(draft)
    if None not in sizes and sizes[0] != sizes[1]:
        raise TokenizerMismatchError(
            f"{field}: draft {draft_name!r} has vocab_size {sizes[1]}, target {target_name!r} {sizes[0]}; the "
            "draft must score the target's vocabulary (same tokenizer and the same number of logits)"
        )

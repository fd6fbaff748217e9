"""What a request must be before any forward: prompts as token ids (:func:`encode`) and checked against the models'
context and vocabulary (:func:`check_request`). Used by :class:`toolkit.speculative_lm.SpeculativeLM`."""

from __future__ import annotations

import torch

from toolkit.errors import ConfigError

_KV_SECTION = {"target": "kv", "draft": "draft_kv"}


def encode(tokenizer, source: str, prompt: str | list[dict] | torch.Tensor, field: str = "prompt") -> torch.Tensor:
    """Token ids ``(1, prompt_len)`` of a string, or of chat messages rendered with the chat template; token ids
    ``(1, prompt_len)`` (an integer tensor) are taken as they are.

    Raises:
        ConfigError (``field``): an empty string, an empty message list, a message without a string ``role`` and
            ``content``, messages whose contents are all empty, or messages for a tokenizer without a chat
            template.
    """
    if torch.is_tensor(prompt):
        if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.dtype not in (torch.long, torch.int):
            raise ConfigError(field, f"token ids must be an integer tensor of shape (1, prompt_len), got "
                              f"{prompt.dtype} {tuple(prompt.shape)}")
        return prompt.long()
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError(field, "is empty: give the text to continue")
        return tokenizer(prompt, return_tensors="pt").input_ids
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        _check_messages(prompt, field)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(field, f"the tokenizer of target.source={source!r} has no chat "
                              "template: give the prompt as plain text (toolkit generate --no-chat; a 'text' "
                              "or 'code' entry in a prompt suite)")
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt")
        return ids if torch.is_tensor(ids) else ids["input_ids"]
    raise ConfigError(field, "must be a string, a list of {'role': ..., 'content': ...} messages or token ids "
                      "(1, prompt_len)")



def check_request(models: list, vocab: int | None, input_ids: torch.Tensor, gen, field: str = "prompt") -> None:
    """Check one request against the models before any forward.

    * the prompt ``input_ids`` ``(1, prompt_len)`` holds at least one token and at most the context
      (``max_position_embeddings``) of the target and of a draft LM: the prefill feeds positions
      ``0 .. prompt_len - 1``, under every KV policy;
    * ``prompt_len + max_new_tokens`` stays within that context, unless the model's cache is a StreamingLLM
      window with ``position_mode: reindex`` (queries then get slot positions, bounded by the window, so
      generation may run past the context: :mod:`toolkit.kv.streaming`). Every other policy feeds absolute
      positions, which past the context are out of the model's range (learned position embeddings fail, rotary
      ones extrapolate into noise);
    * explicit ``eos_token_id`` values lie inside the target's vocabulary (an id the model can never emit would
      silently never stop the generation).

    Raises:
        ConfigError: naming ``field`` (the prompt), ``generation.max_new_tokens`` or
            ``generation.eos_token_id[i]``.
    """
    length = int(input_ids.shape[-1])
    if length == 0:
        raise ConfigError(field, "is empty: it encodes to no tokens")
    for role, model, policy in models:
        limit = _context(model)
        if limit is None:
            continue
        if length > limit:
            raise ConfigError(field, f"has {length} tokens, more than the {role}'s context of {limit} tokens "
                              "(max_position_embeddings); shorten it")
        if length + gen.max_new_tokens > limit and getattr(policy, "position_mode", None) != "reindex":
            raise ConfigError("generation.max_new_tokens", f"the prompt ({length} tokens) + max_new_tokens "
                              f"({gen.max_new_tokens}) = {length + gen.max_new_tokens} exceeds the {role}'s "
                              f"context of {limit} tokens (max_position_embeddings); lower max_new_tokens, or "
                              f"use a KV window with slot positions ({_KV_SECTION[role]}: "
                              "{policy: streaming, position_mode: reindex})")
    if gen.eos_token_id is not None and vocab is not None:
        for i, tok in enumerate(gen.eos_token_id):
            if tok >= vocab:
                raise ConfigError(f"generation.eos_token_id[{i}]", f"{tok} is outside the target's vocabulary "
                                  f"(ids 0..{vocab - 1})")


def _check_messages(messages: list[dict], field: str) -> None:
    """Chat messages: a non-empty list of ``{'role': str, 'content': str | list}``, not every content empty."""
    if not messages:
        raise ConfigError(field, "is an empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), (str, list)):
            raise ConfigError(f"{field}[{i}]", f"a message needs a string 'role' and a 'content', got {message!r}")
    if not any(message["content"] for message in messages):
        raise ConfigError(field, "is empty: every message has an empty content")


def _context(model) -> int | None:
    """``max_position_embeddings`` of a Hugging Face model's text config, or ``None`` (unknown, EAGLE heads)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return None
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None

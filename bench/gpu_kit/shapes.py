"""Random-weight models of real shapes, built from configs on the device (no hub), and the kit's tokenizer.

Every shape uses the embedded SmolLM2 tokenizer's vocabulary (49,152 tokens) so that real prompts can be encoded; a
real Qwen2.5 / Llama-3 embedding is 2.6-3.1x wider, which changes only the LM head's share of the bytes read per token
(said in the report). Random weights give true speeds, verify cost curves and host overhead, never acceptance: the
projection stage takes acceptance from CPU runs with real weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

VOCAB = 49152  # the embedded SmolLM2-135M tokenizer's vocabulary


@dataclass(frozen=True)
class Shape:
    """A decoder's shape: ``model_type`` and config fields (hidden size, layers, heads, KV heads, MLP width)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool = True
    extra: dict = field(default_factory=dict)

    def params(self) -> int:
        """Parameters, counted from the shape (embedding + layers + untied LM head)."""
        h, kv = self.hidden_size, self.num_key_value_heads * (self.hidden_size // self.num_attention_heads)
        layer = h * (h + 2 * kv) + h * h + 3 * h * self.intermediate_size
        return VOCAB * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer


#: the shapes the kit measures (names say whose shape; vocabulary: the embedded tokenizer's)
SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, True, {"rope_theta": 1e6}),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, True, {"rope_theta": 5e5}),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, False, {"rope_theta": 5e5}),
    # a draft for assisted generation / the draft-model drafter (the shape of a 68M-class Llama draft)
    "draft-68m": Shape("llama", 768, 2, 12, 12, 3072, True),
    # correctness: small enough for fp32 on any device, peaked logits (initializer_range 0.2: no near-ties)
    "check": Shape("llama", 512, 4, 8, 4, 1536, False, {"initializer_range": 0.2}),
    # the dry run's stand-ins (CPU, seconds)
    "tiny": Shape("llama", 64, 2, 4, 2, 128, False, {"initializer_range": 0.2}),
    "tiny-draft": Shape("llama", 64, 1, 4, 2, 128, False, {"initializer_range": 0.2}),
}


def build(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0, max_positions: int = 4096):
    """A random-weight ``AutoModelForCausalLM`` of shape ``name`` (:data:`SHAPES`), materialized directly on
    ``device`` in ``dtype``, eval mode, SDPA attention, ``max_positions`` positions of context. Raises ``KeyError``
    for an unknown shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = SHAPES[name]
    config = AutoConfig.for_model(
        shape.model_type, vocab_size=VOCAB, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size, tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=max_positions, head_dim=shape.hidden_size // shape.num_attention_heads, **shape.extra)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def tokenizer(carry: Path):
    """The embedded model's tokenizer: carried (``<carry>/tokenizer``, written by ``bench/gpu_carry.py``), else the
    toolkit's converted copy on a machine that has the embedded model; ``None`` when neither exists."""
    from transformers import AutoTokenizer

    if (carry / "tokenizer" / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(carry / "tokenizer")
    try:
        from toolkit.models.embedded import resolve_source

        return AutoTokenizer.from_pretrained(resolve_source("embedded"))
    except Exception:  # noqa: BLE001 - no embedded model here: the caller uses token-id prompts
        return None


def prompts(tok, count: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` prompts of ``length`` tokens ``(1, length)`` each, on the CPU: the ``make short`` suite's prompts
    encoded with ``tok`` (each repeated to the length; the suite cycled when ``count`` exceeds it), or, without a
    tokenizer or where the suite cannot be read (a source file missing on that machine), random ids with a repeated
    span (something to look up, like real text)."""
    if tok is not None:
        texts = _suite_texts()
        if texts:
            out = []
            for i in range(count):
                ids = tok(texts[i % len(texts)], return_tensors="pt").input_ids
                out.append(ids.repeat(1, -(-length // ids.shape[1]))[:, :length])
            return out
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        base = torch.randint(1, VOCAB, (max(length // 3, 1),), generator=g)
        out.append(torch.cat([base, base, base])[:length].view(1, -1))
    return out


def _suite_texts() -> list[str]:
    from toolkit.errors import ToolkitError
    from toolkit.measure.prompts import load_suite

    try:
        suite = load_suite("short")
    except (ToolkitError, OSError):
        return []
    return [p.prompt if isinstance(p.prompt, str) else "\n".join(m["content"] for m in p.prompt) for p in suite]

"""The EAGLE draft head: one decoder layer that predicts the target's next feature (Li et al. 2024, EAGLE; EAGLE-3).

Two layouts, matching the published checkpoints (see :mod:`toolkit.eagle.checkpoint`):

* ``eagle1`` (EAGLE-1 / EAGLE-2 heads): ``x = fc(cat(embed(token), feature))`` with ``fc: 2H -> H`` (bias), then one
  Llama decoder layer *without* an input norm; the output is the next feature in the target's *post-final-norm*
  space and is read as tokens by the LM head directly (no norm). The step-1 feature is the target's last decoder
  layer output passed through the target's frozen final norm (this also removes SmolLM2's massive activations).
* ``eagle3`` (EAGLE-3 heads): the step-1 feature is ``fc(cat(h_low, h_mid, h_high))`` (``3H -> H``, no bias) over
  three target layers' outputs; later steps feed the head's own output. The layer normalises feature
  (``hidden_norm``) and embedding (``input_layernorm``) separately and its q/k/v read ``cat(embed, feature)``
  (``2H``); tokens are read through ``lm_head(norm(out))``. Options of the published EAGLE-3 heads: the residual
  taken after ``hidden_norm`` (``norm_before_residual``), q/k/v biases, Qwen3's per-head q/k norms, and scaled
  rotary positions (Llama-3.1's ``llama3``, ``linear``, ``yarn``).

Either layout may read a reduced draft vocabulary (EAGLE-3 ``d2t`` / FR-Spec): draft id ``i`` is target id
``i + d2t[i]``; a target token outside it is never drafted.

The head attends over a KV cache of its own: the drafter's static one (:mod:`toolkit.eagle.static_head`, chains and
token trees), or :class:`HeadCache`, the eager reference with exact rollback (``crop``). Shapes: features
``(batch, seq, F)``, embeddings ``(batch, seq, H)``, KV ``(batch, kv_heads, seq, head_dim)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = ("eagle1", "eagle3")


@dataclass
class HeadConfig:
    """Shape of a head. ``feature_layers``: target decoder layers whose outputs form the step-1 feature (eagle1:
    the last layer, ``[-1]``; eagle3: three layers). ``draft_vocab_size`` = ``vocab_size`` means no reduction."""

    variant: str = "eagle1"
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    vocab_size: int = 49152
    draft_vocab_size: int = 49152
    feature_layers: list[int] = field(default_factory=lambda: [-1])
    fc_bias: bool = True
    #: eagle3: the residual around attention is the *normalised* feature (speculators' ``norm_before_residual``)
    norm_before_residual: bool = False
    #: biases on q/k/v/o (``attention_bias`` of a Llama / Qwen3 layer config)
    attention_bias: bool = False
    #: RMSNorm over each head's queries and keys before rotary positions (Qwen3-shaped layers)
    qk_norm: bool = False
    #: rotary scaling of the layer config (``{"rope_type": "llama3" | "linear" | "yarn", ...}``) or None; computed by
    #: transformers' own rope functions
    rope_scaling: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target(cls, target_config, variant: str = "eagle1", draft_vocab_size: int | None = None) -> "HeadConfig":
        """A head shaped like one decoder layer of ``target_config`` (any HF decoder-only config: the head itself is
        Llama-shaped, sized by the target's hidden size, heads and MLP width; the norm epsilon is the target's
        ``rms_norm_eps`` or ``layer_norm_eps`` / ``layer_norm_epsilon``)."""
        c = text_config(target_config)
        n = c.num_hidden_layers
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        eps = next((getattr(c, k) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
                    if getattr(c, k, None) is not None), 1e-5)
        intermediate = getattr(c, "intermediate_size", None) or getattr(c, "ffn_dim", None) or 4 * c.hidden_size
        return cls(variant=variant, hidden_size=c.hidden_size, intermediate_size=intermediate,
                   num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", heads),
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, rms_norm_eps=eps,
                   rope_theta=float(theta), vocab_size=c.vocab_size,
                   draft_vocab_size=draft_vocab_size or c.vocab_size,
                   feature_layers=[-1] if variant == "eagle1" else eagle3_layers(n),
                   fc_bias=variant == "eagle1")


def eagle3_layers(n_layers: int) -> list[int]:
    """EAGLE-3's three feature layers of an ``n_layers`` target: decoder layers ``1, n/2 - 1, n - 4`` (the
    ``output_hidden_states`` indices ``2, n/2, n - 3`` of the EAGLE-3 repository and speculators), kept within
    ``0..n-2`` for small targets (index ``n`` of ``output_hidden_states`` is after the final norm, which the head
    never reads)."""
    return [max(0, min(i, n_layers - 2)) for i in (1, n_layers // 2 - 1, n_layers - 4)]


class HeadCache:
    """The head's KV cache: ``keys`` / ``values`` ``(batch, kv_heads, length, head_dim)``; ``crop(n)`` keeps the
    first ``n`` entries (``n < 0``: drop the last ``-n``), exactly like ``DynamicCache.crop``."""

    compressions = 0  # never compressed (the toolkit.kv.contract.MemoryReport reports read)

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def crop(self, n: int) -> None:
        keep = len(self) + n if n < 0 else n
        if self.keys is not None and keep < len(self):
            self.keys, self.values = self.keys[:, :, :keep], self.values[:, :, :keep]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def kv_bytes(self) -> int:
        """Bytes of the head's keys and values (what reports count as the drafter's KV memory)."""
        return self.nbytes


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


#: rotary scalings whose frequencies depend on the sequence length (not a fixed table): refused
DYNAMIC_ROPE = ("dynamic", "longrope")
#: rotary position types a head may use (the fixed-table ones transformers' Llama rotary embedding computes)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def text_config(config):
    """The decoder's config of a transformers config (``get_text_config()`` of a multimodal one, else itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def rope_type(scaling: dict | None) -> str:
    """The rotary type a ``rope_scaling`` / ``rope_parameters`` mapping names (``default`` for none).

    Raises:
        ValueError: a type not in :data:`ROPE_TYPES` (a length-dependent one, :data:`DYNAMIC_ROPE`, said so).
    """
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        why = "depends on the sequence length" if kind in DYNAMIC_ROPE else "is not supported"
        raise ValueError(f"rope_type {kind!r} {why}; supported: {', '.join(ROPE_TYPES)}")
    return kind


def rope_frequencies(config: HeadConfig) -> tuple[torch.Tensor, float]:
    """``(inv_freq (head_dim/2,), attention_scaling)`` of the head's rotary positions: plain RoPE from
    ``rope_theta``, or — with ``rope_scaling`` (Llama-3.1's ``llama3``, ``linear``, ``yarn``) — the frequencies
    transformers' Llama rotary embedding computes for that scaling. Raises ValueError for another type
    (:func:`rope_type`), e.g. a length-dependent scaling (``dynamic``, ``longrope``) no fixed table can express."""
    c = config
    kind = rope_type(c.rope_scaling)
    if kind == "default":
        return 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)), 1.0
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    original, factor = c.rope_scaling.get("original_max_position_embeddings"), c.rope_scaling.get("factor")
    context = int(original * factor) if original and factor else 2048  # the context the scaling extends to
    layer = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                        max_position_embeddings=context,
                        rope_parameters={**c.rope_scaling, "rope_type": kind, "rope_theta": c.rope_theta})
    rotary = LlamaRotaryEmbedding(layer)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions (Llama convention) over ``in_dim`` inputs; optional biases
    (``attention_bias``) and per-head query / key norms (Qwen3)."""

    def __init__(self, config: HeadConfig, in_dim: int):
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(in_dim, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(in_dim, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(in_dim, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        inv, self.rope_scale = rope_frequencies(c)
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.float()[..., None] * self.inv_freq  # (batch, seq, head_dim/2)
        emb = torch.cat([angles, angles], dim=-1)[:, None]  # (batch, 1, seq, head_dim)
        cos, sin = (emb.cos() * self.rope_scale).to(x.dtype), (emb.sin() * self.rope_scale).to(x.dtype)
        return x * cos + _rotate_half(x) * sin

    def _heads(self, proj: nn.Linear, x: torch.Tensor, count: int, norm: str | None = None) -> torch.Tensor:
        """``proj(x)`` split into ``(b, count, q, head_dim)``, through the per-head norm named ``norm`` when the
        layer has one (``q_norm`` / ``k_norm``, Qwen3)."""
        b, q, _ = x.shape
        out = proj(x).view(b, q, count, self.head_dim)
        if norm is not None and hasattr(self, norm):
            out = getattr(self, norm)(out)
        return out.transpose(1, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: HeadCache | None,
                mask: torch.Tensor | None, extra_kv: tuple | None = None) -> tuple[torch.Tensor, tuple]:
        """``x`` ``(b, q, in_dim)``; ``positions`` ``(b, q)``; ``mask`` bool ``(q, kv)`` (True = attend) or None for
        causal attention over cache + new tokens. ``extra_kv``: keys/values prepended instead of a cache (training
        with several unrolled draft steps). Returns ``(out (b, q, H), (k, v) of the new tokens)``."""
        b, q, _ = x.shape
        qs = self.rope(self._heads(self.q_proj, x, self.heads, "q_norm"), positions)
        k = self.rope(self._heads(self.k_proj, x, self.kv_heads, "k_norm"), positions)
        v = self._heads(self.v_proj, x, self.kv_heads)
        new_kv = (k, v)
        if cache is not None:
            past = len(cache)
            k, v = cache.append(k, v)
            if mask is None and q > 1:
                mask = torch.ones(q, past + q, dtype=torch.bool, device=x.device).tril(past)
        elif extra_kv is not None:
            k, v = torch.cat([extra_kv[0], k], dim=2), torch.cat([extra_kv[1], v], dim=2)
        elif mask is None and q > 1:
            mask = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
        out = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1)), new_kv


class MLP(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One decoder layer; ``eagle1`` has no input norm, ``eagle3`` norms embedding and feature separately."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.variant = config.variant
        self.norm_before_residual = config.norm_before_residual
        h = config.hidden_size
        self.self_attn = Attention(config, h if config.variant == "eagle1" else 2 * h)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        if config.variant == "eagle3":
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, x, embeds, positions, cache, mask, extra_kv=None):
        residual = x
        if self.variant == "eagle3":
            feature = self.hidden_norm(x)
            if self.norm_before_residual:
                residual = feature
            x = torch.cat([self.input_layernorm(embeds), feature], dim=-1)
        attn, new_kv = self.self_attn(x, positions, cache, mask, extra_kv)
        x = residual + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_kv


class EagleHead(nn.Module):
    """The draft head. Parameters are named as in the published checkpoints (``fc``, ``layers.0`` / ``midlayer``,
    ``norm``, ``lm_head``), so :func:`toolkit.eagle.checkpoint.load_head` maps them one to one.

    ``lm_head`` ``(draft_vocab, H)`` and the token embedding ``(vocab, H)`` are frozen copies of the target's (rows
    ``draft_to_target`` for a reduced vocabulary) unless the checkpoint brings its own ``lm_head`` (EAGLE-3).
    ``draft_to_target`` ``(draft_vocab,)`` int64 maps draft ids to target ids.
    """

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        in_features = (2 * h) if config.variant == "eagle1" else (len(config.feature_layers) * h)
        self.fc = nn.Linear(in_features, h, bias=config.fc_bias)
        self.layer = DecoderLayer(config)
        if config.variant == "eagle3":
            self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)

    # -------------------------------------------------------------------------------------------- pieces
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``(b, s, H)`` in the head's dtype (the embedding may be the target's own module)."""
        return self.embed_tokens(tokens).to(self.fc.weight.dtype)

    def input_features(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Step-1 input: target features ``(b, s, F)`` + the *next* tokens ``(b, s)`` -> layer input ``(b, s, H)``."""
        if self.config.variant == "eagle1":
            return self.fc(torch.cat([self.embed(tokens), features], dim=-1))
        return self.fc(features)

    def step_input(self, own: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Later steps: the head's own previous outputs ``(b, s, H)`` + the next tokens ``(b, s)``."""
        if self.config.variant == "eagle1":
            return self.fc(torch.cat([self.embed(tokens), own], dim=-1))
        return own

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Head output ``(..., H)`` -> draft-vocabulary logits ``(..., draft_vocab)``."""
        if self.config.variant == "eagle3":
            out = self.norm(out)
        return self.lm_head(out)

    def to_target_vocab(self, scores: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary scores ``(..., draft_vocab)`` (logits or log-probabilities) -> float32 target-vocabulary
        scores ``(..., vocab)``, ``-inf`` outside the draft vocabulary (q is exactly zero there)."""
        full = scores.new_full((*scores.shape[:-1], self.config.vocab_size), float("-inf"), dtype=torch.float32)
        return full.index_copy_(-1, self.draft_to_target, scores.float())

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: HeadCache | None = None,
                mask: torch.Tensor | None = None, extra_kv=None):
        """Layer over prepared input ``x`` ``(b, s, H)`` (from :meth:`input_features` / :meth:`step_input`) at
        ``positions`` ``(b, s)``; returns ``(out (b, s, H), new (k, v))``."""
        return self.layer(x, self.embed(tokens), positions, cache, mask, extra_kv)

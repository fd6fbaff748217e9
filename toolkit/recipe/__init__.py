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

from toolkit.checks import check_choice, check_int
from toolkit.errors import ConfigError
from toolkit.recipe.sections import (
    ADAPTIVE,
    ATTN_IMPLEMENTATIONS,
    BACKENDS,
    COMPUTE_DTYPES,
    DEVICES,
    DRAFTERS,
    EAGLE_PRECISIONS,
    NAME_PATTERN,
    NAME_RULE,
    PRECISIONS,
    TEMPERATURE_MIN,
    TOP_P_MIN,
    TORCHAO_COMPUTE_DTYPES,
    TORCHAO_GROUP_SIZES,
    TORCHAO_INT8,
    GenerationSpec,
    KVSpec,
    ModelSpec,
    check_name,
)
from toolkit.recipe.speculation import LOOP_FIELDS, SpeculationSpec
from toolkit.recipe.yaml_io import check_keys as _check_keys
from toolkit.recipe.yaml_io import load_yaml_text, read_text
from toolkit.recipe.yaml_io import section as _section
from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD, DRAFT_MODEL, DRAFT_TARGET, DRAFT_UNUSED

#: most requests per target forward (``batch_size``, ``--batch-size``)
BATCH_SIZE_MAX = 256
#: requests per target forward for a list of prompts when the recipe does not set ``batch_size``
DEFAULT_BATCH_SIZE = 8
#: ``compile``: the target's forwards eager (``off``), compiled on a static cache (``on``), or compiled where it was
#: measured to pay (``auto``: torchao int4 / int8 weights on CPU, and CUDA; see toolkit.engine.forward), or ``max``:
#: ``on`` with frozen weights and a C++ wrapper on CPU (~20% faster steps, minutes longer first compile)
COMPILE_MODES = ("off", "on", "auto", "max")

__all__ = ["Recipe", "ModelSpec", "KVSpec", "SpeculationSpec", "GenerationSpec", "check_name", "read_text",
           "load_yaml_text", "LOOP_FIELDS", "ADAPTIVE", "ATTN_IMPLEMENTATIONS", "BACKENDS", "COMPUTE_DTYPES",
           "DEVICES", "DRAFTERS", "EAGLE_PRECISIONS", "NAME_PATTERN", "NAME_RULE", "PRECISIONS", "TEMPERATURE_MIN",
           "TOP_P_MIN", "TORCHAO_COMPUTE_DTYPES", "TORCHAO_GROUP_SIZES", "TORCHAO_INT8"]


@dataclass
class Recipe:
    """A complete, validated configuration: models, KV policies, speculation, generation, prompt set.

    ``draft`` is used by the ``draft_model`` drafter (its source and precision) and by the ``self`` drafter (only its
    precision: the source is the target's). ``draft_kv`` is the draft cache's own compression policy.
    ``prompts`` names a suite in ``recipes/prompts/`` (``short``, ``long``, ``memory``) or a path to a suite file
    (YAML, or JSONL of prompts / chat messages). ``batch_size`` is how many requests share a target forward when the
    recipe runs a list of prompts (:meth:`toolkit.speculative_lm.SpeculativeLM.generate_batch`,
    ``toolkit run --prompts``; ``None``: :data:`DEFAULT_BATCH_SIZE`, 1: one request at a time); it is written to YAML
    only when set.
    ``compile`` (:data:`COMPILE_MODES`) runs single-sequence decoding on the compiled static engine
    (:mod:`toolkit.engine.forward`); written to YAML only when not ``off``.
    """

    name: str = "recipe"
    description: str = ""
    target: ModelSpec = field(default_factory=ModelSpec)
    draft: ModelSpec | None = field(default_factory=lambda: ModelSpec(precision="int4"))
    kv: KVSpec = field(default_factory=KVSpec)
    draft_kv: KVSpec = field(default_factory=KVSpec)
    spec: SpeculationSpec = field(default_factory=SpeculationSpec)
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    prompts: str = "short"
    batch_size: int | None = None
    compile: str = "off"

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
        if self.batch_size is not None:
            check_int("batch_size", self.batch_size, low=1, high=BATCH_SIZE_MAX)
        check_choice("compile", self.compile, COMPILE_MODES)

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
        } | ({"batch_size": self.batch_size} if self.batch_size is not None else {}) | (
            {"compile": self.compile} if self.compile != "off" else {})  # unset / default: hashes stay as they were

    @classmethod
    def from_dict(cls, data: dict) -> Recipe:
        if not isinstance(data, dict):
            raise ConfigError("recipe", f"must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(data) - known))
        if unknown:
            raise ConfigError(unknown[0], "unknown recipe field", sorted(known))
        kwargs: dict[str, Any] = {}
        for key in ("name", "description", "prompts", "batch_size", "compile"):
            if key in data:
                kwargs[key] = data[key]
        if isinstance(kwargs.get("compile"), bool):  # YAML 1.1 reads a bare on / off as a boolean
            kwargs["compile"] = "on" if kwargs["compile"] else "off"
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
        kwargs["spec"] = SpeculationSpec(**spec)
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

    def with_target(self, source: str) -> Recipe:
        """This recipe on the target model at ``source`` (a local HF directory or a ``.gguf`` file): at ``precision:
        native`` where the source carries its own quantized weights — a GGUF on a machine without CUDA, a checkpoint
        quantized by torchao or bitsandbytes (:func:`toolkit.models.spec.native_by_default`) — else at the recipe's
        precision, except that a ``native`` recipe quantizes a source without weights of its own to ``int4``
        (backend ``auto``: the re-quantization native was measured against). ``--target`` (every command), ``search
        --target`` and the search's held-out comparisons follow this rule. A ``self`` drafter's draft follows the
        target (its source; its precision stays the recipe's).
        """
        recipe = self.replace(target=_on_source(self.target, source))
        if self.spec.config.draft == DRAFT_TARGET:
            recipe = recipe.replace(draft=dataclasses.replace(recipe.draft, source=source))
        return recipe

    def with_draft(self, source: str, field: str = "draft.source") -> Recipe:
        """This recipe drafting with the model at ``source``: a draft LM for the ``draft_model`` drafter, by the rule
        of :meth:`with_target` (``native`` where the source carries its own quantized weights; a ``native`` draft
        section quantizes any other source to ``int4``), or an EAGLE head directory for ``eagle`` (its
        ``draft.precision`` kept). ``--draft`` (``toolkit run / generate / eval``) follows this rule.

        Raises:
            ConfigError: naming ``field``: the recipe's drafter runs no draft model of its own (``lookup`` /
                ``ngram`` / ``suffix`` draft from the text, ``self`` from the target's own weights).
        """
        needs = self.spec.config.draft
        if needs == DRAFT_EAGLE_HEAD:
            return self.replace(draft=dataclasses.replace(self.draft, source=source))
        if needs != DRAFT_MODEL:
            what = "the target's own weights" if needs == DRAFT_TARGET else "the text"
            raise ConfigError(field, f"recipe {self.name!r} drafts with {self.spec.drafter!r} from {what} and runs no "
                              "draft model; recipes that take one have spec.drafter",
                              ["draft_model (e.g. short-draft)", "eagle (a head directory; e.g. short-eagle)"])
        return self.replace(draft=_on_source(self.draft, source))

    @property
    def rows_per_forward(self) -> int:
        """``batch_size``, or :data:`DEFAULT_BATCH_SIZE` when the recipe leaves it unset."""
        return self.batch_size if self.batch_size is not None else DEFAULT_BATCH_SIZE

    def config_hash(self) -> str:
        """Short stable hash of everything that affects results (name and description excluded)."""
        data = self.to_dict()
        data.pop("name")
        data.pop("description")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


def _on_source(spec: ModelSpec, source: str) -> ModelSpec:
    """``spec`` on the model at ``source`` (:meth:`Recipe.with_target`'s rule): ``precision: native`` where the source
    carries its own quantized weights (:func:`toolkit.models.spec.native_by_default`), ``int4`` where ``spec`` was
    native and the source has none, else ``spec``'s precision."""
    import torch

    from toolkit.models.spec import NATIVE, native_by_default

    on_cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
    if native_by_default(source, on_cuda):
        precision = {"precision": NATIVE, "backend": "auto"}
    else:
        precision = {"precision": "int4", "backend": "auto"} if spec.precision == NATIVE else {}
    return dataclasses.replace(spec, source=source, **precision)

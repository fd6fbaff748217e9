"""The drafter registry: one inert config dataclass per drafter, registered with the class that builds it.

Modelled on torchao's ``quantize_(model, Int4WeightOnlyConfig(...))`` handler registry. A drafter file defines

* a config dataclass (a subclass of :class:`DrafterConfig`) holding only that drafter's own fields, whose class
  attributes declare what the rest of the toolkit needs to know (its recipe name, what the recipe's ``draft``
  section means for it, whether it proposes token trees, which HF baseline does the same thing, its serving-engine
  names), and
* the drafter class, decorated with ``@register_drafter(ThatConfig)`` and built by ``from_config(config, context)``.

Recipe validation, the plan, the search space, the exporters and the reports ask this registry (or the config's
class attributes); nothing outside it compares drafter names. Adding a drafter = one new file plus one import line in
:mod:`toolkit.speculative.drafters`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from toolkit.errors import ConfigError

#: what a drafter makes of the recipe's ``draft`` section
DRAFT_UNUSED = "none"          # no draft model: the section must be absent or is ignored
DRAFT_MODEL = "model"          # a separate causal LM: draft.source and draft.precision
DRAFT_TARGET = "target"        # the target's own weights at draft.precision (draft.source is ignored)
DRAFT_EAGLE_HEAD = "eagle_head"  # an EAGLE head directory (or 'embedded') at draft.precision (fp32/bf16/fp16)


@dataclass
class DrafterConfig:
    """Base class of every drafter's config. Subclasses add their own fields (with defaults) and set:

    Class attributes:
        name: the recipe's ``spec.drafter`` value.
        speculates: the drafter proposes tokens (``False`` only for ``none``: plain autoregressive decoding).
        draft: what the recipe's ``draft`` section is to this drafter (``DRAFT_*`` above).
        tree: the drafter proposes token trees (``spec.tree: true`` is allowed).
        persistent: one drafter instance serves every ``generate`` call of a SpeculativeLM (memory across requests); its
            class then has ``fork()``: a drafter for a concurrent request sharing that memory (batches).
        batch: the drafter runs in batched decoding (:mod:`toolkit.engine.decoder`): model-free drafters per
            row, draft models and EAGLE heads over the whole batch (:mod:`toolkit.speculative.drafters.rows`).
        hf_baseline: the HF ``generate`` method that does the same kind of drafting (``assisted``,
            ``prompt_lookup``), timed next to ours; ``None`` = only HF AR.
        vllm_method / sglang_algorithm: the serving engines' name of the method, ``None`` where they have none.
    """

    name: ClassVar[str] = ""
    speculates: ClassVar[bool] = True
    draft: ClassVar[str] = DRAFT_UNUSED
    tree: ClassVar[bool] = False
    persistent: ClassVar[bool] = False
    batch: ClassVar[bool] = False
    hf_baseline: ClassVar[str | None] = None
    vllm_method: ClassVar[str | None] = None
    sglang_algorithm: ClassVar[str | None] = None

    def validate(self, prefix: str) -> None:
        """Check the fields; raise :class:`ConfigError` naming ``{prefix}.<field>``. Override per drafter."""

    def engine_params(self, engine: str) -> dict:
        """Drafter-specific settings of the serving engine ``engine`` (``vllm`` or ``sglang``)."""
        return {}

    def engine_gaps(self, engine: str) -> list[tuple[str, str]]:
        """``[(field, what it does)]`` for set fields that the serving engine ``engine`` (``vllm`` or ``sglang``)
        cannot express (exports warn)."""
        return []

    @property
    def uses_draft_model(self) -> bool:
        """The drafter runs a causal LM loaded from the recipe's ``draft`` section (or the target's weights)."""
        return self.draft in (DRAFT_MODEL, DRAFT_TARGET)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class DrafterContext:
    """What a drafter may be built from (one generation call's worth).

    Attributes:
        target: the target model. draft_model: the loaded draft LM or EAGLE head (``None`` if the drafter has none).
        draft_policy: the draft cache's KV policy (``None`` = uncompressed).
        do_sample / temperature / top_k / top_p: the call's sampling settings (draft tokens are chosen the same way).
        seed: the call's seed; a drafter that samples seeds its own generator with ``seed + 1``.
        tokenizer: the target's tokenizer; draft_tokenizer: the draft LM's, only when its vocabulary differs.
        acceptance: a network drafter's per-position acceptance, kept across calls (``None``: a fresh one).
        draft_forward: the draft LM's forward engine (:class:`~toolkit.engine.forward.TargetForward`, compiled where
            the recipe compiles; ``None``: eager).
        compile / backend: compile an EAGLE head's step, with this ``torch.compile`` backend.
    """

    target: Any
    draft_model: Any = None
    draft_policy: Any = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    tokenizer: Any = None
    draft_tokenizer: Any = None
    acceptance: Any = None
    draft_forward: Any = None
    compile: bool = False
    backend: str = "inductor"


_CONFIGS: dict[str, type[DrafterConfig]] = {}
_BUILDERS: dict[type[DrafterConfig], Callable] = {}


def register_drafter(config_type: type[DrafterConfig]) -> Callable:
    """Class decorator: ``@register_drafter(NgramConfig) class NGramDrafter(...)``; the class must define
    ``from_config(config, context) -> drafter | None``.

    Raises:
        ValueError: the config type has no name, or the name is registered to another config type.
    """
    if not config_type.name:
        raise ValueError(f"{config_type.__name__}.name must name the drafter")
    known = _CONFIGS.get(config_type.name)
    if known is not None and known is not config_type:
        raise ValueError(f"drafter name {config_type.name!r} is already registered to {known.__name__}")

    def decorate(cls):
        _CONFIGS[config_type.name] = config_type
        _BUILDERS[config_type] = cls.from_config
        return cls

    return decorate


def drafter_names() -> tuple[str, ...]:
    """Every registered ``spec.drafter`` value, in registration order."""
    return tuple(_CONFIGS)


def config_type(name: object, field: str = "spec.drafter") -> type[DrafterConfig]:
    """The config type registered as ``name``. Raises :class:`ConfigError` naming ``field`` and the allowed names."""
    if not isinstance(name, str) or name not in _CONFIGS:
        raise ConfigError(field, f"unknown value {name!r}", drafter_names())
    return _CONFIGS[name]


def config_types() -> tuple[type[DrafterConfig], ...]:
    return tuple(_CONFIGS.values())


def owner_of(field_name: str) -> list[type[DrafterConfig]]:
    """The registered config types that have a field called ``field_name``."""
    return [c for c in _CONFIGS.values() if field_name in {f.name for f in dataclasses.fields(c)}]


def build_drafter(config: DrafterConfig, context: DrafterContext):
    """A new drafter for ``config`` (``None`` for autoregressive decoding): for every config a row drafter
    (:class:`~toolkit.speculative.drafters.rows.RowDrafter`, the decoder's one protocol) — a network drafter over
    any number of rows, or a single-sequence drafter serving one row (batches give each row its own, see
    :class:`~toolkit.speculative.drafters.rows.RowDrafters`)."""
    return _BUILDERS[type(config)](config, context)

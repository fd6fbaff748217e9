"""The sections of a recipe besides speculation: how a model is loaded (:class:`ModelSpec`), a KV policy
(:class:`KVSpec`) and the generation arguments (:class:`GenerationSpec`, HF's names), with their allowed values."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from toolkit.checks import TOKENS_MAX, check_float, check_int, check_seed
from toolkit.errors import ConfigError
from toolkit.models.spec import (  # noqa: F401 (re-exported: the recipe's model sections)
    ATTN_IMPLEMENTATIONS,
    BACKENDS,
    COMPUTE_DTYPES,
    DEVICES,
    PRECISIONS,
    TORCHAO_COMPUTE_DTYPES,
    TORCHAO_GROUP_SIZES,
    TORCHAO_INT8,
    ModelSpec,
)
from toolkit.recipe.yaml_io import check_keys as _check_keys
from toolkit.speculative.drafters import drafter_names

#: an EAGLE head's ``draft.precision`` (:mod:`toolkit.eagle.precision`: int8 = torchao int8 weight-only linears)
EAGLE_PRECISIONS = ("fp32", "bf16", "fp16", "int8")
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
        :meth:`toolkit.speculative_lm.SpeculativeLM.check_request`, which knows the model)."""
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



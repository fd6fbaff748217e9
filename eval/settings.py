"""How much an evaluation measures: :class:`EvalSettings` (the full protocol, or :meth:`EvalSettings.fast`), read by
:func:`eval.evaluate.evaluate`, the search's trials and the budget fitter."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from eval.batch_run import METHODS as BATCH_METHODS
from eval.runners import BASELINES


@dataclass
class EvalSettings:
    """How much to measure. ``EvalSettings()`` is the full protocol; :meth:`fast` the cheap one (search, tests).

    Attributes:
        num_prompts: use N prompts of the suite, taken round-robin over its kinds (``None`` = all).
        max_new_tokens: cap on the recipe's ``generation.max_new_tokens`` (``None`` = the recipe's value).
        repeats: timed repetitions per method (>= 1; the protocol asks >= 3).
        warmup: untimed calls per method before timing.
        ppl_source: text source of :mod:`eval.data` (prose, code, wikitext, pg19), test split.
        ppl_tokens: tokens of held-out text for perplexity.
        ppl_window / ppl_stride: sliding-window protocol for the uncompressed model.
        baselines: run the HF baselines (``True``: AR, assisted / prompt lookup, AR fp32 reference, and in the batch
            stage HF batched AR and our single-row decoder; or a list of those names — ``ar``, ``assisted``,
            ``prompt_lookup``, ``prompt_lookup_10``, ``ar_fp32``, ``hf-batch-ar``, ``ours-single``; ``False``: none).
        reuse_baselines: reuse an identical baseline measurement made earlier in this process (same model objects,
            prompts and generation settings) instead of timing it again — the search sets this, since its trials
            share baselines; a single ``toolkit eval`` never does.
        reference: load the fp32 uncompressed target as the quality reference when the target is not fp32.
        ignore_eos: fixed-length runs (EOS disabled) for every method.
        mode: label used in the results directory name (``full`` / ``fast`` / anything).
        time_budget_s: fit the work into this many seconds (model loading excluded): the protocol is cut step by
            step from an estimate on the target's measured cost curve (:mod:`eval.budget`: perplexity tokens, new
            tokens, prompts, repetitions) and the timing loop starts no repetition that would overrun; the cuts are
            in ``metrics.json`` ``budget`` and the report. ``None``: no budget.
        batch_prompts: prompts of the batch stage of a recipe that sets ``batch_size`` (:func:`eval.batch_run.
            batch_section`, the ``batch`` section of the metrics): N of the suite spread over its kinds, ``None`` =
            all; ``num_prompts`` cuts only the per-request stage.
        keep_kinds: prompt kinds the per-request prompts always include when the suite has them (``num_prompts``
            is raised and a time budget never cuts below what keeps them): the search sets ``["summarize"]`` when
            its scenario bounds ROUGE-L (:mod:`eval.quality`). ``None``: no such floor.
        fixed: settings a time budget never cuts (``max_new_tokens``, ``ppl_tokens``, ``num_prompts``,
            ``repeats``): what defines a scenario (the long-prompt spaces fix the new tokens and the 4,096-token
            perplexity text, so a budget cuts repetitions only). ``None``: every cut allowed.
    """

    num_prompts: int | None = None
    max_new_tokens: int | None = None
    repeats: int = 3
    warmup: int = 1
    ppl_source: str = "prose"
    ppl_tokens: int = 2048
    ppl_window: int = 1024
    ppl_stride: int = 512
    baselines: bool | list[str] = True
    reuse_baselines: bool = False
    reference: bool = True
    ignore_eos: bool = True
    mode: str = "full"
    batch_prompts: int | None = None
    time_budget_s: float | None = None
    keep_kinds: list[str] | None = None
    fixed: list[str] | None = None

    def __post_init__(self) -> None:
        """Check every field; raises :class:`ConfigError` naming it (``repeats``, ``ppl_source`` ...)."""
        from eval.data import SOURCES
        from toolkit.checks import TOKENS_MAX, check_choice, check_float, check_int
        from toolkit.errors import ConfigError

        for name in ("num_prompts", "max_new_tokens", "batch_prompts"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=1, high=TOKENS_MAX)
        check_int("repeats", self.repeats, low=1, high=1000)
        check_int("warmup", self.warmup, low=0, high=1000)
        check_choice("ppl_source", self.ppl_source, SOURCES)
        check_int("ppl_tokens", self.ppl_tokens, low=2, high=TOKENS_MAX)
        check_int("ppl_window", self.ppl_window, low=2, high=TOKENS_MAX)
        check_int("ppl_stride", self.ppl_stride, low=1, high=TOKENS_MAX)
        if not isinstance(self.baselines, bool) and not (
                isinstance(self.baselines, (list, tuple)) and all(isinstance(b, str) for b in self.baselines)):
            raise ConfigError("baselines", f"must be true, false or a list of baseline names, got {self.baselines!r}")
        allowed = (*BASELINES, *BATCH_METHODS)
        unknown = [b for b in self.baselines if b not in allowed] if isinstance(self.baselines, (list, tuple)) else []
        if unknown:
            raise ConfigError("baselines", f"unknown baseline {unknown[0]!r} (allowed: {', '.join(allowed)})")
        for name in ("reuse_baselines", "reference", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        from toolkit.recipe import check_name

        check_name("mode", self.mode)  # part of a results directory name
        if self.time_budget_s is not None:
            check_float("time_budget_s", self.time_budget_s, low=0.0, low_open=True, high=7 * 24 * 3600.0)
        if self.keep_kinds is not None:
            from toolkit.checks import check_str_list

            self.keep_kinds = check_str_list("keep_kinds", self.keep_kinds, "prompt kinds")
        if self.fixed is not None:
            from eval.budget import CUTTABLE
            from toolkit.checks import check_str_list

            self.fixed = check_str_list("fixed", self.fixed, "settings")
            for name in self.fixed:
                check_choice("fixed", name, CUTTABLE)

    @classmethod
    def fast(cls, **overrides) -> EvalSettings:
        """Fast mode: 2 prompts, <= 48 new tokens, 3 repetitions, 512 perplexity tokens (window 256/128)."""
        base = dict(num_prompts=2, max_new_tokens=48, repeats=3, warmup=1, ppl_tokens=512, ppl_window=256,
                    ppl_stride=128, mode="fast")
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for name in ("batch_prompts", "time_budget_s", "keep_kinds", "fixed"):
            if data[name] is None:  # unset: earlier results (and their directory names) stay valid
                del data[name]
        return data

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:6]

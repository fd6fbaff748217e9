"""Evaluate one recipe: perplexity, acceptance, memory, latency and fidelity, with baselines in the same process.

    >>> from eval.evaluate import evaluate, EvalSettings
    >>> metrics = evaluate(Recipe.load("recipes/short.yaml"), settings=EvalSettings.fast())

Results go to ``results/<recipe-name>-<config-hash>/`` (``config.yaml``, ``metrics.json`` — schema in
``eval/metrics.schema.json`` —, ``report.md``, PNG plots), written atomically. A run whose ``metrics.json`` already
exists is skipped (its metrics are returned) unless ``force=True``. Settings other than the defaults (e.g. fast
mode) get their own directory ``<name>-<config-hash>-<mode>-<settings-hash>`` so they never mix.

Benchmark protocol: every method (ours and each baseline) runs on the same prompts with the same
``max_new_tokens`` and EOS disabled (fixed length); ``warmup`` untimed calls per method first; then ``repeats``
repetitions, methods interleaved within each repetition; the device is synchronized around every timed call.
Per repetition, throughput = all new tokens / all wall time over the prompts, TTFT and TPOT are means over the
prompts; reported as median with min-max over repetitions.

Injection points for tests and for the search (which keeps models loaded between trials): ``target``,
``tokenizer``, ``draft_model``, ``reference_model`` (already-loaded models), ``prompts`` (token-id lists or
:class:`toolkit.measure.prompts.Prompt`), ``ppl_ids`` (token ids of the perplexity text).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eval import metrics as M
from eval.batch_run import METHODS as BATCH_METHODS
from eval.budget import fit_evaluation, timing_deadline
from eval.quality import quality_section
from eval.results import EvalResult
from eval.runners import (
    BASELINES,
    OURS,
    PROMPT_LOOKUP_NGRAM,
    PROMPT_LOOKUPS,
    prompt_lookup_tokens,
    runners_for,
    selected_baselines,
)
from toolkit.io import atomic_write_json, atomic_write_text
from toolkit.measure.harness import Prompt, environment, measure, spread
from toolkit.recipe import ModelSpec, Recipe
from toolkit.session import SHARED_POOL, load_models, plan

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("metrics.schema.json")
DEFAULT_RESULTS = Path("results")


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
            from toolkit.checks import check_str_list

            from eval.budget import CUTTABLE

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


def results_dir(recipe: Recipe, settings: EvalSettings, root: str | Path = DEFAULT_RESULTS) -> Path:
    """``root/<name>-<config-hash>`` for the default settings, else ``...-<mode>-<settings-hash>``.

    Raises:
        ConfigError: the recipe's name or the settings' mode is not a safe name (the directory stays inside
            ``root``; :func:`toolkit.recipe.check_name`).
    """
    from toolkit.recipe import check_name

    name = f"{check_name('name', recipe.name)}-{recipe.config_hash()}"
    if settings != EvalSettings():
        name += f"-{check_name('mode', settings.mode)}-{settings.key()}"
    return Path(root) / name


# ------------------------------------------------------------------------------------------------- model cache
_REF_PPL: dict[tuple, dict] = {}
_BASELINES: dict[tuple, dict] = {}
_BATCH_BASELINES: dict[tuple, tuple] = {}


def get_model(spec: ModelSpec, field: str = "model"):
    """``(model, tokenizer)`` from the process-wide :data:`toolkit.session.SHARED_POOL` (loaded once)."""
    return SHARED_POOL.get(spec, field)


def clear_model_cache() -> None:
    from eval.quality import clear

    clear()
    SHARED_POOL.clear()
    _REF_PPL.clear()
    _BASELINES.clear()
    _BATCH_BASELINES.clear()


def load_recipe_models(recipe: Recipe, reference: bool = True):
    """``(target, tokenizer, draft_model | None, reference_model | None)`` for a recipe, from the shared pool."""
    target, tokenizer, draft_model, _ = load_models(plan(recipe), SHARED_POOL)
    ref = None
    if reference and recipe.target.precision != "fp32":
        ref_spec = dataclasses.replace(recipe.target, precision="fp32", backend="auto")
        ref, _ = get_model(ref_spec, "reference")
    return target, tokenizer, draft_model, ref


# ------------------------------------------------------------------------------------------------- helpers
def _prompts(recipe: Recipe, prompts, generator, count: int | None) -> list[Prompt]:
    """Harness prompts from injected prompts (token-id lists, tensors, harness prompts with their ids, suite prompts)
    or the recipe's suite."""
    if prompts is None:
        from toolkit.measure.prompts import load_suite

        prompts = load_suite(recipe.prompts)
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
            out.append(Prompt(f"ids-{i}", "ids", torch.tensor([list(p)])))
        elif torch.is_tensor(p):
            out.append(Prompt(f"ids-{i}", "ids", p.view(1, -1).long()))
        elif isinstance(p, Prompt):  # already token ids, with an id and a kind (summarize, code, ...)
            out.append(p)
        else:
            out.append(Prompt(p.id, p.kind, generator.encode(p.prompt, f"prompts.{p.id}")))
    out = spread(out, count)
    if not out:
        raise ValueError("prompts: no prompts to evaluate")
    return out


def _generation(recipe: Recipe, settings: EvalSettings):
    """The recipe's generation settings as measured: ``max_new_tokens`` capped by the settings, EOS per the
    settings. Raises ConfigError for an invalid combination."""
    max_new = recipe.generation.max_new_tokens
    if settings.max_new_tokens is not None:
        max_new = min(max_new, settings.max_new_tokens)
    gen = dataclasses.replace(recipe.generation, max_new_tokens=max_new,
                              ignore_eos=settings.ignore_eos or recipe.generation.ignore_eos)
    gen.validate("generation")
    return gen


def _baseline_key(method, recipe, target, draft_model, reference_model, items, gen, settings) -> tuple:
    """Identity of a baseline measurement: models (by object), prompts, generation settings, protocol."""
    k = {"assisted": recipe.spec.num_draft_tokens, "prompt_lookup": prompt_lookup_tokens(recipe),
         "prompt_lookup_10": 10}.get(method)
    ngram = PROMPT_LOOKUP_NGRAM if method in PROMPT_LOOKUPS else None
    models = {"ar": (id(target),), "ar_fp32": (id(reference_model),), "assisted": (id(target), id(draft_model)),
              "prompt_lookup": (id(target),), "prompt_lookup_10": (id(target),)}[method]
    prompts = tuple(tuple(it.input_ids[0].tolist()) for it in items)
    return (method, models, k, ngram, prompts, json.dumps(dataclasses.asdict(gen), sort_keys=True),
            settings.repeats, settings.warmup)


def _downsample(rows: list, limit: int = 200) -> list:
    if len(rows) <= limit:
        return rows
    step = len(rows) / limit
    picked = [rows[int(i * step)] for i in range(limit)]
    if picked[-1] is not rows[-1]:
        picked.append(rows[-1])
    return picked


# ------------------------------------------------------------------------------------------------- main entry
def evaluate(recipe: Recipe, *, settings: EvalSettings | None = None, out_dir: str | Path | None = None,
             results_root: str | Path = DEFAULT_RESULTS, force: bool = False, target=None, tokenizer=None,
             draft_model=None, reference_model=None, prompts=None, ppl_ids: list[int] | None = None,
             progress: bool = True, write: bool = True, plots: bool = True) -> EvalResult:
    """Measure ``recipe`` and write its results; returns an :class:`~eval.results.EvalResult` (its ``to_dict()``
    is the ``metrics.json`` document, see ``eval/metrics.schema.json``).

    Raises:
        ConfigError / ModelLoadError: from recipe validation and model loading.
        ValueError: invalid settings, no prompts, or metrics that do not match the schema.
    """
    settings = settings or EvalSettings()
    recipe.validate()
    out = Path(out_dir) if out_dir is not None else results_dir(recipe, settings, results_root)
    cached = None if force else _cached(out, settings)
    if cached is not None:
        return cached
    started = time.perf_counter()
    run = _Run.start(recipe, settings, prompts, progress, target, tokenizer, draft_model, reference_model)
    perplexity = _perplexity(run, ppl_ids)
    measured, reused = _timed(run)
    batch = _batched(run) if run.batch_items else None
    result = _document(run, measured, reused, perplexity, started, batch)
    validate_metrics(result)
    if write:
        from eval.report import write_report

        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.yaml", recipe.to_yaml())
        result["files"] = write_report(result, out, plots=plots)
        atomic_write_json(out / "metrics.json", result)  # last: its presence marks a finished run
    return EvalResult.from_dict(result)


def _cached(out: Path, settings: EvalSettings) -> EvalResult | None:
    """The finished evaluation in ``out`` when it was measured with the same settings."""
    metrics_path = out / "metrics.json"
    if not metrics_path.is_file():
        return None
    try:
        cached = json.loads(metrics_path.read_text())
    except json.JSONDecodeError:
        log.warning("unreadable %s: recomputing", metrics_path)
        return None
    if cached.get("settings") != settings.to_dict():
        return None
    log.info("results exist, skipped (use --force to recompute): %s", out)
    cached["skipped"] = True
    return EvalResult.from_dict(cached)


@dataclass
class _Run:
    """One evaluation: the recipe built, its reference model, its prompts and generation settings."""

    recipe: Recipe
    settings: EvalSettings
    generator: object
    reference_model: object
    items: list
    gen: object
    progress: bool
    batch_items: list  # prompts of the batch stage (empty: the recipe does not set batch_size)
    requested: EvalSettings  # the settings asked for (``settings``: what runs, cut to fit a time budget)
    budget: object = None  # eval.budget.Fitted, when the settings have a time budget
    deadline: float | None = None  # time.monotonic() by which the work should be done

    @classmethod
    def start(cls, recipe, settings, prompts, progress, target, tokenizer, draft_model, reference_model) -> _Run:
        from toolkit.speculative_lm import build

        if target is None:
            target, tokenizer, draft_model, loaded_ref = load_recipe_models(recipe, settings.reference)
            reference_model = reference_model or loaded_ref
        generator = build(recipe, target=target, tokenizer=tokenizer, draft_model=draft_model)
        if reference_model is None and recipe.target.precision == "fp32":
            reference_model = target
        requested, started = settings, time.monotonic()
        every = _prompts(recipe, prompts, generator, None)
        if settings.keep_kinds and settings.num_prompts is not None:  # e.g. a summarization prompt for ROUGE-L
            from eval.quality import keep_count

            settings = dataclasses.replace(settings, num_prompts=keep_count(every, settings.num_prompts,
                                                                             settings.keep_kinds))
        batched = recipe.batch_size is not None  # scored as it runs: a list of prompts at its batch size
        batch_items = spread(every, settings.batch_prompts) if batched else []
        asked = _generation(recipe, settings)
        for item in spread(every, settings.num_prompts) + batch_items:  # before any forward (a cost sweep too):
            generator.check_request(item.input_ids, asked, f"prompts.{item.id}")  # prompts past the context, EOS ids
        budget = None
        if settings.time_budget_s is not None:  # cut prompts and tokens only shrink what was checked
            budget = fit_evaluation(recipe, settings, generator, every, batch_items, reference_model)
            settings = budget.settings
        items = spread(every, settings.num_prompts)
        gen = _generation(recipe, settings)
        deadline = started + settings.time_budget_s if settings.time_budget_s is not None else None
        return cls(recipe, settings, generator, reference_model, items, gen, progress, batch_items, requested,
                   budget, deadline)

    @property
    def target(self):
        return self.generator.target

    @property
    def separate_reference(self) -> bool:
        return self.reference_model is not None and self.reference_model is not self.target


def _perplexity(run: _Run, ppl_ids: list[int] | None) -> dict:
    """Perplexity through the recipe's cache, sliding-window of the target, and of the fp32 reference (cached per
    process: pure functions of the model and the text)."""
    settings, target = run.settings, run.target
    if ppl_ids is None:
        from eval.data import describe, heldout_ids

        try:
            ppl_ids = heldout_ids(run.generator.tokenizer, settings.ppl_source, settings.ppl_tokens)
        except RuntimeError as exc:  # the hub is unreachable, or the text is shorter than ppl_tokens
            from toolkit.errors import ConfigError

            raise ConfigError("ppl_tokens" if "requested" in str(exc) else "ppl_source", str(exc)) from None
        text_desc = describe(settings.ppl_source)
    else:
        text_desc = "injected token ids"
        if run.budget is not None and "ppl_tokens" in run.budget.cuts:  # a time budget cut the text too
            ppl_ids = ppl_ids[:settings.ppl_tokens]
    ppl_ids = list(ppl_ids)
    ppl_conf = M.perplexity_through_cache(target, ppl_ids, run.generator.target_policy,
                                          chunk=run.recipe.spec.num_draft_tokens + 1, progress=run.progress)
    window = min(settings.ppl_window, len(ppl_ids))
    ids_key = hashlib.sha256(str(ppl_ids).encode()).hexdigest()
    slide_key = ("slide", id(target), ids_key, window, settings.ppl_stride)
    if slide_key not in _REF_PPL:
        _REF_PPL[slide_key] = M.perplexity_sliding_window(target, ppl_ids, window, min(settings.ppl_stride, window),
                                                          progress=run.progress)
    ppl_ref = None
    if run.reference_model is not None:
        key = ("ref", id(run.reference_model), ids_key)
        if key not in _REF_PPL:
            _REF_PPL[key] = M.perplexity_sliding_window(run.reference_model, ppl_ids, len(ppl_ids), len(ppl_ids))
            _REF_PPL[key]["protocol"]["method"] = ("fp32 target, no KV compression, full context over the same "
                                                    "tokens (= through-cache with policy none)")
        ppl_ref = _REF_PPL[key]
    return {"text": text_desc, "configured": ppl_conf, "sliding_window": _REF_PPL[slide_key],
            "reference_fp32": ppl_ref, "ratio_to_fp32": ppl_conf["value"] / ppl_ref["value"] if ppl_ref else None}


def _timed(run: _Run) -> tuple:
    """Our decoder and the applicable HF baselines, timed with the harness; baselines measured earlier in this
    process on the same models, prompts and settings are reused (``settings.reuse_baselines``)."""
    recipe, settings, generator, gen = run.recipe, run.settings, run.generator, run.gen
    applicable = selected_baselines(recipe, run.separate_reference, settings.baselines)
    methods = [OURS] + applicable

    def key(m):
        return _baseline_key(m, recipe, run.target, generator.draft_model, run.reference_model, run.items, gen,
                             settings)

    reused = {m: _BASELINES[key(m)] for m in applicable if settings.reuse_baselines and key(m) in _BASELINES}
    timed = [m for m in methods if m not in reused]
    device = next(run.target.parameters()).device
    deadline = timing_deadline(run.deadline, run.budget, run.settings, lambda: generator.verify_cost)
    measured = measure(runners_for(generator, timed, generator.eos_token_ids(gen), run.reference_model,
                                   trajectory=True), run.items, gen, repeats=settings.repeats, warmup=settings.warmup,
                       warm_gen=dataclasses.replace(gen, max_new_tokens=min(16, gen.max_new_tokens)),
                       meter=lambda: M.PeakMemory(str(device)), progress=run.progress, desc=f"eval {recipe.name}",
                       before_repetition=lambda rep: generator.forget(),  # no repetition sees another's prompts
                       deadline=deadline)
    for m in timed:
        if m != OURS and settings.reuse_baselines and len(measured.calls[m]) == settings.repeats:  # full runs only
            _BASELINES[key(m)] = measured.calls[m]
    measured.calls.update(reused)
    measured.methods = methods
    return measured, reused


def _batched(run: _Run) -> dict:
    """The batch stage (:func:`eval.batch_run.batch_section`): the recipe over ``run.batch_items`` at its batch size,
    next to HF batched AR and our single-row decoder (as ``settings.baselines`` allows)."""
    from eval.batch_run import batch_section

    if run.progress:
        log.info("batch stage: %d prompts, batch size %d", len(run.batch_items), run.recipe.batch_size)
    return batch_section(run.generator, [it.input_ids for it in run.batch_items], [it.id for it in run.batch_items],
                         run.gen, run.settings.repeats, run.settings.baselines,
                         _BATCH_BASELINES if run.settings.reuse_baselines else None, deadline=run.deadline,
                         progress=run.progress)


def _method_metrics(measured, reused: dict, first: dict) -> dict:
    out = {}
    for m in measured.methods:
        entry = measured.speed(m)
        entry["peak_memory"] = M.merge_peaks([c.peak for rep in measured.calls[m] for c in rep])
        if m != OURS:
            entry["target_forwards"] = sum(s.target_forwards for _, s in first[m])
            entry["tokens_per_round"] = (sum(s.committed for _, s in first[m]) /
                                         max(1, sum(s.rounds for _, s in first[m])))
        if m in reused:
            entry["reused"] = True
        out[m] = entry
    return out


def _ratios(method_metrics: dict) -> dict:
    def ratio(a, b):
        if a in method_metrics and b in method_metrics:
            den = method_metrics[b]["throughput"]["median"]
            return method_metrics[a]["throughput"]["median"] / den if den > 0 else None
        return None

    pairs = {"ours_vs_ar": ("ours", "ar"), "ours_vs_assisted": ("ours", "assisted"),
             "ours_vs_prompt_lookup": ("ours", "prompt_lookup"), "ours_vs_prompt_lookup_10": ("ours", "prompt_lookup_10"),
             "assisted_vs_ar": ("assisted", "ar"), "ours_vs_ar_fp32": ("ours", "ar_fp32")}
    ratios = {name: ratio(a, b) for name, (a, b) in pairs.items()}
    return {k: v for k, v in ratios.items() if v is not None}


def _fidelity(run: _Run, first: dict) -> dict:
    fid = {}
    if "ar" in first:
        fid["vs_ar"] = M.fidelity_summary([(a, b) for (a, _), (b, _) in zip(first["ours"], first["ar"])])
    ref_runs = first.get("ar_fp32") or (first.get("ar") if run.reference_model is run.target else None)
    if ref_runs is not None:
        fid["vs_fp32"] = M.fidelity_summary([(a, b) for (a, _), (b, _) in zip(first["ours"], ref_runs)])
    fid["greedy"] = not run.gen.do_sample
    return fid


def _memory(run: _Run, ours_stats: list, ppl_conf: dict, peak: dict, batch: dict | None) -> dict:
    weights = run.generator.weight_bytes
    per_token = M.kv_bytes_per_token(run.target)
    lengths = [s.prompt_tokens + s.new_tokens - 1 for s in ours_stats]
    memory = {
        "weight_bytes": {"target": weights["target"], "draft": weights["draft"],
                         "total": weights["target"] + weights["draft"]},
        "kv_bytes": {
            "target_final": max(s.kv_bytes_target for s in ours_stats),
            "draft_final": max(s.kv_bytes_draft for s in ours_stats),
            "target_peak": max(s.peak_kv_bytes_target for s in ours_stats),
            "target_peak_needed": max(s.peak_kv_bytes_needed_target for s in ours_stats),
            "draft_peak": max(s.peak_kv_bytes_draft for s in ours_stats),
            "uncompressed_target_peak": per_token * max(lengths),
            "per_token_uncompressed": per_token,
            "ppl_run_target_peak": ppl_conf["peak_kv_bytes"],
        },
        "compressions": {"target": sum(s.compressions_target for s in ours_stats),
                         "draft": sum(s.compressions_draft for s in ours_stats)},
        "peak": peak,
    }
    kv_peak = memory["kv_bytes"]["target_peak"] + memory["kv_bytes"]["draft_peak"]
    if batch is not None:  # the batch cache holds every row at once
        memory["kv_bytes"]["batch_peak"] = batch["kv_peak_bytes"]
        kv_peak = max(kv_peak, batch["kv_peak_bytes"])
    memory["total_peak_bytes"] = memory["weight_bytes"]["total"] + kv_peak
    return memory


def _document(run: _Run, measured, reused: dict, perplexity: dict, started: float, batch: dict | None) -> dict:
    """The ``metrics.json`` document of one evaluation."""
    recipe, settings, gen, items = run.recipe, run.settings, run.gen, run.items
    first = {m: [(c.token_ids, c.stats) for c in measured.first(m)] for m in measured.methods}
    ours_stats = [s for _, s in first[OURS]]
    method_metrics = _method_metrics(measured, reused, first)
    trajectories = [c.trajectory for c in measured.first(OURS)]
    return {
        "schema_version": SCHEMA_VERSION,
        "recipe": {"name": recipe.name, "config_hash": recipe.config_hash(), "config": recipe.to_dict(),
                   "weights": dict(run.generator.weights)},
        "settings": run.requested.to_dict(),
        **({"budget": run.budget.to_dict() | {"repeats_done": len(measured.calls[OURS])}} if run.budget else {}),
        "environment": environment(),
        "protocol": {
            "max_new_tokens": gen.max_new_tokens, "ignore_eos": gen.ignore_eos, "do_sample": gen.do_sample,
            "warmup": settings.warmup, "repeats": len(measured.calls[OURS]), "num_prompts": len(items),
            "timing": "wall clock with device synchronization; per repetition: throughput = new tokens / time over "
                      "all prompts, TTFT/TPOT = mean over prompts; median [min-max] over repetitions",
        },
        "prompts": [{"id": it.id, "kind": it.kind, "prompt_tokens": int(it.input_ids.shape[1])} for it in items],
        "perplexity": perplexity,
        "acceptance": M.acceptance(ours_stats),
        "memory": _memory(run, ours_stats, perplexity["configured"], method_metrics["ours"]["peak_memory"], batch),
        "methods": method_metrics,
        "ratios": _ratios(method_metrics),
        "fidelity": _fidelity(run, first),
        "quality": quality_section(items, first, run.generator, run.reference_model, gen),
        "trajectories": [{"prompt": it.id, "rows": _downsample(t)} for it, t in zip(items, trajectories)],
        **({"batch": batch} if batch is not None else {}),
        "elapsed_s": time.perf_counter() - started,
        "skipped": False,
    }


def validate_metrics(data: dict) -> None:
    """Raise ``ValueError`` unless ``data`` matches ``eval/metrics.schema.json``."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    try:
        jsonschema.validate(json.loads(json.dumps(data, default=str)), schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"metrics do not match {SCHEMA_PATH.name} at '{where}': {exc.message}") from exc

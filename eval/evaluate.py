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
from eval.budget import fit_evaluation, timing_deadline
from eval.document import document, validate_metrics
from eval.results import EvalResult
from eval.runners import (
    OURS,
    PROMPT_LOOKUP_NGRAM,
    PROMPT_LOOKUPS,
    prompt_lookup_tokens,
    runners_for,
    selected_baselines,
    static_cache_len,
)
from eval.settings import EvalSettings
from toolkit.io import atomic_write_json, atomic_write_text
from toolkit.measure.harness import Prompt, measure, spread
from toolkit.recipe import ModelSpec, Recipe
from toolkit.session import SHARED_POOL, load_models, plan

log = logging.getLogger(__name__)

DEFAULT_RESULTS = Path("results")


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
            out.append(Prompt(p.id, p.kind, generator.encode(p.prompt, f"prompts.{p.id}"),
                              getattr(p, "reference", None)))
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
    """Identity of a baseline measurement (any of :data:`~eval.runners.BASELINES`): models (by object), prompts,
    generation settings, protocol. Every baseline but ``ar_fp32`` (the fp32 reference) and ``assisted`` (target and
    draft) runs the target alone."""
    k = {"assisted": recipe.spec.num_draft_tokens, "prompt_lookup": prompt_lookup_tokens(recipe),
         "prompt_lookup_10": 10}.get(method)
    ngram = PROMPT_LOOKUP_NGRAM if method in PROMPT_LOOKUPS else None
    models = {"ar_fp32": (id(reference_model),), "assisted": (id(target), id(draft_model))}.get(method, (id(target),))
    prompts = tuple(tuple(it.input_ids[0].tolist()) for it in items)
    return (method, models, k, ngram, prompts, json.dumps(dataclasses.asdict(gen), sort_keys=True),
            settings.repeats, settings.warmup)


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
    result = document(run, measured, reused, perplexity, started, batch)
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
    applicable = selected_baselines(recipe, run.separate_reference, settings.baselines, run.target)
    methods = [OURS] + applicable

    def key(m):
        return _baseline_key(m, recipe, run.target, generator.draft_model, run.reference_model, run.items, gen,
                             settings)

    reused = {m: _BASELINES[key(m)] for m in applicable if settings.reuse_baselines and key(m) in _BASELINES}
    timed = [m for m in methods if m not in reused]
    device = next(run.target.parameters()).device
    deadline = timing_deadline(run.deadline, run.budget, run.settings, lambda: generator.verify_cost)
    static_len = static_cache_len([int(item.input_ids.shape[1]) for item in run.items], gen.max_new_tokens)
    runners = runners_for(generator, timed, generator.eos_token_ids(gen), run.reference_model, trajectory=True,
                          static_cache_len=static_len)
    measured = measure(runners, run.items, gen, repeats=settings.repeats, warmup=settings.warmup,
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

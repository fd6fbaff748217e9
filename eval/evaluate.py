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
from eval.results import EvalResult
from eval.runners import OURS, PROMPT_LOOKUP_NGRAM, PROMPT_LOOKUPS, baseline_methods, prompt_lookup_tokens, runners_for
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
        baselines: run the HF baselines (``True``: AR, assisted / prompt lookup, AR fp32 reference; or a list of
            those names; ``False``: none).
        reuse_baselines: reuse an identical baseline measurement made earlier in this process (same model objects,
            prompts and generation settings) instead of timing it again — the search sets this, since its trials
            share baselines; a single ``toolkit eval`` never does.
        reference: load the fp32 uncompressed target as the quality reference when the target is not fp32.
        ignore_eos: fixed-length runs (EOS disabled) for every method.
        mode: label used in the results directory name (``full`` / ``fast`` / anything).
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

    def __post_init__(self) -> None:
        """Check every field; raises :class:`ConfigError` naming it (``repeats``, ``ppl_source`` ...)."""
        from eval.data import SOURCES
        from toolkit.checks import TOKENS_MAX, check_choice, check_int
        from toolkit.errors import ConfigError

        for name in ("num_prompts", "max_new_tokens"):
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
        for name in ("reuse_baselines", "reference", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        from toolkit.recipe import check_name

        check_name("mode", self.mode)  # part of a results directory name

    @classmethod
    def fast(cls, **overrides) -> EvalSettings:
        """Fast mode: 2 prompts, <= 48 new tokens, 3 repetitions, 512 perplexity tokens (window 256/128)."""
        base = dict(num_prompts=2, max_new_tokens=48, repeats=3, warmup=1, ppl_tokens=512, ppl_window=256,
                    ppl_stride=128, mode="fast")
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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


def get_model(spec: ModelSpec, field: str = "model"):
    """``(model, tokenizer)`` from the process-wide :data:`toolkit.session.SHARED_POOL` (loaded once)."""
    return SHARED_POOL.get(spec, field)


def clear_model_cache() -> None:
    SHARED_POOL.clear()
    _REF_PPL.clear()
    _BASELINES.clear()


def load_recipe_models(recipe: Recipe, reference: bool = True):
    """``(target, tokenizer, draft_model | None, reference_model | None)`` for a recipe, from the shared pool."""
    target, tokenizer, draft_model, _ = load_models(plan(recipe), SHARED_POOL)
    ref = None
    if reference and recipe.target.precision != "fp32":
        ref_spec = dataclasses.replace(recipe.target, precision="fp32")
        ref, _ = get_model(ref_spec, "reference")
    return target, tokenizer, draft_model, ref


# ------------------------------------------------------------------------------------------------- helpers
def _prompts(recipe: Recipe, prompts, generator, settings: EvalSettings) -> list[Prompt]:
    """Harness prompts from injected prompts (token-id lists, tensors, suite prompts) or the recipe's suite."""
    if prompts is None:
        from toolkit.measure.prompts import load_suite

        prompts = load_suite(recipe.prompts)
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
            out.append(Prompt(f"ids-{i}", "ids", torch.tensor([list(p)])))
        elif torch.is_tensor(p):
            out.append(Prompt(f"ids-{i}", "ids", p.view(1, -1).long()))
        else:
            out.append(Prompt(p.id, p.kind, generator.encode(p.prompt, f"prompts.{p.id}")))
    out = spread(out, settings.num_prompts)
    if not out:
        raise ValueError("prompts: no prompts to evaluate")
    return out


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

    from toolkit.generator import build

    settings = settings or EvalSettings()
    recipe.validate()
    out = Path(out_dir) if out_dir is not None else results_dir(recipe, settings, results_root)
    metrics_path = out / "metrics.json"
    if metrics_path.is_file() and not force:
        try:
            cached = json.loads(metrics_path.read_text())
            if cached.get("settings") == settings.to_dict():
                log.info("results exist, skipped (use --force to recompute): %s", out)
                cached["skipped"] = True
                return EvalResult.from_dict(cached)
        except json.JSONDecodeError:
            log.warning("unreadable %s: recomputing", metrics_path)

    started = time.perf_counter()
    if target is None:
        target, tokenizer, draft_model, loaded_ref = load_recipe_models(recipe, settings.reference)
        reference_model = reference_model or loaded_ref
    generator = build(recipe, target=target, tokenizer=tokenizer, draft_model=draft_model)
    draft_model = generator.draft_model
    if reference_model is None and recipe.target.precision == "fp32":
        reference_model = target
    has_separate_ref = reference_model is not None and reference_model is not target
    device = next(target.parameters()).device
    K = recipe.spec.num_draft_tokens

    items = _prompts(recipe, prompts, generator, settings)
    max_new = recipe.generation.max_new_tokens
    if settings.max_new_tokens is not None:
        max_new = min(max_new, settings.max_new_tokens)
    gen = dataclasses.replace(recipe.generation, max_new_tokens=max_new,
                              ignore_eos=settings.ignore_eos or recipe.generation.ignore_eos)
    gen.validate("generation")
    for item in items:  # before any forward: empty prompts, prompts past the context, EOS ids outside the vocab
        generator.check_request(item.input_ids, gen, f"prompts.{item.id}")

    # ---------------------------------------------------------------------------------------- perplexity
    if ppl_ids is None:
        from eval.data import describe, heldout_ids

        try:
            ppl_ids = heldout_ids(tokenizer, settings.ppl_source, settings.ppl_tokens)
        except RuntimeError as exc:  # the hub is unreachable, or the text is shorter than ppl_tokens
            from toolkit.errors import ConfigError

            raise ConfigError("ppl_tokens" if "requested" in str(exc) else "ppl_source", str(exc)) from None
        text_desc = describe(settings.ppl_source)
    else:
        text_desc = "injected token ids"
    ppl_ids = list(ppl_ids)
    ppl_conf = M.perplexity_through_cache(target, ppl_ids, generator.target_policy, chunk=K + 1, progress=progress)
    window = min(settings.ppl_window, len(ppl_ids))
    ids_key = hashlib.sha256(str(ppl_ids).encode()).hexdigest()
    slide_key = ("slide", id(target), ids_key, window, settings.ppl_stride)
    if slide_key not in _REF_PPL:  # a pure function of the model and the text: computed once per process
        _REF_PPL[slide_key] = M.perplexity_sliding_window(target, ppl_ids, window, min(settings.ppl_stride, window),
                                                          progress=progress)
    ppl_slide = _REF_PPL[slide_key]
    ppl_ref = None
    if reference_model is not None:
        key = ("ref", id(reference_model), ids_key)
        if key not in _REF_PPL:
            _REF_PPL[key] = M.perplexity_sliding_window(reference_model, ppl_ids, len(ppl_ids), len(ppl_ids))
            _REF_PPL[key]["protocol"]["method"] = ("fp32 target, no KV compression, full context over the same "
                                                    "tokens (= through-cache with policy none)")
        ppl_ref = _REF_PPL[key]
    perplexity = {"text": text_desc, "configured": ppl_conf, "sliding_window": ppl_slide,
                  "reference_fp32": ppl_ref,
                  "ratio_to_fp32": ppl_conf["value"] / ppl_ref["value"] if ppl_ref else None}

    # ---------------------------------------------------------------------------------------- generation runs
    eos_ids = generator.eos_token_ids(gen)
    applicable = baseline_methods(recipe, has_separate_ref) if settings.baselines else []
    if isinstance(settings.baselines, (list, tuple)):
        applicable = [m for m in applicable if m in settings.baselines]
    methods = [OURS] + applicable
    reused: dict[str, list] = {}
    if settings.reuse_baselines:
        for m in applicable:
            key = _baseline_key(m, recipe, target, draft_model, reference_model, items, gen, settings)
            if key in _BASELINES:
                reused[m] = _BASELINES[key]
    timed = [m for m in methods if m not in reused]
    measured = measure(runners_for(generator, timed, eos_ids, reference_model, trajectory=True), items, gen,
                       repeats=settings.repeats, warmup=settings.warmup,
                       warm_gen=dataclasses.replace(gen, max_new_tokens=min(16, max_new)),
                       meter=lambda: M.PeakMemory(str(device)), progress=progress, desc=f"eval {recipe.name}",
                       before_repetition=lambda rep: generator.forget())  # no repetition sees another's prompts
    for m in timed:
        if m != OURS and settings.reuse_baselines:
            _BASELINES[_baseline_key(m, recipe, target, draft_model, reference_model, items, gen, settings)] = \
                measured.calls[m]
    measured.calls.update(reused)
    measured.methods = methods

    first = {m: [(c.token_ids, c.stats) for c in measured.first(m)] for m in methods}
    ours_stats = [s for _, s in first[OURS]]
    acc = M.acceptance(ours_stats)
    per_token = M.kv_bytes_per_token(target)
    lengths = [s.prompt_tokens + s.new_tokens - 1 for s in ours_stats]
    method_metrics = {}
    for m in methods:
        entry = measured.speed(m)
        entry["peak_memory"] = M.merge_peaks([c.peak for rep in measured.calls[m] for c in rep])
        if m != OURS:
            entry["target_forwards"] = sum(s.target_forwards for _, s in first[m])
            entry["tokens_per_round"] = (sum(s.committed for _, s in first[m]) /
                                         max(1, sum(s.rounds for _, s in first[m])))
        if m in reused:
            entry["reused"] = True
        method_metrics[m] = entry
    trajectories = [c.trajectory for c in measured.first(OURS)]

    def ratio(a, b):
        if a in method_metrics and b in method_metrics:
            den = method_metrics[b]["throughput"]["median"]
            return method_metrics[a]["throughput"]["median"] / den if den > 0 else None
        return None

    ratios = {"ours_vs_ar": ratio("ours", "ar"), "ours_vs_assisted": ratio("ours", "assisted"),
              "ours_vs_prompt_lookup": ratio("ours", "prompt_lookup"),
              "ours_vs_prompt_lookup_10": ratio("ours", "prompt_lookup_10"), "assisted_vs_ar": ratio("assisted", "ar"),
              "ours_vs_ar_fp32": ratio("ours", "ar_fp32")}
    ratios = {k: v for k, v in ratios.items() if v is not None}

    fid = {}
    if "ar" in first:
        fid["vs_ar"] = M.fidelity_summary([(a, b) for (a, _), (b, _) in zip(first["ours"], first["ar"])])
    ref_runs = first.get("ar_fp32") or (first.get("ar") if reference_model is target else None)
    if ref_runs is not None:
        fid["vs_fp32"] = M.fidelity_summary([(a, b) for (a, _), (b, _) in zip(first["ours"], ref_runs)])
    fid["greedy"] = not gen.do_sample

    memory = {
        "weight_bytes": {"target": generator.weight_bytes["target"], "draft": generator.weight_bytes["draft"],
                         "total": generator.weight_bytes["target"] + generator.weight_bytes["draft"]},
        "kv_bytes": {
            "target_final": max(s.kv_bytes_target for s in ours_stats),
            "draft_final": max(s.kv_bytes_draft for s in ours_stats),
            "target_peak": max(s.peak_kv_bytes_target for s in ours_stats),
            "draft_peak": max(s.peak_kv_bytes_draft for s in ours_stats),
            "uncompressed_target_peak": per_token * max(lengths),
            "per_token_uncompressed": per_token,
            "ppl_run_target_peak": ppl_conf["peak_kv_bytes"],
        },
        "compressions": {"target": sum(s.compressions_target for s in ours_stats),
                         "draft": sum(s.compressions_draft for s in ours_stats)},
        "peak": method_metrics["ours"]["peak_memory"],
    }
    memory["total_peak_bytes"] = (memory["weight_bytes"]["total"] + memory["kv_bytes"]["target_peak"]
                                  + memory["kv_bytes"]["draft_peak"])

    result = {
        "schema_version": SCHEMA_VERSION,
        "recipe": {"name": recipe.name, "config_hash": recipe.config_hash(), "config": recipe.to_dict()},
        "settings": settings.to_dict(),
        "environment": environment(),
        "protocol": {
            "max_new_tokens": max_new, "ignore_eos": gen.ignore_eos, "do_sample": gen.do_sample,
            "warmup": settings.warmup, "repeats": settings.repeats, "num_prompts": len(items),
            "timing": "wall clock with device synchronization; per repetition: throughput = new tokens / time over "
                      "all prompts, TTFT/TPOT = mean over prompts; median [min-max] over repetitions",
        },
        "prompts": [{"id": it.id, "kind": it.kind, "prompt_tokens": int(it.input_ids.shape[1])} for it in items],
        "perplexity": perplexity,
        "acceptance": acc,
        "memory": memory,
        "methods": method_metrics,
        "ratios": ratios,
        "fidelity": fid,
        "trajectories": [{"prompt": it.id, "rows": _downsample(t)} for it, t in zip(items, trajectories)],
        "elapsed_s": time.perf_counter() - started,
        "skipped": False,
    }
    validate_metrics(result)
    if write:
        from eval.report import write_report

        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.yaml", recipe.to_yaml())
        result["files"] = write_report(result, out, plots=plots)
        atomic_write_json(metrics_path, result)  # last: its presence marks a finished run
    return EvalResult.from_dict(result)


def validate_metrics(data: dict) -> None:
    """Raise ``ValueError`` unless ``data`` matches ``eval/metrics.schema.json``."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    try:
        jsonschema.validate(json.loads(json.dumps(data, default=str)), schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"metrics do not match {SCHEMA_PATH.name} at '{where}': {exc.message}") from exc

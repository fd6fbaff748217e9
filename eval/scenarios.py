"""The four scenarios: what a search optimizes and which constraints a recipe must meet (also in the README).

* ``short`` — prompts <= 256 tokens, 128-256 new tokens. Objective: throughput (tokens/s) of our loop.
  Constraints: perplexity <= ``ppl_ratio_max`` x the fp32 uncompressed target (default 1.10); optional memory
  budget.
* ``long`` — long prompts (the shipped space: ~4,000-token documents, where the KV cache outweighs the weights).
  Objective: throughput at bounded KV bytes. Constraints: peak KV bytes of target + draft <= ``kv_budget_mb``;
  perplexity (through the compressed cache) <= ``ppl_ratio_max`` x fp32.
* ``memory`` — least memory subject to perplexity <= 1.10 x the fp32 uncompressed baseline and throughput >= AR
  (:attr:`~eval.results.EvalResult.ar_reference_throughput`: HF ``generate`` on the fp32 target where the space
  measures it, else the faster of HF's eager and static compiled AR on the same weights, in the same process; the
  shipped space runs at the ~4,000-token context of ``long``, where KV >= weights). Memory = exact bytes of
  weights (target + draft) + peak KV (target + draft): the memory the recipe itself needs, independent of what else
  the process holds; peak RSS / CUDA peaks are reported next to it.
* ``throughput`` — a file of prompts served in batches (``batch_size`` is searched). Objective: tokens/s of the
  whole batched run (all new tokens / wall time; :func:`eval.batch_run.batch_section`). Constraints: weights + peak
  KV of the batch cache <= ``budget_mb`` (default 1024 MiB, ``--budget-mb``); perplexity <= 1.10 x fp32. Baselines in
  the same run: HF batched ``generate`` (AR, left-padded) at the same batch size; the held-out confirmation adds
  our single-row decoder over the same prompts.

Any scenario can also bound output quality: ``min_rouge_l`` (a space file's ``constraints``, or ``toolkit search
--min-rouge-l``) requires the mean ROUGE-L F1 of the recipe's text against the fp32 AR reference text on the
summarization prompts (:mod:`eval.quality`) to be at least that value, in [0, 1]; its trials then always keep a
summarization prompt (``EvalSettings.keep_kinds``), and a suite without one is refused before any trial.

Every trial is scored on three objectives (throughput up, perplexity down, memory down) so the Pareto front is
comparable across scenarios; the scenario decides which feasible trial wins (its ``primary`` objective, ties
broken by perplexity).
"""

from __future__ import annotations

from dataclasses import dataclass

from eval.results import MB, EvalResult

OBJECTIVES = ("throughput", "ppl", "memory_mb")
DIRECTIONS = ("maximize", "minimize", "minimize")
#: the constraint bounds of a scenario (a space file's ``constraints`` may override them)
BOUNDS = ("ppl_ratio_max", "budget_mb", "kv_budget_mb", "min_speedup_vs_ar", "min_fidelity", "min_rouge_l")
#: bounds that are fractions, in [0, 1]
UNIT_BOUNDS = {"min_fidelity": "a greedy match rate", "min_rouge_l": "a ROUGE-L F1 score"}


@dataclass
class Scenario:
    """A scenario's selection rule and constraint bounds (``None`` = constraint off)."""

    name: str
    primary: str  # one of OBJECTIVES
    ppl_ratio_max: float | None = 1.10
    budget_mb: float | None = None  # weights + peak KV (exact bytes), MiB
    kv_budget_mb: float | None = None  # peak KV of target + draft, MiB
    min_speedup_vs_ar: float | None = None  # ours / AR throughput (EvalResult.ar_reference_throughput)
    min_fidelity: float | None = None  # greedy match rate vs the recipe's target without compression
    min_rouge_l: float | None = None  # mean ROUGE-L F1 vs the fp32 AR reference text, summarization prompts

    def __post_init__(self) -> None:
        """Raises :class:`ConfigError` for an unknown ``primary`` or a bound that is not a finite number >= 0."""
        from toolkit.checks import check_choice

        check_choice("primary", self.primary, OBJECTIVES)
        for name in BOUNDS:
            check_bound(name, getattr(self, name), f"search.constraints.{name}")

    def to_dict(self) -> dict:
        """The scenario as a JSON-able dict (study configuration, trial keys, ``trials.json``). ``min_rouge_l`` appears
        only when set, so studies and trials recorded before it existed keep resuming and being reused."""
        import dataclasses

        data = dataclasses.asdict(self)
        if data["min_rouge_l"] is None:
            del data["min_rouge_l"]
        return data


def check_bound(name: str, value: object, field: str) -> None:
    """A constraint bound is ``None`` (off) or a finite number: > 0 for ratios and budgets, in [0, 1] for
    ``min_fidelity`` and ``min_rouge_l``, >= 0 for ``min_speedup_vs_ar``. Raises :class:`ConfigError` naming
    ``field`` (and, for a fraction, the range [0, 1])."""
    from toolkit.checks import check_float
    from toolkit.errors import ConfigError

    if value is None:
        return
    if name in UNIT_BOUNDS:
        try:
            check_float(field, value, low=0.0, high=1.0)
        except ConfigError:
            raise ConfigError(field, f"must be {UNIT_BOUNDS[name]} in [0, 1] (a number from 0.0 to 1.0; leave it out "
                              f"or null for no bound), got {value!r}") from None
    else:
        check_float(field, value, low=0.0, low_open=name != "min_speedup_vs_ar")


SCENARIOS = {
    "short": Scenario("short", primary="throughput", ppl_ratio_max=1.10),
    "long": Scenario("long", primary="throughput", ppl_ratio_max=1.25, kv_budget_mb=32.0),
    "memory": Scenario("memory", primary="memory_mb", ppl_ratio_max=1.10, min_speedup_vs_ar=1.0),
    "throughput": Scenario("throughput", primary="throughput", ppl_ratio_max=1.10, budget_mb=1024.0),
}


def scenario_of(space, budget_mb: float | None = None, min_rouge_l: float | None = None) -> Scenario:
    """The scenario of a search space (:class:`eval.space.SearchSpace`): the named scenario's bounds, the space file's
    ``constraints`` over them, then ``--budget-mb`` / ``--min-rouge-l`` over those. Raises :class:`ConfigError`
    for a bad bound (``--min-rouge-l`` outside [0, 1] ...)."""
    import dataclasses

    check_bound("min_rouge_l", min_rouge_l, "--min-rouge-l")
    base = SCENARIOS.get(space.scenario, Scenario(space.scenario, primary="throughput"))
    sc = dataclasses.replace(base, **space.constraints) if space.constraints else base
    if budget_mb is not None:
        sc = dataclasses.replace(sc, budget_mb=float(budget_mb))
    if min_rouge_l is not None:
        sc = dataclasses.replace(sc, min_rouge_l=float(min_rouge_l))
    return sc


def check_quality_prompts(sc: Scenario, space, prompts=None) -> None:
    """A scenario that bounds ROUGE-L needs a summarization prompt among its trials' prompts: the injected
    ``prompts`` (objects with a ``kind``; token-id lists have none) or the space's suite (``base.prompts``).

    Raises:
        ConfigError: field ``search.constraints.min_rouge_l``, naming the suite and the kinds it has.
    """
    from eval.quality import SUMMARY_KINDS
    from toolkit.errors import ConfigError

    if sc.min_rouge_l is None:
        return
    if prompts is not None:
        kinds, where = {getattr(p, "kind", "ids") for p in prompts}, "the given prompts"
    else:
        import dataclasses

        from toolkit.measure.prompts import load_suite
        from toolkit.recipe import Recipe

        suite = space.base.get("prompts") or next(f.default for f in dataclasses.fields(Recipe) if f.name == "prompts")
        kinds, where = {p.kind for p in load_suite(suite)}, f"prompt suite {suite!r}"
    if not kinds & set(SUMMARY_KINDS):
        raise ConfigError("search.constraints.min_rouge_l", f"ROUGE-L is measured on summarization prompts (kind "
                          f"{' / '.join(SUMMARY_KINDS)}), but {where} has only kinds {sorted(kinds)}: use a suite "
                          "with one (--prompts) or drop the bound")


def objectives(r: EvalResult) -> list[float]:
    """``[throughput tok/s, perplexity (configured), memory MiB (weights + peak KV)]`` of an evaluation."""
    return [r.throughput.median, r.ppl, r.memory_mb]


def constraints(r: EvalResult, sc: Scenario) -> dict[str, float]:
    """Constraint values (feasible iff every value <= 0), named, for Optuna (:func:`eval.search.trials.
    record_constraints`)."""
    out: dict[str, float] = {}
    if sc.ppl_ratio_max is not None:
        out["ppl_ratio"] = (r.ppl_ratio if r.ppl_ratio is not None else float("inf")) - sc.ppl_ratio_max
    if sc.budget_mb is not None:
        out["budget_mb"] = r.memory_mb - sc.budget_mb
    if sc.kv_budget_mb is not None:
        out["kv_budget_mb"] = r.kv_peak_bytes / MB - sc.kv_budget_mb
    if sc.min_speedup_vs_ar is not None:
        ar = r.ar_reference_throughput
        # AR is timed one request at a time: compare our single-request throughput (a batched recipe's too)
        out["speedup_vs_ar"] = sc.min_speedup_vs_ar - (r.single_throughput.median / ar if ar else 0.0)
    if sc.min_fidelity is not None:
        out["fidelity"] = sc.min_fidelity - (r.fidelity_vs_ar or 0.0)
    if sc.min_rouge_l is not None:  # not measured (no summarization prompt or no reference): infeasible
        out["rouge_l"] = sc.min_rouge_l - r.rouge_l if r.rouge_l is not None else float("inf")
    return out

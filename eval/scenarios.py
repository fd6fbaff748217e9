"""The four scenarios: what a search optimizes and which constraints a recipe must meet (also in the README).

* ``short`` — prompts <= 256 tokens, 128-256 new tokens. Objective: throughput (tokens/s) of our loop.
  Constraints: perplexity <= ``ppl_ratio_max`` x the fp32 uncompressed target (default 1.10); optional memory
  budget.
* ``long`` — >= 2000 new tokens. Objective: throughput at bounded KV bytes. Constraints: peak KV bytes of target +
  draft <= ``kv_budget_mb``; perplexity (through the compressed cache) <= ``ppl_ratio_max`` x fp32.
* ``memory`` — least memory subject to perplexity <= 1.10 x the fp32 uncompressed baseline and throughput >= AR
  (the fp32 uncompressed target with HF ``generate``, measured in the same process). Memory = exact bytes of
  weights (target + draft) + peak KV (target + draft): the memory the recipe itself needs, independent of what else
  the process holds; peak RSS / CUDA peaks are reported next to it.
* ``throughput`` — a file of prompts served in batches (``batch_size`` is searched). Objective: tokens/s of the
  whole batched run (all new tokens / wall time; :func:`eval.batch_run.batch_section`). Constraints: weights + peak
  KV of the batch cache <= ``budget_mb`` (default 1024 MiB, ``--budget-mb``); perplexity <= 1.10 x fp32. Baselines in
  the same run: HF batched ``generate`` (AR, left-padded) at the same batch size; the held-out confirmation adds
  our single-row decoder over the same prompts.

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
BOUNDS = ("ppl_ratio_max", "budget_mb", "kv_budget_mb", "min_speedup_vs_ar", "min_fidelity")


@dataclass
class Scenario:
    """A scenario's selection rule and constraint bounds (``None`` = constraint off)."""

    name: str
    primary: str  # one of OBJECTIVES
    ppl_ratio_max: float | None = 1.10
    budget_mb: float | None = None  # weights + peak KV (exact bytes), MiB
    kv_budget_mb: float | None = None  # peak KV of target + draft, MiB
    min_speedup_vs_ar: float | None = None  # ours / AR (fp32 uncompressed target) throughput
    min_fidelity: float | None = None  # greedy match rate vs the recipe's target without compression

    def __post_init__(self) -> None:
        """Raises :class:`ConfigError` for an unknown ``primary`` or a bound that is not a finite number >= 0."""
        from toolkit.checks import check_choice

        check_choice("primary", self.primary, OBJECTIVES)
        for name in BOUNDS:
            check_bound(name, getattr(self, name), f"search.constraints.{name}")


def check_bound(name: str, value: object, field: str) -> None:
    """A constraint bound is ``None`` (off) or a finite number: > 0 for ratios and budgets, in [0, 1] for
    ``min_fidelity``, >= 0 for ``min_speedup_vs_ar``. Raises :class:`ConfigError` naming ``field``."""
    from toolkit.checks import check_float

    if value is None:
        return
    if name == "min_fidelity":
        check_float(field, value, low=0.0, high=1.0)
    else:
        check_float(field, value, low=0.0, low_open=name != "min_speedup_vs_ar")


SCENARIOS = {
    "short": Scenario("short", primary="throughput", ppl_ratio_max=1.10),
    "long": Scenario("long", primary="throughput", ppl_ratio_max=1.25, kv_budget_mb=32.0),
    "memory": Scenario("memory", primary="memory_mb", ppl_ratio_max=1.10, min_speedup_vs_ar=1.0),
    "throughput": Scenario("throughput", primary="throughput", ppl_ratio_max=1.10, budget_mb=1024.0),
}


def objectives(r: EvalResult) -> list[float]:
    """``[throughput tok/s, perplexity (configured), memory MiB (weights + peak KV)]`` of an evaluation."""
    return [r.throughput.median, r.ppl, r.memory_mb]


def constraints(r: EvalResult, sc: Scenario) -> dict[str, float]:
    """Constraint values (feasible iff every value <= 0), named, for Optuna's ``constraints_func``."""
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
    return out

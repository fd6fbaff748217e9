"""The three scenarios: what a search optimizes and which constraints a recipe must meet (also in the README).

* ``short`` — prompts <= 256 tokens, 128-256 new tokens. Objective: throughput (tokens/s) of our loop.
  Constraints: perplexity <= ``ppl_ratio_max`` x the fp32 uncompressed target (default 1.10); optional memory
  budget.
* ``long`` — >= 2000 new tokens. Objective: throughput at bounded KV bytes. Constraints: peak KV bytes of target +
  draft <= ``kv_budget_mb``; perplexity (through the compressed cache) <= ``ppl_ratio_max`` x fp32.
* ``memory`` — least memory subject to perplexity <= 1.10 x the fp32 uncompressed baseline and throughput >= AR
  (the fp32 uncompressed target with HF ``generate``, measured in the same process). Memory = exact bytes of
  weights (target + draft) + peak KV (target + draft): the memory the recipe itself needs, independent of what else
  the process holds; peak RSS / CUDA peaks are reported next to it.

Every trial is scored on three objectives (throughput up, perplexity down, memory down) so the Pareto front is
comparable across scenarios; the scenario decides which feasible trial wins (its ``primary`` objective, ties
broken by perplexity).
"""

from __future__ import annotations

from dataclasses import dataclass

MB = 1024 * 1024

OBJECTIVES = ("throughput", "ppl", "memory_mb")
DIRECTIONS = ("maximize", "minimize", "minimize")


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
        if self.primary not in OBJECTIVES:
            raise ValueError(f"primary: must be one of {OBJECTIVES}, got {self.primary!r}")


SCENARIOS = {
    "short": Scenario("short", primary="throughput", ppl_ratio_max=1.10),
    "long": Scenario("long", primary="throughput", ppl_ratio_max=1.25, kv_budget_mb=32.0),
    "memory": Scenario("memory", primary="memory_mb", ppl_ratio_max=1.10, min_speedup_vs_ar=1.0),
}


def objectives(m: dict) -> list[float]:
    """``[throughput tok/s, perplexity (configured), memory MiB (weights + peak KV)]`` of a metrics dict."""
    return [m["methods"]["ours"]["throughput"]["median"], m["perplexity"]["configured"]["value"],
            m["memory"]["total_peak_bytes"] / MB]


def ar_reference_throughput(m: dict) -> float | None:
    """Median throughput of AR on the fp32 uncompressed target (``ar_fp32``, else ``ar`` of an fp32 target)."""
    methods = m["methods"]
    if "ar_fp32" in methods:
        return methods["ar_fp32"]["throughput"]["median"]
    if "ar" in methods and m["recipe"]["config"]["target"]["precision"] == "fp32":
        return methods["ar"]["throughput"]["median"]
    return methods.get("ar", {}).get("throughput", {}).get("median")


def constraints(m: dict, sc: Scenario) -> dict[str, float]:
    """Constraint values (feasible iff every value <= 0), named, for Optuna's ``constraints_func``."""
    out: dict[str, float] = {}
    if sc.ppl_ratio_max is not None:
        ratio = m["perplexity"]["ratio_to_fp32"]
        out["ppl_ratio"] = (ratio if ratio is not None else float("inf")) - sc.ppl_ratio_max
    if sc.budget_mb is not None:
        out["budget_mb"] = m["memory"]["total_peak_bytes"] / MB - sc.budget_mb
    if sc.kv_budget_mb is not None:
        kv = m["memory"]["kv_bytes"]
        out["kv_budget_mb"] = (kv["target_peak"] + kv["draft_peak"]) / MB - sc.kv_budget_mb
    if sc.min_speedup_vs_ar is not None:
        ar = ar_reference_throughput(m)
        ours = m["methods"]["ours"]["throughput"]["median"]
        out["speedup_vs_ar"] = sc.min_speedup_vs_ar - (ours / ar if ar else 0.0)
    if sc.min_fidelity is not None:
        fid = m["fidelity"].get("vs_ar", {}).get("match_rate", 0.0)
        out["fidelity"] = sc.min_fidelity - fid
    return out

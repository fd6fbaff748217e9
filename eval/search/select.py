"""Trial rows and the selection rule: feasibility, the Pareto front, the winner of a scenario."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from eval.results import EvalResult
from eval.scenarios import DIRECTIONS, OBJECTIVES, Scenario


@dataclass
class TrialRow:
    """One completed trial of a study.

    Attributes:
        number: Optuna trial number.
        params: the space labels picked (``{dimension: label}``).
        values: objectives in :data:`eval.scenarios.OBJECTIVES` order: throughput (tok/s), perplexity, memory (MiB).
        constraints: named constraint values (feasible iff all <= 0); ``None`` when none were recorded.
        recipe: the trial's recipe as a dict; config_hash: its hash.
        summary: what the evaluation measured (:func:`summary_of`).
        seed: the seed's name when the point was a seed (a shipped recipe), else ``None``.
        results_dir: the evaluation's results directory, relative to ``--out``.
        pareto / chosen: set by the selection; heldout / shipped: set by the held-out confirmation.
    """

    number: int
    params: dict
    values: list[float]
    constraints: dict | None
    recipe: dict | None = None
    config_hash: str | None = None
    summary: dict = field(default_factory=dict)
    seed: str | None = None
    results_dir: str | None = None
    pareto: bool = False
    chosen: bool = False
    heldout: dict | None = None
    shipped: list | None = None

    @property
    def feasible(self) -> bool:
        return is_feasible(self.constraints)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "feasible": self.feasible}


def is_feasible(cons: dict | None) -> bool:
    return cons is not None and all(v <= 0 for v in cons.values())


def summary_of(r: EvalResult) -> dict:
    """What a trial records of its evaluation (JSON-able, stored in the study)."""
    return {"throughput": r.throughput.median, "throughput_min": r.throughput.min,
            "throughput_max": r.throughput.max, "ppl": r.ppl, "ppl_ratio": r.ppl_ratio, "memory_mb": r.memory_mb,
            "kv_peak_mb": r.kv_peak_bytes / 2**20, "weights_mb": r.weight_bytes / 2**20,
            "alpha": r.acceptance_rate, "tau": r.tokens_per_round, "ratios": r.ratios, "ttft_ms": r.ttft_ms.median,
            "fidelity_vs_ar": r.fidelity_vs_ar, "fidelity_vs_fp32": r.fidelity_vs_fp32,
            "rouge_l": r.rouge_l, "code_exact_match": r.code_exact_match,
            "peak_memory": r.document["memory"]["peak"], "elapsed_s": r.elapsed_s}


def study_rows(study) -> list[TrialRow]:
    """The completed trials of ``study`` as rows."""
    import optuna

    rows = []
    for t in study.trials:
        if t.state != optuna.trial.TrialState.COMPLETE:
            continue
        a = t.user_attrs
        rows.append(TrialRow(t.number, dict(t.params), list(t.values), a.get("constraints"), a.get("recipe"),
                             a.get("config_hash"), a.get("summary", {}), a.get("seed"), a.get("results_dir")))
    return rows


def study_counts(study) -> dict:
    """Trials by outcome: completed (measured or reused), invalid (pruned before loading), duplicate, failed."""
    import optuna

    TS = optuna.trial.TrialState
    out = {"complete": 0, "invalid": 0, "duplicate": 0, "failed": 0, "running": 0, "reused": 0}
    reasons: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        if t.state == TS.COMPLETE:
            out["complete"] += 1
            out["reused"] += "cached_from" in t.user_attrs
        elif t.state == TS.PRUNED and "invalid" in t.user_attrs:
            out["invalid"] += 1
            key = t.user_attrs["invalid"].split(":", 1)[0]
            reasons[key] = reasons.get(key, 0) + 1
        elif t.state == TS.PRUNED:
            out["duplicate"] += 1
        elif t.state == TS.FAIL:
            out["failed"] += 1
        elif t.state == TS.RUNNING:
            out["running"] += 1
    out["invalid_by_field"] = reasons
    return out


def _dominates(a: list[float], b: list[float]) -> bool:
    signs = [1 if d == "maximize" else -1 for d in DIRECTIONS]
    better_or_equal = all(s * x >= s * y for s, x, y in zip(signs, a, b))
    return better_or_equal and any(s * x > s * y for s, x, y in zip(signs, a, b))


def pareto_front(rows: list[TrialRow]) -> list[TrialRow]:
    """Feasible rows not dominated by another feasible row on (throughput up, ppl down, memory down)."""
    feasible = [r for r in rows if r.feasible]
    return [r for r in feasible if not any(_dominates(o.values, r.values) for o in feasible if o is not r)]


def choose(rows: list[TrialRow], sc: Scenario) -> TrialRow | None:
    """The feasible row best on ``sc.primary`` (ties: lower perplexity); ``None`` if no row is feasible."""
    feasible = [r for r in rows if r.feasible]
    if not feasible:
        return None
    i = OBJECTIVES.index(sc.primary)
    sign = 1 if DIRECTIONS[i] == "maximize" else -1
    return max(feasible, key=lambda r: (sign * r.values[i], -r.values[1]))


def primary_value(summary: dict, sc: Scenario) -> float:
    return {"throughput": summary["throughput"], "ppl": summary["ppl"], "memory_mb": summary["memory_mb"]}[sc.primary]


def beats(mine: float, theirs: float, sc: Scenario) -> bool:
    """``mine`` is better than ``theirs`` on the scenario's primary objective."""
    return mine > theirs if DIRECTIONS[OBJECTIVES.index(sc.primary)] == "maximize" else mine < theirs


def verdict(mine: dict, theirs: dict, sc: Scenario) -> str:
    """``beats``, ``matches`` or ``does NOT beat``: summary ``mine`` against ``theirs`` on the scenario's primary
    objective. Throughput is timed (median of repetitions with their min and max): where the two ranges overlap the
    difference is within the spread of the repetitions, and that is ``matches``. PPL and memory are deterministic."""
    a, b = primary_value(mine, sc), primary_value(theirs, sc)
    if sc.primary == "throughput" and "throughput_min" in mine and "throughput_min" in theirs:
        if mine["throughput_min"] <= theirs["throughput_max"] and theirs["throughput_min"] <= mine["throughput_max"]:
            return "matches"
    if a == b:
        return "matches"
    return "beats" if beats(a, b, sc) else "does NOT beat"

"""Trial execution: one point of the space -> a recipe -> an evaluation -> objectives and constraints.

A point that makes no valid recipe is pruned with its reason before any model loads. A point whose result is already
known is not measured again: a completed trial with the same :func:`trial_key` (the recipe's hash plus everything
else that changes a trial's result: evaluation settings, prompt suite, scenario bounds) is reused; a point that
failed before is skipped; a duplicate running in another worker is skipped. A crash fails that trial only.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eval.scenarios import Scenario, constraints, objectives
from eval.search.select import is_feasible, summary_of
from eval.space import SearchSpace
from toolkit.errors import ConfigError


def trial_key(recipe, settings, sc: Scenario, prompts=None) -> str:
    """What a trial's result depends on: the recipe, the evaluation settings, the prompts (the suite file's content,
    or injected prompts), the scenario's bounds (they decide feasibility)."""
    suite = recipe.prompts
    if prompts is not None:
        suite = json.dumps([p.tolist() if hasattr(p, "tolist") else str(p) for p in prompts])
    else:
        from toolkit.resources import resolve

        try:
            suite = hashlib.sha256(resolve(recipe.prompts, "prompts", "prompts").read_bytes()).hexdigest()
        except ConfigError:
            pass
    parts = {"recipe": recipe.config_hash(), "settings": settings.to_dict(), "suite": suite,
             "scenario": sc.to_dict()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def native_constraints() -> bool:
    """Whether this optuna takes constraints on the trial (``Trial.set_constraint``, optuna >= 5, which deprecates
    the samplers' ``constraints_func``); else the sampler's ``constraints_func`` reads them
    (:func:`eval.search.study.make_sampler`)."""
    import optuna

    return hasattr(optuna.trial.Trial, "set_constraint")


def record_constraints(trial, cons: dict | None) -> None:
    """A trial's constraint values (each feasible at <= 0): the ``constraints`` user attribute our reports read, and
    on optuna >= 5 the trial's own constraints, which TPE reads. ``None``: a pruned trial, infeasible to the sampler
    (as ``constraints_func``'s ``[1.0]`` made it)."""
    if cons is not None:
        trial.set_user_attr("constraints", cons)
    if native_constraints():
        for name, value in (cons if cons is not None else {"pruned": 1.0}).items():
            trial.set_constraint(name, value)


def _pruned(trial, reason: str):
    """``optuna.TrialPruned(reason)``, the trial marked infeasible first (:func:`record_constraints`)."""
    import optuna

    record_constraints(trial, None)
    return optuna.TrialPruned(reason)


@dataclass
class TrialRunner:
    """The Optuna objective of one study (see the module docstring).

    Args:
        study / sp / sc / settings: the study, its space, scenario and evaluation settings.
        out: the ``--out`` directory; out_dir: ``<out>/<scenario>`` (trial results go to ``<out_dir>/trials/``,
            recorded relative to ``out``).
        models_fn / prompts / ppl_ids: test injection (see :func:`eval.search.run_search`).
    """

    study: object
    sp: SearchSpace
    sc: Scenario
    settings: object
    out: Path
    out_dir: Path
    models_fn: Callable | None = None
    prompts: object = None
    ppl_ids: object = None
    progress: bool = True
    durations: list[float] = field(default_factory=list)

    def __call__(self, trial) -> list[float]:
        params = self._suggest(trial)
        trial.set_user_attr("worker_pid", os.getpid())
        try:
            recipe = self.sp.recipe(params)
        except ConfigError as exc:
            trial.set_user_attr("invalid", str(exc))
            raise _pruned(trial, f"invalid combination: {exc}") from None
        key = trial_key(recipe, self.settings, self.sc, self.prompts)
        trial.set_user_attr("config_hash", recipe.config_hash())
        trial.set_user_attr("trial_key", key)
        trial.set_user_attr("recipe", recipe.to_dict())
        known = self._known(trial, key)
        if known is not None:
            return known
        return self._measure(trial, params, recipe)

    def _suggest(self, trial) -> dict:
        params: dict = {}
        for d in self.sp.dimensions:
            if d.active(params):
                params[d.name] = trial.suggest_categorical(d.name, d.searched)
        return params

    def _known(self, trial, key: str) -> list[float] | None:
        """Values of an identical finished trial (reused); raises TrialPruned for a known failure or a duplicate
        running elsewhere; ``None`` when the point must be measured."""
        import optuna

        TS = optuna.trial.TrialState
        for old in self.study.get_trials(deepcopy=False, states=(TS.COMPLETE,)):
            if old.user_attrs.get("trial_key") == key and old.user_attrs.get("constraints") is not None:
                record_constraints(trial, old.user_attrs["constraints"])
                for attr in ("summary", "results_dir"):
                    trial.set_user_attr(attr, old.user_attrs.get(attr))
                trial.set_user_attr("cached_from", old.number)
                return list(old.values)
        for old in self.study.get_trials(deepcopy=False, states=(TS.FAIL,)):
            if old.user_attrs.get("trial_key") == key and "error" in old.user_attrs:  # (a dead worker's is retried)
                raise _pruned(trial, f"failed before in trial {old.number}: {old.user_attrs['error']}")
        for other in self.study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
            if other.number < trial.number and other.user_attrs.get("trial_key") == key:
                raise _pruned(trial, f"duplicate of trial {other.number}, running in another worker")
        return None

    def _measure(self, trial, params: dict, recipe) -> list[float]:
        from eval.evaluate import evaluate, results_dir

        inject = self.models_fn(recipe) if self.models_fn is not None else {}
        target_dir = results_dir(recipe, self.settings, self.out_dir / "trials")
        t0 = time.perf_counter()
        try:
            m = evaluate(recipe, settings=self.settings, out_dir=target_dir, prompts=self.prompts,
                         ppl_ids=self.ppl_ids, progress=self.progress, **inject)
        except Exception as exc:  # one combination that fails to run must not end the study: FAIL, and go on
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
            print(f"  trial {trial.number}: {params} FAILED: {trial.user_attrs['error']}", file=sys.stderr)
            raise
        cons = constraints(m, self.sc)
        record_constraints(trial, cons)
        trial.set_user_attr("summary", summary_of(m))
        trial.set_user_attr("results_dir", target_dir.relative_to(self.out).as_posix())
        values = objectives(m)
        self.durations.append(time.perf_counter() - t0)
        print(f"  trial {trial.number}: {params} -> {values[0]:.1f} tok/s, PPL {values[1]:.2f}, "
              f"{values[2]:.1f} MiB, {'feasible' if is_feasible(cons) else 'infeasible ' + str(cons)} "
              f"({self.durations[-1]:.0f} s{', cached' if m.skipped else ''})", file=sys.stderr)
        return values


@dataclass
class Deadline:
    """Optuna callback: stop starting trials when one more (plus the held-out confirmations) would overrun the
    budget. The reserve is the slowest trial seen plus the confirmations (winner + shipped recipes) at a typical
    trial's duration, scaled by the held-out prompt count (a confirmation times every baseline afresh, ~1.5x)."""

    runner: TrialRunner
    started: float
    budget_s: float
    confirmations: int

    def __call__(self, study, trial) -> None:
        durations = self.runner.durations
        if not durations:
            return
        sp, settings = self.runner.sp, self.runner.settings
        scale = 1.5 * max(1.0, (sp.heldout.get("num_prompts") or 1) / (settings.num_prompts or 1))
        reserve = max(durations) + self.confirmations * scale * statistics.median(durations)
        if time.monotonic() - self.started + reserve > self.budget_s:
            print(f"search {sp.scenario}: stopping: the {self.budget_s:.0f} s budget leaves no room for another "
                  "trial", file=sys.stderr)
            study.stop()

"""Plain functions behind ``toolkit eval`` and ``toolkit search`` (wired in :mod:`toolkit_cli`)."""

from __future__ import annotations

import sys
from pathlib import Path

#: ``toolkit eval --fast`` fits its measurement into this many seconds unless ``--time-budget`` says otherwise
FAST_TIME_BUDGET_S = 150.0


def eval_command(recipe, force: bool = False, fast: bool = False, results_root: str | Path = "results",
                 time_budget_s: float | None = None, **settings):
    """``toolkit eval RECIPE [--force] [--fast] [--time-budget S]``: evaluate a recipe (a Recipe or a YAML path),
    write ``<results_root>/<name>-<hash>/``. ``--fast`` has a time budget of :data:`FAST_TIME_BUDGET_S` unless
    ``time_budget_s`` is given (:mod:`eval.budget`).

    Extra keyword arguments override :class:`eval.evaluate.EvalSettings` fields. Returns the metrics dict.
    Raises ConfigError / ModelLoadError for a bad recipe or unreadable model.
    """
    from eval.evaluate import EvalSettings, evaluate, results_dir
    from toolkit.recipe import Recipe

    recipe = recipe if isinstance(recipe, Recipe) else Recipe.load(recipe)
    if time_budget_s is not None or fast:
        settings["time_budget_s"] = time_budget_s if time_budget_s is not None else FAST_TIME_BUDGET_S
    cfg = EvalSettings.fast(**settings) if fast else EvalSettings(**settings)
    out = results_dir(recipe, cfg, results_root)
    result = evaluate(recipe, settings=cfg, out_dir=out, force=force)
    state = "existing results (use --force to recompute)" if result.skipped else "results"
    print(f"{recipe.name}: {state} in {out}/", file=sys.stderr)
    print(result.summary_line(), file=sys.stderr)
    return result


def search_command(scenario: str, budget_mb: float | None = None, trials: int | None = None,
                   storage: str | None = None, **kwargs) -> dict:
    """``toolkit search --scenario S [--budget-mb N] [--trials N] [--storage URL]``; see :mod:`eval.search`."""
    from eval.search import run_search

    return run_search(scenario, budget_mb=budget_mb, trials=trials, storage=storage, **kwargs)

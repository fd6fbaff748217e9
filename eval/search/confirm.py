"""Choosing and confirming the winner: the Pareto front, the scenario's pick, its measurement on held-out prompts
next to every shipped recipe of ``heldout.compare`` (every baseline timed again, in the same run), the outputs."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable

from eval.scenarios import Scenario, constraints
from eval.search.report import plot_trials, table, write_found_recipe
from eval.search.select import choose, is_feasible, pareto_front, study_counts, study_rows, summary_of
from eval.space import SearchSpace
from toolkit.errors import ConfigError
from toolkit.io import atomic_write_json, atomic_write_text


def heldout_confirmation(sp: SearchSpace, settings, out_dir: Path, models_fn: Callable | None = None,
                         heldout_prompts=None, ppl_ids=None, progress: bool = True) -> Callable:
    """``confirm(recipe) -> EvalResult``: ``recipe`` measured on the space's held-out prompts with every baseline
    timed again in this run (no reuse). Raises ConfigError when the space names no held-out suite."""
    from eval.evaluate import evaluate, results_dir

    def confirm(recipe):
        inject = models_fn(recipe) if models_fn is not None else {}
        h_settings = dataclasses.replace(settings, reuse_baselines=False, mode="heldout",
                                         num_prompts=sp.heldout.get("num_prompts", settings.num_prompts),
                                         baselines=sp.heldout.get("baselines", settings.baselines))
        if heldout_prompts is None and not sp.heldout.get("prompts"):
            raise ConfigError("search.heldout.prompts", "no held-out prompt suite in the space file")
        r = recipe if heldout_prompts is not None else recipe.replace(prompts=sp.heldout["prompts"])
        return evaluate(r, settings=h_settings, out_dir=results_dir(r, h_settings, out_dir / "heldout"),
                        prompts=heldout_prompts, ppl_ids=ppl_ids, progress=progress, **inject)

    return confirm


def shipped_recipes(sp: SearchSpace) -> list:
    """The shipped recipes ``heldout.compare`` names; on a user's model (``sp.target``) the same recipes for that
    model, those that need the embedded model's own EAGLE head left out."""
    from toolkit.recipe import Recipe
    from toolkit.resources import resolve
    from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD

    out = []
    for name in sp.heldout.get("compare", []):
        recipe = Recipe.load(resolve(name, "", "search.heldout.compare"))
        if sp.target is not None:
            if recipe.spec.config.draft == DRAFT_EAGLE_HEAD:
                continue
            recipe = recipe.with_target(sp.target)  # its own weights where it has them (precision native)
        out.append(recipe)
    return out


def confirm_winner(best, sp: SearchSpace, sc: Scenario, confirm: Callable) -> None:
    """Measure the winner and every shipped recipe of ``heldout.compare`` on the held-out prompts; the numbers go
    into ``best.heldout`` / ``best.shipped`` (and from there into the found recipe's provenance)."""
    from toolkit.recipe import Recipe

    vm = confirm(Recipe.from_dict(best.recipe))
    cons = constraints(vm, sc)
    best.heldout = {"summary": summary_of(vm), "constraints": cons, "feasible": is_feasible(cons),
                    "prompts": sp.heldout.get("prompts")}
    if not best.heldout["feasible"]:
        print(f"search {sc.name}: WARNING: the winner misses a constraint on the held-out prompts: {cons}",
              file=sys.stderr)
    best.shipped = []
    winner = Recipe.from_dict(best.recipe)
    for shipped in shipped_recipes(sp):
        if winner.batch_size is not None and shipped.batch_size is None:  # served as the winner is: same batch size
            shipped = shipped.replace(batch_size=winner.batch_size)
        sm = confirm(shipped)
        cons = constraints(sm, sc)
        best.shipped.append({"name": shipped.name, "summary": summary_of(sm), "constraints": cons,
                             "feasible": is_feasible(cons), "same_config": shipped.config_hash() ==
                             winner.config_hash()})


def finalize(study, sp: SearchSpace, sc: Scenario, out_dir: Path, found_dir, settings, storage: str,
             confirm: Callable | None = None, base: Path | None = None) -> dict:
    """Write the Pareto plot/table and trials.json, choose the winner, confirm it, write its recipe.

    ``storage`` is the study's URL without its password. Returns ``{"scenario", "trials", "feasible", "counts",
    "best" (row dict or None), "pareto" (row dicts), "files", "recipe_path"}``."""
    rows = study_rows(study)
    counts = study_counts(study)
    front = pareto_front(rows)
    best = choose(rows, sc)
    for r in rows:
        r.pareto = any(r is f for f in front)
        r.chosen = r is best
    if confirm is not None and best is not None:
        confirm_winner(best, sp, sc, confirm)
    files = {"trials": str(out_dir / "trials.json"), "table": str(out_dir / "pareto.md"),
             "plot": str(out_dir / "pareto.png")}
    atomic_write_json(out_dir / "trials.json", {"scenario": sc.to_dict(), "storage": storage,
                                                "study": study.study_name, "counts": counts,
                                                "rows": [r.to_dict() for r in rows]})
    atomic_write_text(out_dir / "pareto.md", table(rows, sc, best, counts))
    if rows:
        plot_trials(rows, sc, out_dir / "pareto.png", counts)
    result = {"scenario": sc.name, "trials": len(rows), "feasible": sum(r.feasible for r in rows), "counts": counts,
              "best": None if best is None else best.to_dict(), "pareto": [r.to_dict() for r in front],
              "files": files, "recipe_path": None}
    if best is None:
        print(f"search {sc.name}: no feasible trial among {len(rows)}; no recipe written", file=sys.stderr)
        return result
    if found_dir is not None:
        path = Path(found_dir) / f"{sc.name}.yaml"
        write_found_recipe(path, best, rows, sp, sc, settings, study.study_name, storage, counts, base)
        result["recipe_path"] = files["recipe"] = str(path)
    s = best.summary
    print(f"search {sc.name}: picked trial {best.number} {best.params}: {s['throughput']:.1f} tok/s, "
          f"PPL {s['ppl']:.2f} (x{(s['ppl_ratio'] or float('nan')):.3f}), {s['memory_mb']:.1f} MiB"
          + (f" -> {result['recipe_path']}" if result["recipe_path"] else ""), file=sys.stderr)
    return result

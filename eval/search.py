"""Automated configuration search per scenario (Optuna, multi-objective, constrained), recipes as output.

    toolkit search --scenario short [--budget-mb N] [--trials N] [--storage URL]

Every trial builds a recipe from the scenario's space (``recipes/search/<scenario>.yaml``, see :mod:`eval.space`),
runs the evaluator on it (fast settings from the space file) and reports three objectives — throughput (max),
perplexity (min), memory = weights + peak KV in MiB (min) — plus the scenario's constraints through Optuna's
``constraints_func`` (feasible iff every value <= 0; :mod:`eval.scenarios`). The winner is the feasible trial best on
the scenario's primary objective (ties: lower perplexity); infeasible trials are never chosen, and when no trial is
feasible no recipe is written.

Storage and resuming: the default storage is a SQLite file ``results/search/<scenario>.db``; a study is resumed
by name (``search-<scenario>``) and ``--trials N`` is the total the study should reach, so re-running after an
interrupt only runs the missing trials (trials left RUNNING by a killed local run are marked FAIL and redone;
finished ones are never repeated). Evaluations are cached on disk by recipe config hash
(``results/search/<scenario>/<name>-<hash>-...``) and inside the study, so a repeated point costs nothing.

Scaling past one machine: pass any Optuna RDB URL as ``--storage`` and start the same command on several machines;
they share one study (Optuna heartbeats fail trials of crashed workers after a grace period)::

    # once: createdb optuna; pip install psycopg2-binary
    toolkit search --scenario long --trials 24 --storage postgresql://user:pass@db-host:5432/optuna   # machine A
    toolkit search --scenario long --trials 24 --storage postgresql://user:pass@db-host:5432/optuna   # machine B

Outputs (``results/search/<scenario>/``): ``pareto.png`` (throughput vs memory, perplexity as colour, Pareto front
and winner marked), ``pareto.md`` (every trial: params, objectives, constraints, Pareto/feasible flags),
``trials.json``; and ``recipes/found/<scenario>.yaml`` with provenance (hardware, library versions, date, metrics) and
a "why it won" line, runnable with ``toolkit run``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import sys
import time
from pathlib import Path
from typing import Callable

from eval.scenarios import DIRECTIONS, OBJECTIVES, SCENARIOS, Scenario, constraints, objectives
from eval.space import SearchSpace, load_space
from toolkit.errors import ConfigError
from toolkit.io import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
FOUND_DIR = ROOT / "recipes" / "found"
SEARCH_ROOT = Path("results") / "search"


# ------------------------------------------------------------------------------------------------- selection
def is_feasible(cons: dict | None) -> bool:
    return cons is not None and all(v <= 0 for v in cons.values())


def _dominates(a: list[float], b: list[float]) -> bool:
    signs = [1 if d == "maximize" else -1 for d in DIRECTIONS]
    better_or_equal = all(s * x >= s * y for s, x, y in zip(signs, a, b))
    return better_or_equal and any(s * x > s * y for s, x, y in zip(signs, a, b))


def pareto_front(rows: list[dict]) -> list[dict]:
    """Feasible rows not dominated by another feasible row on (throughput up, ppl down, memory down)."""
    feasible = [r for r in rows if r["feasible"]]
    return [r for r in feasible if not any(_dominates(o["values"], r["values"]) for o in feasible if o is not r)]


def choose(rows: list[dict], sc: Scenario) -> dict | None:
    """The feasible row best on ``sc.primary`` (ties: lower perplexity); ``None`` if no row is feasible."""
    feasible = [r for r in rows if r["feasible"]]
    if not feasible:
        return None
    i = OBJECTIVES.index(sc.primary)
    sign = 1 if DIRECTIONS[i] == "maximize" else -1
    return max(feasible, key=lambda r: (sign * r["values"][i], -r["values"][1]))


def _rows(study) -> list[dict]:
    import optuna

    rows = []
    for t in study.trials:
        if t.state != optuna.trial.TrialState.COMPLETE:
            continue
        cons = t.user_attrs.get("constraints")
        rows.append({"number": t.number, "params": dict(t.params), "values": list(t.values), "constraints": cons,
                     "feasible": is_feasible(cons), "recipe": t.user_attrs.get("recipe"),
                     "config_hash": t.user_attrs.get("config_hash"), "summary": t.user_attrs.get("summary", {}),
                     "results_dir": t.user_attrs.get("results_dir")})
    return rows


# ------------------------------------------------------------------------------------------------- the search
def _scenario(space: SearchSpace, budget_mb: float | None) -> Scenario:
    base = SCENARIOS.get(space.scenario, Scenario(space.scenario, primary="throughput"))
    sc = dataclasses.replace(base, **space.constraints) if space.constraints else base
    if budget_mb is not None:
        sc = dataclasses.replace(sc, budget_mb=float(budget_mb))
    return sc


def _summary(m: dict) -> dict:
    ours = m["methods"]["ours"]["throughput"]
    kv = m["memory"]["kv_bytes"]
    return {"throughput": ours["median"], "throughput_min": ours["min"], "throughput_max": ours["max"],
            "ppl": m["perplexity"]["configured"]["value"], "ppl_ratio": m["perplexity"]["ratio_to_fp32"],
            "memory_mb": m["memory"]["total_peak_bytes"] / 2**20,
            "kv_peak_mb": (kv["target_peak"] + kv["draft_peak"]) / 2**20,
            "weights_mb": m["memory"]["weight_bytes"]["total"] / 2**20,
            "alpha": m["acceptance"]["acceptance_rate"], "tau": m["acceptance"]["tokens_per_round"],
            "ratios": m["ratios"], "ttft_ms": m["methods"]["ours"]["ttft_ms"]["median"],
            "fidelity_vs_ar": m["fidelity"].get("vs_ar", {}).get("match_rate"),
            "fidelity_vs_fp32": m["fidelity"].get("vs_fp32", {}).get("match_rate"),
            "peak_memory": m["memory"]["peak"], "elapsed_s": m["elapsed_s"]}


def run_search(scenario: str, budget_mb: float | None = None, trials: int | None = None,
               storage: str | None = None, *, space: str | Path | dict | None = None,
               results_root: str | Path = SEARCH_ROOT, found_dir: str | Path | None = FOUND_DIR,
               models_fn: Callable | None = None, prompts=None, ppl_ids=None, progress: bool = True,
               eval_overrides: dict | None = None, study_name: str | None = None, verify: bool = True) -> dict:
    """Run (or resume) the search of ``scenario``; returns a summary dict (best row, Pareto front, file paths).

    ``space`` defaults to ``recipes/search/<scenario>.yaml``. Test injection: ``models_fn(recipe) -> dict`` with
    ``target``, ``tokenizer``, ``draft_model``, ``reference_model``; ``prompts`` / ``ppl_ids`` as in
    :func:`eval.evaluate.evaluate`. ``found_dir=None`` writes no recipe. ``verify`` re-evaluates the winner with
    every baseline timed again in the same run (trials reuse baseline timings across trials when the space's eval
    settings say ``reuse_baselines``) and records those numbers in the recipe's provenance.

    Raises:
        ConfigError: unknown scenario / malformed space file.
    """
    import optuna

    from eval.evaluate import EvalSettings, evaluate, results_dir

    if space is None and scenario not in SCENARIOS:
        raise ConfigError("scenario", f"unknown scenario {scenario!r}", sorted(SCENARIOS))
    sp = load_space(space if space is not None else scenario)
    if sp.scenario != scenario:
        sp = dataclasses.replace(sp, scenario=scenario)
    sc = _scenario(sp, budget_mb)
    settings = EvalSettings(**{"mode": "search", **sp.eval, **(eval_overrides or {})})
    n_total = trials if trials is not None else sp.trials
    out_dir = Path(results_root) / scenario
    out_dir.mkdir(parents=True, exist_ok=True)
    default_storage = storage is None
    if default_storage:
        storage = f"sqlite:///{(Path(results_root) / f'{scenario}.db').resolve()}"
    rdb = optuna.storages.RDBStorage(storage, heartbeat_interval=30, grace_period=120) \
        if not default_storage else optuna.storages.RDBStorage(storage)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def constraints_func(trial) -> list[float]:
        cons = trial.user_attrs.get("constraints")
        return list(cons.values()) if cons else [1.0]

    grid = sp.grid_size <= n_total
    if grid:  # every point is queued explicitly (see below); the sampler only fills in past the queue
        sampler = optuna.samplers.RandomSampler(seed=0)
        sampler_name = f"exhaustive grid ({sp.grid_size} points)"
    else:
        sampler = optuna.samplers.TPESampler(seed=0, constraints_func=constraints_func, multivariate=True,
                                             n_startup_trials=min(6, n_total))
        sampler_name = f"TPE with constraints_func ({sp.grid_size} points, {n_total} trials)"
    study = optuna.create_study(study_name=study_name or f"search-{scenario}", storage=rdb,
                                directions=list(DIRECTIONS), sampler=sampler, load_if_exists=True)
    if default_storage:  # a local file has one writer: RUNNING trials are leftovers of an interrupted run
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            rdb.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=finished))
    if grid:
        # Exhaustive grid: queue every point that no finished, running or queued trial covers (a point whose trial
        # failed or was interrupted is queued again); finished points are never repeated.
        TS = optuna.trial.TrialState
        covered = {json.dumps(t.params, sort_keys=True) for t in study.get_trials(
            deepcopy=False, states=(TS.COMPLETE, TS.PRUNED, TS.RUNNING, TS.WAITING))}
        budget = n_total - done - len(study.get_trials(deepcopy=False, states=(TS.WAITING,)))
        for point in sp.points():
            if budget <= 0:
                break
            if json.dumps(point, sort_keys=True) not in covered:
                study.enqueue_trial(point)
                budget -= 1
    remaining = max(0, n_total - done)
    if grid:
        remaining = min(remaining, len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))))
    print(f"search {scenario}: {done} finished trial(s) in the study, running {remaining} more "
          f"({sampler_name}; storage {storage})", file=sys.stderr)

    def objective(trial) -> list[float]:
        params = {d.name: trial.suggest_categorical(d.name, d.labels) for d in sp.dimensions}
        try:
            recipe = sp.recipe(params)
        except ConfigError as exc:
            trial.set_user_attr("invalid", str(exc))
            raise optuna.TrialPruned(f"invalid combination: {exc}") from None
        h = recipe.config_hash()
        trial.set_user_attr("config_hash", h)
        trial.set_user_attr("recipe", recipe.to_dict())
        for old in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if old.user_attrs.get("config_hash") == h and old.user_attrs.get("constraints") is not None:
                for key in ("constraints", "summary", "results_dir"):
                    trial.set_user_attr(key, old.user_attrs.get(key))
                trial.set_user_attr("cached_from", old.number)
                return list(old.values)
        inject = models_fn(recipe) if models_fn is not None else {}
        target_dir = results_dir(recipe, settings, out_dir)
        started = time.perf_counter()
        m = evaluate(recipe, settings=settings, out_dir=target_dir, prompts=prompts, ppl_ids=ppl_ids,
                     progress=progress, **inject).to_dict()
        cons = constraints(m, sc)
        trial.set_user_attr("constraints", cons)
        trial.set_user_attr("summary", _summary(m))
        trial.set_user_attr("results_dir", str(target_dir))
        values = objectives(m)
        print(f"  trial {trial.number}: {params} -> {values[0]:.1f} tok/s, PPL {values[1]:.2f}, "
              f"{values[2]:.1f} MiB, {'feasible' if is_feasible(cons) else 'infeasible ' + str(cons)} "
              f"({time.perf_counter() - started:.0f} s{', cached' if m.get('skipped') else ''})", file=sys.stderr)
        return values

    if remaining:
        study.optimize(objective, n_trials=remaining, gc_after_trial=False, show_progress_bar=False)
    verifier = None
    if verify:
        def verifier(recipe):
            """Re-measure the winner with every baseline timed interleaved in this run (no reuse)."""
            inject = models_fn(recipe) if models_fn is not None else {}
            v_settings = dataclasses.replace(settings, reuse_baselines=False, mode="verify")
            return evaluate(recipe, settings=v_settings, out_dir=results_dir(recipe, v_settings, out_dir),
                            prompts=prompts, ppl_ids=ppl_ids, progress=progress, **inject).to_dict()
    return finalize(study, sp, sc, out_dir, found_dir, settings, storage, verifier)


# ------------------------------------------------------------------------------------------------- outputs
def finalize(study, sp: SearchSpace, sc: Scenario, out_dir: Path, found_dir, settings, storage: str,
             verifier: Callable | None = None) -> dict:
    """Write the Pareto plot/table and trials.json, choose the winner, write its recipe; return the summary.

    ``verifier(recipe) -> metrics`` re-evaluates the winner with freshly timed, interleaved baselines (trials may
    reuse baseline timings from earlier trials); its numbers and constraint values go into the provenance."""
    rows = _rows(study)
    front = pareto_front(rows)
    best = choose(rows, sc)
    for r in rows:
        r["pareto"] = any(r is f for f in front)
        r["chosen"] = r is best
    if verifier is not None and best is not None:
        from toolkit.recipe import Recipe

        vm = verifier(Recipe.from_dict(best["recipe"]))
        best["verified"] = {"summary": _summary(vm), "constraints": constraints(vm, sc),
                            "feasible": is_feasible(constraints(vm, sc))}
        if not best["verified"]["feasible"]:
            print(f"search {sc.name}: WARNING: the winner misses a constraint when re-measured with fresh "
                  f"baselines: {best['verified']['constraints']}", file=sys.stderr)
    files = {"trials": str(out_dir / "trials.json"), "table": str(out_dir / "pareto.md"),
             "plot": str(out_dir / "pareto.png")}
    atomic_write_json(out_dir / "trials.json", {"scenario": dataclasses.asdict(sc), "storage": _safe_url(storage),
                                                "study": study.study_name, "rows": rows})
    atomic_write_text(out_dir / "pareto.md", _table(rows, sc, best))
    if rows:
        _plot(rows, sc, out_dir / "pareto.png")
    result = {"scenario": sc.name, "trials": len(rows), "feasible": sum(r["feasible"] for r in rows),
              "best": best, "pareto": front, "files": files, "recipe_path": None}
    if best is None:
        print(f"search {sc.name}: no feasible trial among {len(rows)}; no recipe written", file=sys.stderr)
        return result
    if found_dir is not None:
        path = Path(found_dir) / f"{sc.name}.yaml"
        write_found_recipe(path, best, rows, sp, sc, settings, study.study_name, storage)
        result["recipe_path"] = str(path)
        files["recipe"] = str(path)
    s = best["summary"]
    print(f"search {sc.name}: picked trial {best['number']} {best['params']}: {s['throughput']:.1f} tok/s, "
          f"PPL {s['ppl']:.2f} (x{(s['ppl_ratio'] or float('nan')):.3f}), {s['memory_mb']:.1f} MiB"
          + (f" -> {result['recipe_path']}" if result["recipe_path"] else ""), file=sys.stderr)
    return result


def _safe_url(url: str) -> str:
    """A storage URL without its password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        return f"{scheme}://{cred.split(':', 1)[0]}:***@{host}"
    return url


def _fmt_cons(cons: dict | None) -> str:
    if not cons:
        return "–"
    return ", ".join(f"{k} {'ok' if v <= 0 else f'+{v:.3g}'}" for k, v in cons.items())


def _table(rows: list[dict], sc: Scenario, best: dict | None) -> str:
    bounds = {k: v for k, v in dataclasses.asdict(sc).items() if k not in ("name", "primary") and v is not None}
    lines = [f"# Search: {sc.name}", "",
             f"Primary objective: {sc.primary}; constraints: {bounds}. Objectives of every trial: throughput "
             "(tok/s, median of the repetitions, up), perplexity (recipe's target through its cache, down), memory "
             "(weights + peak KV of target and draft, exact bytes, MiB, down).", "",
             "| # | params | tok/s [min–max] | vs AR fp32 | PPL (×fp32) | memory MiB | KV MiB | α | τ | constraints | "
             "feasible | Pareto | chosen |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["number"]):
        s = r["summary"]
        ar = s.get("ratios", {}).get("ours_vs_ar_fp32", s.get("ratios", {}).get("ours_vs_ar"))
        lines.append(
            f"| {r['number']} | {', '.join(f'{k}={v}' for k, v in r['params'].items())} | "
            f"{s['throughput']:.1f} [{s['throughput_min']:.1f}–{s['throughput_max']:.1f}] | "
            f"{'–' if ar is None else f'{ar:.2f}×'} | {s['ppl']:.2f} (×{(s['ppl_ratio'] or float('nan')):.3f}) | "
            f"{s['memory_mb']:.1f} | {s['kv_peak_mb']:.1f} | {s['alpha']:.2f} | {s['tau']:.2f} | "
            f"{_fmt_cons(r['constraints'])} | {'yes' if r['feasible'] else 'no'} | {'yes' if r['pareto'] else ''} | "
            f"{'**yes**' if r['chosen'] else ''} |")
    lines += ["", f"Winner: trial {best['number']}" if best else "No feasible trial: nothing chosen.", ""]
    return "\n".join(lines)


def _plot(rows: list[dict], sc: Scenario, path: Path) -> None:
    import os
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    feas = [r for r in rows if r["feasible"]]
    infeas = [r for r in rows if not r["feasible"]]
    if infeas:
        ax.scatter([r["values"][2] for r in infeas], [r["values"][0] for r in infeas], marker="x", c="gray",
                   label="infeasible")
    if feas:
        sc_ = ax.scatter([r["values"][2] for r in feas], [r["values"][0] for r in feas],
                         c=[r["values"][1] for r in feas], cmap="viridis", label="feasible")
        bar = fig.colorbar(sc_, ax=ax, label="perplexity")
        bar.formatter.set_useOffset(False)
        bar.update_ticks()
    front = sorted([r for r in rows if r["pareto"]], key=lambda r: r["values"][2])
    if front:
        ax.plot([r["values"][2] for r in front], [r["values"][0] for r in front], "r--", lw=1)
        ax.scatter([r["values"][2] for r in front], [r["values"][0] for r in front], s=120, facecolors="none",
                   edgecolors="r", label="Pareto front")
    for r in rows:
        ax.annotate(str(r["number"]), (r["values"][2], r["values"][0]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
        if r["chosen"]:
            ax.scatter([r["values"][2]], [r["values"][0]], marker="*", s=250, c="gold", edgecolors="k",
                       label="chosen", zorder=5)
    ax.set_xlabel("memory: weights + peak KV (MiB)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(f"Search '{sc.name}': throughput vs memory (primary: {sc.primary})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
        plt.close(fig)


def _why(best: dict, rows: list[dict], sc: Scenario) -> str:
    s = best["summary"]
    feasible = [r for r in rows if r["feasible"]]
    others = sorted((r for r in feasible if r is not best),
                    key=lambda r: r["values"][OBJECTIVES.index(sc.primary)],
                    reverse=DIRECTIONS[OBJECTIVES.index(sc.primary)] == "maximize")
    ar = s.get("ratios", {}).get("ours_vs_ar_fp32", s.get("ratios", {}).get("ours_vs_ar"))
    if sc.primary == "throughput":
        head = f"highest throughput ({s['throughput']:.1f} tok/s{f', {ar:.2f}x AR fp32' if ar else ''})"
    elif sc.primary == "memory_mb":
        head = f"least memory ({s['memory_mb']:.1f} MiB weights + peak KV)"
    else:
        head = f"lowest perplexity ({s['ppl']:.2f})"
    line = (f"{head} among {len(feasible)} feasible of {len(rows)} trials, at PPL {s['ppl']:.2f} "
            f"(x{(s['ppl_ratio'] or float('nan')):.3f} of fp32)")
    if others:
        o = others[0]
        line += (f"; runner-up trial {o['number']} ({', '.join(f'{k}={v}' for k, v in o['params'].items())}): "
                 f"{o['summary']['throughput']:.1f} tok/s, {o['summary']['memory_mb']:.1f} MiB")
    return line


def write_found_recipe(path: Path, best: dict, rows: list[dict], sp: SearchSpace, sc: Scenario, settings,
                       study_name: str, storage: str) -> None:
    """Write the winner as a runnable recipe with provenance comments and a "why it won" description."""
    import optuna

    from toolkit.recipe import Recipe
    from toolkit.harness import environment

    recipe = Recipe.from_dict({**best["recipe"], "name": f"found-{sc.name}"})
    why = _why(best, rows, sc)
    recipe = recipe.replace(description=f"Found by `toolkit search --scenario {sc.name}`: {why}.")
    env = environment()
    s = best["summary"]
    bounds = {k: v for k, v in dataclasses.asdict(sc).items() if k not in ("name", "primary") and v is not None}
    header = [
        f"# Found by `toolkit search --scenario {sc.name}` (study {study_name}, trial {best['number']}, "
        f"{len(rows)} trials; storage {_safe_url(storage)})",
        f"# Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# Hardware: {env['hardware']} ({env['platform']}, {env['torch_threads']} torch threads)",
        f"# Versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"optuna {optuna.__version__}" + (f", bitsandbytes {env['bitsandbytes']}" if "bitsandbytes" in env else ""),
        f"# Space: {sp.source}; params: {best['params']}; scenario bounds: {bounds}",
        f"# Measured with eval settings {json.dumps(settings.to_dict())}:",
        f"#   throughput {s['throughput']:.2f} tok/s [{s['throughput_min']:.2f}-{s['throughput_max']:.2f}], "
        f"ratios {json.dumps({k: round(v, 3) for k, v in s['ratios'].items()})}",
        f"#   perplexity {s['ppl']:.3f} (x{(s['ppl_ratio'] or float('nan')):.4f} of fp32), memory {s['memory_mb']:.2f} MiB "
        f"(weights {s['weights_mb']:.2f} + peak KV {s['kv_peak_mb']:.2f}), alpha {s['alpha']:.3f}, tau {s['tau']:.3f}, "
        f"TTFT {s['ttft_ms']:.1f} ms",
        f"#   constraints {json.dumps({k: round(v, 4) for k, v in best['constraints'].items()})} (<= 0 = met)",
        f"# Why it won: {why}",
        f"# Results: {best['results_dir']}",
    ]
    if best.get("verified"):
        v = best["verified"]
        vs = v["summary"]
        header += [
            "# Verified (same settings, every baseline timed again, interleaved with ours in one run): "
            f"throughput {vs['throughput']:.2f} tok/s [{vs['throughput_min']:.2f}-{vs['throughput_max']:.2f}], "
            f"ratios {json.dumps({k: round(x, 3) for k, x in vs['ratios'].items()})}, "
            f"constraints {json.dumps({k: round(x, 4) for k, x in v['constraints'].items()})} -> "
            f"{'feasible' if v['feasible'] else 'NOT FEASIBLE on re-measurement'}",
        ]
    header += [
        "",
    ]
    atomic_write_text(Path(path), "\n".join(header) + recipe.to_yaml())

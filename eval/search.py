"""Automated configuration search per scenario (Optuna, multi-objective, constrained), recipes as output.

    toolkit search --scenario short [--trials N] [--timeout S] [--out DIR] [--storage URL] [--workers N]

Every trial walks the scenario's space (``recipes/search/<scenario>.yaml``, conditional dimensions, see
:mod:`eval.space`), builds the recipe — a combination that makes no valid recipe is pruned with its reason before
any model loads, counted and never evaluated — runs the evaluator on it (fast settings from the space file) and
reports three objectives: throughput (max), perplexity (min), memory = weights + peak KV in MiB (min), plus the
scenario's constraints through Optuna's ``constraints_func`` (feasible iff every value <= 0; :mod:`eval.scenarios`).
The sampler is multi-objective TPE with constraints (multivariate, grouped for conditional spaces); a space small
enough for the trial budget is run as an exhaustive grid instead. The winner is the feasible trial best on the
scenario's primary objective (ties: lower perplexity); infeasible trials are never chosen.

Budget and resuming: ``--trials N`` is the number of *completed* trials the study should reach and ``--timeout S``
the wall-clock budget of this run (default ``timeout_s`` of the space file, <= 30 min on a 2-core CPU); the run stops
starting trials when one more trial plus the held-out confirmation would overrun it. A study is resumed by name
(``search-<scenario>``): re-running runs only the missing trials; finished ones are never repeated, and an identical
recipe is never evaluated twice (a finished one is reused, one running in another worker is skipped).

Held-out confirmation: the winner is measured again on a prompt suite no trial saw (``heldout.prompts`` in the
space file, e.g. ``recipes/prompts/short-heldout.yaml``), every baseline timed afresh in the same run, and so is each
shipped recipe named in ``heldout.compare``; the found recipe records the search and the held-out numbers.

Many workers, one study: ``--storage postgresql://...`` (or any Optuna RDB URL) and ``--workers N`` starts N worker
processes on the study (or start the same command on several machines with ``--no-finalize`` and the same
``--study-name``). Workers send heartbeats; the trial of a worker that dies is marked FAIL after the grace period
and re-queued once (``RetryFailedTrialCallback``).

Outputs go to the working directory, ``--out`` (default ``./found``): ``<scenario>.yaml`` (the runnable winner, with
provenance and "why it won"; paths relative to the file), ``<scenario>/`` with ``pareto.png`` (every measured trial:
throughput vs memory, perplexity as colour, Pareto front and winner marked), ``pareto.md``, ``trials.json``, the
per-trial evaluation results and the default SQLite study ``study.db``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from eval.results import EvalResult
from eval.scenarios import DIRECTIONS, OBJECTIVES, SCENARIOS, Scenario, constraints, objectives
from eval.space import SearchSpace, data_path, load_space
from toolkit.errors import ConfigError
from toolkit.io import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path("found")
DEFAULT_TIMEOUT_S = 1800.0
_SAME_DIR = object()  # found_dir default: the --out directory

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
                     "seed": t.user_attrs.get("seed"),
                     "results_dir": t.user_attrs.get("results_dir")})
    return rows


def _point_key(trial) -> str:
    """The point of a trial as a comparable key (a queued trial's point is still in ``fixed_params``)."""
    return json.dumps(trial.params or trial.system_attrs.get("fixed_params", {}), sort_keys=True)


def _counts(study) -> dict:
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


# ------------------------------------------------------------------------------------------------- the search
def _scenario(space: SearchSpace, budget_mb: float | None) -> Scenario:
    base = SCENARIOS.get(space.scenario, Scenario(space.scenario, primary="throughput"))
    sc = dataclasses.replace(base, **space.constraints) if space.constraints else base
    if budget_mb is not None:
        sc = dataclasses.replace(sc, budget_mb=float(budget_mb))
    return sc


def _summary(r: EvalResult) -> dict:
    """What a trial records of its evaluation (JSON-able, stored in the study)."""
    return {"throughput": r.throughput.median, "throughput_min": r.throughput.min,
            "throughput_max": r.throughput.max, "ppl": r.ppl, "ppl_ratio": r.ppl_ratio, "memory_mb": r.memory_mb,
            "kv_peak_mb": r.kv_peak_bytes / 2**20, "weights_mb": r.weight_bytes / 2**20,
            "alpha": r.acceptance_rate, "tau": r.tokens_per_round, "ratios": r.ratios, "ttft_ms": r.ttft_ms.median,
            "fidelity_vs_ar": r.fidelity_vs_ar, "fidelity_vs_fp32": r.fidelity_vs_fp32,
            "peak_memory": r.document["memory"]["peak"], "elapsed_s": r.elapsed_s}


def _storage(url: str | None, out_dir: Path, heartbeat_s: float | None):
    """``(RDBStorage, url, shared)``: the default is a local SQLite file (one writer); a given URL is shared by
    workers, so it runs with heartbeats and re-queues the trial of a dead worker once."""
    import optuna
    from optuna.storages import RetryFailedTrialCallback

    if url is None:
        url = f"sqlite:///{(out_dir / 'study.db').resolve()}"
        return optuna.storages.RDBStorage(url), url, False
    hb = heartbeat_s or 30.0
    storage = optuna.storages.RDBStorage(_driver_url(url), heartbeat_interval=max(1, int(round(hb))),
                                         grace_period=int(3 * hb) + 1,
                                         failed_trial_callback=RetryFailedTrialCallback(max_retry=1))
    return storage, url, True


def _driver_url(url: str) -> str:
    """``postgresql://`` with the driver that is installed: SQLAlchemy 2.1 defaults to psycopg 3, the toolkit
    depends on psycopg2 (``psycopg2-binary``)."""
    if url.startswith(("postgresql://", "postgres://")):
        import importlib.util

        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + url.split("://", 1)[1]
    return url


def _worker_command(scenario: str, space_arg, storage: str, study_name: str, n_total: int, timeout: float | None,
                    out: Path, enable: list[str], budget_mb, heartbeat_s) -> list[str]:
    cmd = [sys.executable, "-m", "toolkit_cli", "search", "--scenario", scenario, "--storage", storage,
           "--study-name", study_name, "--trials", str(n_total), "--out", str(out), "--workers", "1",
           "--no-finalize"]
    if space_arg is not None:
        cmd += ["--space", str(space_arg)]
    if timeout is not None:
        cmd += ["--timeout", str(timeout)]
    for item in enable:
        cmd += ["--enable", item]
    if budget_mb is not None:
        cmd += ["--budget-mb", str(budget_mb)]
    if heartbeat_s is not None:
        cmd += ["--heartbeat", str(heartbeat_s)]
    return cmd


def run_search(scenario: str, budget_mb: float | None = None, trials: int | None = None,
               storage: str | None = None, *, space: str | Path | dict | None = None,
               out: str | Path = DEFAULT_OUT, found_dir=_SAME_DIR, timeout: float | None = None,
               workers: int = 1, enable: list[str] | None = None, finalize_results: bool = True,
               heartbeat_s: float | None = None, models_fn: Callable | None = None, prompts=None, ppl_ids=None,
               heldout_prompts=None, progress: bool = True, eval_overrides: dict | None = None,
               study_name: str | None = None, heldout: bool = True) -> dict:
    """Run (or resume) the search of ``scenario``; returns a summary dict (best row, Pareto front, counts, files).

    Args:
        space: the space file (default ``recipes/search/<scenario>.yaml``), a path or a dict.
        out: output directory (relative to the working directory): ``<out>/<scenario>.yaml`` and ``<out>/<scenario>/``.
        found_dir: where the found recipe goes (default ``out``); ``None`` writes none.
        trials: completed trials the study should reach (default: the space's ``trials``).
        timeout: wall-clock budget of this run in seconds (default: the space's ``timeout_s``, else 1800).
        workers: worker processes on this study (this process + ``workers - 1`` started with the same arguments).
        enable: dimensions / labels kept off in the space file to search too (``["drafter.suffix"]``).
        finalize_results: choose the winner and write outputs (workers started elsewhere pass ``False``).
        heartbeat_s: heartbeat interval of a shared storage (grace period 3x); default 30 s.
        models_fn / prompts / ppl_ids / heldout_prompts: test injection (``models_fn(recipe) -> dict`` with
            ``target``, ``tokenizer``, ``draft_model``, ``reference_model``; prompts as in :func:`eval.evaluate.evaluate`).
        heldout: confirm the winner on the held-out prompts (and the shipped recipes of ``heldout.compare``).

    Raises:
        ConfigError: unknown scenario, malformed space file, or a bad ``--enable`` name.
    """
    import optuna
    from optuna.study import MaxTrialsCallback

    from eval.evaluate import EvalSettings, evaluate, results_dir

    started = time.monotonic()
    if space is None and scenario not in SCENARIOS:
        raise ConfigError("scenario", f"unknown scenario {scenario!r}", sorted(SCENARIOS))
    sp = load_space(space if space is not None else scenario)
    if sp.scenario != scenario:
        sp = dataclasses.replace(sp, scenario=scenario)
    sp.enable(list(enable or []))
    sc = _scenario(sp, budget_mb)
    settings = EvalSettings(**{"mode": "search", **sp.eval, **(eval_overrides or {})})
    n_total = trials if trials is not None else sp.trials
    budget_s = timeout if timeout is not None else (sp.timeout_s or DEFAULT_TIMEOUT_S)
    out = Path(out)
    out_dir = out / scenario
    out_dir.mkdir(parents=True, exist_ok=True)
    if found_dir is _SAME_DIR:
        found_dir = out
    if storage is None and workers > 1:  # several local workers share the SQLite file, with heartbeats
        storage = f"sqlite:///{(out_dir / 'study.db').resolve()}"
    rdb, storage, shared = _storage(storage, out_dir, heartbeat_s)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # TPE 'group'

    def constraints_func(trial) -> list[float]:
        cons = trial.user_attrs.get("constraints")
        return list(cons.values()) if cons else [1.0]

    points = sp.points(limit=n_total)
    grid = len(points) <= n_total
    if grid:  # every valid point is queued explicitly (see below); the sampler only fills in past the queue
        sampler = optuna.samplers.RandomSampler(seed=0)
        sampler_name = f"exhaustive grid ({len(points)} points)"
    else:
        sampler = optuna.samplers.TPESampler(seed=None if shared else 0, constraints_func=constraints_func,
                                             multivariate=True, group=True, n_startup_trials=min(8, n_total),
                                             warn_independent_sampling=False)
        sampler_name = f"TPE with constraints_func (more than {n_total} points, {n_total} trials)"
    name = study_name or f"search-{scenario}"
    study = optuna.create_study(study_name=name, storage=rdb, directions=list(DIRECTIONS), sampler=sampler,
                                load_if_exists=True)
    TS = optuna.trial.TrialState
    if not shared:  # a local file has one writer: RUNNING trials are leftovers of an interrupted run
        for t in study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
            rdb.set_trial_state_values(t._trial_id, TS.FAIL)
    done = len(study.get_trials(deepcopy=False, states=(TS.COMPLETE,)))
    invalid_points = 0
    if grid:
        # Exhaustive grid: queue every valid point that no finished, running or queued trial covers (a point whose
        # trial failed or was interrupted is queued again); invalid points are counted, never queued.
        covered = {_point_key(t) for t in study.get_trials(
            deepcopy=False, states=(TS.COMPLETE, TS.PRUNED, TS.RUNNING, TS.WAITING))}
        budget = n_total - done - len(study.get_trials(deepcopy=False, states=(TS.WAITING,)))
        for point in points:
            try:
                sp.recipe(point)
            except ConfigError:
                invalid_points += 1
                continue
            if budget > 0 and json.dumps(point, sort_keys=True) not in covered:
                study.enqueue_trial(point)
                budget -= 1
    elif done < n_total:
        # Seeds (the shipped recipes as points of this space) are measured first, once: TPE then starts from them
        covered = {_point_key(t) for t in study.get_trials(deepcopy=False)}
        for seed_name, point in sp.seed_points():
            if json.dumps(point, sort_keys=True) not in covered:
                study.enqueue_trial(point, user_attrs={"seed": seed_name})
    remaining = max(0, n_total - done)
    if grid:
        remaining = min(remaining, len(study.get_trials(deepcopy=False, states=(TS.WAITING,))))
    print(f"search {scenario}: {done} completed trial(s) in study {name}, up to {remaining} more "
          f"({sampler_name}; budget {budget_s:.0f} s; storage {_safe_url(storage)}; worker pid {os.getpid()})",
          file=sys.stderr)

    durations: list[float] = []

    def objective(trial) -> list[float]:
        params: dict = {}
        for d in sp.dimensions:
            if d.active(params):
                params[d.name] = trial.suggest_categorical(d.name, d.searched)
        trial.set_user_attr("worker_pid", os.getpid())
        try:
            recipe = sp.recipe(params)
        except ConfigError as exc:
            trial.set_user_attr("invalid", str(exc))
            raise optuna.TrialPruned(f"invalid combination: {exc}") from None
        h = recipe.config_hash()
        trial.set_user_attr("config_hash", h)
        trial.set_user_attr("recipe", recipe.to_dict())
        for old in study.get_trials(deepcopy=False, states=(TS.COMPLETE,)):
            if old.user_attrs.get("config_hash") == h and old.user_attrs.get("constraints") is not None:
                for key in ("constraints", "summary", "results_dir"):
                    trial.set_user_attr(key, old.user_attrs.get(key))
                trial.set_user_attr("cached_from", old.number)
                return list(old.values)
        for old in study.get_trials(deepcopy=False, states=(TS.FAIL,)):
            if old.user_attrs.get("config_hash") == h and "error" in old.user_attrs:  # (a dead worker's is retried)
                raise optuna.TrialPruned(f"failed before in trial {old.number}: {old.user_attrs['error']}")
        for other in study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
            if other.number < trial.number and other.user_attrs.get("config_hash") == h:
                raise optuna.TrialPruned(f"duplicate of trial {other.number}, running in another worker")
        inject = models_fn(recipe) if models_fn is not None else {}
        target_dir = results_dir(recipe, settings, out_dir / "trials")
        t0 = time.perf_counter()
        try:
            m = evaluate(recipe, settings=settings, out_dir=target_dir, prompts=prompts, ppl_ids=ppl_ids,
                         progress=progress, **inject)
        except Exception as exc:  # one combination that fails to run must not end the study: FAIL, and go on
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
            print(f"  trial {trial.number}: {params} FAILED: {trial.user_attrs['error']}", file=sys.stderr)
            raise
        cons = constraints(m, sc)
        trial.set_user_attr("constraints", cons)
        trial.set_user_attr("summary", _summary(m))
        trial.set_user_attr("results_dir", target_dir.relative_to(out).as_posix())  # relative to --out
        values = objectives(m)
        durations.append(time.perf_counter() - t0)
        print(f"  trial {trial.number}: {params} -> {values[0]:.1f} tok/s, PPL {values[1]:.2f}, "
              f"{values[2]:.1f} MiB, {'feasible' if is_feasible(cons) else 'infeasible ' + str(cons)} "
              f"({durations[-1]:.0f} s{', cached' if m.skipped else ''})", file=sys.stderr)
        return values

    def stop_before_deadline(study_, trial) -> None:
        """Stop when one more trial (plus the held-out confirmation) would overrun the budget."""
        if durations:
            # reserve: the slowest trial seen, plus the confirmations (winner + shipped recipes) at a typical trial's
            # duration; a confirmation times every baseline afresh (~1.5x per prompt) on the held-out prompt count
            confirmations = 1 + len(sp.heldout.get("compare", [])) if finalize_results and heldout else 0
            scale = 1.5 * max(1.0, (sp.heldout.get("num_prompts") or 1) / (settings.num_prompts or 1))
            reserve = max(durations) + confirmations * scale * statistics.median(durations)
            if time.monotonic() - started + reserve > budget_s:
                print(f"search {scenario}: stopping: the {budget_s:.0f} s budget leaves no room for another trial",
                      file=sys.stderr)
                study_.stop()

    children: list[subprocess.Popen] = []
    if workers > 1:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        space_arg = space if isinstance(space, (str, Path)) else None
        if isinstance(space, dict):
            raise ConfigError("workers", "worker processes need a space file (pass a path), not a dict")
        timeout_left = max(1.0, budget_s - (time.monotonic() - started))
        for _ in range(workers - 1):
            cmd = _worker_command(scenario, space_arg, storage, name, n_total, timeout_left, out, list(enable or []),
                                  budget_mb, heartbeat_s)
            children.append(subprocess.Popen(cmd, env=env))
        print(f"search {scenario}: started {len(children)} more worker(s): pids "
              f"{[c.pid for c in children]}", file=sys.stderr)
    if remaining:
        # completed trials count toward --trials; invalid / duplicate ones are cheap but capped all the same
        left = max(1.0, budget_s - (time.monotonic() - started))
        study.optimize(objective, n_trials=remaining * 20 + 50, timeout=left,
                       callbacks=[MaxTrialsCallback(n_total, states=(TS.COMPLETE,)), stop_before_deadline],
                       gc_after_trial=False, show_progress_bar=False, catch=(Exception,))
    for child in children:
        code = child.wait()
        if code != 0:
            print(f"search {scenario}: worker {child.pid} exited with status {code}", file=sys.stderr)
    if not finalize_results:
        return {"scenario": scenario, "study": name, "counts": _counts(study)}
    if shared:
        _settle(study, rdb)
    confirm = None
    if heldout:
        def confirm(recipe, suite_recipe=None):
            """Measure ``recipe`` on the held-out prompts with every baseline timed again in this run."""
            inject = models_fn(recipe) if models_fn is not None else {}
            h_settings = dataclasses.replace(settings, reuse_baselines=False, mode="heldout",
                                             num_prompts=sp.heldout.get("num_prompts", settings.num_prompts))
            if heldout_prompts is None and not sp.heldout.get("prompts"):
                raise ConfigError("search.heldout.prompts", "no held-out prompt suite in the space file")
            r = recipe if heldout_prompts is not None else recipe.replace(prompts=sp.heldout["prompts"])
            return evaluate(r, settings=h_settings, out_dir=results_dir(r, h_settings, out_dir / "heldout"),
                            prompts=heldout_prompts, ppl_ids=ppl_ids, progress=progress, **inject)
    return finalize(study, sp, sc, out_dir, found_dir, settings, storage, confirm, base=out)


def _settle(study, rdb) -> None:
    """Before choosing: wait (at most two grace periods) for RUNNING trials of workers that died to be marked
    FAIL by the heartbeat, so the study the outputs describe holds no stale trial; live workers are not waited for
    beyond that."""
    import optuna

    grace = rdb.get_heartbeat_interval() and rdb.grace_period or 0
    deadline = time.monotonic() + 2 * grace
    while time.monotonic() < deadline:
        optuna.storages.fail_stale_trials(study)
        if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            return
        time.sleep(1.0)


# ------------------------------------------------------------------------------------------------- outputs
def _shipped(sp: SearchSpace) -> list:
    """The shipped recipes ``heldout.compare`` names (``recipes/<name>.yaml``)."""
    from toolkit.recipe import Recipe

    return [Recipe.load(data_path(f"{n}.yaml")) for n in sp.heldout.get("compare", [])]


def finalize(study, sp: SearchSpace, sc: Scenario, out_dir: Path, found_dir, settings, storage: str,
             confirm: Callable | None = None, base: Path | None = None) -> dict:
    """Write the Pareto plot/table and trials.json, choose the winner, confirm it, write its recipe.

    ``confirm(recipe) -> metrics`` measures a recipe on the held-out prompts with freshly timed, interleaved
    baselines; it runs on the winner and on every shipped recipe of ``heldout.compare``, and the numbers go into the
    found recipe's provenance."""
    rows = _rows(study)
    counts = _counts(study)
    front = pareto_front(rows)
    best = choose(rows, sc)
    for r in rows:
        r["pareto"] = any(r is f for f in front)
        r["chosen"] = r is best
    if confirm is not None and best is not None:
        from toolkit.recipe import Recipe

        vm = confirm(Recipe.from_dict(best["recipe"]))
        best["heldout"] = {"summary": _summary(vm), "constraints": constraints(vm, sc),
                           "feasible": is_feasible(constraints(vm, sc)), "prompts": sp.heldout.get("prompts")}
        if not best["heldout"]["feasible"]:
            print(f"search {sc.name}: WARNING: the winner misses a constraint on the held-out prompts: "
                  f"{best['heldout']['constraints']}", file=sys.stderr)
        best["shipped"] = []
        for shipped in _shipped(sp):
            sm = confirm(shipped)
            best["shipped"].append({"name": shipped.name, "summary": _summary(sm),
                                    "constraints": constraints(sm, sc), "feasible": is_feasible(constraints(sm, sc))})
    files = {"trials": str(out_dir / "trials.json"), "table": str(out_dir / "pareto.md"),
             "plot": str(out_dir / "pareto.png")}
    atomic_write_json(out_dir / "trials.json", {"scenario": dataclasses.asdict(sc), "storage": _safe_url(storage),
                                                "study": study.study_name, "counts": counts, "rows": rows})
    atomic_write_text(out_dir / "pareto.md", _table(rows, sc, best, counts))
    if rows:
        _plot(rows, sc, out_dir / "pareto.png", counts)
    result = {"scenario": sc.name, "trials": len(rows), "feasible": sum(r["feasible"] for r in rows),
              "counts": counts, "best": best, "pareto": front, "files": files, "recipe_path": None}
    if best is None:
        print(f"search {sc.name}: no feasible trial among {len(rows)}; no recipe written", file=sys.stderr)
        return result
    if found_dir is not None:
        path = Path(found_dir) / f"{sc.name}.yaml"
        write_found_recipe(path, best, rows, sp, sc, settings, study.study_name, storage, counts, base)
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


def _table(rows: list[dict], sc: Scenario, best: dict | None, counts: dict | None = None) -> str:
    bounds = {k: v for k, v in dataclasses.asdict(sc).items() if k not in ("name", "primary") and v is not None}
    lines = [f"# Search: {sc.name}", "",
             f"Primary objective: {sc.primary}; constraints: {bounds}. Objectives of every trial: throughput "
             "(tok/s, median of the repetitions, up), perplexity (recipe's target through its cache, down), memory "
             "(weights + peak KV of target and draft, exact bytes, MiB, down).", "",
             _counts_line(counts), "",
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


def _counts_line(counts: dict | None) -> str:
    if not counts:
        return ""
    by = ", ".join(f"{k}: {v}" for k, v in sorted(counts.get("invalid_by_field", {}).items()))
    return (f"Trials: {counts['complete']} completed ({counts['reused']} reused an identical earlier evaluation), "
            f"{counts['invalid']} invalid combinations rejected before loading any model{f' ({by})' if by else ''}, "
            f"{counts['duplicate']} duplicates of a running trial skipped, {counts['failed']} failed.")


def _plot(rows: list[dict], sc: Scenario, path: Path, counts: dict | None = None) -> None:
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
    extra = f"; {counts['invalid']} invalid not run" if counts and counts.get("invalid") else ""
    ax.set_title(f"Search '{sc.name}': all {len(rows)} measured trials (primary: {sc.primary}{extra})", fontsize=9)
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


def _primary_value(summary: dict, sc: Scenario) -> float:
    return {"throughput": summary["throughput"], "ppl": summary["ppl"], "memory_mb": summary["memory_mb"]}[sc.primary]


def _fmt_primary(value: float, sc: Scenario) -> str:
    return {"throughput": f"{value:.2f} tok/s", "ppl": f"PPL {value:.3f}", "memory_mb": f"{value:.2f} MiB"}[sc.primary]


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
    line = (f"{head} among {len(feasible)} feasible of {len(rows)} measured trials, at PPL {s['ppl']:.2f} "
            f"(x{(s['ppl_ratio'] or float('nan')):.3f} of fp32)")
    if others:
        o = others[0]
        line += (f"; runner-up trial {o['number']} ({', '.join(f'{k}={v}' for k, v in o['params'].items())}): "
                 f"{o['summary']['throughput']:.1f} tok/s, {o['summary']['memory_mb']:.1f} MiB")
    if best.get("heldout"):
        h = best["heldout"]
        line += (f"; on held-out prompts {_fmt_primary(_primary_value(h['summary'], sc), sc)}"
                 f"{'' if h['feasible'] else ' (misses a constraint there)'}")
        for c in best.get("shipped", []):
            mine, theirs = _primary_value(h["summary"], sc), _primary_value(c["summary"], sc)
            better = mine > theirs if DIRECTIONS[OBJECTIVES.index(sc.primary)] == "maximize" else mine < theirs
            # a shipped recipe that misses a constraint of the scenario loses to a feasible winner whatever its value
            better = h["feasible"] and (better or not c["feasible"])
            line += (f"; {'beats' if better else 'does NOT beat'} shipped recipe {c['name']} "
                     f"({_fmt_primary(theirs, sc)}{'' if c['feasible'] else ', infeasible'} on the same held-out "
                     "prompts)")
    return line


def _relative(value: str, start: Path) -> str:
    """``value`` relative to ``start`` when it is an existing local path (found recipes hold no machine paths)."""
    p = Path(value)
    if p.is_absolute() and p.exists():
        return os.path.relpath(p, start.resolve())
    return value


def _portable_recipe(data: dict, recipe_dir: Path) -> dict:
    """Model sources that are local paths, rewritten relative to the recipe file's directory."""
    data = json.loads(json.dumps(data))
    for section in ("target", "draft"):
        if isinstance(data.get(section), dict) and isinstance(data[section].get("source"), str):
            data[section]["source"] = _relative(data[section]["source"], recipe_dir)
    return data


def _portable_storage(url: str, recipe_dir: Path) -> str:
    if url.startswith("sqlite:///"):
        return "sqlite:///" + _relative(url[len("sqlite:///"):], recipe_dir)
    return _safe_url(url)


def _summary_line(s: dict) -> str:
    return (f"throughput {s['throughput']:.2f} tok/s [{s['throughput_min']:.2f}-{s['throughput_max']:.2f}], "
            f"ratios {json.dumps({k: round(v, 3) for k, v in s['ratios'].items()})}, perplexity {s['ppl']:.3f} "
            f"(x{(s['ppl_ratio'] or float('nan')):.4f} of fp32), memory {s['memory_mb']:.2f} MiB "
            f"(weights {s['weights_mb']:.2f} + peak KV {s['kv_peak_mb']:.2f}), alpha {s['alpha']:.3f}, "
            f"tau {s['tau']:.3f}, TTFT {s['ttft_ms']:.1f} ms")


def write_found_recipe(path: Path, best: dict, rows: list[dict], sp: SearchSpace, sc: Scenario, settings,
                       study_name: str, storage: str, counts: dict | None = None, base: Path | None = None) -> None:
    """Write the winner as a runnable recipe with provenance comments and a "why it won" description.

    No machine paths: local model sources, the SQLite study and results directories are written relative to the
    recipe file's directory; the space is named by its place under ``recipes/``."""
    import optuna

    from toolkit.recipe import Recipe
    from toolkit.harness import environment

    path = Path(path)
    here = path.parent
    recipe = Recipe.from_dict({**_portable_recipe(best["recipe"], here), "name": f"found-{sc.name}"})
    why = _why(best, rows, sc)
    recipe = recipe.replace(description=f"Found by `toolkit search --scenario {sc.name}`: {why}.")
    env = environment()
    s = best["summary"]
    bounds = {k: v for k, v in dataclasses.asdict(sc).items() if k not in ("name", "primary") and v is not None}
    results = best["results_dir"]
    if base is not None and results and not Path(results).is_absolute():
        results = _relative(str((Path(base) / results).resolve()), here)
    header = [
        f"# Found by `toolkit search --scenario {sc.name}` (study {study_name}, trial {best['number']}, "
        f"{len(rows)} measured trials; storage {_portable_storage(storage, here)})",
        f"# Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# Hardware: {env['hardware']} ({env['platform']}, {env['torch_threads']} torch threads)",
        f"# Versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"optuna {optuna.__version__}" + (f", bitsandbytes {env['bitsandbytes']}" if "bitsandbytes" in env else ""),
        f"# Space: {_relative(sp.source, here)}; params: {best['params']}; scenario bounds: {bounds}",
    ]
    if counts:
        header.append(f"# {_counts_line(counts)}")
    header += [
        f"# Search measurement (eval settings {json.dumps(settings.to_dict())}):",
        f"#   {_summary_line(s)}",
        f"#   constraints {json.dumps({k: round(v, 4) for k, v in best['constraints'].items()})} (<= 0 = met)",
    ]
    if best.get("heldout"):
        h = best["heldout"]
        header += [
            f"# Held-out confirmation (prompt suite {h['prompts']!r}, never seen by the search; every baseline timed "
            "again in the same run):",
            f"#   {_summary_line(h['summary'])}",
            f"#   constraints {json.dumps({k: round(x, 4) for k, x in h['constraints'].items()})} -> "
            f"{'feasible' if h['feasible'] else 'NOT FEASIBLE on held-out prompts'}",
        ]
        for c in best.get("shipped", []):
            header.append(f"#   shipped recipe {c['name']} on the same prompts: {_summary_line(c['summary'])}"
                          f"{'' if c['feasible'] else ' (infeasible)'}")
    header += [
        f"# Why it won: {why}",
        f"# Results: {results} (paths in this file are relative to it)",
        "",
    ]
    atomic_write_text(path, "\n".join(header) + recipe.to_yaml())

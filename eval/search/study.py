"""Study set-up and the run: storage, sampler, seeds and grid queueing, worker processes, the budget, resuming.

The default storage is a local SQLite file under ``<out>/<scenario>/`` with one writer: the run takes a lock on that
directory (a second search on the same ``--out`` is refused, naming the holder), and RUNNING trials found at start are
leftovers of an interrupted run (marked FAIL, their points measured again). A shared storage URL (PostgreSQL, ...) is
for many workers: heartbeats, and the trial of a dead worker re-queued once. Storage URLs never appear with their
password in logs, files or process arguments (workers get the URL through the environment).

A study records what its trials depend on (space file, scenario bounds, evaluation settings); resuming it with a
different configuration is refused with the difference named.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eval.quality import SUMMARY_KINDS
from eval.scenarios import DIRECTIONS, SCENARIOS, Scenario, check_quality_prompts, scenario_of
from eval.search.confirm import finalize, heldout_confirmation
from eval.search.select import study_counts
from eval.search.storage import lock_out_dir, open_storage, safe_url
from eval.search.trials import Deadline, TrialRunner
from eval.space import SearchSpace
from eval.space_file import MAX_TIMEOUT_S, MAX_TRIALS, load_space
from toolkit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path("found")
DEFAULT_TIMEOUT_S = 1800.0
#: a trial's time budget is the space's timeout_s over this (unless its eval section sets time_budget_s)
TRIALS_PER_BUDGET = 10
#: environment variable that carries the storage URL to worker processes (never their command line)
STORAGE_ENV = "TOOLKIT_SEARCH_STORAGE"
_SAME_DIR = object()  # found_dir default: the --out directory


def study_config(sp: SearchSpace, sc: Scenario, settings) -> dict:
    """What every trial of a study depends on besides its own point."""
    shape = {"base": sp.base, "dimensions": [dataclasses.asdict(d) for d in sp.dimensions]}
    space = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"space": space, "scenario": sc.to_dict(), "eval": settings.to_dict()}


def check_resume(study, config: dict) -> None:
    """Record ``config`` on a new study; refuse one that was run with another (the first difference named)."""
    old = study.user_attrs.get("search_config")
    if old is None:
        study.set_user_attr("search_config", config)
        return
    for key in config:
        if old.get(key) != config[key]:
            raise ConfigError("search", f"study {study.study_name!r} was run with another {key} ({old.get(key)} "
                              f"!= {config[key]} now): its trials do not compare; use another --out or "
                              "--study-name")


def make_sampler(points: list, n_total: int, shared: bool):
    """``(sampler, description, grid)``: an exhaustive grid when the space fits the trial budget, else TPE with
    constraints (multivariate, grouped for conditional spaces)."""
    import optuna

    def constraints_func(trial) -> list[float]:
        cons = trial.user_attrs.get("constraints")
        return list(cons.values()) if cons else [1.0]

    if len(points) <= n_total:  # every valid point is queued explicitly; the sampler only fills in past the queue
        return optuna.samplers.RandomSampler(seed=0), f"exhaustive grid ({len(points)} points)", True
    from packaging.version import Version

    from eval.search.trials import native_constraints

    # quiet about parameters sampled independently: optuna >= 4.9 is by default and deprecates the argument; from
    # optuna 5 on the trials carry their constraints (eval.search.trials.record_constraints)
    options = {} if Version(optuna.__version__) >= Version("4.9") else {"warn_independent_sampling": False}
    if not native_constraints():
        options["constraints_func"] = constraints_func
    sampler = optuna.samplers.TPESampler(seed=None if shared else 0, multivariate=True, group=True,
                                         n_startup_trials=min(8, n_total), **options)
    return sampler, f"TPE with constraints (more than {n_total} points, {n_total} trials)", False


def _point_key(trial) -> str:
    """The point of a trial as a comparable key (a queued trial's point is still in ``fixed_params``)."""
    return json.dumps(trial.params or trial.system_attrs.get("fixed_params", {}), sort_keys=True)


def queue_points(study, sp: SearchSpace, points: list, grid: bool, n_total: int) -> None:
    """Grid: queue every valid point no finished, running or queued trial covers (a failed or interrupted point is
    queued again). TPE: queue the seeds (the shipped recipes as points) once, so the search starts from them."""
    import optuna

    TS = optuna.trial.TrialState
    done = len(study.get_trials(deepcopy=False, states=(TS.COMPLETE,)))
    if grid:
        covered = {_point_key(t) for t in study.get_trials(
            deepcopy=False, states=(TS.COMPLETE, TS.PRUNED, TS.RUNNING, TS.WAITING))}
        budget = n_total - done - len(study.get_trials(deepcopy=False, states=(TS.WAITING,)))
        for point in points:
            try:
                sp.recipe(point)
            except ConfigError:
                continue  # invalid: counted when its trial would run, never queued
            if budget > 0 and json.dumps(point, sort_keys=True) not in covered:
                study.enqueue_trial(point)
                budget -= 1
    elif done < n_total:
        covered = {_point_key(t) for t in study.get_trials(deepcopy=False)}
        for seed_name, point in sp.seed_points():
            if json.dumps(point, sort_keys=True) not in covered:
                study.enqueue_trial(point, user_attrs={"seed": seed_name})


def start_workers(count: int, args: dict, storage: str) -> list[subprocess.Popen]:
    """``count`` more worker processes on the study (``--no-finalize``); the storage URL goes by environment."""
    if count <= 0:
        return []
    if args["space"] is not None and not isinstance(args["space"], (str, Path)):
        raise ConfigError("workers", "worker processes need a space file (pass a path), not a dict")
    cmd = [sys.executable, "-m", "toolkit_cli", "search", "--scenario", args["scenario"], "--study-name",
           args["study_name"], "--trials", str(args["trials"]), "--out", str(args["out"]), "--workers", "1",
           "--no-finalize", "--timeout", str(args["timeout"])]
    if args["space"] is not None:
        cmd += ["--space", str(args["space"])]
    for item in args["enable"]:
        cmd += ["--enable", item]
    for flag, key in (("--budget-mb", "budget_mb"), ("--heartbeat", "heartbeat_s"), ("--target", "target"),
                      ("--draft", "draft"), ("--prompts", "prompt_suite"), ("--min-rouge-l", "min_rouge_l")):
        if args.get(key) is not None:
            cmd += [flag, str(args[key])]
    env = {**os.environ, STORAGE_ENV: storage,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    children = [subprocess.Popen(cmd, env=env) for _ in range(count)]
    print(f"search {args['scenario']}: started {len(children)} more worker(s): pids {[c.pid for c in children]}",
          file=sys.stderr)
    return children


def settle(study, rdb) -> None:
    """Before choosing: wait (at most two grace periods) for RUNNING trials of workers that died to be marked FAIL
    by the heartbeat, so the study the outputs describe holds no stale trial."""
    import optuna

    grace = rdb.get_heartbeat_interval() and rdb.grace_period or 0
    deadline = time.monotonic() + 2 * grace
    while time.monotonic() < deadline:
        optuna.storages.fail_stale_trials(study)
        if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            return
        time.sleep(1.0)


def _check_arguments(scenario: str, space, budget_mb, timeout, trials, workers: int) -> None:
    """:func:`run_search`'s arguments, each checked with an error naming its option."""
    from toolkit.checks import check_float, check_int
    from toolkit.recipe import check_name

    if space is None and scenario not in SCENARIOS:
        raise ConfigError("scenario", f"unknown scenario {scenario!r}", sorted(SCENARIOS))
    check_name("scenario", scenario)  # <out>/<scenario>/ and <out>/<scenario>.yaml stay inside --out
    if budget_mb is not None:
        check_float("--budget-mb", budget_mb, low=0.0, low_open=True)
    if timeout is not None:
        check_float("--timeout", timeout, low=0.0, high=MAX_TIMEOUT_S, low_open=True)
    if trials is not None:
        check_int("--trials", trials, low=1, high=MAX_TRIALS)
    check_int("--workers", workers, low=1, high=64)


def _space(scenario: str, space, enable, target, draft, prompt_suite) -> SearchSpace:
    """The space file of ``scenario`` (or ``space``) with ``enable`` switched on, adapted to a user's models, its
    trials' prompts replaced by ``prompt_suite`` (read here: a bad file fails before any model loads)."""
    sp = load_space(space if space is not None else scenario)
    if sp.scenario != scenario:
        sp = dataclasses.replace(sp, scenario=scenario)
    sp.enable(list(enable or []))
    sp.for_model(target, draft)
    if prompt_suite is not None:
        from toolkit.measure.prompts import load_suite

        load_suite(prompt_suite)
        local = Path(prompt_suite).expanduser()
        sp.base["prompts"] = str(local.resolve()) if local.is_file() else prompt_suite
    return sp


def _trial_settings(sp: SearchSpace, sc, eval_overrides: dict | None):
    """A trial's :class:`~eval.settings.EvalSettings`: the space's ``eval`` section in search mode, with a time budget
    of ``timeout_s`` / :data:`TRIALS_PER_BUDGET` (at least 30 s) and, where the scenario bounds ROUGE-L, the
    summarization prompts kept (a budget never cuts them)."""
    from eval.settings import EvalSettings

    trial_budget = {"time_budget_s": max(30.0, sp.timeout_s / TRIALS_PER_BUDGET)} if sp.timeout_s else {}
    keep = {"keep_kinds": list(SUMMARY_KINDS)} if sc.min_rouge_l is not None else {}
    return EvalSettings(**{"mode": "search", **trial_budget, **keep, **sp.eval, **(eval_overrides or {})})


def _wait(children: list, scenario: str) -> None:
    """Wait for the worker processes; a worker's failure is said on stderr (its trials are in the study)."""
    for child in children:
        if child.wait() != 0:
            print(f"search {scenario}: worker {child.pid} exited with status {child.returncode}", file=sys.stderr)


def run_search(scenario: str, budget_mb: float | None = None, trials: int | None = None,
               storage: str | None = None, *, space: str | Path | dict | None = None,
               out: str | Path = DEFAULT_OUT, found_dir=_SAME_DIR, timeout: float | None = None,
               workers: int = 1, enable: list[str] | None = None, finalize_results: bool = True,
               heartbeat_s: float | None = None, models_fn: Callable | None = None, prompts=None, ppl_ids=None,
               heldout_prompts=None, progress: bool = True, eval_overrides: dict | None = None,
               study_name: str | None = None, heldout: bool = True, target: str | None = None,
               draft: str | None = None, prompt_suite: str | None = None, min_rouge_l: float | None = None) -> dict:
    """Run (or resume) the search of ``scenario``; returns a summary dict (best row, Pareto front, counts, files).

    Args:
        target / draft: a user's model (local directory or .gguf) and draft LM: the space is adapted to them
            (:meth:`eval.space.SearchSpace.for_model`) and the found recipe names them.
        prompt_suite: the trials' prompts instead of the space's (``base.prompts``): a JSONL file of prompts, a
            suite YAML or a shipped suite name (``--prompts``).
        space: the space file (default ``recipes/search/<scenario>.yaml``), a path or a dict.
        out: output directory (relative to the working directory): ``<out>/<scenario>.yaml`` and ``<out>/<scenario>/``.
        found_dir: where the found recipe goes (default ``out``); ``None`` writes none.
        storage: an Optuna RDB URL (default: SQLite under ``--out``; also read from ``$TOOLKIT_SEARCH_STORAGE``).
        trials: completed trials the study should reach (default: the space's ``trials``).
        timeout: wall-clock budget of this run in seconds (default: the space's ``timeout_s``, else 1800).
        workers: worker processes on this study (this process + ``workers - 1`` started with the same arguments).
        enable: dimensions / labels kept off in the space file to search too (``["drafter.suffix"]``).
        finalize_results: choose the winner and write outputs (workers started elsewhere pass ``False``).
        heartbeat_s: heartbeat interval of a shared storage (grace period 3x); default 30 s.
        models_fn / prompts / ppl_ids / heldout_prompts: test injection (``models_fn(recipe) -> dict`` with
            ``target``, ``tokenizer``, ``draft_model``, ``reference_model``; prompts as in :func:`eval.evaluate.evaluate`).
        heldout: confirm the winner on the held-out prompts (and the shipped recipes of ``heldout.compare``).
        min_rouge_l: bound the mean ROUGE-L F1 vs the fp32 AR reference text (in [0, 1], :mod:`eval.scenarios`).

    A trial's evaluation has a time budget (:func:`_trial_settings`), so a larger model's trials are cut (fewer
    tokens, prompts, repetitions; recorded in each trial's metrics) instead of one trial eating the search's budget.

    Raises:
        ConfigError: unknown scenario, malformed space file, a bad ``--enable`` name, a bound out of range
            (``--min-rouge-l``), a ROUGE-L bound without a summarization prompt, another search on ``--out``, or a
            resumed study whose configuration differs.
    """
    started = time.monotonic()
    _check_arguments(scenario, space, budget_mb, timeout, trials, workers)
    sp = _space(scenario, space, enable, target, draft, prompt_suite)
    sc = scenario_of(sp, budget_mb, min_rouge_l)
    check_quality_prompts(sc, sp, prompts)  # before any model loads
    settings = _trial_settings(sp, sc, eval_overrides)
    out = Path(out)
    (out / scenario).mkdir(parents=True, exist_ok=True)
    storage = storage or os.environ.get(STORAGE_ENV)
    if storage is None and workers > 1:  # several local workers share the SQLite file, with heartbeats
        storage = f"sqlite:///{(out / scenario / 'study.db').resolve()}"
    run = Run(scenario, sp, sc, settings, out, started,
              trials if trials is not None else sp.trials,
              timeout if timeout is not None else (sp.timeout_s or DEFAULT_TIMEOUT_S),
              {"models_fn": models_fn, "prompts": prompts, "ppl_ids": ppl_ids, "heldout_prompts": heldout_prompts,
               "progress": progress})
    worker_args = {"scenario": scenario, "out": out, "space": space, "enable": list(enable or []),
                   "budget_mb": budget_mb, "heartbeat_s": heartbeat_s, "target": target, "min_rouge_l": min_rouge_l,
                   "draft": draft, "prompt_suite": sp.base.get("prompts") if prompt_suite is not None else None}
    found = out if found_dir is _SAME_DIR else found_dir
    return _run_study(run, storage, workers, worker_args, heartbeat_s, study_name, finalize_results, heldout, found)


def _run_study(run: Run, storage: str | None, workers: int, worker_args: dict, heartbeat_s, study_name,
               finalize_results: bool, heldout: bool, found) -> dict:
    """:func:`run_search` once its arguments are checked: open (or resume) the study under the output directory's
    lock (a local SQLite study) or on ``storage``, start ``workers - 1`` more workers, optimize, then choose and
    write the outputs (:meth:`Run.finalize`) unless ``finalize_results`` is False."""
    scenario = run.scenario
    lock = None if storage is not None else lock_out_dir(run.out / scenario)
    try:
        study, rdb, storage, shared = run.open_study(storage, heartbeat_s, study_name)
        children = start_workers(workers - 1, worker_args | {"study_name": study.study_name, "trials": run.n_total,
                                                             "timeout": run.time_left()}, storage)
        run.optimize(study, finalize_results and heldout)
        _wait(children, scenario)
        if not finalize_results:
            return {"scenario": scenario, "study": study.study_name, "counts": study_counts(study)}
        if shared:
            settle(study, rdb)
        return run.finalize(study, found, safe_url(storage), heldout)
    finally:
        if lock is not None:
            lock.release()


@dataclass
class Run:
    """One run of a study: what it searches and measures, its budget, its test injections."""

    scenario: str
    sp: SearchSpace
    sc: Scenario
    settings: object
    out: Path
    started: float
    n_total: int
    budget_s: float
    inject: dict

    @property
    def out_dir(self) -> Path:
        return self.out / self.scenario

    def time_left(self) -> float:
        return max(1.0, self.budget_s - (time.monotonic() - self.started))

    def open_study(self, storage: str | None, heartbeat_s: float | None, study_name: str | None):
        """Create or resume the study (its configuration checked), queue the grid or the seeds, report it."""
        import optuna

        rdb, storage, shared = open_storage(storage, self.out_dir, heartbeat_s)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # TPE 'group'
        points = self.sp.points(limit=self.n_total)
        sampler, sampler_name, grid = make_sampler(points, self.n_total, shared)
        name = study_name or f"search-{self.scenario}"
        study = optuna.create_study(study_name=name, storage=rdb, directions=list(DIRECTIONS), sampler=sampler,
                                    load_if_exists=True)
        check_resume(study, study_config(self.sp, self.sc, self.settings))
        TS = optuna.trial.TrialState
        if not shared:  # a local file has one writer (we hold the lock): RUNNING trials are leftovers of a dead run
            for t in study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
                rdb.set_trial_state_values(t._trial_id, TS.FAIL)
        queue_points(study, self.sp, points, grid, self.n_total)
        done = len(study.get_trials(deepcopy=False, states=(TS.COMPLETE,)))
        self.remaining = max(0, self.n_total - done)
        if grid:
            self.remaining = min(self.remaining, len(study.get_trials(deepcopy=False, states=(TS.WAITING,))))
        print(f"search {self.scenario}: {done} completed trial(s) in study {name}, up to {self.remaining} more "
              f"({sampler_name}; budget {self.budget_s:.0f} s; storage {safe_url(storage)}; worker pid "
              f"{os.getpid()})", file=sys.stderr)
        return study, rdb, storage, shared

    def optimize(self, study, confirming: bool) -> None:
        """Run trials until ``n_total`` completed ones, the budget, or no point is left."""
        import optuna
        from optuna.study import MaxTrialsCallback

        if not self.remaining:
            return
        i = self.inject
        runner = TrialRunner(study, self.sp, self.sc, self.settings, self.out, self.out_dir, i["models_fn"],
                             i["prompts"], i["ppl_ids"], i["progress"])
        confirmations = (1 + len(self.sp.heldout.get("compare", []))) if confirming else 0
        TS = optuna.trial.TrialState
        # completed trials count toward --trials; invalid / duplicate ones are cheap but capped all the same
        study.optimize(runner, n_trials=self.remaining * 20 + 50, timeout=self.time_left(),
                       callbacks=[MaxTrialsCallback(self.n_total, states=(TS.COMPLETE,)),
                                  Deadline(runner, self.started, self.budget_s, confirmations)],
                       gc_after_trial=False, show_progress_bar=False, catch=(Exception,))

    def finalize(self, study, found_dir, storage: str, heldout: bool) -> dict:
        i = self.inject
        confirm = heldout_confirmation(self.sp, self.settings, self.out_dir, i["models_fn"], i["heldout_prompts"],
                                       i["ppl_ids"], i["progress"]) if heldout else None
        return finalize(study, self.sp, self.sc, self.out_dir, found_dir, self.settings, storage, confirm,
                        base=self.out)

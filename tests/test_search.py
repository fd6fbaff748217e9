"""Configuration search end to end on tiny random models: runs, never picks infeasible trials, writes a runnable
recipe, resumes without repeating finished trials."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import perturbed_copy, tiny_llama

from eval import search as S
from eval.scenarios import Scenario
from toolkit.errors import ConfigError
from toolkit.recipe import Recipe
from toolkit.session import plan

EVAL = {"num_prompts": 1, "max_new_tokens": 24, "repeats": 1, "warmup": 0, "ppl_tokens": 64, "ppl_window": 32, "baselines": ["ar"],
        "ppl_stride": 16}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    target = tiny_llama()
    return {"target": target, "draft": perturbed_copy(target, scale=0.3)}


def _space(trials=4):
    return {
        "scenario": "short", "trials": trials,
        "base": {"target": {"device": "cpu"}, "draft": {"device": "cpu"}, "kv": {"policy": "none"},
                 "spec": {"drafter": "draft_model", "num_draft_tokens": 3},
                 "generation": {"max_new_tokens": 32}, "prompts": "short"},
        "eval": EVAL,
        "space": {
            "drafter": {"choices": {"draft": {"spec": {"drafter": "draft_model"}},
                                    "ngram": {"spec": {"drafter": "ngram"}, "draft": None}}},
            "kv": {"choices": {"none": {"kv": {"policy": "none"}},
                               "stream": {"kv": {"policy": "streaming", "sink_tokens": 4, "window": 12}}}},
        },
    }


def _run(tmp_path, tiny, calls=None, fail_at=None, **kw):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (10,), generator=g).tolist()]
    ppl_ids = torch.randint(3, 128, (64,), generator=g).tolist()

    def models_fn(recipe):
        if calls is not None:
            calls.append(recipe.config_hash())
            if fail_at is not None and len(calls) == fail_at:
                raise KeyboardInterrupt  # simulated interrupt in the middle of a trial
        return {"target": tiny["target"], "tokenizer": None, "draft_model": tiny["draft"], "reference_model": None}

    heldout = [torch.randint(3, 128, (12,), generator=g).tolist()]  # prompts no trial sees
    kw.setdefault("space", _space())
    kw.setdefault("heldout", calls is None)  # the winner's confirmation would add a models_fn call
    return S.run_search("short", out=tmp_path / "found", models_fn=models_fn, prompts=prompts, ppl_ids=ppl_ids,
                        heldout_prompts=heldout, progress=False, **kw)


@pytest.mark.slow
def test_tiny_search_end_to_end_infeasible_never_chosen_and_recipe_runs(tmp_path, tiny):
    # budget between one and two models' weights: every draft-model trial is infeasible
    weights_mb = sum(p.numel() * 4 for p in tiny["target"].parameters()) / 2**20
    result = _run(tmp_path, tiny, budget_mb=weights_mb * 1.5)
    assert result["trials"] == 4
    assert 0 < result["feasible"] < 4
    best = result["best"]
    assert best["feasible"] and best["params"]["drafter"] == "ngram"
    assert all(v <= 0 for v in best["constraints"].values())
    for name in ("trials", "table", "plot", "recipe"):
        assert (tmp_path / "found" / "short.yaml").is_file() if name == "recipe" else \
            (tmp_path / "found" / "short" / {"trials": "trials.json", "table": "pareto.md", "plot": "pareto.png"}[name]
             ).stat().st_size > 0
    text = (tmp_path / "found" / "short.yaml").read_text()
    assert "# Hardware:" in text and "# Why it won:" in text and "transformers" in text
    assert "# Held-out confirmation" in text and result["best"]["heldout"]["summary"]["throughput"] > 0
    assert "/tmp" not in text and str(tmp_path) not in text  # no machine paths in a found recipe
    # the written recipe loads and runs
    from toolkit.speculative_lm import build

    recipe = Recipe.load(tmp_path / "found" / "short.yaml")
    assert recipe.spec.drafter == "ngram" and recipe.generation.max_new_tokens == 32
    gen = build(recipe, target=tiny["target"], tokenizer=None)
    spec = recipe.generation
    from toolkit.speculative.stats import GenerationStats

    stats = GenerationStats()
    ids = [t for c in gen.decoder(spec).decode(torch.tensor([[5, 6, 7, 5, 6]]), spec, stats, [], None) for t in c]
    assert len(ids) == 32


def test_a_found_recipe_beats_a_shipped_one_only_outside_the_spread_of_repetitions():
    """The found recipe's provenance said "beats shipped recipe short (74.06 tok/s ...)" for the same configuration
    at 75.22 tok/s, within the repetitions' spread; timed throughput whose min-max ranges overlap now "matches", and a
    shipped recipe with the winner's configuration is said to be one."""
    from eval.search.report import _why
    from eval.search.select import verdict

    def summary(median, low, high, memory=140.0):
        return {"throughput": median, "throughput_min": low, "throughput_max": high, "ppl": 19.5, "ppl_ratio": 1.0,
                "memory_mb": memory}

    short, memory = Scenario("short", primary="throughput"), Scenario("memory", primary="memory_mb")
    assert verdict(summary(75.2, 74.9, 76.2), summary(74.1, 72.6, 75.0), short) == "matches"
    assert verdict(summary(75.2, 74.9, 76.2), summary(74.1, 72.6, 74.8), short) == "beats"
    assert verdict(summary(70.0, 69.0, 71.0), summary(74.1, 72.6, 74.8), short) == "does NOT beat"
    assert verdict(summary(70.0, 69.0, 71.0, 100.0), summary(74.1, 72.6, 74.8, 101.0), memory) == "beats"
    best = S.TrialRow(0, {"drafter": "lookup"}, [75.2, 19.5, 140.0], {"ppl_ratio": -0.1},
                      summary=summary(75.2, 74.9, 76.2))
    best.heldout = {"summary": summary(75.2, 74.9, 76.2), "feasible": True}
    best.shipped = [{"name": "short", "summary": summary(74.1, 72.6, 75.0), "feasible": True, "same_config": True},
                    {"name": "short-exact", "summary": summary(31.0, 30.8, 31.0), "feasible": True}]
    why = _why(best, [best], short)
    assert "; matches shipped recipe short (the same configuration) (74.10 tok/s" in why
    assert "; beats shipped recipe short-exact (31.00 tok/s" in why


def test_choose_never_picks_infeasible():
    sc = Scenario("short", primary="throughput")
    rows = [S.TrialRow(0, {}, [100.0, 10.0, 5.0], {"ppl_ratio": 0.5}),
            S.TrialRow(1, {}, [50.0, 10.0, 5.0], {"ppl_ratio": -0.1}),
            S.TrialRow(2, {}, [60.0, 12.0, 5.0], {"ppl_ratio": -0.1})]
    assert S.choose(rows, sc).number == 2
    assert S.choose([rows[0]], sc) is None
    assert S.choose(rows, Scenario("memory", primary="memory_mb")).number == 1  # tie on memory: lower PPL
    assert [r.number for r in S.pareto_front(rows)] == [1, 2]
    assert rows[1].to_dict()["feasible"] and not rows[0].to_dict()["feasible"]
    assert not S.is_feasible({"ppl_ratio": 0.01}) and S.is_feasible({"ppl_ratio": -0.1, "budget_mb": 0.0})


def test_no_feasible_trial_writes_no_recipe(tmp_path, tiny):
    result = _run(tmp_path, tiny, budget_mb=1e-6, trials=2)
    assert result["best"] is None and result["recipe_path"] is None
    assert not (tmp_path / "found" / "short.yaml").exists()


@pytest.mark.slow
def test_resume_after_interrupt_does_not_repeat_finished_trials(tmp_path, tiny):
    calls: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, tiny, calls=calls, fail_at=3, trials=4)  # trials 0, 1 finish; trial 2 is interrupted
    assert len(calls) == 3
    import optuna

    storage = f"sqlite:///{(tmp_path / 'found' / 'short' / 'study.db').resolve()}"
    study = optuna.load_study(study_name="search-short", storage=storage)
    finished = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(finished) == 2
    finished_hashes = {t.user_attrs["config_hash"] for t in finished}

    calls2: list[str] = []
    result = _run(tmp_path, tiny, calls=calls2, trials=4)
    assert result["trials"] == 4
    assert len(calls2) == 2 and not finished_hashes & set(calls2)  # only the missing points were evaluated
    study = optuna.load_study(study_name="search-short", storage=storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len({t.user_attrs["config_hash"] for t in done}) == 4
    # running again with the same total does nothing
    calls3: list[str] = []
    _run(tmp_path, tiny, calls=calls3, trials=4)
    assert calls3 == []


_KILLED_SEARCH = """
import os, signal, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from conftest import perturbed_copy, tiny_llama
import test_search

class KillAtThirdTrial(list):
    def append(self, item):  # models_fn records each trial's config hash here, then builds the models
        super().append(item)
        if len(self) == 3:
            os.kill(os.getpid(), signal.SIGKILL)

target = tiny_llama()
test_search._run(Path(sys.argv[1]), {"target": target, "draft": perturbed_copy(target, scale=0.3)},
                 calls=KillAtThirdTrial(), trials=4)
"""


@pytest.mark.slow
@pytest.mark.system
def test_resume_after_kill_9_reruns_only_what_was_lost(tmp_path, tiny):
    """A search killed with SIGKILL in the middle of its third trial (a subprocess): the SQLite study stays
    readable with two finished trials and the killed one RUNNING; the lock dies with the process; ``--resume``
    (the same call again) marks the leftover FAIL, measures only the killed and the missing points, and writes the
    recipe."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import optuna

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_SEARCH, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    storage = f"sqlite:///{(tmp_path / 'found' / 'short' / 'study.db').resolve()}"
    study = optuna.load_study(study_name="search-short", storage=storage)
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 2
    assert states.count(optuna.trial.TrialState.RUNNING) == 1  # what a kill -9 leaves behind
    finished = {t.user_attrs["config_hash"] for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}
    calls: list[str] = []
    result = _run(tmp_path, tiny, calls=calls, trials=4)
    assert result["trials"] == 4 and len(calls) == 2 and not finished & set(calls)
    study = optuna.load_study(study_name="search-short", storage=storage)
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    done = {t.user_attrs["config_hash"] for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert len(done) == 4
    assert Recipe.load(result["recipe_path"]).spec.drafter in ("draft_model", "ngram")


def test_space_files_parse_and_build_valid_recipes():
    from eval.space_file import load_space

    for name in ("short", "long", "memory", "throughput"):
        sp = load_space(name)
        assert sp.scenario == name and sp.source == f"recipes/search/{name}.yaml"
        built = 0
        rng = random.Random(0)
        for point in [sp.random_point(rng) for _ in range(40)]:  # a sample: the spaces hold millions of points
            try:
                sp.recipe(point)
                built += 1
            except Exception as exc:  # noqa: BLE001 - only ConfigError is allowed
                from toolkit.errors import ConfigError

                assert isinstance(exc, ConfigError), exc
        assert built >= 2
        for seed_name, point in sp.seed_points():  # the shipped recipes are valid points of their space
            assert sp.recipe(point).spec.drafter
    # throughput: every point is a batched recipe of a drafter that batches (model-free, uncompressed cache)
    from toolkit.kv.rows import static_why

    full_attention = tiny_llama()
    sp = load_space("throughput")
    rng = random.Random(1)
    for point in [sp.random_point(rng) for _ in range(20)]:
        recipe = sp.recipe(point)
        assert recipe.batch_size == point["batch_size"] and recipe.spec.config.batch
        # only policies that batch (on a full-attention target: the static cache or the policy's per-row cache)
        assert static_why(plan(recipe).target_policy, full_attention) is None
    # long and memory: trials run at the length that defines the scenario (the found recipe's new tokens, on the
    # ~4,000-token prompts), so every KV policy, unbounded ones too, is measured at the size it really has
    from toolkit.measure.prompts import load_suite

    for name in ("long", "memory"):
        sp = load_space(name)
        assert sp.eval["max_new_tokens"] == sp.base["generation"]["max_new_tokens"]
        assert min(len(str(p.prompt)) for p in load_suite(sp.base["prompts"])) > 12_000  # characters: ~4k tokens
        kv = next(d for d in sp.dimensions if d.name == "kv_policy")
        assert {"quantized", "l2norm", "streaming"} <= set(kv.searched)
        # memory weighs the uncompressed recipe too; long's KV bound (~25% of it) rules it out before it runs
        assert ("none" in kv.searched) == (name == "memory") and "none" in kv.labels


def _cond_space():
    return {"scenario": "short", "trials": 50,
            "base": {"target": {"device": "cpu"}, "draft": {"device": "cpu"}, "kv": {"policy": "none"},
                     "spec": {"drafter": "draft_model", "num_draft_tokens": 3}, "prompts": "short"},
            "space": {
                "drafter": {"choices": {"draft": {"spec": {"drafter": "draft_model"}},
                                        "ngram": {"spec": {"drafter": "ngram"}, "draft": None},
                                        "future": {"spec": {"drafter": "ngram", "no_such_field": 1}, "draft": None}},
                            "disabled": ["future"]},
                "kv_policy": {"choices": {"none": {"kv": {"policy": "none"}},
                                          "streaming": {"kv": {"policy": "streaming", "sink_tokens": 2}},
                                          "l2norm": {"kv": {"policy": "l2norm", "sink_tokens": 0,
                                                            "protect_recent": 4}}}},
                "kv_window": {"path": "kv.window", "choices": [2, 12], "when": {"kv_policy": ["streaming"]}},
                "kv_budget": {"path": "kv.budget", "choices": [8, 16], "when": {"kv_policy": ["l2norm"]}},
                "draft_precision": {"path": "draft.precision", "choices": ["fp32", "bf16"],
                                    "when": {"drafter": ["draft"]}},
                "backend": {"path": "target.not_a_field", "choices": ["torchao"], "enabled": False},
            }}


def test_conditional_dimensions_exist_only_where_their_condition_holds():
    from eval.space_file import load_space
    from toolkit.errors import ConfigError

    sp = load_space(_cond_space())
    points = sp.points()
    # drafter (2 searched) x kv (none 1 + streaming 2 windows + l2norm 2 budgets = 5) x draft precision (2 | 1)
    assert len(points) == 2 * 5 + 1 * 5 == sp.grid_size
    for p in points:
        assert ("kv_window" in p) == (p["kv_policy"] == "streaming")
        assert ("kv_budget" in p) == (p["kv_policy"] == "l2norm")
        assert ("draft_precision" in p) == (p["drafter"] == "draft")
        assert "backend" not in p and p["drafter"] != "future"
    r = sp.recipe({"drafter": "draft", "kv_policy": "l2norm", "kv_budget": 16, "draft_precision": "bf16"})
    assert r.kv.policy == "l2norm" and r.kv.params["budget"] == 16 and "window" not in r.kv.params
    assert r.draft.precision == "bf16"
    # a window smaller than a verify forward (K + 1 = 4) is rejected with the field named, before any model loads
    with pytest.raises(ConfigError, match="kv.window"):
        sp.recipe({"drafter": "ngram", "kv_policy": "streaming", "kv_window": 2})
    with pytest.raises(ConfigError, match="kv_window"):  # inactive dimension given a label
        sp.recipe({"drafter": "ngram", "kv_policy": "none", "kv_window": 12})
    # entries kept off in the file are switched on by name; a field this recipe version lacks is a ConfigError
    sp.enable(["drafter.future"])
    assert len(sp.points()) == (2 + 1 + 1) * 5
    with pytest.raises(ConfigError, match="spec.no_such_field"):
        sp.recipe({"drafter": "future", "kv_policy": "none"})
    sp.enable(["backend"])
    assert len(sp.points()) == (2 + 1 + 1) * 5 and all(p["backend"] == "torchao" for p in sp.points())
    with pytest.raises(ConfigError, match="target.not_a_field"):
        sp.recipe({"drafter": "ngram", "kv_policy": "none", "backend": "torchao"})
    with pytest.raises(ConfigError, match="--enable"):
        sp.enable(["drafter.nope"])
    bad = _cond_space()
    bad["space"]["kv_window"]["when"] = {"kv_budget": [8]}  # must name an earlier dimension
    with pytest.raises(ConfigError, match="search.space.kv_window.when.kv_budget"):
        load_space(bad)


@pytest.mark.slow
def test_invalid_combinations_are_counted_and_never_evaluated(tmp_path, tiny):
    space = _cond_space()
    space["space"].pop("backend")
    space["eval"] = EVAL
    space["base"]["generation"] = {"max_new_tokens": 24}
    calls: list[str] = []
    result = _run(tmp_path, tiny, calls=calls, space=space, trials=5, enable=["drafter.future"])
    counts = result["counts"]
    assert counts["complete"] == 5 and counts["invalid"] >= 1  # 8 of the 20 points are invalid
    assert len(calls) == counts["complete"] - counts["reused"]  # models were loaded for valid trials only
    import optuna

    study = optuna.load_study(study_name="search-short",
                              storage=f"sqlite:///{(tmp_path / 'found' / 'short' / 'study.db').resolve()}")
    invalid = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert invalid and all("invalid" in t.user_attrs and "recipe" not in t.user_attrs for t in invalid)
    if hasattr(optuna.trial.Trial, "set_constraint"):  # optuna >= 5: the trials carry the constraints TPE reads
        complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert complete and all(t.constraints == t.user_attrs["constraints"] for t in complete)
        assert all(t.constraints == {"pruned": 1.0} for t in invalid)  # infeasible, as constraints_func's [1.0]
    assert {t.user_attrs["config_hash"] for t in study.trials if "config_hash" in t.user_attrs} >= set(calls)
    assert "invalid combinations rejected before loading any model" in (tmp_path / "found" / "short" /
                                                                        "pareto.md").read_text()


def test_timeout_stops_starting_trials(tmp_path, tiny):
    result = _run(tmp_path, tiny, trials=4, timeout=0.01, heldout=False)
    assert 1 <= result["counts"]["complete"] < 4


def test_seeds_are_measured_first_once_and_bad_seeds_are_named(tmp_path, tiny):
    from eval.space_file import load_space
    from toolkit.errors import ConfigError

    space = _cond_space()
    space["space"].pop("backend")
    space["eval"] = EVAL
    space["base"]["generation"] = {"max_new_tokens": 24}
    seed = {"drafter": "ngram", "kv_policy": "streaming", "kv_window": 12}
    space["seeds"] = {"shipped-like": seed}
    calls: list[str] = []
    result = _run(tmp_path, tiny, calls=calls, space=space, trials=2)  # 15 points > 2 trials: TPE, not a grid
    assert result["counts"]["complete"] == 2
    import optuna

    study = optuna.load_study(study_name="search-short",
                              storage=f"sqlite:///{(tmp_path / 'found' / 'short' / 'study.db').resolve()}")
    assert study.trials[0].params == seed and study.trials[0].user_attrs["seed"] == "shipped-like"
    _run(tmp_path, tiny, calls=calls, space=space, trials=3)  # resumed: the seed is not queued a second time
    study = optuna.load_study(study_name="search-short", storage=study._storage)
    assert sum(t.user_attrs.get("seed") == "shipped-like" for t in study.trials) == 1
    bad = dict(space, seeds={"tiny-window": {**seed, "kv_window": 2}})  # window < K + 1: no valid recipe
    with pytest.raises(ConfigError, match="search.seeds.tiny-window"):
        load_space(bad).seed_points()
    with pytest.raises(ConfigError, match="search.seeds.typo.kv_windw"):
        load_space(dict(space, seeds={"typo": {**seed, "kv_windw": 12}}))


@pytest.mark.slow
def test_a_trial_that_raises_is_failed_with_its_error_and_the_study_goes_on(tmp_path, tiny, monkeypatch):
    import eval.evaluate as E

    real = E.evaluate

    def crashing(recipe, **kw):  # a combination whose evaluation crashes (e.g. a kernel without an op it needs)
        if recipe.spec.drafter == "ngram":
            raise NotImplementedError("Int4OpaqueTensor dispatch: aten.index")
        return real(recipe, **kw)

    monkeypatch.setattr(E, "evaluate", crashing)
    result = _run(tmp_path, tiny, heldout=False, trials=4)  # a grid of 4 points, 2 of them crash
    counts = result["counts"]  # each crashing point failed once, then skipped; the 2 others measured once
    assert counts["failed"] == 2 and counts["complete"] - counts["reused"] == 2
    import optuna

    study = optuna.load_study(study_name="search-short",
                              storage=f"sqlite:///{(tmp_path / 'found' / 'short' / 'study.db').resolve()}")
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert {t.params["drafter"] for t in failed} == {"ngram"} and all(t.user_attrs["error"] for t in failed)
    assert result["best"]["params"]["drafter"] == "draft"


@pytest.mark.slow
def test_resume_with_other_settings_is_refused_and_reuse_follows_what_changes_a_result(tmp_path, tiny):
    first = _run(tmp_path, tiny, heldout=False, trials=2)
    assert first["counts"]["complete"] == 2
    with pytest.raises(ConfigError, match="another eval") as excinfo:  # other evaluation settings, same study
        _run(tmp_path, tiny, heldout=False, trials=3, eval_overrides={"max_new_tokens": 16})
    assert excinfo.value.field == "search"
    with pytest.raises(ConfigError, match="another scenario"):  # other bounds: feasibility would be stale
        _run(tmp_path, tiny, heldout=False, trials=3, budget_mb=1.0)
    # a new study (another name) with other settings measures again: nothing is reused across settings
    calls: list[str] = []
    other = _run(tmp_path, tiny, calls=calls, trials=2, study_name="other", eval_overrides={"max_new_tokens": 16})
    assert other["counts"]["reused"] == 0 and len(calls) == 2


def test_a_second_search_on_the_same_out_is_refused(tmp_path, tiny):
    from filelock import FileLock

    (tmp_path / "found" / "short").mkdir(parents=True)
    held = FileLock(str(tmp_path / "found" / "short" / ".search.lock"))
    held.acquire()
    try:
        with pytest.raises(ConfigError, match="another search is running") as excinfo:
            _run(tmp_path, tiny, heldout=False, trials=1)
        assert excinfo.value.field == "out"
    finally:
        held.release()
    assert _run(tmp_path, tiny, heldout=False, trials=1)["counts"]["complete"] == 1  # free again


def test_storage_password_never_written_or_passed_on_the_command_line(tmp_path, monkeypatch):
    url = "postgresql://user:s3cret@db.example:5432/studies"
    assert S.safe_url(url) == "postgresql://user:***@db.example:5432/studies"
    started: list = []

    class Fake:
        pid, returncode = 1, 0

        def __init__(self, cmd, env):
            started.append((cmd, env))

        def wait(self):
            return 0

    from eval.search import study as study_module

    monkeypatch.setattr(study_module.subprocess, "Popen", Fake)
    study_module.start_workers(2, {"scenario": "short", "study_name": "s", "trials": 4, "out": tmp_path,
                                   "timeout": 10.0, "space": None, "enable": [], "budget_mb": None,
                                   "heartbeat_s": None}, url)
    assert len(started) == 2
    for cmd, env in started:
        assert not any("s3cret" in part for part in cmd) and env[S.STORAGE_ENV] == url


@pytest.mark.slow
def test_throughput_search_scores_batched_runs_and_writes_a_batched_recipe(tmp_path, tiny):
    """The throughput scenario: batch size searched, trials scored on the batched run (HF batched AR reused across
    trials), the memory bound on weights + the batch cache, the found recipe carries its batch size."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 14, 11, 6)]
    space = {"scenario": "throughput", "trials": 3,
             "base": {"target": {"device": "cpu"}, "draft": None, "kv": {"policy": "none"}, "batch_size": 2,
                      "spec": {"drafter": "lookup", "num_draft_tokens": 4, "adaptive": "cost"},
                      "generation": {"max_new_tokens": 16}, "prompts": "short"},
             "eval": {**EVAL, "baselines": ["hf-batch-ar"], "reuse_baselines": True, "max_new_tokens": 12},
             "heldout": {"baselines": ["hf-batch-ar", "ours-single"]},
             "seeds": {"b1": {"batch_size": 1, "drafter": "lookup"}},
             "space": {"batch_size": {"path": "batch_size", "choices": [1, 2, 4]},
                       "drafter": {"choices": {"lookup": {"spec": {"drafter": "lookup"}},
                                               "none": {"spec": {"drafter": "none"}}}}}}
    result = S.run_search("throughput", space=space, out=tmp_path / "found", progress=False, prompts=prompts,
                          ppl_ids=torch.randint(3, 128, (64,), generator=g).tolist(), heldout_prompts=prompts[:3],
                          models_fn=lambda r: {"target": tiny["target"], "tokenizer": None, "draft_model": None,
                                               "reference_model": None})
    assert result["trials"] == 3 and result["best"]["feasible"]
    rows = json.loads((tmp_path / "found" / "throughput" / "trials.json").read_text())["rows"]
    assert len(rows) == 3 and rows[0]["params"]["batch_size"] == 1  # the seed first
    for row in rows:  # every trial scored on its batched run, next to HF batched AR at its batch size
        assert "ours_batch_vs_hf_batch_ar" in row["summary"]["ratios"]
    held = result["best"]["heldout"]["summary"]["ratios"]
    assert {"ours_batch_vs_hf_batch_ar", "ours_batch_vs_ours_single"} <= set(held)
    found = Recipe.load(tmp_path / "found" / "throughput.yaml")
    assert found.batch_size == result["best"]["params"]["batch_size"]
    assert "HF batched AR" in (tmp_path / "found" / "throughput" / "pareto.md").read_text()

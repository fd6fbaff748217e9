"""Configuration search end to end on tiny random models: runs, never picks infeasible trials, writes a runnable
recipe, resumes without repeating finished trials."""

from __future__ import annotations

import pytest
import torch

from conftest import perturbed_copy, tiny_llama
from eval import search as S
from eval.scenarios import Scenario
from toolkit.recipe import Recipe

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

    kw.setdefault("space", _space())
    kw.setdefault("verify", calls is None)  # the winner's re-measurement would add a models_fn call
    return S.run_search("short", results_root=tmp_path / "res", found_dir=tmp_path / "found", models_fn=models_fn,
                        prompts=prompts, ppl_ids=ppl_ids, progress=False, **kw)


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
            (tmp_path / "res" / "short" / {"trials": "trials.json", "table": "pareto.md", "plot": "pareto.png"}[name]
             ).stat().st_size > 0
    text = (tmp_path / "found" / "short.yaml").read_text()
    assert "# Hardware:" in text and "# Why it won:" in text and "transformers" in text
    assert "# Verified" in text and result["best"]["verified"]["summary"]["throughput"] > 0
    # the written recipe loads and runs
    from toolkit.generator import build

    recipe = Recipe.load(tmp_path / "found" / "short.yaml")
    assert recipe.spec.drafter == "ngram" and recipe.generation.max_new_tokens == 32
    gen = build(recipe, target=tiny["target"], tokenizer=None)
    spec = recipe.generation
    from toolkit.speculative.stats import GenerationStats

    stats = GenerationStats()
    ids = [t for c in gen.decoder(spec).decode(torch.tensor([[5, 6, 7, 5, 6]]), spec, stats, [], None) for t in c]
    assert len(ids) == 32


def test_choose_never_picks_infeasible():
    sc = Scenario("short", primary="throughput")
    rows = [{"number": 0, "values": [100.0, 10.0, 5.0], "feasible": False},
            {"number": 1, "values": [50.0, 10.0, 5.0], "feasible": True},
            {"number": 2, "values": [60.0, 12.0, 5.0], "feasible": True}]
    assert S.choose(rows, sc)["number"] == 2
    assert S.choose([rows[0]], sc) is None
    assert S.choose(rows, Scenario("memory", primary="memory_mb"))["number"] == 1  # tie on memory: lower PPL
    assert [r["number"] for r in S.pareto_front(rows)] == [1, 2]
    assert not S.is_feasible({"ppl_ratio": 0.01}) and S.is_feasible({"ppl_ratio": -0.1, "budget_mb": 0.0})


def test_no_feasible_trial_writes_no_recipe(tmp_path, tiny):
    result = _run(tmp_path, tiny, budget_mb=1e-6, trials=2)
    assert result["best"] is None and result["recipe_path"] is None
    assert not (tmp_path / "found" / "short.yaml").exists()


def test_resume_after_interrupt_does_not_repeat_finished_trials(tmp_path, tiny):
    calls: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, tiny, calls=calls, fail_at=3, trials=4)  # trials 0, 1 finish; trial 2 is interrupted
    assert len(calls) == 3
    import optuna

    storage = f"sqlite:///{(tmp_path / 'res' / 'short.db').resolve()}"
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


def test_space_files_parse_and_build_valid_recipes():
    from eval.space import load_space

    for name in ("short", "long", "memory"):
        sp = load_space(name)
        assert sp.scenario == name and sp.grid_size <= 24
        built = 0
        for point in sp.points():
            try:
                sp.recipe(point)
                built += 1
            except Exception as exc:  # noqa: BLE001 - only ConfigError is allowed
                from toolkit.errors import ConfigError

                assert isinstance(exc, ConfigError), exc
        assert built >= 2

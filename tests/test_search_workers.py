"""Several worker processes on one study in a real PostgreSQL server (tests/postgres.py), on a tiny random model:
the requested number of trials completes, no recipe is evaluated twice, and killing a worker mid-trial loses
nothing (its trial is marked failed by the heartbeat and re-queued; the study finishes and the winner is written)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.system]  # starts three Python processes that import torch


def _tiny_model_dir(path: Path) -> Path:
    """A random-weight 2-layer Llama with the embedded model's tokenizer (vocabulary and chat template)."""
    from toolkit.models import resolve_source

    embedded = Path(resolve_source("embedded"))
    model = tiny_llama(vocab=49152, max_positions=1024)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (embedded / name).exists():
            shutil.copy(embedded / name, path / name)
    return path


def _space(model: Path) -> dict:
    spec = {"source": str(model), "precision": "fp32", "device": "cpu"}
    return {
        "scenario": "short", "trials": 6, "timeout_s": 500,
        "base": {"target": spec, "draft": spec, "kv": {"policy": "none"}, "draft_kv": {"policy": "none"},
                 "spec": {"drafter": "draft_model", "num_draft_tokens": 3},
                 "generation": {"max_new_tokens": 16, "do_sample": False}, "prompts": "short"},
        "eval": {"num_prompts": 1, "max_new_tokens": 16, "repeats": 1, "warmup": 0, "ppl_tokens": 64,
                 "ppl_window": 32, "ppl_stride": 16, "baselines": ["ar"], "reuse_baselines": True},
        "heldout": {"prompts": "short-heldout", "num_prompts": 1},
        "space": {
            "drafter": {"choices": {"draft": {"spec": {"drafter": "draft_model"}},
                                    "ngram": {"spec": {"drafter": "ngram"}, "draft": None}}},
            "kv_policy": {"choices": {"none": {"kv": {"policy": "none"}},
                                      "streaming": {"kv": {"policy": "streaming", "sink_tokens": 4}}}},
            "kv_window": {"path": "kv.window", "choices": [12, 28], "when": {"kv_policy": ["streaming"]}},
            "num_draft_tokens": {"path": "spec.num_draft_tokens", "choices": [2, 3, 4]},
        },
    }


def test_two_workers_share_a_postgres_study_and_survive_a_killed_worker(tmp_path, postgres_url):
    import optuna

    from eval.search import driver_url

    model = _tiny_model_dir(tmp_path / "tiny-model")
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(_space(model)))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "toolkit_cli", "search", "--scenario", "short", "--space", str(space),
           "--storage", postgres_url, "--study-name", "workers-test", "--workers", "2", "--trials", "6",
           "--heartbeat", "1", "--out", "found"]
    main = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed: tuple[int, int] | None = None  # (trial number, pid)
    try:
        deadline = time.monotonic() + 300
        while killed is None and time.monotonic() < deadline and main.poll() is None:
            time.sleep(0.2)
            try:
                study = optuna.load_study(study_name="workers-test", storage=driver_url(postgres_url))
            except KeyError:
                continue
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                pid = t.user_attrs.get("worker_pid")
                if pid is not None and pid != main.pid and "config_hash" in t.user_attrs:
                    os.kill(pid, signal.SIGKILL)  # the extra worker, in the middle of an evaluation
                    killed = (t.number, pid)
                    break
        output, _ = main.communicate(timeout=600)
    finally:
        if main.poll() is None:
            main.kill()
    assert killed is not None, "the second worker never started a trial:\n" + output
    assert main.returncode == 0, output
    assert f"worker {killed[1]} exited with status -9" in output

    study = optuna.load_study(study_name="workers-test", storage=driver_url(postgres_url))
    TS = optuna.trial.TrialState
    complete = study.get_trials(states=(TS.COMPLETE,))
    assert len(complete) >= 6  # the requested number completed (a worker may finish one in flight past it)
    # marked failed by the heartbeat, not left RUNNING — unless the worker ended it (pruned) between the poll that
    # saw it RUNNING and the kill
    assert study.trials[killed[0]].state in (TS.FAIL, TS.PRUNED)
    assert not study.get_trials(states=(TS.RUNNING,))
    evaluated = [t.user_attrs["config_hash"] for t in complete if "cached_from" not in t.user_attrs]
    assert len(evaluated) == len(set(evaluated))  # no recipe evaluated twice
    assert {t.user_attrs["worker_pid"] for t in complete} >= {main.pid}

    found = work / "found" / "short.yaml"
    text = found.read_text()
    assert "# Held-out confirmation" in text and str(tmp_path) not in text  # no machine paths
    from toolkit.recipe import Recipe

    recipe = Recipe.load(found)
    assert (found.parent / recipe.target.source).resolve() == model.resolve()  # relative to the recipe file

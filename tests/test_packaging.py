"""The library installs as a real package: a non-editable wheel runs the commands with its shipped data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """Build a wheel of this checkout and install it (no deps: they are this venv's) into a private directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv*", ".git", "results", "build", "*.egg-info",
                                                                "__pycache__", "bench", ".gpu-carry", ".whl"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(source)], check=True)
    wheel = next((tmp / "dist").glob("*.whl"))
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)
    return site


def _run(site: Path, cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site))  # the wheel's copy first, never this source tree
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.system
def test_wheel_ships_recipes_prompts_spaces_and_metric_modules(installed, tmp_path, monkeypatch):
    from toolkit.metrics import NAMES

    for name in NAMES:  # the evaluate scripts are package data (setup.py), not packages
        assert (installed / "toolkit" / "metrics" / name / f"{name}.py").is_file(), name
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))  # evaluate copies the scripts here
    monkeypatch.setenv("HF_METRICS_CACHE", str(tmp_path / "metrics"))
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    probe = ("import toolkit, toolkit_cli, eval; from toolkit.resources import shipped; "
             "print(toolkit.__file__); print(sorted(p.name for p in shipped('').glob('*.yaml'))); "
             "print(sorted(p.name for p in shipped('prompts').glob('*.yaml'))); "
             "print(sorted(p.name for p in shipped('search').glob('*.yaml'))); "
             "import toolkit.metrics as TM; print(TM.path('rouge_l')); "
             "print(TM.load('rouge_l').compute(predictions=['the cat'], references=['the cat sat'])['rouge_l'])")
    out = _run(installed, tmp_path, "-c", probe)
    assert out.returncode == 0, out.stderr[-2000:]
    location, recipes, suites, spaces, metric, score = out.stdout.splitlines()[-6:]
    assert location.startswith(str(installed))  # imported from the installed wheel, not the checkout
    assert "short.yaml" in recipes and "short.yaml" in suites and "short.yaml" in spaces
    assert metric.startswith(str(installed)) and float(score) == pytest.approx(0.8)  # P 1, R 2/3


@pytest.mark.slow
@pytest.mark.system
def test_installed_cli_runs_a_shipped_recipe_into_the_working_directory(installed, tmp_path):
    before = sorted(str(p) for p in installed.rglob("*"))
    out = _run(installed, tmp_path, "-m", "toolkit_cli", "run", "short-ngram", "--max-new-tokens", "8",
               "--num-prompts", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    written = list((tmp_path / "results" / "run").glob("short-ngram-*.json"))
    assert len(written) == 1
    text = written[0].read_text()
    assert str(ROOT) not in text and str(installed) not in text  # no machine paths in what users keep
    assert json.loads(text)["rows"][0]["new_tokens"] == 8
    assert sorted(str(p) for p in installed.rglob("*") if "__pycache__" not in str(p)) == \
        [p for p in before if "__pycache__" not in p]  # nothing written into the installed package

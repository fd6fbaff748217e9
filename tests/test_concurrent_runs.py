"""Two processes at once on the same files: ``toolkit run`` of one recipe into one ``--out`` (both finish, the
results are whole JSON, no temporary file is left). The embedded-model conversion under two processes is
``tests/test_models_cache.py::test_two_processes_converting_at_once_share_one_conversion``; two searches on one
``--out`` are ``tests/test_search.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import tiny_llama
from test_distill import char_tokenizer

ROOT = Path(__file__).resolve().parents[1]

_WORKER = """
import os, runpy, sys, time
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.01)
sys.argv = ["toolkit"] + sys.argv[2:]
runpy.run_module("toolkit_cli", run_name="__main__")
"""


def _tiny_model_dir(path: Path) -> Path:
    """A random-weight 2-layer Llama with a character tokenizer and a chat template, as an HF directory."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tiny_llama(seed=0, max_positions=4096).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.system
def test_two_processes_run_the_same_recipe_into_the_same_out(tmp_path):
    model = _tiny_model_dir(tmp_path / "model")
    spec = {"source": str(model), "precision": "fp32", "device": "cpu"}
    recipe = tmp_path / "same.yaml"
    recipe.write_text(yaml.safe_dump({"name": "same", "target": spec, "draft": spec, "kv": {"policy": "none"},
                                      "draft_kv": {"policy": "none"},
                                      "spec": {"drafter": "draft_model", "num_draft_tokens": 3},
                                      "generation": {"max_new_tokens": 8, "do_sample": False}, "prompts": "short"}))
    out, go = tmp_path / "results", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-c", _WORKER, str(go), "run", str(recipe), "--out", str(out), "--num-prompts", "1"]
    workers = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for _ in range(2)]
    time.sleep(0.3)
    go.touch()  # both start together
    results = [w.communicate(timeout=300) for w in workers]
    for worker, (stdout, stderr) in zip(workers, results):
        assert worker.returncode == 0, stderr[-3000:]
        assert "results:" in stdout
    written = sorted(p.name for p in out.iterdir())
    assert len(written) == 2 and written[0].endswith(".json") and written[1].endswith(".md"), written
    data = json.loads((out / written[0]).read_text())  # whole JSON, not interleaved halves
    assert data["recipe"]["name"] == "same" and len(data["rows"]) == 1
    assert "| ours |" in (out / written[1]).read_text()

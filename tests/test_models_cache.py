"""The converted-model cache: concurrent first use by two real processes, and detection of a damaged copy.

The GGUF here is a real llama-architecture GGUF file written with the ``gguf`` package: the embedded model's
tokenizer metadata cut to its first ``VOCAB`` tokens (special tokens, the byte alphabet and the merges among them, so
transformers' GGUF loader builds a working GPT-2 BPE tokenizer) and one random decoder layer of width 64, so a
conversion takes about a second (the full 49k-token metadata alone costs ~5 s per read, and a conversion reads the
file four times).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gguf_files import write_llama_gguf

from toolkit.models import manifest_problem
from toolkit.models.embedded import MANIFEST

REPO = Path(__file__).resolve().parents[1]
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


_WORKER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from toolkit.models import resolve_source
    go = Path(sys.argv[2])
    while not go.exists():  # both workers start converting at the same moment
        time.sleep(0.01)
    print(resolve_source(sys.argv[1]), flush=True)
""")


def _env(cache: Path) -> dict:
    env = dict(os.environ, TOOLKIT_CACHE_DIR=str(cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return env


@pytest.mark.slow
@pytest.mark.system
def test_two_processes_converting_at_once_share_one_conversion(tmp_path, tiny_gguf):
    cache, go = tmp_path / "cache", tmp_path / "go"
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER, str(tiny_gguf), str(go)], env=_env(cache),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)
    go.touch()
    results = [w.communicate(timeout=600) for w in workers]
    for worker, (out, err) in zip(workers, results):
        assert worker.returncode == 0, err[-3000:]
        assert "Directory not empty" not in err
    paths = {out.strip().splitlines()[-1] for out, _ in results}
    assert len(paths) == 1  # both got the same converted copy
    converted = Path(paths.pop())
    assert converted.parent == cache and (converted / "config.json").is_file()
    conversions = sum("converting tiny-llama.gguf" in err for _, err in results)
    assert conversions == 1, [err[-2000:] for _, err in results]  # the second waited and reused, not re-converted
    reports = [line for _, err in results for line in err.splitlines() if line.startswith("converted ")]
    assert len(reports) == 1 and "tiny-llama.gguf (" in reports[0] and str(converted) in reports[0]
    assert "MiB GGUF) in " in reports[0] and "cached as fp32 safetensors" in reports[0]
    assert manifest_problem(converted) is None
    leftovers = [p.name for p in cache.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # no temporary directory left behind


def test_truncated_safetensors_is_detected_named_and_reconverted(tmp_path, tiny_gguf, monkeypatch, caplog):
    from toolkit.models import load_model
    from toolkit.recipe import ModelSpec

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    spec = ModelSpec(source=str(tiny_gguf), device="cpu")
    model, _ = load_model(spec)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    converted = next(p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith("."))
    manifest = json.loads((converted / MANIFEST).read_text())
    weights = converted / "model.safetensors"
    assert manifest["files"]["model.safetensors"]["bytes"] == weights.stat().st_size
    with open(weights, "r+b") as handle:  # a copy cut short, as by a full disk or a killed copy
        handle.truncate(weights.stat().st_size // 2)
    problem = manifest_problem(converted)
    assert problem is not None and "model.safetensors" in problem and "truncated" in problem
    with caplog.at_level("WARNING", logger="toolkit.models"):
        model, _ = load_model(spec)
    assert any("model.safetensors" in r.getMessage() and "converting" in r.getMessage() for r in caplog.records)
    assert manifest_problem(converted) is None
    for key, value in model.state_dict().items():  # the same GGUF converts to the same weights
        assert (value == reference[key]).all(), key


def test_same_size_corruption_is_caught_by_the_hash(tmp_path, tiny_gguf, monkeypatch):
    from toolkit.models import resolve_source

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    converted = Path(resolve_source(str(tiny_gguf)))
    weights = converted / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:  # flip bytes in the data section: same size, valid header
        handle.seek(size - 16)
        handle.write(bytes(16))
    problem = manifest_problem(converted)
    assert problem is not None and "model.safetensors" in problem and "SHA-256" in problem
    assert Path(resolve_source(str(tiny_gguf))) == converted and manifest_problem(converted) is None


def test_copy_from_before_manifests_is_checked_structurally(tmp_path, tiny_gguf, monkeypatch):
    from toolkit.models import resolve_source

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    converted = Path(resolve_source(str(tiny_gguf)))
    (converted / MANIFEST).unlink()  # as written by the previous release
    assert manifest_problem(converted) is None
    weights = converted / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size - 1)
    problem = manifest_problem(converted)
    assert problem is not None and "model.safetensors" in problem and "header" in problem
    assert Path(resolve_source(str(tiny_gguf))) == converted
    assert (converted / MANIFEST).is_file() and manifest_problem(converted) is None


def test_a_gguf_is_cached_at_the_dtype_the_model_loads_at(tmp_path, tiny_gguf, monkeypatch):
    """A bf16 model (bf16, and int4 through torchao) caches its GGUF as bf16: half the bytes of an fp32 copy, and
    exactly the fp32 copy's weights cast to bf16; each dtype keeps its own copy (loading casts nothing)."""
    import torch
    from safetensors.torch import load_file

    from toolkit.models import load_model, resolve_source
    from toolkit.recipe import ModelSpec

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    model, _ = load_model(ModelSpec(source=str(tiny_gguf), precision="bf16"))
    (half,) = [p for p in tmp_path.iterdir() if p.is_dir()]  # only a bf16 copy was written
    assert half.name.endswith("-bf16") and next(model.parameters()).dtype == torch.bfloat16
    full = Path(resolve_source(str(tiny_gguf)))
    assert full != half and manifest_problem(half) is None
    h, f = load_file(str(half / "model.safetensors")), load_file(str(full / "model.safetensors"))
    assert h.keys() == f.keys() and all(h[k].dtype == torch.bfloat16 for k in h)
    assert all(torch.equal(h[k], f[k].to(torch.bfloat16)) for k in h)
    ratio = (half / "model.safetensors").stat().st_size / (full / "model.safetensors").stat().st_size
    assert 0.49 < ratio < 0.51
    assert Path(resolve_source(str(tiny_gguf), dtype=torch.bfloat16)) == half  # not the fp32 copy

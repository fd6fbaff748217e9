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

from toolkit.models import embedded_gguf_path, manifest_problem
from toolkit.models.embedded import MANIFEST

REPO = Path(__file__).resolve().parents[1]
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 1, 1024
_OVERRIDES = {"llama.vocab_size": VOCAB, "llama.block_count": LAYERS, "llama.embedding_length": HIDDEN,
              "llama.feed_forward_length": FFN,
              "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
              "llama.rope.dimension_count": HIDDEN // HEADS, "llama.context_length": 512, "general.file_type": 0}


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A small llama GGUF (F32 tensors) carrying the embedded model's tokenizer; returns ``path``."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(embedded_gguf_path())
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.quantization_version"):
            continue
        value = _OVERRIDES.get(name, field.contents())
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = value[:VOCAB]
        elif name == "tokenizer.ggml.merges":
            kept = set(reader.fields["tokenizer.ggml.tokens"].contents()[:VOCAB])
            value = [m for m in value if "".join(m.split(" ")) in kept and all(p in kept for p in m.split(" "))]
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    rng = np.random.default_rng(seed)
    vocab = VOCAB

    def weight(*shape):  # numpy order (out, in); the writer stores GGUF's reversed order
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(vocab, HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (KV_HEADS * head_dim, HIDDEN)),
                            ("attn_v", (KV_HEADS * head_dim, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


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

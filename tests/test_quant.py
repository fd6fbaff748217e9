"""Weight-quantization backends on tiny random models: recipe fields, ``auto`` resolution, torchao formats, exact
weight bytes, errors for combinations without a kernel, quiet loads."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from test_generator import word_tokenizer

from toolkit.errors import ConfigError, ModelLoadError
from toolkit.models import load_model, weight_bytes
from toolkit.quant import BACKENDS, choose_backend
from toolkit.quant.auto import TABLE
from toolkit.quant.packed_fp32 import packed_bytes
from toolkit.recipe import TORCHAO_GROUP_SIZES, ModelSpec, Recipe

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
torchao_installed = pytest.mark.skipif(not __import__("importlib").util.find_spec("torchao"),
                                       reason="torchao is not installed")


def _save(path: Path, model) -> Path:
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """Tiny Llama (hidden 64, MLP 128, vocab 128) as an HF directory: every linear width divides 32 and 64."""
    return _save(tmp_path_factory.mktemp("tiny-quant"), tiny_llama(seed=0))


# ------------------------------------------------------------------------------------------------------ recipe
def test_backend_fields_are_validated_with_the_dotted_name():
    with pytest.raises(ConfigError) as excinfo:
        ModelSpec(backend="onnx").validate("target")
    assert excinfo.value.field == "target.backend" and excinfo.value.allowed == list(BACKENDS)
    with pytest.raises(ConfigError) as excinfo:
        ModelSpec(torchao_int8="w8a16").validate("draft")
    assert excinfo.value.field == "draft.torchao_int8" and excinfo.value.allowed == ["weight_only", "dynamic"]
    with pytest.raises(ConfigError) as excinfo:
        ModelSpec(torchao_group_size=48).validate("draft")
    assert excinfo.value.field == "draft.torchao_group_size" and excinfo.value.allowed == list(TORCHAO_GROUP_SIZES)


def test_backend_round_trips_through_yaml():
    recipe = Recipe(target=ModelSpec(precision="int8", backend="torchao", torchao_int8="weight_only"),
                    draft=ModelSpec(precision="int4", backend="bitsandbytes"))
    again = Recipe.from_yaml(recipe.to_yaml())
    assert again.target.backend == "torchao" and again.target.torchao_int8 == "weight_only"
    assert again.draft.backend == "bitsandbytes"


# ------------------------------------------------------------------------------------------------------ auto
def test_auto_follows_the_measured_table_and_falls_back(monkeypatch):
    import toolkit.quant as quant

    assert choose_backend(ModelSpec(precision="bf16"), CPU, "target") == "none"
    for precision in ("int8", "int4"):
        row = [entry.backend for entry in TABLE[(precision, "cpu")]]
        assert all(entry.evidence and "PLACEHOLDER" not in entry.evidence for entry in TABLE[(precision, "cpu")])
        assert choose_backend(ModelSpec(precision=precision), CPU, "target") == row[0]
        monkeypatch.setattr(quant, "installed", lambda name, first=row[0]: name != first)
        assert choose_backend(ModelSpec(precision=precision), CPU, "target") == row[1]
        monkeypatch.setattr(quant, "installed", lambda name: False)
        with pytest.raises(ModelLoadError, match="target.precision=" + precision):
            choose_backend(ModelSpec(precision=precision), CPU, "target")
        monkeypatch.undo()


def test_auto_skips_a_backend_without_a_kernel_for_the_spec():
    # torchao int4 has no fp16 CPU kernel: auto must fall through to bitsandbytes instead of failing
    spec = ModelSpec(precision="int4", torchao_compute_dtype="fp16")
    assert choose_backend(spec, CPU, "draft") == "bitsandbytes"
    with pytest.raises(ConfigError) as excinfo:
        choose_backend(ModelSpec(precision="int4", backend="torchao", torchao_compute_dtype="fp16"), CPU, "draft")
    assert excinfo.value.field == "draft.torchao_compute_dtype"


# ------------------------------------------------------------------------------------------------------ torchao
def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _relative_error(model, reference, ids):
    with torch.no_grad():
        got = model(ids).logits.float()
        want = reference(ids).logits.float()
    return ((got - want).norm() / want.norm()).item()


@torchao_installed
@pytest.mark.parametrize("fields, inner, max_error", [
    ({"precision": "int8", "torchao_int8": "weight_only"}, "Int8Tensor", 0.02),
    ({"precision": "int8", "torchao_int8": "dynamic"}, "Int8Tensor", 0.05),
    ({"precision": "int4", "torchao_group_size": 32}, "Int4OpaqueTensor", 0.25),
    ({"precision": "int4", "torchao_group_size": 64}, "Int4OpaqueTensor", 0.25),
])
def test_torchao_formats_load_quantize_every_linear_and_count_bytes_exactly(tiny_dir, fields, inner, max_error):
    reference = tiny_llama(seed=0)
    model, _ = load_model(ModelSpec(source=str(tiny_dir), device="cpu", backend="torchao", **fields), "target")
    assert model.toolkit_backend == "torchao"
    linears = _linears(model)
    assert linears and all(type(m.weight).__name__ == inner for m in linears)
    ids = torch.arange(1, 40).view(1, -1)
    error = _relative_error(model, reference, ids)
    assert error < max_error, error
    # exact bytes: packed weights + scales (+ zero points) of every linear, the rest at the compute dtype
    compute = torch.bfloat16 if fields["precision"] == "int4" else torch.float32
    element = torch.tensor([], dtype=compute).element_size()
    linear_ids = {id(m.weight) for m in linears}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in linear_ids) * element
    rest += sum(b.numel() * b.element_size() for b in model.buffers())
    if fields["precision"] == "int8":  # int8 data, fp32 scale and int8 zero point per output row
        packed = sum(m.out_features * m.in_features + m.out_features * (4 + 1) for m in linears)
    else:  # two int4 per byte, bf16 (scale, zero) per group of each row
        g = fields["torchao_group_size"]
        packed = sum(m.out_features * m.in_features // 2 + m.out_features * (m.in_features // g) * 2 * 2
                     for m in linears)
    assert weight_bytes(model) == packed + rest
    assert weight_bytes(model) < weight_bytes(reference) * (0.55 if fields["precision"] == "int4" else 0.4)


@torchao_installed
def test_torchao_greedy_decoding_still_runs_through_the_decoder(tiny_dir):
    import toolkit
    from toolkit.recipe import SpeculationSpec

    recipe = Recipe(target=ModelSpec(source=str(tiny_dir), device="cpu", precision="int8", backend="torchao"),
                    draft=ModelSpec(source=str(tiny_dir), device="cpu", precision="int4", backend="torchao"),
                    spec=SpeculationSpec(drafter="self", num_draft_tokens=3))
    generator = toolkit.build(recipe)
    result = generator.generate("the license", max_new_tokens=10, ignore_eos=True)
    assert len(result.token_ids) == 10 and result.stats.drafted > 0
    plain = toolkit.build(recipe.replace(spec=SpeculationSpec(drafter="none")))
    assert plain.generate("the license", max_new_tokens=10, ignore_eos=True).token_ids == result.token_ids


@torchao_installed
def test_torchao_combinations_without_a_kernel_name_the_field(tmp_path, tiny_dir):
    with pytest.raises(ConfigError) as excinfo:  # the CPU int4 kernel packs groups of 32/64/128 only
        load_model(ModelSpec(source=str(tiny_dir), device="cpu", precision="int4", backend="torchao",
                             torchao_group_size=256), "target")
    assert excinfo.value.field == "target.torchao_group_size" and excinfo.value.allowed == [32, 64, 128]
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # 96 is a multiple of 32, not of 64
    odd = _save(tmp_path / "odd", LlamaForCausalLM(config))
    with pytest.raises(ConfigError) as excinfo:
        load_model(ModelSpec(source=str(odd), device="cpu", precision="int4", backend="torchao",
                             torchao_group_size=64), "draft")
    assert excinfo.value.field == "draft.torchao_group_size" and excinfo.value.allowed == [32]
    if __import__("importlib").util.find_spec("bitsandbytes"):  # auto does not fail: it falls back
        model, _ = load_model(ModelSpec(source=str(odd), device="cpu", precision="int4", torchao_group_size=64))
        assert model.toolkit_backend == "bitsandbytes" and model.toolkit_spec.backend == "bitsandbytes"
    with pytest.raises(ConfigError) as excinfo:
        load_model(ModelSpec(source=str(tiny_dir), device="cpu", precision="int8", backend="torchao",
                             torchao_int8="dynamic", torchao_compute_dtype="fp16"), "target")
    assert excinfo.value.field == "target.torchao_compute_dtype"


def test_missing_torchao_is_a_model_load_error(tiny_dir, monkeypatch):
    import toolkit.quant.torchao as backend

    monkeypatch.setattr(backend, "available", lambda: False)
    with pytest.raises(ModelLoadError, match=r"target.backend=torchao needs torchao"):
        load_model(ModelSpec(source=str(tiny_dir), device="cpu", precision="int8", backend="torchao"), "target")


# ------------------------------------------------------------------------------------------------------ bitsandbytes
def test_bitsandbytes_int8_bytes_are_exact(tiny_dir):
    model, _ = load_model(ModelSpec(source=str(tiny_dir), device="cpu", precision="int8", backend="bitsandbytes"))
    assert model.toolkit_backend == "bitsandbytes"
    int8 = [m for m in model.modules() if type(m).__name__ == "Linear8bitLt"]
    assert int8
    ids = {id(m.weight) for m in int8}
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in ids)
    rest += sum(b.numel() * b.element_size() for b in model.buffers())
    packed = sum(m.out_features * m.in_features + m.out_features * 4 for m in int8)  # int8 + fp32 row scale SCB
    assert weight_bytes(model) == packed + rest + packed_bytes(model)  # + the fp32 LM head's oneDNN copy, if any


# ------------------------------------------------------------------------------------------------------ quiet loads
_QUIET = textwrap.dedent("""
    import sys
    from toolkit_cli.app import configure_logging
    configure_logging()  # as the toolkit command does: WARNING, plus toolkit.quant's kernel line
    from toolkit.models import load_model
    from toolkit.recipe import ModelSpec
    for backend in sys.argv[2:]:
        for _ in range(2):
            load_model(ModelSpec(source=sys.argv[1], device="cpu", precision="int4", backend=backend))
""")


@pytest.mark.system
def test_importing_the_library_changes_no_logging_level():
    """A library sets no logging levels at import (the ``toolkit`` command does, :func:`configure_logging`)."""
    code = ("import logging, toolkit, toolkit.quant, toolkit.models, toolkit.kv, toolkit.speculative_lm; "
            "print(logging.root.level, *sorted(n for n, l in logging.root.manager.loggerDict.items() "
            "if n.split('.')[0] == 'toolkit' and getattr(l, 'level', logging.NOTSET) != logging.NOTSET))")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(logging.WARNING)], done.stdout  # root untouched, no toolkit.* level set


@pytest.mark.slow
@pytest.mark.system
def test_quantized_loads_are_quiet_and_name_the_kernel_once(tiny_dir):
    backends = ["bitsandbytes"] + (["torchao"] if __import__("importlib").util.find_spec("torchao") else [])
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", _QUIET, str(tiny_dir), *backends], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "gemm_4bit_forward" not in output and "kernels-community" not in output.replace(
        "the optional kernels-community GEMM", "")
    assert "Failed to load" not in output and "Enum subclass" not in output and "triton" not in output
    lines = [line for line in output.splitlines() if line.startswith("INFO toolkit.quant:")]
    assert len(lines) == len(backends), output[-3000:]  # once per backend, not once per load
    assert "bitsandbytes NF4 on CPU" in lines[0]
    if "torchao" in backends:
        assert "torchao int4 (group 32) on CPU" in lines[1]


@torchao_installed
def test_eagle_head_loads_on_a_torchao_int4_target(tiny_dir):
    """An int4 target's LM head is an ``Int4OpaqueTensor`` (no row indexing): the head takes the dequantized rows of
    its draft vocabulary, and EAGLE drafting on that target reproduces the target's own greedy output."""
    import toolkit
    from toolkit.distill.eagle_train import build_head
    from toolkit.eagle.checkpoint import load_head, save_head
    from toolkit.recipe import SpeculationSpec

    model, tokenizer = load_model(ModelSpec(source=str(tiny_dir), device="cpu", precision="int4", backend="torchao"),
                                  "target")
    lm = model.get_output_embeddings().weight
    assert type(lm.data if isinstance(lm, torch.nn.Parameter) else lm).__name__ == "Int4OpaqueTensor"
    head = build_head(tiny_llama(seed=0), draft_vocab=64, counts=torch.arange(128, 0, -1).float(), seed=0)
    head_dir = tiny_dir.parent / "int4-head"
    save_head(head, head_dir)
    loaded = load_head(head_dir, model)
    with torch.no_grad():  # the int4 LM head's logits, from the head's rows and from the quantized module
        hidden = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
        want = model.get_output_embeddings()(hidden)[:, loaded.draft_to_target].float()
        got = (hidden.float() @ loaded.lm_head.weight.float().T)
    assert torch.allclose(got, want, rtol=0.02, atol=0.02)
    recipe = Recipe(target=ModelSpec(source=str(tiny_dir), device="cpu", precision="int4", backend="torchao"),
                    draft=ModelSpec(source=str(head_dir), device="cpu", precision="fp32"),
                    spec=SpeculationSpec(drafter="eagle", num_draft_tokens=3))
    generator = toolkit.build(recipe, target=model, tokenizer=tokenizer)
    ar = toolkit.build(Recipe(target=recipe.target, spec=SpeculationSpec(drafter="none")), target=model,
                       tokenizer=tokenizer)
    prompt = "the cat sat on the mat"
    assert generator.generate(prompt, max_new_tokens=16).token_ids == ar.generate(prompt, max_new_tokens=16).token_ids


@torchao_installed
@pytest.mark.parametrize("fields", [{"precision": "int4"}, {"precision": "int8", "torchao_int8": "weight_only"}])
def test_head_aware_calibration_runs_on_torchao_targets(tiny_dir, fields, monkeypatch, tmp_path):
    """The head-aware policy's calibration key hashed weight samples with ``view``, which torchao's quantized
    tensors lack (found by the short search): it now keys quantized models by their formats and plain weights."""
    from toolkit.kv.calibration import load_or_calibrate, model_key

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    model, _ = load_model(ModelSpec(source=str(tiny_dir), device="cpu", backend="torchao", **fields), "target")
    reference, _ = load_model(ModelSpec(source=str(tiny_dir), device="cpu"), "target")
    assert model_key(model) != model_key(reference)
    with torch.inference_mode():
        scores = load_or_calibrate(model, num_tokens=160)  # > local window (64) + sinks: far tokens exist
    c = model.config
    assert scores.shape == (c.num_hidden_layers, c.num_key_value_heads) and float(scores.max()) == pytest.approx(1.0)

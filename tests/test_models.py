"""Model loading: sources, precisions, documented errors."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from test_generator import word_tokenizer

import toolkit
from toolkit.errors import ConfigError, ModelLoadError, TokenizerMismatchError
from toolkit.models import cache_dir, check_same_vocab, load_model, weight_bytes
from toolkit.quant.packed_fp32 import packed_bytes
from toolkit.recipe import PRECISIONS, ModelSpec, Recipe, SpeculationSpec


@pytest.fixture(scope="module")
def local_model_dir(tmp_path_factory):
    """A tiny Llama + word-level tokenizer saved as an HF model directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(seed=0).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------------------ sources
def test_local_directory_loads_at_each_plain_precision(local_model_dir):
    reference = tiny_llama(seed=0)
    ids = torch.arange(10).view(1, -1)
    sizes = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        model, tokenizer = load_model(ModelSpec(source=str(local_model_dir), precision=precision, device="cpu"))
        assert next(model.parameters()).dtype == dtype
        assert not model.training and not any(p.requires_grad for p in model.parameters())
        assert model.toolkit_spec.precision == precision
        assert tokenizer.get_vocab() == word_tokenizer().get_vocab()
        sizes[precision] = weight_bytes(model) - packed_bytes(model)  # an fp32 layer's oneDNN copy: its own test
        if precision != "fp16":  # fp16 matmul on CPU may be unsupported/slow; fp32 and bf16 must run
            with torch.no_grad():
                logits = model(ids).logits.float()
                expected = reference(ids).logits
            tolerance = 1e-5 if precision == "fp32" else 0.05
            torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)
    n_params = sum(p.numel() for p in reference.parameters())
    # parameters at 4 / 2 bytes each, plus small fp32 buffers (rotary inv_freq) that do not scale with precision
    assert 0 <= sizes["fp32"] - 4 * n_params < 1024
    assert 0 <= sizes["bf16"] - 2 * n_params < 1024 and sizes["fp16"] == sizes["bf16"]


@pytest.mark.parametrize("source", ["no-such-org/no-such-model-xyz"])
def test_hub_id_offline_raises_model_load_error(monkeypatch, source):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time by huggingface_hub
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(ModelSpec(source=source, device="cpu"), "target")
    message = str(excinfo.value)
    assert f"target.source={source!r}" in message
    assert "local model directory" in message and "embedded" in message


@pytest.mark.parametrize("source", ["/tmp/toolkit-test/missing/model-dir", "./missing/model", "~/missing-model-xyz",
                                    "a/b/c"])
def test_missing_local_path_is_not_sent_to_the_hub(monkeypatch, source):
    """A source that can only be a path (absolute, ./, ~, several '/') and does not exist: said so, field named."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(ModelLoadError, match=r"^target\.source: local path .* does not exist"):
        load_model(ModelSpec(source=source, device="cpu"), "target")


def test_nonexistent_gguf_path(tmp_path):
    missing = tmp_path / "nope" / "model.Q4_0.gguf"
    with pytest.raises(ModelLoadError, match=r"GGUF file .*model\.Q4_0\.gguf.* does not exist"):
        load_model(ModelSpec(source=str(missing), device="cpu"))


def test_directory_without_config_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(ModelSpec(source=str(tmp_path), device="cpu"))


def test_bad_spec_fields_raise_config_error_before_loading():
    with pytest.raises(ConfigError) as excinfo:
        load_model(ModelSpec(source="/does/not/matter", precision="int2"), "draft")
    assert excinfo.value.field == "draft.precision" and excinfo.value.allowed == list(PRECISIONS)
    with pytest.raises(ConfigError) as excinfo:
        load_model(ModelSpec(source="/does/not/matter", device="npu"), "target")
    assert excinfo.value.field == "target.device" and excinfo.value.allowed == ["auto", "cpu", "cuda"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda_is_a_config_error(local_model_dir):
    with pytest.raises(ConfigError, match="cuda"):
        load_model(ModelSpec(source=str(local_model_dir), device="cuda"))


def test_cache_dir_honours_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path


# ------------------------------------------------------------------------------------------------------ vocab check
def test_check_same_vocab_passes_for_equal_vocabularies():
    check_same_vocab(word_tokenizer(), word_tokenizer(), "a", "b")  # no error


def test_tokenizer_vocab_mismatch_names_both_models():
    with pytest.raises(TokenizerMismatchError) as excinfo:
        check_same_vocab(word_tokenizer(128), word_tokenizer(96), "org/target-model", "org/draft-model")
    message = str(excinfo.value)
    assert "org/target-model" in message and "org/draft-model" in message
    assert "128" in message and "96" in message


def test_tokenizer_mismatch_same_size_different_ids():
    a = word_tokenizer()
    vocab = dict(a.get_vocab())
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = sorted(vocab, key=vocab.get)
    words[3], words[4] = words[4], words[3]  # same strings, two ids swapped
    b = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                                                             unk_token="<unk>")))
    with pytest.raises(TokenizerMismatchError):
        check_same_vocab(a, b, "t", "d")


def test_a_draft_with_another_tokenizer_is_drafted_across_tokenizers(tmp_path, local_model_dir):
    other = tmp_path / "other-draft"
    tiny_llama(seed=1, vocab=96).save_pretrained(other)
    word_tokenizer(96).save_pretrained(other)
    recipe = Recipe(target=ModelSpec(source=str(local_model_dir), device="cpu"),
                    draft=ModelSpec(source=str(other), device="cpu"), spec=SpeculationSpec(drafter="draft_model"))
    generator = toolkit.build(recipe)
    assert generator.draft_tokenizer is not None  # detected: the vocabularies differ
    ar = toolkit.build(recipe.replace(draft=None, spec=SpeculationSpec(drafter="none")))
    out = generator.generate("the license", max_new_tokens=12, ignore_eos=True)
    assert out.token_ids == ar.generate("the license", max_new_tokens=12, ignore_eos=True).token_ids
    with pytest.raises(TokenizerMismatchError):  # the target's own weights cannot have another vocabulary
        toolkit.build(recipe.replace(spec=SpeculationSpec(drafter="self")), draft_model=generator.draft_model)


def test_build_from_local_directories_end_to_end(local_model_dir):
    recipe = Recipe(target=ModelSpec(source=str(local_model_dir), device="cpu"),
                    draft=ModelSpec(source=str(local_model_dir), precision="bf16", device="cpu"),
                    spec=SpeculationSpec(drafter="self", num_draft_tokens=3))
    generator = toolkit.build(recipe)
    assert next(generator.draft_model.parameters()).dtype == torch.bfloat16
    target_bytes = generator.weight_bytes["target"] - packed_bytes(generator.target)  # oneDNN's copy: its own test
    assert abs(generator.weight_bytes["draft"] * 2 - target_bytes) < 1024
    result = generator.generate("the license", max_new_tokens=12, ignore_eos=True)
    assert len(result.token_ids) == 12 and result.stats.drafted > 0

# The slow quantization-quality layer (every backend x precision vs fp32) lives in tests/test_quant_quality.py.

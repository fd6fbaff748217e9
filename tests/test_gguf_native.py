"""``precision: native``: a GGUF file's quantized blocks loaded as they are (codes unchanged, no second rounding).

Layers: the block decoder reproduces the ``gguf`` package's own dequantization exactly (every format with a group-32
affine form); the int4 planes hold the same weights up to the bf16 rounding of the scales; a tiny llama GGUF of
mixed block types loads natively (its Q8_0 embedding in its blocks), its weights equal transformers' dequantized ones
within that rounding (so the names, llama.cpp's Q/K row permutation and the tied head are right) and its logits
follow; bad inputs end in one clear error;
on the embedded model (slow) native weights score like the file itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import VOCAB, random_k_blocks, write_llama_gguf

from toolkit.errors import ConfigError, ModelLoadError
from toolkit.models.gguf_native import TENSORS
from toolkit.quant.block_embedding import BlockEmbedding
from toolkit.quant.gguf_blocks import affine_groups, nibble_planes
from toolkit.quant.int4_linear import (
    GEMM_ROWS,
    PackedInt4Linear,
    int4pack_codes,
    int4pack_readable,
    pack_nibbles,
    prompt_gemm,
    unpack_nibbles,
)
from toolkit.recipe import ModelSpec

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
AFFINE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K]


def _blocks(qtype, rows: int, columns: int, rng) -> np.ndarray:
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return random_k_blocks(rows, columns, qtype, rng)
    return gguf.quants.quantize(rng.standard_normal((rows, columns)).astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", AFFINE, ids=lambda t: t.name)
def test_codes_scales_and_planes_give_the_files_weights_exactly(qtype):
    rng = np.random.default_rng(0)
    raw = _blocks(qtype, 6, 512, rng)
    expected = gguf.quants.dequantize(raw, qtype)
    codes, scale, minimum, bits = affine_groups(raw, qtype, 512)
    assert codes.max() < 2 ** bits and codes.max() >= 2 ** (bits - 1)  # the full code range is used
    groups = codes.astype(np.float32).reshape(6, -1, 32) * scale[..., None] + minimum[..., None]
    np.testing.assert_array_equal(groups.reshape(6, 512), expected)
    plane_codes, plane_scale, plane_zero = nibble_planes(codes, scale, minimum, bits)
    assert plane_codes.max() <= 15 and plane_codes.shape[1] == 512 * ((bits + 3) // 4)
    parts = (plane_codes.astype(np.float32) - 8).reshape(6, -1, 32) * plane_scale[..., None] + plane_zero[..., None]
    np.testing.assert_allclose(parts.reshape(6, -1, 512).sum(1), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    if qtype in (T.Q4_0, T.Q5_0, T.Q8_0):  # zeros kept small: the kernel rounds them to bf16 (0, -8 d, 8 d)
        assert np.abs(plane_zero[:, :16]).max() <= 8 * np.abs(scale).max() * (1 + 1e-6)


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q2_K, T.F16, T.IQ4_NL], ids=lambda t: t.name)
def test_formats_without_a_group32_affine_form_are_not_decoded(qtype):
    assert affine_groups(np.zeros((1, 256), dtype=np.uint8), qtype, 256) is None


@pytest.mark.parametrize("planes", [1, 2])
def test_packed_int4_linear_is_the_planes_weight_up_to_bf16(planes):
    rng = np.random.default_rng(planes)
    out_features, in_features = 48, 96
    codes = rng.integers(0, 16, (out_features, planes * in_features), dtype=np.uint8)
    scale_zero = torch.rand(planes * in_features // 32, out_features, 2, dtype=torch.float32) * 0.1
    bias = torch.randn(out_features)
    layer = PackedInt4Linear(torch.from_numpy(pack_nibbles(codes)), scale_zero, in_features, out_features, bias)
    assert torch.equal(unpack_nibbles(torch.from_numpy(pack_nibbles(codes))), torch.from_numpy(codes).int())
    sz = scale_zero.to(torch.bfloat16).float().repeat_interleave(32, 0)  # (planes * in, out, 2)
    weight = ((torch.from_numpy(codes).float() - 8) * sz[..., 0].T + sz[..., 1].T).reshape(out_features, planes, -1)
    x = torch.randn(3, 5, in_features).to(torch.bfloat16)
    expected = x.float() @ weight.sum(1).T + bias.to(torch.bfloat16).float()
    got = layer(x)
    assert got.shape == (3, 5, out_features) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    with pytest.raises(ValueError, match="groups of 32"):
        PackedInt4Linear(torch.from_numpy(pack_nibbles(codes)), scale_zero, in_features + 1, out_features)


@pytest.mark.parametrize("out_features", [16, 48, 64, 80, 192])
def test_int4pack_codes_reads_back_atens_packing(out_features):
    """Full and partial row blocks of ATen's CPU layout, whatever this CPU's vector width."""
    codes = torch.randint(0, 16, (out_features, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(int4pack_codes(packed, out_features).to(torch.int32), codes)
    assert int4pack_readable()


@pytest.mark.parametrize("planes", [1, 2])
def test_prompt_forwards_run_the_dequantized_weight(planes):
    """From GEMM_ROWS rows on, a forward is one bf16 GEMM by the planes' summed weight; it agrees with the int4
    kernel's (fp32 weights) to the bf16 rounding of the weights and of the output."""
    rng = np.random.default_rng(planes)
    out_features, in_features = 80, 64
    codes = rng.integers(0, 16, (out_features, planes * in_features), dtype=np.uint8)
    scale_zero = torch.rand(planes * in_features // 32, out_features, 2) * 0.1
    layer = PackedInt4Linear(torch.from_numpy(pack_nibbles(codes)), scale_zero, in_features, out_features)
    sz = scale_zero.to(torch.bfloat16).float().repeat_interleave(32, 0)
    weight = ((torch.from_numpy(codes).float() - 8) * sz[..., 0].T + sz[..., 1].T).view(out_features, planes, -1)
    assert torch.equal(layer.dense_weight(), weight.sum(1).to(torch.bfloat16))
    x = torch.randn(GEMM_ROWS, in_features).to(torch.bfloat16)
    assert torch.equal(layer(x), prompt_gemm(x, layer.dense_weight()))
    kernel = layer(x[: GEMM_ROWS - 1])  # one row fewer: the int4 kernel
    torch.testing.assert_close(layer(x)[:-1].float(), kernel.float(), rtol=0, atol=2e-2 * kernel.abs().max().item())


def test_prompt_gemm_in_fp32_agrees_with_bf16_up_to_summation_order():
    """Where the CPU has no bf16 arithmetic the prompt GEMM runs in fp32: the products of bf16 numbers are exact there,
    so both forms round the same sums (to within one bf16 ulp of the output: their summation orders differ), and
    the fp32 form is the exact fp64 product rounded once."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 96, generator=gen).to(torch.bfloat16)
    weight = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    exact = x.double() @ weight.double().T
    fp32 = prompt_gemm(x, weight, native=False)
    assert fp32.dtype == torch.bfloat16 and fp32.shape == (300, 40)
    ulp = exact.abs().float() * 2.0 ** -7 + 1e-6
    assert ((fp32.double() - exact).abs() <= ulp / 2 + 1e-5).all()
    bf16 = prompt_gemm(x, weight, native=True)
    assert ((bf16.double() - fp32.double()).abs() <= ulp).all()


MIXED = {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q5_0, "attn_output": T.Q8_0, "ffn_gate": T.Q4_K,
         "ffn_up": T.Q5_K, "ffn_down": T.Q6_K, "token_embd": T.Q8_0}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A tiny llama GGUF with one block type per tensor kind, its native model and its dequantized fp32 model."""
    from transformers import AutoModelForCausalLM

    from toolkit.models import load_model
    from toolkit.models.embedded import resolve_source
    from toolkit.models.gguf_native import resolve_native

    root = tmp_path_factory.mktemp("native")
    path = write_llama_gguf(root / "mixed.gguf", types=MIXED, hidden=256, ffn=512, heads=4, kv_heads=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOOLKIT_CACHE_DIR", str(root / "cache"))
        model, _ = load_model(ModelSpec(source=str(path), precision="native", device="cpu"))
        directory = resolve_native(str(path))
        reference = AutoModelForCausalLM.from_pretrained(resolve_source(str(path)), dtype=torch.float32).eval()
    return model, reference, directory


def test_native_model_runs_the_files_codes_and_lists_what_it_dequantized(mixed):
    model, _, _ = mixed
    report = model.toolkit_native
    layer = model.model.layers[0]
    for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, model.lm_head):
        assert isinstance(module, PackedInt4Linear)
    assert [layer.self_attn.v_proj.planes, layer.self_attn.o_proj.planes, model.lm_head.planes] == [2, 2, 2]
    assert report["tied_head"] and report["native"]["lm_head.weight"]["gguf_type"] == "Q8_0"
    assert report["dequantized"] == {"model.layers.0.mlp.down_proj.weight": {"gguf_type": "Q6_K", "kept_as": "bf16"}}
    assert isinstance(layer.mlp.down_proj, torch.nn.Linear) and layer.mlp.down_proj.weight.dtype == torch.bfloat16
    assert not model.config.tie_word_embeddings
    embedding = model.get_input_embeddings()  # Q8_0: its blocks as they are (tests/test_block_embedding.py)
    assert isinstance(embedding, BlockEmbedding) and (embedding.num_embeddings, embedding.embedding_dim) == (VOCAB, 256)
    assert report["embedding"] == {"name": "model.embed_tokens.weight", "gguf_type": "Q8_0", "kept_as": "blocks",
                                   "bytes": VOCAB * 256 + VOCAB * 256 // 32 * 2}


def test_native_weights_equal_the_dequantized_file_up_to_bf16_scales(mixed):
    """Names, Q/K row permutation, planes and the tied head: every native weight is transformers' dequantized one
    within the bf16 rounding of its group's scale and zero (a wrong row order or plane is off by whole steps)."""
    from safetensors.torch import load_file

    model, reference, directory = mixed
    stored = load_file(f"{directory}/{TENSORS}")
    expected = dict(reference.named_parameters(remove_duplicate=False))
    for name, info in model.toolkit_native["native"].items():
        codes = unpack_nibbles(stored[f"{name}.nibbles"]).float()
        sz = stored[f"{name}.scale_and_zero"].float().repeat_interleave(32, 0)  # (planes * in, out, 2)
        weight = ((codes - 8) * sz[..., 0].T + sz[..., 1].T).reshape(info["out_features"], -1, info["in_features"])
        bound = ((codes - 8).abs() * sz[..., 0].T.abs() + sz[..., 1].T.abs()).reshape(weight.shape).sum(1) * 2 ** -8
        error = (weight.sum(1) - expected[name]).abs()
        assert (error <= bound + 1e-7).all(), f"{name}: off by {(error - bound).max():.3g} beyond bf16 rounding"


def test_native_logits_follow_the_dequantized_file(mixed):
    model, reference, _ = mixed
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits.float(), reference(ids).logits
    correlation = torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1]
    assert correlation > 0.99, correlation
    assert (got - want).abs().max() < 0.5 * want.std()


def test_native_needs_a_gguf_source():
    with pytest.raises(ConfigError, match=r"target\.precision.*not a GGUF file"):
        ModelSpec(source="/some/hf-directory", precision="native").validate("target")


def test_native_of_a_truncated_file_is_one_clear_error(tmp_path, monkeypatch):
    from toolkit.models import load_model

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "full.gguf", types={"attn_q": T.Q4_0})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"target\.source: .*cut\.gguf is not a readable GGUF file"):
        load_model(ModelSpec(source=str(cut), precision="native", device="cpu"), "target")
    assert not list((tmp_path / "cache").glob("*native*"))  # nothing half-written is left


def test_native_of_a_file_that_is_no_causal_lm_is_one_clear_error(tmp_path, monkeypatch):
    from toolkit.models import load_model

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(str(tmp_path / "enc.gguf"), "bert")
    writer.add_uint32("bert.block_count", 1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"target\.source: converting .*enc\.gguf failed"):
        load_model(ModelSpec(source=str(tmp_path / "enc.gguf"), precision="native", device="cpu"), "target")
    assert not [p for p in (tmp_path / "cache").glob("*") if not p.name.endswith(".lock")]

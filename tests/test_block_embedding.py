"""A GGUF input embedding kept in its own blocks (``toolkit/quant/block_embedding.py``, ``precision: native``).

Every looked-up row equals the ``gguf`` package's dequantization of that row cast to bf16 — the bf16 table the native
conversion kept before — for every block format, on raw blocks and through tiny GGUF files; its bytes are the codes
and scales exactly (a plain block format: the file's own bytes) and the reports count them; a native model's greedy
text with it is the text with the bf16 table; a format without a block form (Q6_K) keeps the bf16 table and says so;
EAGLE heads share it and the EAGLE trainer's initial head copies its rows; on the embedded model (heavy) the native
weights shrink by the table's bf16 bytes less its blocks' bytes.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf_files import VOCAB, random_k_blocks, write_llama_gguf
from test_decoder import hf_greedy

from toolkit.models.sizes import bytes_read_per_token, weight_bytes
from toolkit.quant.block_embedding import BlockEmbedding, block_tensors, embedding_table, layout
from toolkit.quant.gguf_blocks import block_fields
from toolkit.recipe import ModelSpec

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
AFFINE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K]
HIDDEN = 256  # a whole K-quant super-block per row


def _raw(qtype, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return random_k_blocks(rows, columns, qtype, rng)
    return gguf.quants.quantize(rng.standard_normal((rows, columns)).astype(np.float32), qtype)


def _bf16_table(raw: np.ndarray, qtype, rows: int, columns: int) -> torch.Tensor:
    """The gguf package's dequantization in fp32, cast to bf16: the table the native conversion kept before."""
    weights = gguf.quants.dequantize(np.asarray(raw), qtype).astype(np.float32)
    return torch.from_numpy(weights).to(torch.bfloat16).reshape(rows, columns)


def _module(raw: np.ndarray, qtype, columns: int, chunks: int = 1) -> BlockEmbedding:
    parts = [block_tensors(block_fields(part, qtype, columns)) for part in np.array_split(raw, chunks)]
    return BlockEmbedding({k: torch.from_numpy(np.concatenate([p[k] for p in parts])) for k in parts[0]},
                          qtype.name)


@pytest.mark.parametrize("qtype", AFFINE, ids=lambda t: t.name)
def test_every_row_is_the_gguf_packages_dequantization_at_bf16(qtype):
    rows, columns = 96, 512
    raw = _raw(qtype, rows, columns)
    expected = _bf16_table(raw, qtype, rows, columns)
    module = _module(raw, qtype, columns, chunks=3)  # rows read in chunks, as the conversion reads a file
    ids = torch.randperm(rows, generator=torch.Generator().manual_seed(0)).reshape(4, 24)
    rows_out = module(ids)
    assert rows_out.shape == (4, 24, columns) and rows_out.dtype == torch.bfloat16
    assert torch.equal(rows_out, expected[ids])
    assert torch.equal(module.dequantized(), expected) and torch.equal(embedding_table(module), expected)
    bits = block_fields(raw[:1], qtype, columns).format.bits
    k_quant = qtype in (T.Q4_K, T.Q5_K)
    codes = rows * columns * bits // 8
    scales = rows * (columns // (256 if k_quant else 32)) * 2 * (1 if qtype in (T.Q4_0, T.Q5_0, T.Q8_0) else 2)
    sub_scales = rows * (columns // 32) * 2 if k_quant else 0
    assert module.nbytes == codes + scales + sub_scales == sum(t.nbytes for t in module.buffers())
    if not k_quant:  # a plain block of 32 holds exactly the file's bytes
        assert module.nbytes == raw.nbytes


def test_a_cast_of_the_module_leaves_its_fields_unrounded():
    raw = _raw(T.Q4_1, 8, 64)
    module = _module(raw, T.Q4_1, 64)
    before = module(torch.arange(8))
    module.to(torch.float32).to(torch.bfloat16)  # fields are int16 bit patterns: nothing to cast
    assert torch.equal(module(torch.arange(8)), before)


def test_bad_tensors_are_one_clear_error():
    fields = {k: torch.from_numpy(v) for k, v in block_tensors(block_fields(_raw(T.Q8_0, 4, 64), T.Q8_0, 64)).items()}
    with pytest.raises(ValueError, match=r"Q6_K has no block form for an embedding \(Q4_0, Q4_1"):
        layout("Q6_K", 4, 256)
    with pytest.raises(ValueError, match=r"a Q4_0 block embedding of 4 x 64 holds .*got"):
        BlockEmbedding(fields, "Q4_0")  # Q8_0's one byte a code is not Q4_0's two codes a byte
    with pytest.raises(ValueError, match=r"needs its \(rows, blocks\) fp16 scales 'd'"):
        BlockEmbedding({"codes": fields["codes"]}, "Q8_0")


def _native(tmp_path_factory, embedding_type, name: str):
    """``(path, native model)`` of a tiny llama GGUF whose ``token_embd`` is ``embedding_type`` (tied LM head)."""
    from toolkit.models import load_model

    root = tmp_path_factory.mktemp(name)
    path = write_llama_gguf(root / f"{name}.gguf", types={"token_embd": embedding_type, "attn_q": T.Q4_0,
                                                           "ffn_up": T.Q8_0}, hidden=HIDDEN, ffn=512)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOOLKIT_CACHE_DIR", str(root / "cache"))
        model, _ = load_model(ModelSpec(source=str(path), precision="native", device="cpu"))
    return path, model


@pytest.fixture(scope="module")
def natives(tmp_path_factory):
    return {qtype: _native(tmp_path_factory, qtype, qtype.name) for qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K)}


def _file_table(path, name: str = "token_embd.weight") -> torch.Tensor:
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return _bf16_table(tensor.data, tensor.tensor_type, int(tensor.shape[1]), int(tensor.shape[0]))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_a_native_files_embedding_keeps_its_blocks_and_every_row_is_the_files(natives, qtype):
    path, model = natives[qtype]
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, BlockEmbedding) and embedding.gguf_type == qtype.name
    assert torch.equal(embedding(torch.arange(VOCAB).view(4, -1)).view(VOCAB, HIDDEN), _file_table(path))
    assert model.toolkit_native["embedding"] == {"name": "model.embed_tokens.weight", "gguf_type": qtype.name,
                                                 "kept_as": "blocks", "bytes": embedding.nbytes}
    assert model.toolkit_native["native"]["lm_head.weight"]["gguf_type"] == qtype.name  # the head: its own planes


def test_weight_reports_count_the_codes_and_scales_exactly(natives):
    _, model = natives[T.Q8_0]
    embedding = model.get_input_embeddings()
    assert embedding.nbytes == VOCAB * HIDDEN + VOCAB * HIDDEN // 32 * 2  # int8 codes + an fp16 scale per 32
    others = sum(t.nbytes for name, t in list(model.named_parameters()) + list(model.named_buffers())
                 if not name.startswith("model.embed_tokens."))
    assert weight_bytes(model) == others + embedding.nbytes
    assert bytes_read_per_token(model) == others + embedding.nbytes // VOCAB  # a step reads one row of each


def test_greedy_text_equals_the_bf16_tables(natives):
    _, model = natives[T.Q4_K]
    table = copy.deepcopy(model)
    table.set_input_embeddings(torch.nn.Embedding.from_pretrained(embedding_table(model.get_input_embeddings())))
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    assert hf_greedy(model, prompt, 16) == hf_greedy(table, prompt, 16)


def test_a_format_without_a_block_form_keeps_the_bf16_table(tmp_path_factory):
    path, model = _native(tmp_path_factory, T.Q6_K, "q6k")
    embedding = model.get_input_embeddings()
    assert type(embedding) is torch.nn.Embedding and embedding.weight.dtype == torch.bfloat16
    assert torch.equal(embedding.weight, _file_table(path))
    assert model.toolkit_native["embedding"] == {"name": "model.embed_tokens.weight", "gguf_type": "Q6_K",
                                                 "kept_as": "bf16", "bytes": VOCAB * HIDDEN * 2}


def test_eagle_heads_share_the_block_embedding_and_the_trainer_copies_its_rows(natives, tmp_path):
    from toolkit.distill.eagle_init import build_head
    from toolkit.eagle.checkpoint import dense_weight, load_head, save_head

    _, target = natives[T.Q4_1]
    embedding = target.get_input_embeddings()
    counts = torch.arange(VOCAB, dtype=torch.float64)
    built = build_head(target, 64, counts, seed=0)
    assert torch.equal(built.embed_tokens.weight, embedding.dequantized().float())
    lm = dense_weight(target.get_output_embeddings()).float()
    assert torch.equal(built.lm_head.weight, lm[built.draft_to_target])
    save_head(built, tmp_path / "head")  # the published layout: no embedding
    head = load_head(tmp_path / "head", target)
    assert head.embed_tokens is embedding  # shared: no (vocab, H) table copied
    tokens = torch.tensor([[5, 900, 17]])
    assert torch.equal(head.embed(tokens), embedding(tokens).to(head.fc.weight.dtype))


@pytest.mark.slow
@pytest.mark.heavy
def test_the_embedded_models_native_weights_shrink_by_the_tables_bytes_and_its_text_stays():
    """SmolLM2-135M Q4_1 (token_embd Q8_0, 49152 x 576): 30,081,024 bytes of blocks for 56,623,104 at bf16."""
    from toolkit.models import load_model

    model, tokenizer = load_model(ModelSpec(source="embedded", precision="native", device="cpu"))
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, BlockEmbedding) and embedding.gguf_type == "Q8_0"
    assert embedding.nbytes == 49152 * 576 + 49152 * 18 * 2 == 30_081_024
    blocks = weight_bytes(model)
    table = copy.deepcopy(model)
    table.set_input_embeddings(torch.nn.Embedding.from_pretrained(embedding_table(embedding)))
    assert weight_bytes(table) - blocks == 49152 * 576 * 2 - 30_081_024
    prompt = tokenizer("The three laws of thermodynamics are", return_tensors="pt").input_ids
    assert hf_greedy(model, prompt, 24) == hf_greedy(table, prompt, 24)

"""fp32 linears on oneDNN's prepacked GEMM (toolkit/quant/packed_fp32.py): the same products as nn.Linear up to fp32
summation order, eager and compiled at every width; only plain fp32 CPU linears change, where $TOOLKIT_FP32_KERNEL
says so; copies, pickles and in-place weight changes keep the packed copy right; weight bytes count the copy; the
path line and the cost curve's key say so; a speculative recipe on it (eager) stays token-identical to AR with drafts
accepted."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import tiny_llama
from test_models import local_model_dir  # noqa: F401 (the fixture: a tiny Llama as an HF directory)

from toolkit.engine.cost import cost_key
from toolkit.engine.forward import forward_for
from toolkit.errors import ConfigError
from toolkit.models.sizes import bytes_read_per_token, weight_bytes
from toolkit.quant import packed_fp32
from toolkit.quant.packed_fp32 import PackedFp32Linear, packed_bytes, use_packed_fp32
from toolkit.recipe import Recipe, SpeculationSpec
from toolkit.session import plan

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")


@pytest.fixture
def onednn(monkeypatch):
    """Pack on this machine whatever its CPU."""
    monkeypatch.setenv("TOOLKIT_FP32_KERNEL", "onednn")


def _pair(bias: bool) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 80, bias=bias).requires_grad_(False)
    layer = copy.deepcopy(plain)
    layer.__class__ = PackedFp32Linear
    layer.pack()
    return plain, layer


@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_nn_linear_up_to_rounding_eager_and_compiled(bias):
    plain, layer = _pair(bias)
    compiled = torch.compile(layer, dynamic=True)
    for shape in ((1, 96), (1, 1, 96), (1, 3, 96), (2, 5, 96), (9, 96)):
        x = torch.randn(shape)
        want = plain(x)
        for got in (layer(x), compiled(x)):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    x = torch.randn(3, 96, requires_grad=True)  # gradients: nn.Linear's own forward
    assert torch.equal(layer(x), plain(x))
    x = torch.randn(1, packed_fp32.PACKED_MAX_ROWS + 1, 96)  # a long prompt: MKL's sgemm, nn.Linear's own forward
    assert torch.equal(layer(x), plain(x))


def test_copies_pickles_and_in_place_changes_keep_the_packed_copy_right():
    plain, layer = _pair(True)
    x = torch.randn(4, 96)
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):  # the test's own object, in memory
        assert type(other) is PackedFp32Linear and other.packed is not layer.packed
        torch.testing.assert_close(other(x), plain(x), atol=1e-5, rtol=1e-5)
    assert layer.state_dict().keys() == plain.state_dict().keys()  # the copy: no state dict entry, no parameter
    assert [n for n, _ in layer.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert isinstance(layer.packed, torch.nn.Parameter) and not layer.packed.requires_grad  # guards: frozen
    layer.weight.mul_(2)  # an in-place change: the next eager call re-packs
    torch.testing.assert_close(layer(x), x @ (2 * plain.weight).T + plain.bias, atol=1e-5, rtol=1e-5)


def test_only_plain_fp32_cpu_linears_change_where_the_setting_says(monkeypatch):
    model = tiny_llama(seed=0)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    monkeypatch.setenv("TOOLKIT_FP32_KERNEL", "mkl")
    assert use_packed_fp32(model) == 0
    monkeypatch.setenv("TOOLKIT_FP32_KERNEL", "auto")
    monkeypatch.setattr(packed_fp32, "cpu_vendor", lambda: "GenuineIntel")  # MKL's own CPUs: left to MKL
    assert use_packed_fp32(model) == 0
    monkeypatch.setattr(packed_fp32, "cpu_vendor", lambda: "AuthenticAMD")
    assert use_packed_fp32(tiny_llama(seed=0).to(torch.bfloat16)) == 0  # bf16: not this kernel
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_packed_fp32(model) == linears > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert use_packed_fp32(model) == 0  # already done
    monkeypatch.setenv("TOOLKIT_FP32_KERNEL", "blas")
    with pytest.raises(ConfigError, match=r"TOOLKIT_FP32_KERNEL: .*allowed: auto, onednn, mkl"):
        use_packed_fp32(tiny_llama(seed=0))


def test_weight_bytes_count_the_packed_copy_and_a_step_reads_one_of_the_two(onednn):
    plain, model = tiny_llama(seed=0), tiny_llama(seed=0)
    use_packed_fp32(model)
    linear_bytes = sum(4 * m.weight.numel() for m in model.modules() if isinstance(m, PackedFp32Linear))
    assert linear_bytes <= packed_bytes(model) <= 1.25 * linear_bytes  # oneDNN's blocks pad narrow layers
    assert weight_bytes(model) == weight_bytes(plain) + packed_bytes(model)
    assert bytes_read_per_token(model) == bytes_read_per_token(plain)


def test_the_path_line_and_the_cost_key_say_so(onednn):
    recipe = Recipe.from_dict({"name": "fp32", "target": {"device": "cpu"}, "draft": None, "compile": "on",
                               "spec": {"drafter": "lookup", "num_draft_tokens": 4}})
    plain, model = tiny_llama(seed=0), tiny_llama(seed=0)
    use_packed_fp32(model)
    assert cost_key(model) != cost_key(plain)
    mib = packed_bytes(model) / 2**20
    for mode in ("on", "off"):
        chosen = recipe.replace(compile=mode)
        forward, why = forward_for(chosen, model, plan(chosen))
        assert forward.compiled is (mode == "on")
        assert f"fp32 linears on {packed_fp32.KERNEL} (+{mib:.0f} MiB)" in why
        assert packed_fp32.KERNEL not in forward_for(chosen, plain, plan(chosen))[1]


def test_a_speculative_recipe_on_packed_weights_equals_ar_with_drafts_accepted(onednn, local_model_dir):
    # eager: compiled graphs calling the packed op compile cold in every test run (~20-30 s, nothing shared with the
    # suite's MKL graphs); the op inside a compiled graph is the first test's
    import toolkit

    target = {"source": str(local_model_dir), "device": "cpu"}
    recipe = Recipe.from_dict({"name": "fp32", "target": target, "draft": None, "compile": "off",
                               "spec": {"drafter": "lookup", "num_draft_tokens": 4}})
    lm = toolkit.build(recipe)
    assert packed_fp32.uses_packed_fp32(lm.target)
    ar = toolkit.build(recipe.replace(spec=SpeculationSpec(drafter="none")), target=lm.target, tokenizer=lm.tokenizer)
    prompt = "the license the license the license the license the"
    got = lm.generate(prompt, max_new_tokens=24, ignore_eos=True)
    assert got.token_ids == ar.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids
    assert got.stats.accepted > 0 and got.stats.tokens_per_round > 1

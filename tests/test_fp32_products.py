"""bf16 layers on a CPU without BF16 instructions (toolkit/quant/fp32_products.py): forwards of 8+ rows multiply in
fp32 and agree with PyTorch's bf16 kernel up to summation order; fewer rows run that kernel itself; the swap touches
only plain bf16 linears, only where the CPU lacks BF16 instructions, and the path line and the cost curve's key say
so."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from toolkit.engine.cost import cost_key
from toolkit.engine.forward import forward_for
from toolkit.quant import fp32_products
from toolkit.quant.fp32_products import FP32_PRODUCT_ROWS, Fp32ProductLinear, use_fp32_products
from toolkit.recipe import Recipe
from toolkit.session import plan


@pytest.fixture
def software_bf16(monkeypatch):
    """This CPU seen as one without BF16 instructions (whatever it has)."""
    monkeypatch.setattr(fp32_products, "native_bf16", lambda: False)


def test_rows_past_the_threshold_multiply_in_fp32_and_agree_with_the_bf16_kernel():
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 64, bias=True).to(torch.bfloat16)
    layer = torch.nn.Linear(96, 64, bias=True).to(torch.bfloat16)
    layer.load_state_dict(plain.state_dict())
    layer.__class__ = Fp32ProductLinear
    for rows in (1, FP32_PRODUCT_ROWS - 1):  # fewer rows: the very same kernel
        x = torch.randn(1, rows, 96).to(torch.bfloat16)
        assert torch.equal(layer(x), plain(x))
    x = torch.randn(2, FP32_PRODUCT_ROWS, 96).to(torch.bfloat16)  # 2 x 8 rows: fp32 products rounded to bf16
    wide = (x.float() @ plain.weight.float().T).to(torch.bfloat16) + plain.bias
    assert torch.equal(layer(x), wide) and layer(x).shape == (2, FP32_PRODUCT_ROWS, 64)
    close = (layer(x).float() - plain(x).float()).abs() <= 2 ** -7 * plain(x).float().abs() + 1e-2
    assert close.all()  # the bf16 kernel's result, up to summation order and one bf16 rounding
    assert layer.state_dict().keys() == plain.state_dict().keys()


def test_only_plain_bf16_linears_change_and_only_without_bf16_instructions(monkeypatch):
    monkeypatch.setattr(fp32_products, "native_bf16", lambda: True)
    model = tiny_llama(seed=0).to(torch.bfloat16)
    assert use_fp32_products(model) == 0 and not any(isinstance(m, Fp32ProductLinear) for m in model.modules())
    monkeypatch.setattr(fp32_products, "native_bf16", lambda: False)
    assert use_fp32_products(tiny_llama(seed=0)) == 0  # fp32 weights: nothing to widen
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_fp32_products(model) == linears > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert use_fp32_products(model) == 0  # already done


def test_a_prompt_through_fp32_products_gives_the_bf16_kernels_logits(software_bf16):
    model, plain = tiny_llama(seed=0).to(torch.bfloat16), tiny_llama(seed=0).to(torch.bfloat16)
    use_fp32_products(model)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = model(ids).logits.float(), plain(ids).logits.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_the_path_line_and_the_cost_key_say_so(software_bf16):
    recipe = Recipe.from_dict({"name": "bf16", "target": {"device": "cpu"}, "draft": None, "compile": "on",
                               "spec": {"drafter": "lookup", "num_draft_tokens": 4}})
    plain = tiny_llama(seed=0).to(torch.bfloat16)
    model = tiny_llama(seed=0).to(torch.bfloat16)
    use_fp32_products(model)
    assert cost_key(model) != cost_key(plain)
    for mode in ("on", "off"):
        chosen = recipe.replace(compile=mode)
        forward, why = forward_for(chosen, model, plan(chosen))
        assert forward.compiled is (mode == "on")
        assert f"bf16 forwards of {FP32_PRODUCT_ROWS}+ rows multiply in fp32" in why
        assert "multiply in fp32" not in forward_for(chosen, plain, plan(chosen))[1]

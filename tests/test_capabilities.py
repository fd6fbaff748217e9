"""What a recipe can do on its models (toolkit/engine/capabilities.py): decided once at build time and read by the
forward choice, batching, the draft network's engine and the tree check, each answer ``None`` or the reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import perturbed_copy, tiny_llama

import toolkit
from toolkit.engine.capabilities import capabilities
from toolkit.errors import ConfigError
from toolkit.recipe import Recipe
from toolkit.session import plan


def recipe(**sections) -> Recipe:
    base = {"name": "caps", "target": {"device": "cpu"}, "draft": None, "compile": "on",
            "spec": {"drafter": "lookup", "num_draft_tokens": 4}, "generation": {"max_new_tokens": 8}}
    return Recipe.from_dict(base | sections)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=0)
    chunked = tiny_llama(seed=0)
    chunked.config.layer_types = ["chunked_attention", "full_attention"]  # layers the static cache does not hold
    return target, chunked, perturbed_copy(target, scale=0.05)


def test_a_plain_recipe_can_do_everything(models):
    target = models[0]
    caps = capabilities(plan(recipe()), target)
    assert (caps.static, caps.compile, caps.batch, caps.tree, caps.draft_compile) == (None,) * 5
    assert caps.summary() == "static engine: yes; compiled: yes; batches: yes"


def test_each_reason_names_what_stops_it(models):
    target, chunked, draft = models
    caps = capabilities(plan(recipe()), chunked)
    assert "chunked_attention" in caps.static
    assert caps.compile.startswith("compile: on, but the static cache does not hold") and "chunked" in caps.compile
    assert caps.batch.startswith("the static cache does not hold") and caps.tree is None  # chains asked
    auto = capabilities(plan(recipe(compile="auto")), target)  # fp32 weights on CPU: compiling pays (~1.3x)
    assert auto.static is None and auto.compile is None and auto.batch is None
    off = capabilities(plan(recipe(compile="off")), target)
    assert off.compile == "compile: off" and "static engine: yes; compiled: no (compile: off)" in off.summary()
    drafted = recipe(draft={"device": "cpu"}, spec={"drafter": "draft_model", "num_draft_tokens": 3}, compile="off")
    caps = capabilities(plan(drafted), target, draft)
    assert caps.draft_compile == "compile: off" and caps.batch is None
    on = capabilities(plan(dataclasses.replace(drafted, compile="on")), chunked, draft)  # the draft's own facts
    assert on.compile.startswith("compile: on, but the static cache") and on.draft_compile is None
    trees = recipe(spec={"drafter": "suffix", "tree": True})
    assert capabilities(plan(trees), target).batch == "token trees decode one sequence at a time"
    assert "token trees run on the static cache" in capabilities(plan(trees), chunked).tree


def test_build_refuses_trees_the_static_cache_cannot_hold_and_logs_the_record(models, caplog):
    target, chunked, _ = models
    with pytest.raises(ConfigError) as info:
        toolkit.build(recipe(spec={"drafter": "suffix", "tree": True}), target=chunked, tokenizer=None)
    assert info.value.field == "spec.tree" and "chunked_attention" in str(info.value)
    with caplog.at_level("INFO", logger="toolkit"):
        lm = toolkit.build(recipe(compile="off"), target=target, tokenizer=None)
    assert "recipe caps: static engine: yes; compiled: no (compile: off); batches: yes" in caplog.text
    assert lm.batchable and not lm.engine.compiled and lm.engine_note == "eager (compile: off)"
    assert not toolkit.build(recipe(), target=chunked, tokenizer=None).batchable


def test_torchao_w8a8_weights_on_cpu_run_eager_whatever_compile_says():
    """Inductor's CPU lowering of torchao's int8 weights with dynamic int8 activations drifted from eager (the
    embedded model's greedy text broke down from its second token, under our compiled engine and HF's static
    compiled AR alike): such a target runs eager with the reason, and `auto` does not count it among the weights
    where compiling pays (so `--compare` drops HF's compiled AR). Weight-only int8 compiled exactly: untouched."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    from toolkit.engine.capabilities import compile_breaks
    from toolkit.engine.forward import compile_pays

    weight_only, w8a8 = tiny_llama(seed=0), tiny_llama(seed=0)
    quantize_(weight_only, Int8WeightOnlyConfig())
    quantize_(w8a8, Int8DynamicActivationInt8WeightConfig())
    assert compile_breaks(weight_only) is None and compile_pays(weight_only)
    assert "dynamic int8 activations on CPU" in compile_breaks(w8a8) and not compile_pays(w8a8)
    for mode in ("on", "auto", "max"):
        why = capabilities(plan(recipe(compile=mode)), w8a8).compile
        assert why.startswith(f"compile: {mode}, but torchao int8 weights with dynamic int8 activations"), why
        assert capabilities(plan(recipe(compile=mode)), weight_only).compile is None


def bnb_model(tmp_path, seed: int = 0):
    """A tiny llama with bitsandbytes' NF4 weights on the CPU (transformers' loader)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama(seed=seed).save_pretrained(tmp_path / f"bnb-{seed}")
    return AutoModelForCausalLM.from_pretrained(tmp_path / f"bnb-{seed}", device_map="cpu",
                                                quantization_config=BitsAndBytesConfig(load_in_4bit=True))


def test_auto_compiles_every_cpu_weight_format_but_bitsandbytes(tmp_path):
    """compile: auto on CPU compiles fp32 / bf16 / fp16 and torchao / native weights (measured to pay), not
    bitsandbytes' (opaque kernels) nor W8A8 (compiles wrongly), each with its reason."""
    from toolkit.engine.forward import compile_pays

    pytest.importorskip("bitsandbytes")
    assert compile_pays(tiny_llama()) and compile_pays(tiny_llama().to(torch.bfloat16))
    nf4 = bnb_model(tmp_path)
    assert not compile_pays(nf4)
    why = capabilities(plan(recipe(compile="auto")), nf4).compile
    assert why.startswith("compile: auto;") and "bitsandbytes' kernels" in why
    assert capabilities(plan(recipe(compile="on")), nf4).compile is None  # asked for: compiled anyway


def test_a_quantized_draft_compiles_beside_a_target_that_does_not(models, monkeypatch):
    """compile: auto decides for each network on its own weights: a target whose weights gain nothing from compiling
    runs eager while a torchao-quantized draft beside it compiles on its own static cache (before, the draft
    followed the target and ran eager too: the shipped `long` recipe's int4 drafting took 82 ms a round eager
    against 47 compiled on a Xeon, its fp32 target then eager). warm_up compiles the draft's graphs alone; greedy
    output is the target's, drafts accepted."""
    from test_decoder import hf_greedy
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from toolkit.engine.forward import TargetForward

    target, _, draft = models
    draft = perturbed_copy(draft, scale=0.0)
    quantize_(draft, Int8WeightOnlyConfig())  # torchao weights: compiling pays (compile_pays)
    drafted = recipe(draft={"device": "cpu"}, spec={"drafter": "draft_model", "num_draft_tokens": 3},
                     compile="auto", generation={"max_new_tokens": 16, "ignore_eos": True})
    monkeypatch.setattr("toolkit.engine.forward.compile_pays", lambda model: model is draft)  # the target not
    caps = capabilities(plan(drafted), target, draft)
    assert "gains nothing" in caps.compile and caps.draft_compile is None
    assert "compiled: no (compile: auto" in caps.summary() and "draft compiled: yes" in caps.summary()
    # dynamo traces the draft's graphs as inductor would, without code generation (seconds, not minutes)
    monkeypatch.setattr("toolkit.speculative_lm.TargetForward",
                        lambda *args, **kwargs: TargetForward(*args, **{**kwargs, "backend": "eager"}))
    torch._dynamo.reset()
    lm = toolkit.build(drafted, target=target, draft_model=draft, tokenizer=None)
    assert not lm.engine.compiled and lm.draft_engine.compiled
    assert lm.engine_note.startswith("eager (compile: auto;") and \
        lm.engine_note.endswith("; draft LM compiled on its own static cache")
    assert lm.warm_up(64) > 0 and set(lm.draft_engine.compile_s) == {(1, 1), (1, 2)}
    prompt = torch.randint(1, 128, (1, 11), generator=torch.Generator().manual_seed(3))
    out = lm.generate(prompt)
    assert out.token_ids == hf_greedy(target, prompt, 16) and out.stats.tokens_per_round > 1
    assert out.stats.compile_ms == 0  # warmed up
    torch._dynamo.reset()

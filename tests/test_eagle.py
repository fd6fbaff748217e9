"""The EAGLE drafter (toolkit/eagle, toolkit/speculative/drafters/eagle.py) on tiny random models and (slow) on the
embedded model with the shipped head.

* greedy output token-identical to AR (HF ``generate``), with both acceptances and rejections;
* the unrolled training forward (training-time test) computes exactly what incremental drafting computes;
* the head cache rolls back exactly;
* speculative sampling with the head's q (zero outside the draft vocabulary) reproduces the target's joint law of
  the first tokens (chi-square);
* published EAGLE-1 / EAGLE-3 layouts load; bad heads raise one ConfigError naming ``draft.source``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import batch_decoder, tiny_llama
from scipy.stats import chisquare
from test_decoder import hf_greedy, make_prompt, speculate

from toolkit.distill.eagle_train import build_head, head_loss, unroll
from toolkit.eagle.checkpoint import load_head, save_head
from toolkit.eagle.features import FeatureHook
from toolkit.eagle.head import EagleHead, HeadCache, HeadConfig
from toolkit.errors import ConfigError
from toolkit.engine.planner import ConstantK
from toolkit.speculative.drafters.eagle import EagleDrafter

NEW_TOKENS = 40
INIT = {"initializer_range": 0.2}


def _foreign_hooks(model) -> list:
    """Forward hooks on ``model`` other than transformers' own output capturing (which records only when asked)."""
    from toolkit.engine.forward import _foreign

    return [h for m in model.modules() for h in m._forward_hooks.values() if _foreign(h)]


def greedy_rows(target, count: int, new: int, seed: int = 100) -> list[list[int]]:
    rows = []
    for i in range(count):
        prompt = make_prompt(seed + i, length=8)
        rows.append(prompt[0].tolist() + hf_greedy(target, prompt, new))
    return rows


def features_of(target, rows) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor(rows)
    with FeatureHook(target, [-1]) as hook, torch.no_grad():
        target(input_ids=tokens)
        return hook.features().float(), tokens


@pytest.fixture(scope="module")
def target(eagle_pair):
    return eagle_pair[0]


@pytest.fixture(scope="module")
def trained_head(eagle_pair):
    return eagle_pair[1]


def train_head(target):
    """An EAGLE-1 head (draft vocabulary: 96 of 128 tokens) trained for a few hundred steps on the target's own
    greedy continuations, so that it agrees with the target often but not always (conftest's ``eagle_pair``: trained
    once per worker, for this module and test_eagle_tree)."""
    feats, tokens = features_of(target, greedy_rows(target, 16, 48))
    counts = torch.bincount(tokens.flatten(), minlength=128).double()
    head = build_head(target, 96, counts, seed=0)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=3e-3)
    valid = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    for _ in range(150):
        loss, _ = head_loss(head, feats, tokens, valid, [1.0, 0.8, 0.64], 0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)
    return head


def test_greedy_eagle_matches_ar(target, trained_head):
    prompt = make_prompt(0)
    reference = hf_greedy(target, prompt, NEW_TOKENS)
    for k in (1, 3, 5):
        ids, stats, _ = speculate(target, EagleDrafter(target, trained_head), prompt, ConstantK(k))
        assert ids == reference
        assert stats.accepted > 0, "no draft token was ever accepted"
        assert stats.accepted < stats.drafted, "no draft token was ever rejected"
        assert stats.target_forwards == stats.rounds + 1
    assert not _foreign_hooks(target), "the drafter reads features without hooks"


def test_drafts_only_from_the_draft_vocabulary(target, trained_head):
    drafter = EagleDrafter(target, trained_head)
    allowed = set(trained_head.draft_to_target.tolist())
    prompt = make_prompt(3)
    seen = []
    original = drafter.commit_rows

    def spy(rows, accepted, features):  # the proposals as the round read them
        seen.extend(t for row in rows for t in row.proposal)
        original(rows, accepted, features)
    drafter.commit_rows = spy
    speculate(target, drafter, prompt, ConstantK(4))
    assert seen and set(seen) <= allowed


def test_unrolled_training_forward_equals_incremental_drafting(target):
    """Level s of :func:`unroll` at position t == drafting step s from the true pairs 0..t-s+1 with a HeadCache."""
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.from_target(target.config, "eagle1")).eval()
    feats, tokens = features_of(target, greedy_rows(target, 1, 20))
    with torch.no_grad():
        outs = unroll(head, feats, tokens, 3)
        for start in (0, 4, 9):  # chain starts at the true pair `start`
            cache = HeadCache()
            pos = torch.arange(start + 1).unsqueeze(0)
            x = head.input_features(feats[:, :start + 1], tokens[:, 1:start + 2])
            out, _ = head(x, tokens[:, 1:start + 2], pos, cache)
            last = out[:, -1:]
            torch.testing.assert_close(last[0, 0], outs[0][0, start], atol=1e-5, rtol=1e-5)
            for s in (2, 3):
                t = start + s - 1
                tok = tokens[:, t + 1:t + 2]
                last, _ = head(head.step_input(last, tok), tok, torch.tensor([[t]]), cache)
                torch.testing.assert_close(last[0, 0], outs[s - 1][0, t], atol=1e-5, rtol=1e-5)
            assert len(cache) == start + 3


def test_head_cache_crop_is_exact():
    cache = HeadCache()
    k = torch.randn(1, 2, 5, 4)
    cache.append(k, k + 1)
    cache.append(k[:, :, :3], k[:, :, :3])
    assert len(cache) == 8
    cache.crop(-3)
    assert len(cache) == 5 and torch.equal(cache.keys, k) and torch.equal(cache.values, k + 1)
    cache.crop(2)
    assert len(cache) == 2 and cache.nbytes == 2 * 2 * 2 * 4 * 4


# ------------------------------------------------------------------------------------------------------ sampling
def _joint_law_head(target, trained_head):
    """The prompt, the target's joint law of its first two tokens (top_k 3) and a head reading the trained one's layer
    through a 40-token draft vocabulary without the target's favourite second token (q is zero there)."""
    prompt = make_prompt(5)
    with torch.no_grad():
        logits0 = target(prompt).logits[0, -1]
        top0 = torch.topk(logits0, 3).indices
        p1 = torch.softmax(torch.where(logits0 >= logits0[top0[-1]], logits0, -torch.inf), -1)
        joint, second = {}, []
        for a in top0.tolist():
            logits1 = target(torch.cat([prompt, torch.tensor([[a]])], 1)).logits[0, -1]
            top1 = torch.topk(logits1, 3)
            p2 = torch.softmax(torch.where(logits1 >= top1.values[-1], logits1, -torch.inf), -1)
            second += top1.indices.tolist()
            for b in top1.indices.tolist():
                joint[(a, b)] = float(p1[a] * p2[b])
    excluded = second[0]  # the favourite second token after the favourite first token
    counts = torch.ones(128)
    counts[second] = 100.0
    counts[excluded] = 0.0
    head = build_head(target, 40, counts, seed=3)
    own = {k: v for k, v in trained_head.state_dict().items() if not k.startswith("lm_head")}
    head.load_state_dict(own | {"lm_head.weight": head.lm_head.weight.detach()})
    head.eval().requires_grad_(False)
    assert excluded not in head.draft_to_target.tolist()
    return prompt, joint, head


def _assert_joint_law(observed: dict, joint: dict, n: int) -> None:
    keys = list(joint)
    expected = np.array([joint[k] for k in keys])
    pvalue = chisquare(np.array([observed[k] for k in keys]), expected / expected.sum() * n).pvalue
    assert pvalue > 0.01


@pytest.mark.slow
@pytest.mark.heavy  # ~14 s; test_batched_eagle_sampling_reproduces_target_joint_law runs the same law
def test_sampling_reproduces_target_joint_law(target, trained_head):
    """Chi-square on the first two committed tokens (top_k 3 for a small support). The head agrees with the target
    often, and its q is zero on the target's favourite second token, which is left out of the draft vocabulary."""
    prompt, joint, head = _joint_law_head(target, trained_head)
    n = 1200
    observed = {key: 0 for key in joint}
    drafted = 0
    for seed in range(n):
        gen = torch.Generator().manual_seed(10_000 + seed)
        drafter = EagleDrafter(target, head, do_sample=True, top_k=3, generator=gen)
        ids, stats, _ = speculate(target, drafter, prompt, ConstantK(2), max_new_tokens=3, do_sample=True, top_k=3,
                                  seed=seed)
        observed[(ids[0], ids[1])] += 1
        drafted += stats.accepted
    assert 0 < drafted < n * 2  # both acceptances and rejections happened
    _assert_joint_law(observed, joint, n)


@pytest.mark.slow
def test_batched_eagle_sampling_reproduces_target_joint_law(target, trained_head):
    """The same law with the head drafting for batches of 8 (toolkit/speculative/drafters/eagle.py): every row its
    own generators, the head's q (zero outside its draft vocabulary) in each row's rejection sampling."""
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.cost_model import VerifyCost

    class FreeSteps(EagleDrafter):
        def step_ms(self, rows: int) -> float:
            return 0.0

    prompt, joint, head = _joint_law_head(target, trained_head)
    n, observed, accepted = 1200, {key: 0 for key in joint}, 0
    for chunk in range(n // 8):
        gen = GenerationSpec(max_new_tokens=3, do_sample=True, top_k=3, ignore_eos=True, seed=8 * chunk)
        decoder = batch_decoder(target, FreeSteps(target, head, do_sample=True, top_k=3, seed=gen.seed),
                                VerifyCost([1.0] * 64, learn=False), num_draft_tokens=2, batch_size=8)
        for ids, stats in decoder.decode_batch([prompt] * 8, gen):
            observed[(ids[0], ids[1])] += 1
            accepted += stats.accepted
    assert 0 < accepted < n  # one draft token per row (room for 1 of the 3 tokens): accepted and rejected
    _assert_joint_law(observed, joint, n)


# ------------------------------------------------------------------------------------------------------ layouts
def _eagle1_state(target, seed=0) -> dict:
    torch.manual_seed(seed)
    h, inter = target.config.hidden_size, target.config.intermediate_size
    kv = target.config.num_key_value_heads * (h // target.config.num_attention_heads)
    s = {"fc.weight": torch.randn(h, 2 * h) * 0.05, "fc.bias": torch.randn(h) * 0.01,
         "layers.0.self_attn.q_proj.weight": torch.randn(h, h) * 0.1,
         "layers.0.self_attn.k_proj.weight": torch.randn(kv, h) * 0.1,
         "layers.0.self_attn.v_proj.weight": torch.randn(kv, h) * 0.1,
         "layers.0.self_attn.o_proj.weight": torch.randn(h, h) * 0.1,
         "layers.0.mlp.gate_proj.weight": torch.randn(inter, h) * 0.1,
         "layers.0.mlp.up_proj.weight": torch.randn(inter, h) * 0.1,
         "layers.0.mlp.down_proj.weight": torch.randn(h, inter) * 0.1,
         "layers.0.post_attention_layernorm.weight": torch.ones(h)}
    return s


def _llama_config(target, **extra) -> dict:
    c = target.config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": 10000.0, "vocab_size": c.vocab_size, **extra}


def test_loads_published_eagle1_layout(tmp_path, target):
    """EAGLE-1 repository layout: config.json + pytorch_model.bin, fc (2H->H, bias), layers.0.* without an input
    norm, no LM head (the target's is used)."""
    state = _eagle1_state(target)
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(_llama_config(target)))
    head = load_head(tmp_path, target)
    assert head.config.variant == "eagle1" and head.config.draft_vocab_size == 128
    assert torch.equal(head.fc.weight, state["fc.weight"])
    assert torch.equal(head.layer.self_attn.k_proj.weight, state["layers.0.self_attn.k_proj.weight"])
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    prompt = make_prompt(1)
    ids, stats, _ = speculate(target, EagleDrafter(target, head), prompt, ConstantK(3))
    assert ids == hf_greedy(target, prompt, NEW_TOKENS)


def test_loads_published_eagle3_layout(tmp_path, target):
    """EAGLE-3 layout: fc (3H->H) over three target layers, midlayer.* with hidden_norm / input_layernorm and
    2H-wide q/k/v, norm, its own lm_head over a reduced vocabulary, d2t offsets and t2d mask (safetensors)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    c = target.config
    h, inter = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    draft_ids = torch.arange(0, 128, 2)  # 64 even token ids
    t2d = torch.zeros(128, dtype=torch.bool)
    t2d[draft_ids] = True
    state = {"fc.weight": torch.randn(h, 3 * h) * 0.05,
             "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
             "midlayer.self_attn.q_proj.weight": torch.randn(h, 2 * h) * 0.1,
             "midlayer.self_attn.k_proj.weight": torch.randn(kv, 2 * h) * 0.1,
             "midlayer.self_attn.v_proj.weight": torch.randn(kv, 2 * h) * 0.1,
             "midlayer.self_attn.o_proj.weight": torch.randn(h, h) * 0.1,
             "midlayer.mlp.gate_proj.weight": torch.randn(inter, h) * 0.1,
             "midlayer.mlp.up_proj.weight": torch.randn(inter, h) * 0.1,
             "midlayer.mlp.down_proj.weight": torch.randn(h, inter) * 0.1,
             "midlayer.post_attention_layernorm.weight": torch.ones(h), "norm.weight": torch.ones(h),
             "lm_head.weight": torch.randn(64, h), "d2t": draft_ids - torch.arange(64), "t2d": t2d}
    save_file(state, str(tmp_path / "model.safetensors"))
    config = _llama_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=64,
                           eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 1]})  # of 2 layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    head = load_head(tmp_path, target)
    assert head.config.variant == "eagle3" and head.config.feature_layers == [0, 0, 0]
    assert torch.equal(head.draft_to_target, draft_ids)
    assert torch.equal(head.lm_head.weight, state["lm_head.weight"])
    prompt = make_prompt(2)
    drafter = EagleDrafter(target, head)
    ids, stats, _ = speculate(target, drafter, prompt, ConstantK(3))
    assert ids == hf_greedy(target, prompt, NEW_TOKENS)
    assert stats.drafted > 0


def test_save_head_round_trip(tmp_path, target, trained_head):
    save_head(trained_head, tmp_path)
    loaded = load_head(tmp_path, target)
    assert torch.equal(loaded.draft_to_target, trained_head.draft_to_target)
    for name, tensor in trained_head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    prompt = make_prompt(4)
    a, _, _ = speculate(target, EagleDrafter(target, trained_head), prompt, ConstantK(3))
    b, _, _ = speculate(target, EagleDrafter(target, loaded), prompt, ConstantK(3))
    assert a == b


def test_bad_heads_raise_config_error_naming_draft_source(tmp_path, target, trained_head):
    with pytest.raises(ConfigError, match=r"^draft\.source: .*does not exist"):
        load_head(tmp_path / "missing", target)
    save_head(trained_head, tmp_path / "ok")
    other = tiny_llama(seed=0, vocab=256, **INIT)
    with pytest.raises(ConfigError, match=r"^draft\.source: head vocab_size 128 .*256"):
        load_head(tmp_path / "ok", other)
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    config["hidden_size"] = 32
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"^draft\.source: head hidden_size 32"):
        load_head(tmp_path / "ok", target)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^draft\.source: .*no head weights"):
        load_head(tmp_path / "empty", target)


class _Hostile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):  # unpickling would create the file
        return (open, (self.path, "w"))


def test_a_hostile_pickled_head_is_refused_and_never_run(tmp_path, target):
    """A head directory with a pytorch_model.bin whose unpickling would run code: one ConfigError naming
    draft.source, and the code never runs (only safetensors or torch's restricted unpickler read heads)."""
    import pickle

    marker = tmp_path / "pwned"
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(_llama_config(target)))
    (head / "pytorch_model.bin").write_bytes(pickle.dumps({"fc.weight": _Hostile(marker)}, protocol=2))
    with pytest.raises(ConfigError, match=r"^draft\.source: .*not a file of plain tensors"):
        load_head(head, target)
    assert not marker.exists()
    (head / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(ConfigError, match=r"^draft\.source: "):
        load_head(head, target)


# ------------------------------------------------------------------------------------------------------ recipe
def test_recipe_fields_for_eagle(tmp_path, target, trained_head):
    from toolkit.recipe import ModelSpec, Recipe, SpeculationSpec
    from toolkit.speculative_lm import build

    with pytest.raises(ConfigError, match=r"^draft: spec.drafter='eagle' needs a draft section"):
        Recipe(draft=None, spec=SpeculationSpec(drafter="eagle"))
    missing = Recipe(draft=ModelSpec(source=str(tmp_path / "nope"), precision="fp32"),
                     spec=SpeculationSpec(drafter="eagle"))
    with pytest.raises(ConfigError, match=r"^draft\.source: EAGLE head directory .* does not exist"):
        build(missing, target=target, tokenizer=None)
    save_head(trained_head, tmp_path / "head")
    recipe = Recipe(draft=ModelSpec(source=str(tmp_path / "head"), precision="bf16"),
                    spec=SpeculationSpec(drafter="eagle", num_draft_tokens=3))
    generator = build(recipe, target=target, tokenizer=None)
    drafter = generator._drafter(recipe.generation)
    assert isinstance(drafter, EagleDrafter) and drafter.dtype == torch.bfloat16
    assert generator.draft_model.embed_tokens is target.get_input_embeddings()  # shared, not copied
    prompt = make_prompt(6)
    ids, _, _ = speculate(target, drafter, prompt, ConstantK(3))
    assert ids == hf_greedy(target, prompt, NEW_TOKENS)  # a bf16 head under an fp32 target is still lossless
    allowed = r"\(allowed: fp32, bf16, fp16, int8\)"
    with pytest.raises(ConfigError, match=r"^draft\.precision: unknown value 'int4' " + allowed):
        Recipe(draft=ModelSpec(source="x", precision="int4"), spec=SpeculationSpec(drafter="eagle"))


def test_int8_head_quantizes_every_linear_and_stays_lossless(tmp_path, target, trained_head):
    """``draft.precision: int8``: every linear of the head (fc, the layer's projections, the LM head) holds torchao
    int8 weights at bf16 activations, the shared embedding is the target's; greedy output is AR's, with drafts
    accepted as often as the bf16 head's give or take a few."""
    from toolkit.recipe import ModelSpec, Recipe, SpeculationSpec
    from toolkit.speculative_lm import build

    save_head(trained_head, tmp_path / "head")
    runs = {}
    for precision in ("bf16", "int8"):
        recipe = Recipe(draft=ModelSpec(source=str(tmp_path / "head"), precision=precision),
                        spec=SpeculationSpec(drafter="eagle", num_draft_tokens=3))
        generator = build(recipe, target=target, tokenizer=None)
        drafter = generator._drafter(recipe.generation)
        runs[precision] = [speculate(target, drafter, make_prompt(100 + i, length=8), ConstantK(3)) for i in range(3)]
    head = generator.draft_model
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 9  # fc, q/k/v/o, gate/up/down, the LM head
    assert all(m.weight.qdata.dtype == torch.int8 and m.weight.dtype == torch.bfloat16 for m in linears)
    assert head.embed_tokens is target.get_input_embeddings()  # the target's, not quantized
    for i, (ids, stats, _) in enumerate(runs["int8"]):
        assert ids == hf_greedy(target, make_prompt(100 + i, length=8), NEW_TOKENS)
    accepted = {p: sum(s.accepted for _, s, _ in runs[p]) for p in runs}
    assert accepted["int8"] > 0 and abs(accepted["int8"] - accepted["bf16"]) <= 0.2 * accepted["bf16"]


@pytest.mark.slow
@pytest.mark.heavy  # ~7 s on the embedded model; the tiny-model heads above prove the path
def test_shipped_head_greedy_matches_ar_on_embedded_model(embedded):
    """The head shipped for the embedded target: token-identical greedy output, and it drafts usefully."""
    from toolkit.eagle.checkpoint import resolve_head

    model, tokenizer = embedded
    head = load_head(resolve_head("embedded"), model, dtype=torch.bfloat16)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Explain why exercise is good for health."}],
                                        add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    reference = hf_greedy(model, ids, 32)
    out, stats, _ = speculate(model, EagleDrafter(model, head), ids, ConstantK(4), max_new_tokens=32)
    assert out == reference
    assert stats.accepted > 0 and stats.accepted < stats.drafted
    assert not _foreign_hooks(model)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "phi3", "gpt_neox", "gpt2"])
def test_eagle_head_for_other_architectures_trains_and_decodes_as_ar(arch):
    """Features are read through the family's own layer list and final norm (``base_model``): a head built for a
    tiny random target of another family trains a few steps and decodes token-identical to AR."""
    from test_architectures import tiny

    target = tiny(arch)
    rows = greedy_rows(target, 6, 24)
    feats, tokens = features_of(target, rows)
    assert feats.shape == (6, 32, 64)
    head = build_head(target, 128, torch.bincount(tokens.flatten(), minlength=128).double(), seed=0)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    valid = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    for _ in range(20):
        loss, _ = head_loss(head, feats, tokens, valid, [1.0, 0.8], 0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)
    prompt = make_prompt(3)
    ids, stats, _ = speculate(target, EagleDrafter(target, head), prompt, ConstantK(3), max_new_tokens=16)
    assert ids == hf_greedy(target, prompt, 16) and stats.drafted > 0


@pytest.mark.slow
@pytest.mark.heavy  # ~9 s; test_training_faults trains an EAGLE-3 head and test_eagle_layouts reads the layout
def test_eagle3_head_trains_decodes_as_ar_and_serves_in_the_speculators_layout(tmp_path, target):
    """``variant: eagle3``: the head reads three target layers' raw outputs (``aux``), trains its own LM head on the
    token-level loss only, beats its untrained self on held-out acceptance, decodes token-identical to AR, and
    round-trips through the speculators layout unchanged."""
    from toolkit.distill.eagle_data import compute_features
    from toolkit.eagle.convert import convert_head
    from toolkit.eagle.head import HeadConfig

    layers = HeadConfig.from_target(target.config, "eagle3").feature_layers
    rows = greedy_rows(target, 20, 40)
    cache = compute_features(target, rows, 48, 0, aux_layers=layers)
    assert cache["aux"].shape == (20, 48, 3 * 64) and cache["features"].shape == (20, 48, 64)
    tokens = cache["tokens"]
    counts = torch.bincount(tokens.flatten(), minlength=128).double()
    head = build_head(target, 96, counts, seed=0, variant="eagle3")
    assert head.lm_head.weight.requires_grad and not head.embed_tokens.weight.requires_grad
    target_lm = target.lm_head.weight.detach()[head.draft_to_target]
    train, held = slice(0, 16), slice(16, 20)
    valid = torch.ones(16, 47)

    def held_kl() -> float:
        with torch.no_grad():
            _, parts = head_loss(head, cache["features"][held].float(), tokens[held], torch.ones(4, 47), [1.0], 0.0,
                                 inputs=cache["aux"][held].float(), target_lm=target_lm)
        return parts[0]

    before = held_kl()
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(120):
        loss, _ = head_loss(head, cache["features"][train].float(), tokens[train], valid, [1.0, 0.8, 0.64], 0.1,
                            inputs=cache["aux"][train].float(), target_lm=target_lm)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)
    after = held_kl()
    assert after < 0.9 * before  # it learned the target's law on held-out rows
    prompt = make_prompt(6)
    ids, stats, _ = speculate(target, EagleDrafter(target, head), prompt, ConstantK(3))
    assert ids == hf_greedy(target, prompt, NEW_TOKENS) and stats.drafted > 0
    save_head(head, tmp_path / "ours")
    convert_head(tmp_path / "ours", target.config, tmp_path / "spec", "speculators", "v", [], dtype=torch.float32)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [i % 2 + 1 for i in layers]  # never negative
    loaded = load_head(tmp_path / "spec", target)
    again, _, _ = speculate(target, EagleDrafter(target, loaded), prompt, ConstantK(3))
    assert again == ids


def test_batched_eagle_rows_equal_each_prompt_alone_and_draft_as_one_sequence(target, trained_head):
    """An EAGLE head drafting for a whole batch (toolkit/speculative/drafters/eagle.py): every row's greedy output
    is its prompt's output alone, and — drafting free, verifying every draft (K = 4, a flat verify curve) — each row
    drafts and accepts exactly what the single-sequence EAGLE drafter does with K = 4 (stale or misplaced true pairs
    in the static head cache would change the proposals)."""
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.cost_model import VerifyCost

    class FreeSteps(EagleDrafter):
        def step_ms(self, rows: int) -> float:
            return 0.0

    # prompts the head was trained on (it agrees often) and others (it mostly misses), of different lengths
    batch = [make_prompt(100 + i, length=8) for i in range(3)] + [make_prompt(20 + i, length=6 + 2 * i)
                                                                  for i in range(2)]
    alone = [speculate(target, EagleDrafter(target, trained_head), p, ConstantK(4)) for p in batch]
    decoder = batch_decoder(target, FreeSteps(target, trained_head), VerifyCost([1.0] * 64, learn=False),
                            num_draft_tokens=4, batch_size=3)
    rows = decoder.decode_batch(batch, GenerationSpec(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for (ids, stats), (ref, ref_stats, _) in zip(rows, alone):  # 5 prompts through 3 slots: rows leave and join
        assert ids == ref
        assert (stats.drafted, stats.accepted) == (ref_stats.drafted, ref_stats.accepted)
    assert 0 < sum(s.accepted for _, s in rows) < sum(s.drafted for _, s in rows)
    assert not _foreign_hooks(target), "the drafter reads features without hooks"

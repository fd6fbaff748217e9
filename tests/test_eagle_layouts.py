"""EAGLE-3 heads in the published layouts: the speculators layout (what ``vllm serve`` reads) and the EAGLE-3
repository's, loaded and written (``toolkit draft export-head``).

* the head's EAGLE-3 layer computes what speculators' EAGLE-3 first layer computes, checked against transformers'
  own Llama / Qwen3 decoder layers widened the way speculators widens them (q/k/v over ``cat(embed, feature)``),
  with the options published heads use: ``norm_before_residual``, q/k/v biases, Qwen3 q/k norms, Llama-3.1 / YaRN
  rotary scaling;
* a head converted to the speculators layout and back loads tensor-identical and decodes token-identical to AR;
* the written ``config.json`` holds what vLLM's speculators parser requires and only fields speculators'
  ``Eagle3SpeculatorConfig`` defines (speculators v0.7.0, c05b95b3; vLLM ``transformers_utils/configs/speculators``);
* bad heads and bad requests raise one ConfigError naming the field and leave nothing behind.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from test_decoder import hf_greedy, make_prompt, speculate
from typer.testing import CliRunner

from toolkit.eagle.checkpoint import load_head, save_head
from toolkit.eagle.convert import convert_head
from toolkit.eagle.head import EagleHead, HeadConfig
from toolkit.errors import ConfigError
from toolkit.engine.planner import ConstantK
from toolkit.speculative.drafters.eagle import EagleDrafter

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
#: (name, HeadConfig options): the plain EAGLE-3 layer and the options of published heads
OPTIONS = [("llama", {}),
           ("llama3-rope-norm-residual", {"rope_scaling": LLAMA3_ROPE, "norm_before_residual": True}),
           ("qwen3-bias-yarn", {"qk_norm": True, "attention_bias": True, "rope_scaling": YARN_ROPE})]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=4, initializer_range=0.2)


def random_head(target, seed: int = 0, **options) -> EagleHead:
    """An EAGLE-3 head for ``target`` (4 layers; it reads decoder layers 0, 1, 2) with every weight random (norms
    too), over the 64 even token ids."""
    c = target.config
    config = HeadConfig(variant="eagle3", hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                        head_dim=c.hidden_size // c.num_attention_heads, rms_norm_eps=1e-6, rope_theta=10000.0,
                        vocab_size=c.vocab_size, draft_vocab_size=64, feature_layers=[0, 1, 2], fc_bias=False,
                        **options)
    torch.manual_seed(seed)
    head = EagleHead(config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            scale = 0.3 if "norm" in name else 0.15
            param.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn_like(param))
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    head.draft_to_target = torch.arange(0, 128, 2)
    return head.eval().requires_grad_(False)


def reference_layer(head: EagleHead, x: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Speculators' EAGLE-3 first layer (``Eagle3FirstLayerMixin``) built from transformers' Llama / Qwen3 decoder
    layer with q/k/v widened to ``2H`` and the head's weights: split ``cat(embed, feature)``, ``input_layernorm`` on
    the embedding, ``hidden_norm`` on the feature, residual = the feature (normalised with
    ``norm_before_residual``), attention with the layer type's rotary embedding, then the MLP block."""
    from transformers import LlamaConfig, Qwen3Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

    c = head.config
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    options = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                   num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                   head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, attention_bias=c.attention_bias,
                   rope_parameters=rope, vocab_size=c.vocab_size, max_position_embeddings=128)
    if c.qk_norm:
        config, layer_class, rotary_class = Qwen3Config(**options), Qwen3DecoderLayer, Qwen3RotaryEmbedding
    else:
        config, layer_class, rotary_class = LlamaConfig(**options), LlamaDecoderLayer, LlamaRotaryEmbedding
    config._attn_implementation = "eager"
    layer = layer_class(config, layer_idx=0)
    h, a = c.hidden_size, layer.self_attn
    a.q_proj = torch.nn.Linear(2 * h, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
    a.k_proj = torch.nn.Linear(2 * h, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
    a.v_proj = torch.nn.Linear(2 * h, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)  # o_proj as built
    layer.hidden_norm = Qwen3RMSNorm(h, eps=c.rms_norm_eps)
    missing, unexpected = layer.load_state_dict(head.layer.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    cos, sin = rotary_class(config)(x, positions)
    q = x.shape[1]
    mask = torch.full((q, q), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        feature = layer.hidden_norm(x)
        residual = feature if c.norm_before_residual else x
        attn, _ = a(hidden_states=torch.cat([layer.input_layernorm(embeds), feature], dim=-1),
                    position_embeddings=(cos, sin), attention_mask=mask)
        out = residual + attn
        return out + layer.mlp(layer.post_attention_layernorm(out))


@pytest.mark.parametrize("name, options", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_eagle3_layer_computes_what_speculators_first_layer_computes(target, name, options):
    head = random_head(target, **options)
    torch.manual_seed(1)
    x, embeds = torch.randn(2, 12, 64), torch.randn(2, 12, 64)
    positions = torch.arange(3, 15).expand(2, 12)  # not from 0: a rotary offset error shows
    with torch.no_grad():
        ours, _ = head.layer(x, embeds, positions, None, None)
    torch.testing.assert_close(ours, reference_layer(head, x, embeds, positions), rtol=1e-4, atol=1e-4)


def _vllm_and_speculators_accept(config: dict, k: int) -> None:
    """What vLLM's speculators parser requires (``SpeculatorsConfig.validate_speculators_config`` and
    ``update_eagle3``) and the fields speculators' ``Eagle3SpeculatorConfig`` / ``SpeculatorsConfig`` /
    ``GreedyTokenProposalConfig`` / ``VerifierConfig`` define (v0.7.0): nothing missing, nothing unknown."""
    from transformers import AutoConfig

    eagle3_fields = {"speculators_model_type", "speculators_version", "speculators_config", "architectures",
                     "transformer_layer_config", "draft_vocab_size", "norm_before_residual", "target_hidden_size",
                     "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm", "norm_output",
                     "embed_requires_grad", "torch_dtype"}
    assert set(config) <= eagle3_fields, set(config) - eagle3_fields
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    spec = config["speculators_config"]
    assert set(spec) == {"algorithm", "proposal_methods", "default_proposal_method", "verifier"}
    assert spec["algorithm"] == "eagle3"
    method = spec["proposal_methods"][0]
    assert set(method) == {"proposal_type", "speculative_tokens", "verifier_accept_k", "accept_tolerance"}
    assert method["proposal_type"] == spec["default_proposal_method"] == "greedy"
    assert method["speculative_tokens"] == k and method["verifier_accept_k"] >= 1 and method["accept_tolerance"] >= 0
    assert set(spec["verifier"]) == {"name_or_path", "architectures"} and spec["verifier"]["name_or_path"]
    layer = config["transformer_layer_config"]
    assert isinstance(layer, dict) and layer["num_hidden_layers"] == 1
    built = AutoConfig.for_model(**layer)  # what speculators does with it (AutoConfig.for_model(model_type) class)
    assert built.hidden_size == layer["hidden_size"] and built.vocab_size == layer["vocab_size"]
    assert isinstance(config["draft_vocab_size"], int) and isinstance(config["norm_before_residual"], bool)
    assert all(isinstance(i, int) for i in config["eagle_aux_hidden_state_layer_ids"])


@pytest.mark.parametrize("name, options", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_speculators_round_trip_is_tensor_identical_and_decodes_as_ar(tmp_path, target, name, options):
    head = random_head(target, **options)
    save_head(head, tmp_path / "ours")
    summary = convert_head(tmp_path / "ours", target.config, tmp_path / "spec", "speculators",
                           "org/verifier", ["LlamaForCausalLM"], num_speculative_tokens=4, dtype=torch.float32)
    assert summary["variant"] == "eagle3" and not summary["warnings"]
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    _vllm_and_speculators_accept(config, 4)
    assert config["transformer_layer_config"]["model_type"] == ("qwen3" if options.get("qk_norm") else "llama")
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # output_hidden_states indices
    assert config["transformer_layer_config"]["max_position_embeddings"] == 512  # the target's context
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "spec" / "model.safetensors")))
    assert "layers.0.hidden_norm.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert {"d2t", "t2d", "lm_head.weight", "norm.weight", "fc.weight"} <= names
    # and back into the EAGLE-3 repository's layout (a Llama layer: a Qwen3-shaped head is refused there)
    directories = ["spec"]
    if options.get("qk_norm"):
        with pytest.raises(ConfigError, match="allowed for it: 'speculators'") as err:
            convert_head(tmp_path / "spec", target.config, tmp_path / "eagle", "eagle", "", [])
        assert err.value.field == "layout" and not (tmp_path / "eagle").exists()
    else:
        convert_head(tmp_path / "spec", target.config, tmp_path / "eagle", "eagle", "", [], dtype=torch.float32)
        directories.append("eagle")
    for directory in directories:
        loaded = load_head(tmp_path / directory, target)
        assert loaded.config == head.config, directory
        for key, tensor in head.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], tensor), (directory, key)
        assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    prompt = make_prompt(5)
    ids, stats, _ = speculate(target, EagleDrafter(target, loaded), prompt, ConstantK(3))
    assert ids == hf_greedy(target, prompt, len(ids)) and stats.drafted > 0


def _speculators_dir(tmp_path, target, **changes):
    """A speculators head directory (from a random head) with ``changes`` made to its config.json."""
    save_head(random_head(target), tmp_path / "ours")
    out = tmp_path / "spec"
    convert_head(tmp_path / "ours", target.config, out, "speculators", "v", [], dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("layer."):
            config["transformer_layer_config"][key[len("layer."):]] = value
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("changes, words", [
    ({"speculators_model_type": "eagle"}, "speculators_model_type 'eagle' is not supported; allowed: eagle3"),
    ({"transformer_layer_config": None}, "needs transformer_layer_config"),
    ({"layer.model_type": "mistral"}, "model_type 'mistral' is not supported; allowed: llama, qwen3"),
    ({"layer.num_hidden_layers": 2}, "one-layer EAGLE-3 heads only"),
    ({"norm_before_fc": True}, "['norm_before_fc'] are not supported"),
    ({"target_hidden_size": 128}, "target_hidden_size 128 differs"),
    ({"layer.rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' depends on the sequence"),
    ({"layer.rope_scaling": {"rope_type": "proportional"}}, "rope_type 'proportional' is not supported"),
    ({"layer.rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "cannot be built from its config"),
    ({"layer.hidden_size": 32}, "hidden_size 32 does not fit the target's hidden_size 64"),
    ({"layer.model_type": "qwen3"}, "missing tensors ['layer.self_attn.q_norm.weight'"),  # a Qwen3 layer has them
    ({"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, "must be output_hidden_states indices 1..3"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, "must be output_hidden_states indices 1..3"),
])
def test_bad_speculators_heads_raise_config_error_naming_the_field(tmp_path, target, changes, words):
    directory = _speculators_dir(tmp_path, target, **changes)
    with pytest.raises(ConfigError) as err:
        load_head(directory, target)
    assert err.value.field == "draft.source" and words in str(err.value)


def test_bad_export_requests_write_nothing(tmp_path, target):
    from transformers import AutoConfig

    from toolkit.eagle.checkpoint import SHIPPED
    from toolkit.models.embedded import resolve_source

    save_head(random_head(target), tmp_path / "ours")
    cases = [(dict(source=tmp_path / "ours", layout="gguf"), "layout", "allowed: speculators, eagle"),
             (dict(source=tmp_path / "ours", layout="speculators", num_speculative_tokens=0),
              "num_speculative_tokens", "must be >= 1")]
    for kwargs, field, words in cases:
        kwargs = {"target_config": target.config, "out": tmp_path / "out", "verifier": "v",
                  "verifier_architectures": [], **kwargs}
        with pytest.raises(ConfigError) as err:
            convert_head(**kwargs)
        assert err.value.field == field and words in str(err.value)
    # the shipped head is EAGLE-1: speculators stores EAGLE-3 heads only
    embedded = AutoConfig.from_pretrained(resolve_source("embedded"))
    with pytest.raises(ConfigError, match="stores EAGLE-3 heads only"):
        convert_head(SHIPPED["embedded"], embedded, tmp_path / "out", "speculators", "v", [])
    (tmp_path / "file").write_text("x")
    for out, words in ((tmp_path / "file", "is not an empty directory"), (tmp_path / "ours", "being converted")):
        with pytest.raises(ConfigError, match=words) as err:
            convert_head(tmp_path / "ours", target.config, out, "speculators", "v", [])
        assert err.value.field == "--out"
    # a head without its fc layer: refused before anything is written
    from safetensors.torch import load_file, save_file

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text((tmp_path / "ours" / "config.json").read_text())
    state = load_file(str(tmp_path / "ours" / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k != "fc.weight"}, str(tmp_path / "broken" / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing tensors \['fc.weight'\]"):
        convert_head(tmp_path / "broken", target.config, tmp_path / "out", "speculators", "v", [])
    # a head reading the target's last layer: engines cannot give it that feature
    bad = random_head(target)
    bad.config.feature_layers = [0, 1, 3]
    save_head(bad, tmp_path / "last")
    with pytest.raises(ConfigError, match="include the target's last layer"):
        convert_head(tmp_path / "last", target.config, tmp_path / "out", "speculators", "v", [])
    assert not (tmp_path / "out").exists() and (tmp_path / "file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "file", "last", "ours"]  # no temporary left


def test_export_head_command_writes_a_servable_head(tmp_path, target):
    from toolkit_cli.app import app

    model = tmp_path / "model"
    target.save_pretrained(model)
    save_head(random_head(target), tmp_path / "ours")
    runner = CliRunner()
    out = tmp_path / "served"
    res = runner.invoke(app, ["draft", "export-head", str(tmp_path / "ours"), "--target", str(model), "--out",
                              str(out), "-k", "5"])
    assert res.exit_code == 0, res.output
    assert f"vllm serve {out}" in res.stdout
    config = json.loads((out / "config.json").read_text())
    _vllm_and_speculators_accept(config, 5)
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(model.resolve()),
                                                        "architectures": ["LlamaForCausalLM"]}
    assert config["torch_dtype"] == "bfloat16"
    assert load_head(out, target).config.variant == "eagle3"
    res = runner.invoke(app, ["draft", "export-head", "embedded", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "layout: 'speculators' stores EAGLE-3 heads only" in res.output
    res = runner.invoke(app, ["draft", "export-head", "embedded", "--layout", "eagle", "--out", str(tmp_path / "e")])
    assert res.exit_code == 0 and "reduced draft vocabulary (8192 of 49152 tokens) is dropped" in res.output
    written = json.loads((tmp_path / "e" / "config.json").read_text())
    assert "toolkit_eagle" not in written and written["draft_vocab_size"] == written["vocab_size"] == 49152

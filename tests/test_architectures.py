"""Every HF decoder-only architecture the toolkit claims: tiny random models of 12 families, each decoding with the
main drafters (AR, lookup with the cost-aware verify length, a draft model chain and tree, n-gram), a compressed
cache and batched decoding, token-identical to HF greedy where nothing is compressed."""

from __future__ import annotations

import pytest
import torch
from conftest import batch_decoder, perturbed_copy
from test_decoder import hf_greedy
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.kv import make_policy
from toolkit.kv.rows import SingleRowCache, static_why
from toolkit.kv.static import StaticKV
from toolkit.kv.static_sliding import SLIDING, SlidingStaticKV, layer_kinds
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.planner import ConstantK, CostAwareK
from toolkit.recipe import GenerationSpec, KVSpec
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import DraftModel, LookupDrafter, NGramDrafter
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.tree import TreeShape
from toolkit.speculative.verify_length import Calibrator

#: tiny sizes per family: hidden 64, 2 layers, 4 heads (2 KV heads where the family has GQA), vocab 128
ARCHS = {
    "llama": {"num_key_value_heads": 2}, "qwen2": {"num_key_value_heads": 2}, "qwen3": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 2, "sliding_window": None}, "gemma3_text": {"num_key_value_heads": 2},
    "phi3": {"num_key_value_heads": 2, "pad_token_id": 0}, "gpt_neox": {}, "gpt2": {}, "opt": {},
    "olmo2": {"num_key_value_heads": 2}, "granite": {"num_key_value_heads": 2}, "gemma2": {"num_key_value_heads": 2},
}
NEW = 16
#: families whose full tree round is also run here (the tree tests cover Llama and NeoX in depth), and every family
#: with sliding-window layers (trees on the static cache's rings)
TREE_CHECKED = ("llama", "gpt2", "opt", "phi3")


def sliding_layers(model) -> bool:
    return SLIDING in layer_kinds(model)


def tiny(arch: str, seed: int = 0):
    sizes = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 256, "n_embd": 64, "n_layer": 2, "n_head": 4,
             "n_positions": 256, "ffn_dim": 128, "word_embed_proj_dim": 64, "head_dim": 16,
             "initializer_range": 0.2, **ARCHS[arch]}
    config = AutoConfig.for_model(arch, **sizes)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def models():
    out = {}
    for arch in ARCHS:
        target = tiny(arch)
        base = torch.randint(1, 128, (6,), generator=torch.Generator().manual_seed(1))
        prompt = torch.cat([base, base, base[:3]]).view(1, -1)
        out[arch] = (target, prompt, hf_greedy(target, prompt, NEW))
    return out


def decode(target, drafter, prompt, controller=None, policy=None, tree=None,
           own_cache: bool = False) -> tuple[list[int], GenerationStats]:
    """Greedy decode of ``prompt``; ``own_cache``: on the policy's own single-sequence cache (which compresses at its
    commit points) instead of the cache the decoder picks (the static cache's ring for StreamingLLM)."""
    stats = GenerationStats()
    loop = SpeculativeDecoder(target, drafter, controller or ConstantK(4), policy, tree)
    if own_cache:
        loop._new_cache = lambda prompts, gen: SingleRowCache(policy, target)
    gen = GenerationSpec(max_new_tokens=NEW, ignore_eos=True)
    return [t for chunk in loop.decode(prompt, gen, stats) for t in chunk], stats


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_drafter_is_greedy_exact(models, arch):
    target, prompt, reference = models[arch]
    assert decode(target, None, prompt)[0] == reference
    assert decode(target, NGramDrafter(), prompt)[0] == reference
    cost = CostAwareK(VerifyCost([1.0] * 32, learn=False), Calibrator(), 6, 7)
    assert decode(target, LookupDrafter(max_cached_requests=0), prompt, cost)[0] == reference
    draft = perturbed_copy(target, scale=0.1)
    assert decode(target, DraftModel(draft), prompt)[0] == reference
    if arch in TREE_CHECKED or sliding_layers(target):
        assert decode(target, DraftModel(draft), prompt, tree=TreeShape(6, 3, 2))[0] == reference


@pytest.mark.parametrize("arch", list(ARCHS))
def test_batched_rows_are_greedy_exact(models, arch):
    target, prompt, reference = models[arch]
    other = prompt[:, 3:]
    gen = GenerationSpec(max_new_tokens=NEW, ignore_eos=True)
    assert static_why(None, target) is None  # sliding-window layers too (rings of the static cache)
    decoder = batch_decoder(target, lambda: LookupDrafter(max_cached_requests=0), VerifyCost([1.0] * 64, learn=False),
                            num_draft_tokens=4, batch_size=2)
    rows = decoder.decode_batch([prompt, other, prompt], gen)
    assert [ids for ids, _ in rows] == [reference, hf_greedy(target, other, NEW), reference]
    assert isinstance(decoder.cache, SlidingStaticKV if sliding_layers(target) else StaticKV)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_compressed_cache_runs_and_matches_ar_under_the_same_policy(models, arch):
    """StreamingLLM (absolute positions, exact window) on the static cache's ring where the family has full-attention
    layers only, else on the policy's own cache; on the policy's own cache (which compresses) it decodes the same."""
    target, prompt, _ = models[arch]
    spec = KVSpec("streaming", {"sink_tokens": 2, "window": 12, "compress_interval": 2})
    ar, _ = decode(target, None, prompt, policy=make_policy(spec))
    ours, _ = decode(target, NGramDrafter(), prompt, policy=make_policy(spec))
    assert ours == ar
    own, stats = decode(target, NGramDrafter(), prompt, policy=make_policy(spec), own_cache=True)
    assert own == ar and stats.compressions_target > 0


def test_a_family_without_sdpa_loads_with_eager_attention_and_decodes(tmp_path):
    """Gemma-2 has no SDPA attention since transformers 5.15 (softcapping): the default recipe (attn_implementation:
    sdpa) loads it with eager; on a release whose Gemma-2 declares SDPA, with SDPA."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    import toolkit
    from toolkit.recipe import ModelSpec, Recipe, SpeculationSpec

    tiny("gemma2").save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(128)}, unk_token="t0"))).save_pretrained(tmp_path)
    recipe = Recipe(name="gemma2", target=ModelSpec(source=str(tmp_path), device="cpu"), draft=None,
                    spec=SpeculationSpec(drafter="lookup", num_draft_tokens=4), generation=GenerationSpec(
                        max_new_tokens=NEW, ignore_eos=True))
    generator = toolkit.build(recipe)
    expected = "sdpa" if type(generator.target)._supports_sdpa else "eager"
    assert generator.target.config._attn_implementation == expected
    prompt = "t5 t9 t13 t2 t5 t9 t13 t2 t5"
    ids = generator.encode(prompt)
    assert generator.generate(prompt).token_ids == hf_greedy(generator.target, ids, NEW)

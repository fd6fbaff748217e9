"""Token trees (toolkit/speculative/tree*.py, toolkit/engine/tree.py) on the decoder's static cache.

* the mask of hand-built trees, greedy tree verification on the device on hand-built logits;
* greedy tree speculation is token-identical to AR decoding for the draft model (EAGLE-2 dynamic trees) and the
  suffix drafter, with and without StreamingLLM, with rejections and >= 2 rounds;
* the draft model's own static cache holds exactly the committed prefix after every tree round;
* trees under a quantized KV cache plan when its residual has room (their exactness: tests/test_kv_quantized.py);
  the tree forward and the gather on every static form: tests/test_static_tree.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_forward, perturbed_copy, tiny_llama, tiny_neox

from toolkit.engine.accept import accept_tree
from toolkit.kv import make_policy
from toolkit.recipe import GenerationSpec, KVSpec
from toolkit.engine.planner import ConstantK
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.speculative.drafters import DraftModel
from toolkit.speculative.drafters.suffix import SuffixDrafter
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.tree import TokenTree, TreeShape
from toolkit.speculative.tree_dynamic import build_dynamic_tree

pytestmark = pytest.mark.usefixtures("one_thread")
INIT = {"initializer_range": 0.2}
NEW = 40


# ------------------------------------------------------------------------------------------ structure and masks
def hand_tree() -> TokenTree:
    #          root
    #        /      \
    #      0(a)     1(b)
    #     /   \
    #   2(c)  3(d)
    #    |
    #   4(e)
    return TokenTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 0, 2]))


def test_mask_of_a_hand_built_tree():
    tree = hand_tree()
    assert tree.depth.tolist() == [1, 1, 2, 2, 3]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0],  # a
        [1, 0, 1, 0, 0, 0],  # b
        [1, 1, 0, 1, 0, 0],  # c
        [1, 1, 0, 0, 1, 0],  # d
        [1, 1, 0, 1, 0, 1],  # e
    ], dtype=torch.bool)
    assert torch.equal(tree.mask(), expected) and tree.mask_rows() == expected.long().tolist()
    assert tree.path_to(4) == [0, 2, 4] and tree.path_to(-1) == []
    assert tree.children() == {-1: [0, 1], 0: [2, 3], 1: [], 2: [4], 3: [], 4: []}


def test_chain_is_a_tree_and_bad_trees_raise():
    chain = TokenTree.chain(torch.tensor([5, 6, 7]))
    assert chain.parent_list() == [-1, 0, 1] and chain.depth_list() == [1, 2, 3]
    assert torch.equal(chain.mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="parents\\[1\\]"):
        TokenTree(torch.tensor([1, 2]), torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="contradicts"):
        TokenTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), depth=torch.tensor([1, 1]))


def logits_for(argmax: list[int], vocab: int = 32) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def greedy_tree_accept(tree: TokenTree, logits: torch.Tensor) -> tuple[list[int], int, list[bool]]:
    """``(path, next token, kept entries)`` of :func:`toolkit.engine.accept.accept_tree` (the root's token: 0)."""
    tokens = torch.cat([torch.zeros(1, dtype=torch.long), tree.tokens])
    parents = torch.tensor([0] + [p + 1 for p in tree.parent_list()])
    depth = torch.tensor([0] + tree.depth_list())
    (deepest, nxt), keep = accept_tree(logits, tokens, parents, depth, tree.mask())
    return tree.path_to(int(deepest) - 1), int(nxt), keep.tolist()


def test_greedy_tree_accept_takes_the_deepest_matching_path():
    tree = hand_tree()
    # root predicts a (10); a predicts c (12); c predicts e (14); e predicts 7 (bonus)
    assert greedy_tree_accept(tree, logits_for([10, 12, 0, 14, 0, 7])) == ([0, 2, 4], 7, [1, 1, 0, 1, 0, 1])
    # root predicts b: only b is accepted, bonus = b's argmax
    assert greedy_tree_accept(tree, logits_for([11, 12, 9, 14, 0, 7]))[:2] == ([1], 9)
    # a accepted, but a predicts 13 = d; d's row gives the bonus
    assert greedy_tree_accept(tree, logits_for([10, 13, 0, 14, 3, 7]))[:2] == ([0, 3], 3)
    # nothing matches: the correction from the root row, the root alone kept
    assert greedy_tree_accept(tree, logits_for([2, 12, 0, 14, 0, 7])) == ([], 2, [1, 0, 0, 0, 0, 0])
    # c matches its parent a, but a does not match the root: c is not accepted
    assert greedy_tree_accept(tree, logits_for([11, 12, 0, 14, 0, 7]))[:2] == ([1], 0)
    # two accepted siblings of one depth: the first one listed
    twins = TokenTree(torch.tensor([10, 10]), torch.tensor([-1, -1]))
    assert greedy_tree_accept(twins, logits_for([10, 4, 5]))[:2] == ([0], 4)


def test_dynamic_tree_budget_topk_and_ancestor_closure():
    vocab = 16
    g = torch.Generator().manual_seed(3)
    calls = []

    def expand(nodes, tokens, parents, depths):
        calls.append(len(nodes))
        return torch.log_softmax(torch.randn(len(nodes), vocab, generator=g) * 3, -1)

    root = torch.log_softmax(torch.randn(vocab, generator=g) * 3, -1)
    tree, kept = build_dynamic_tree(root, expand, TreeShape(budget=10, depth=4, topk=3), depth=4)
    assert len(tree) == 10 and calls == [3, 3, 3]
    assert tree.max_depth <= 4
    assert kept == sorted(kept)
    # the root's children are its top-3 tokens, in order
    root_children = [tree.token_list()[i] for i in tree.children()[-1]]
    assert set(root_children) <= set(root.topk(3).indices.tolist())


# ------------------------------------------------------------------------------------------ greedy == AR
def decode(target, drafter, prompt, policy=None, tree=None, k=3, new=NEW):
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, drafter, ConstantK(k), policy, tree=tree)
    chunks = list(decoder.decode(prompt, GenerationSpec(max_new_tokens=new, ignore_eos=True), stats, []))
    return [t for c in chunks for t in c], stats


def assert_real_tree_rounds(stats):
    assert stats.rounds >= 2
    assert 0 < stats.accepted < stats.drafted  # acceptances and rejections both happened


# StreamingLLM ``reindex`` has no static form: trees refuse it (tests/test_static_tree.py).
POLICIES = {
    "none": None,
    "streaming": KVSpec("streaming", {"sink_tokens": 2, "window": 10, "compress_interval": 3}),
}


@pytest.mark.parametrize("kv", [{"policy": "quantized", "quant_bits": 4},
                                {"policy": "streaming", "window": 200, "quant_bits": 4}])
def test_trees_under_a_quantized_cache_plan(kv):
    """Trees run under a quantized cache (tests/test_kv_quantized.py checks they reproduce AR); the plan only asks
    for room: residual_length >= tree_depth + quant_group_size - 2, named when missing."""
    from toolkit.errors import ConfigError
    from toolkit.recipe import Recipe
    from toolkit.session import plan

    spec = {"drafter": "suffix", "tree": True, "tree_depth": 6}
    plan(Recipe.from_dict({"spec": spec, "draft": None, "kv": kv}))  # defaults: group 64, residual 128
    small = {**kv, "quant_group_size": 16, "residual_length": 19}
    with pytest.raises(ConfigError) as info:
        plan(Recipe.from_dict({"spec": spec, "draft": None, "kv": small}))
    assert info.value.field == "kv.residual_length" and "20" in str(info.value)
    plan(Recipe.from_dict({"spec": spec, "draft": None, "kv": {**small, "residual_length": 20}}))


def policy_of(name):
    return make_policy(POLICIES[name]) if POLICIES[name] is not None else None


@pytest.mark.parametrize("arch", ["llama", "neox"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_draft_model_tree_matches_ar(arch, policy):
    build = {"llama": tiny_llama, "neox": tiny_neox}[arch]
    target = build(seed=0, **INIT)
    draft = perturbed_copy(target, scale=0.1, seed=1)
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    ar, _ = decode(target, None, prompt, policy_of(policy))
    for shape in (TreeShape(8, 4, 2), TreeShape(12, 5, 3)):
        out, stats = decode(target, DraftModel(draft, policy_of(policy)), prompt, policy_of(policy), shape)
        assert out == ar
        assert_real_tree_rounds(stats)
        assert stats.draft_forwards > 0


@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_suffix_tree_matches_ar_and_remembers_requests(policy):
    target = tiny_llama(seed=0, **INIT)
    base = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    prompt = torch.cat([base, base, base[:, :5]], 1)
    ar, _ = decode(target, None, prompt, policy_of(policy))
    drafter = SuffixDrafter(max_spec_factor=2.0, min_token_prob=0.05)
    first, stats1 = decode(target, drafter, prompt, policy_of(policy), TreeShape(8, 6, 1))
    again, stats2 = decode(target, drafter, prompt, policy_of(policy), TreeShape(8, 6, 1))
    assert first == ar and again == ar
    assert stats2.rounds >= 2 and stats2.accepted > 0
    assert stats1.accepted + stats2.accepted < stats1.drafted + stats2.drafted  # rejections happened
    assert stats2.rounds < stats1.rounds  # the first request's output is in memory
    linear, stats3 = decode(target, drafter, prompt, policy_of(policy), None, k=6)
    assert linear == ar and stats3.accepted > 0


def test_draft_cache_holds_the_committed_prefix_after_every_tree_round():
    """After every tree round the draft model's static cache represents a committed prefix (the accepted path's
    expanded nodes gathered behind the tokens it held, the rest rolled back), with exactly the entries a forward over
    that prefix makes."""
    from transformers import DynamicCache

    target = tiny_llama(seed=0, **INIT)
    draft_lm = perturbed_copy(target, scale=0.1, seed=1)
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    drafter = DraftModel(draft_lm)
    decoder = SpeculativeDecoder(target, drafter, ConstantK(3), None, tree=TreeShape(8, 4, 2))
    sequence = prompt[0].tolist()
    checked = 0
    for chunk in decoder.decode(prompt, GenerationSpec(max_new_tokens=NEW, ignore_eos=True), GenerationStats(), []):
        sequence += chunk
        if len(sequence) == prompt.shape[1] + 1:
            continue  # the prefill's token: the draft's row joins after it
        cache, held = drafter.cache, drafter.cache.held[0]
        assert held == drafter._held[0] == int(cache.lengths[0]) and len(sequence) - 3 <= held < len(sequence)
        ref = DynamicCache()
        with torch.no_grad():
            hf_forward(draft_lm, input_ids=torch.tensor([sequence[:held]]), past_key_values=ref, use_cache=True)
        for layer, single in zip(cache.layers, ref.layers):
            assert torch.allclose(layer.keys[0, :, :held], single.keys[0], atol=1e-5)
            assert torch.allclose(layer.values[0, :, :held], single.values[0], atol=1e-5)
        checked += 1
    assert checked >= 2

def test_tree_sampling_in_the_decoder_is_reproducible_and_exact_in_length():
    target = tiny_llama(seed=0, **INIT)
    draft = perturbed_copy(target, scale=0.1, seed=1)
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))

    def run(seed):
        stats = GenerationStats()
        decoder = SpeculativeDecoder(target, DraftModel(draft), ConstantK(3), None, tree=TreeShape(8, 4, 2))
        spec = GenerationSpec(max_new_tokens=25, ignore_eos=True, do_sample=True, temperature=0.8, seed=seed)
        return [t for c in decoder.decode(prompt, spec, stats, []) for t in c], stats

    a, stats = run(3)
    b, _ = run(3)
    c, _ = run(4)
    assert a == b and a != c and len(a) == 25
    assert stats.rounds >= 2 and stats.accepted > 0


# ------------------------------------------------------------------------------------------ embedded model (slow)
@pytest.mark.slow
@pytest.mark.heavy  # 20-25 s; the tiny-model tests above prove the same path
def test_embedded_greedy_tree_matches_ar(embedded, embedded_int4, embedded_greedy):
    """fp32 embedded model, real prompts: EAGLE-2 trees from the NF4 self-draft (chat and code prompts) and suffix
    trees (every prompt) == HF greedy (the references test_decoder's embedded test checks too)."""
    model, tokenizer = embedded
    suffix = SuffixDrafter(max_spec_factor=2.0, min_token_prob=0.05)
    taus = []
    for name in ("chat", "summarize", "code"):
        prompt, reference = embedded_greedy(name, 32)
        drafters = [(suffix, TreeShape(12, 16, 4))]
        if name != "summarize":
            drafters.insert(0, (DraftModel(embedded_int4[0]), TreeShape(12, 4, 3)))
        for drafter, shape in drafters:
            ids, stats = decode(model, drafter, prompt, tree=shape, new=32)
            assert ids == reference, (name, type(drafter).__name__)
            assert stats.rounds >= 2
            taus.append(stats.tokens_per_round)
    assert max(taus) > 1.5

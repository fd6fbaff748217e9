"""Token trees (toolkit/speculative/tree*.py) and the tree commit of every cache class (``cache.keep_tail``).

* mask and positions of hand-built trees, greedy tree verification on hand-built logits;
* exact cache length and contents after a tree commit, for every cache class (dynamic, StreamingLLM absolute and
  reindex, L2 with per-layer lengths, head-aware tiers), after compression has already run: the tree forward's
  logits on the accepted path and the cache after :func:`keep_tail` equal a plain forward over that path;
* greedy tree speculation is token-identical to AR decoding for the draft model (EAGLE-2 dynamic trees) and the
  suffix drafter, with and without StreamingLLM, with rejections and >= 2 rounds;
* the draft model's own cache holds exactly the committed prefix after every tree round;
* trees under a quantized KV cache plan when its residual has room (their exactness: tests/test_kv_quantized.py).
"""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed_copy, tiny_llama, tiny_neox

from toolkit.kv import make_policy
from toolkit.kv.contract import new_cache, policy_attached
from toolkit.kv.tail import tree_additive_mask
from toolkit.recipe import GenerationSpec, KVSpec
from toolkit.engine.planner import ConstantK
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.speculative.drafters import DraftModel
from toolkit.speculative.drafters.suffix import SuffixDrafter
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.tree import TokenTree, TreeShape
from toolkit.speculative.tree_dynamic import build_dynamic_tree
from toolkit.speculative.tree_verify import greedy_tree_accept

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


def test_mask_and_positions_of_a_hand_built_tree():
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
    assert torch.equal(tree.mask(), expected)
    assert tree.positions(20).tolist() == [[20, 21, 21, 22, 22, 23]]
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


def test_tree_additive_mask_layout():
    tree_mask = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    mask = tree_additive_mask(tree_mask, held=3, dtype=torch.float32)
    assert mask.shape == (1, 1, 2, 5)
    visible = mask[0, 0] == 0
    assert visible.tolist() == [[True] * 3 + [True, False], [True] * 5]


def logits_for(argmax: list[int], vocab: int = 32) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_greedy_tree_accept_takes_the_deepest_matching_path():
    tree = hand_tree()
    # root predicts a (10); a predicts c (12); c predicts e (14); e predicts 7 (bonus)
    path, nxt = greedy_tree_accept(tree, logits_for([10, 12, 0, 14, 0, 7]))
    assert (path, nxt) == ([0, 2, 4], 7)
    # root predicts b: only b is accepted, bonus = b's argmax
    path, nxt = greedy_tree_accept(tree, logits_for([11, 12, 9, 14, 0, 7]))
    assert (path, nxt) == ([1], 9)
    # a accepted, but a predicts 13 = d; d's row gives the bonus
    path, nxt = greedy_tree_accept(tree, logits_for([10, 13, 0, 14, 3, 7]))
    assert (path, nxt) == ([0, 3], 3)
    # nothing matches: the correction from the root row
    path, nxt = greedy_tree_accept(tree, logits_for([2, 12, 0, 14, 0, 7]))
    assert (path, nxt) == ([], 2)


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


# ------------------------------------------------------------------------------------------ exact tree commit
CACHES = {
    "dynamic": None,
    "streaming": KVSpec("streaming", {"sink_tokens": 2, "window": 12, "compress_interval": 2}),
    "streaming-reindex": KVSpec("streaming", {"sink_tokens": 2, "window": 12, "compress_interval": 2,
                                              "position_mode": "reindex"}),
    "l2norm": KVSpec("l2norm", {"budget": 14, "sink_tokens": 2, "protect_recent": 4, "skip_layers": [0],
                                "compress_interval": 2}),
    "head_aware": KVSpec("head_aware", {"budget": 14, "sink_tokens": 2, "protect_recent": 4, "skip_layers": [0],
                                        "compress_interval": 2, "tiers": 2,
                                        "importance": [[0.1, 0.9], [0.8, 0.2]]}),
}


def layer_tensors(cache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        if hasattr(layer, "tier_keys"):
            out += layer.tier_keys + layer.tier_values
        else:
            out += [layer.keys, layer.values]
    return out


def forward(model, cache, tokens, positions, tree_mask=None):
    with policy_attached(getattr(cache, "policy", None), model):  # per-layer / per-tier attention for this forward
        out = model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=tokens.shape[1],
                    **cache.forward_kwargs(positions, tree_mask=tree_mask))
    return out.logits[0]


@pytest.mark.parametrize("name", list(CACHES))
def test_tree_commit_equals_a_forward_over_the_accepted_path(name):
    model = tiny_llama(seed=0, **INIT)
    prompt = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(1))

    def fresh():
        policy = make_policy(CACHES[name]) if CACHES[name] is not None else None
        cache = new_cache(policy, model)
        with torch.no_grad():
            forward(model, cache, prompt, torch.arange(30).unsqueeze(0))
        cache.commit()  # compresses (every policy's budget is below 30)
        return cache

    tree = hand_tree()
    tree = TokenTree(torch.tensor([3, 9, 40, 41, 77]), tree.parents)
    root = torch.tensor([[5]])
    with torch.no_grad():
        cache = fresh()
        length = cache.get_seq_length()
        assert length == 30
        if CACHES[name] is not None:
            assert cache.compressions == 1
        tokens = torch.cat([root, tree.tokens.view(1, -1)], 1)
        tree_logits = forward(model, cache, tokens, tree.positions(length), tree.mask())
        path = tree.path_to(4)  # root -> a -> c -> e
        cache.keep_tail([0] + [i + 1 for i in path])
        assert cache.get_seq_length() == length + 1 + len(path)

        ref = fresh()
        path_tokens = torch.cat([root, tree.tokens[path].view(1, -1)], 1)
        ref_logits = forward(model, ref, path_tokens, torch.arange(length, length + 4).unsqueeze(0))
    assert torch.allclose(tree_logits[[0] + [i + 1 for i in path]], ref_logits, atol=1e-5)
    assert ref.get_seq_length() == cache.get_seq_length()
    got, want = layer_tensors(cache), layer_tensors(ref)
    assert [t.shape for t in got] == [t.shape for t in want]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)
    assert cache.kv_bytes() == ref.kv_bytes()
    # the kept entries are still pending: the next commit compresses exactly like the reference
    cache.commit(), ref.commit()
    for a, b in zip(layer_tensors(cache), layer_tensors(ref)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def test_keep_tail_rejects_bad_offsets():
    model = tiny_llama(seed=0)
    cache = new_cache(None, model)
    with torch.no_grad():
        forward(model, cache, torch.tensor([[1, 2, 3]]), torch.arange(3).unsqueeze(0))
    cache.commit()
    with torch.no_grad():
        forward(model, cache, torch.tensor([[4, 5]]), torch.arange(3, 5).unsqueeze(0))
    with pytest.raises(ValueError, match="ascending"):
        cache.keep_tail([1, 0])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        cache.keep_tail([2])
    cache.keep_tail([1])
    assert cache.get_seq_length() == 4


# ------------------------------------------------------------------------------------------ greedy == AR
def decode(target, drafter, prompt, policy=None, tree=None, k=3, new=NEW):
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, drafter, ConstantK(k), policy, tree=tree)
    chunks = list(decoder.decode(prompt, GenerationSpec(max_new_tokens=new, ignore_eos=True), stats, []))
    return [t for c in chunks for t in c], stats


def assert_real_tree_rounds(stats):
    assert stats.rounds >= 2
    assert 0 < stats.accepted < stats.drafted  # acceptances and rejections both happened


# StreamingLLM ``reindex`` is left out here: its slot positions depend on when evictions happen, so not even linear
# speculation reproduces AR under it; its tree commit is checked exactly above.
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
    target = tiny_llama(seed=0, **INIT)
    draft_lm = perturbed_copy(target, scale=0.1, seed=1)
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    drafter = DraftModel(draft_lm)
    decoder = SpeculativeDecoder(target, drafter, ConstantK(3), None, tree=TreeShape(8, 4, 2))
    sequence = prompt[0].tolist()
    checked = 0
    for chunk in decoder.decode(prompt, GenerationSpec(max_new_tokens=NEW, ignore_eos=True), GenerationStats(), []):
        sequence += chunk
        cache, held = drafter.cache.cache, drafter.cache.length  # trees: the draft's single-sequence cache
        if cache is None or held == 0:
            continue
        assert cache.get_seq_length() == held <= len(sequence) - 1
        ref = new_cache(None, draft_lm)
        with torch.no_grad():
            forward(draft_lm, ref, torch.tensor([sequence[:held]]), torch.arange(held).unsqueeze(0))
        for a, b in zip(layer_tensors(cache), layer_tensors(ref)):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
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


@pytest.mark.parametrize("name", ["l2norm", "head_aware"])
def test_tree_rounds_under_compressing_policies_keep_exact_lengths(name):
    """Per-layer (L2 skip_layers) and per-tier (head-aware) lengths under tree masks, through many compressions:
    after every round the target cache represents exactly the committed sequence minus its last token."""
    target = tiny_llama(seed=0, **INIT)
    draft = perturbed_copy(target, scale=0.1, seed=1)
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    policy = make_policy(CACHES[name])
    decoder = SpeculativeDecoder(target, DraftModel(draft), ConstantK(3), policy, tree=TreeShape(8, 4, 2))
    factor = max(policy.plan(target)[1][1]) if name == "head_aware" else 1.0
    bound = round(factor * 14) + 2  # the compressed layer's largest (tier) budget + compress_interval
    stats = GenerationStats()
    committed = prompt.shape[1]
    for chunk in decoder.decode(prompt, GenerationSpec(max_new_tokens=60, ignore_eos=True), stats, []):
        committed += len(chunk)
        cache = decoder.cache.cache  # token trees: the policy's single-sequence cache (a SingleRowCache's)
        assert cache.get_seq_length() == committed - 1 == decoder.cache.length
        assert cache.physical_length(0) == committed - 1  # skip layer: every committed entry, nothing else
        assert cache.physical_length(1) <= min(bound, committed - 1)
    assert stats.new_tokens == 60 and stats.compressions_target >= 3 and 0 < stats.accepted < stats.drafted

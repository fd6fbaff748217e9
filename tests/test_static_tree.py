"""Token trees on the static engine (toolkit/kv/static_tree.py, toolkit/engine/tree.py).

* greedy tree decoding is token-identical to AR greedy under the same KV policy — none, the StreamingLLM ring, L2-norm
  and head-aware tiers (prompts compressed by their prefill), KIVI 4-bit, and a sliding-window model — for a
  model-free tree drafter, a draft model's EAGLE-2 trees (its own cache under the same policy) and EAGLE heads, with
  drafts accepted (tau > 1) and rejected;
* after a tree round every static form holds exactly the root's and the path's entries at the row's next slots (the
  same entries, lengths and fills as a chain forward over those tokens, through a compressing commit point after it);
* compiled forwards (dynamo, CPU's dynamic widths and CUDA's padded buckets) equal eager ones for tree rounds, through
  the graphs of chain forwards;
* sampling through tree rounds on the static cache reproduces the target's distribution (chi-square);
* trees are refused, naming ``spec.tree``, where no static cache holds the recipe.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import perturbed_copy, tiny_llama
from scipy.stats import chisquare
from test_decoder import INIT
from test_static_sliding import tiny as tiny_family

from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.forward import TargetForward
from toolkit.engine.planner import ConstantK
from toolkit.errors import ConfigError
from toolkit.kv import make_policy
from toolkit.kv.rows import rows_cache
from toolkit.kv.static import StaticKV
from toolkit.kv.static_tree import TreeInputs
from toolkit.recipe import GenerationSpec, KVSpec, Recipe
from toolkit.speculative.drafters import DraftModel
from toolkit.speculative.drafters.base import Drafter
from toolkit.speculative.drafters.eagle import EagleDrafter
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.tree import TokenTree, TreeShape

pytestmark = pytest.mark.usefixtures("one_thread")
DTYPE = torch.float64  # tree and chain forwards sum in other orders: in float64 no near-tie of two logits flips
NEW = 20
#: target KV policies; L2-norm and head-aware compress the 36-token prompts at their prefill and not again within
#: NEW tokens (interval 20), so AR and speculation see the same commit points
POLICIES = {
    "none": None,
    "streaming": {"policy": "streaming", "sink_tokens": 2, "window": 10, "compress_interval": 3},
    "l2norm": {"policy": "l2norm", "budget": 12, "sink_tokens": 2, "protect_recent": 4, "skip_layers": [0],
               "compress_interval": 20},
    "head_aware": {"policy": "head_aware", "budget": 12, "sink_tokens": 2, "protect_recent": 4, "skip_layers": [0],
                   "compress_interval": 20, "tiers": 2, "importance": [[0.5, 0.5], [0.1, 0.9]]},
    "kivi4": {"policy": "quantized", "quant_bits": 4, "quant_group_size": 8, "residual_length": 10, "sink_tokens": 2},
}
SHAPE = TreeShape(budget=8, depth=4, topk=2)


def policy_of(name: str):
    spec = POLICIES[name]
    return None if spec is None else make_policy(KVSpec(spec["policy"], {k: v for k, v in spec.items()
                                                                          if k != "policy"}))


def prompt_of(seed: int = 0, length: int = 36) -> torch.Tensor:
    return torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed))


class OracleTrees(Drafter):
    """A model-free tree drafter that knows the target's greedy continuation ``reference`` (prompt included): every
    tree is the true next tokens down ``depth`` levels, each with a wrong sibling listed first (so the path's entries
    are not the first slots), and every other tree's third level is wrong too — rounds accept several tokens and
    reject some."""

    def __init__(self, reference: list[int], vocab: int = 128):
        self.reference, self.vocab, self.proposed = reference, vocab, 0

    def propose(self, input_ids, num_draft_tokens):
        raise NotImplementedError("trees only")

    def propose_tree(self, input_ids: torch.Tensor, budget: int, depth: int, topk: int) -> TokenTree:
        n = input_ids.shape[1]
        truth = self.reference[n:n + min(depth, budget // 2)]
        self.proposed += 1
        tokens, parents, parent = [], [], -1
        for level, token in enumerate(truth):
            if level == 2 and self.proposed % 2:
                token = (token + 3) % self.vocab
            tokens += [(token + 1) % self.vocab, token]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return TokenTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def commit_tree(self, accepted_nodes: list[int]) -> None:
        pass


def decode(target, drafter, prompt, policy, tree=None, forward=None, new=NEW, **gen):
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, drafter, ConstantK(3), policy, tree=tree, forward=forward)
    spec = GenerationSpec(max_new_tokens=new, ignore_eos=True, **gen)
    return [t for chunk in decoder.decode(prompt, spec, stats) for t in chunk], stats, decoder


def assert_real_tree_rounds(stats) -> None:
    assert stats.rounds >= 2 and stats.tokens_per_round > 1  # drafts accepted
    assert stats.accepted < stats.drafted  # and some rejected


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=0, **INIT).to(DTYPE)


@pytest.fixture(scope="module")
def sliding():
    return tiny_family("qwen2").to(DTYPE)  # a sliding layer (window 16) and a full one


# ------------------------------------------------------------------------------------------------ greedy == AR
@pytest.mark.parametrize("drafter", ["oracle", "draft_model"])
@pytest.mark.parametrize("name", [*POLICIES, "sliding"])
def test_greedy_tree_decoding_equals_ar_under_the_same_policy(llama, sliding, name, drafter):
    target, kv = (sliding, "none") if name == "sliding" else (llama, name)
    prompt = prompt_of(1)
    ar, _, _ = decode(target, None, prompt, policy_of(kv))
    if drafter == "oracle":
        tree_drafter = OracleTrees(prompt[0].tolist() + ar)
    else:  # the draft's own cache under the same policy: its tree expansions run on that static form
        tree_drafter = DraftModel(perturbed_copy(target, scale=0.1, seed=1), policy_of(kv))
    ids, stats, decoder = decode(target, tree_drafter, prompt, policy_of(kv), SHAPE)
    assert ids == ar
    assert_real_tree_rounds(stats)
    assert isinstance(decoder.cache, StaticKV)
    if drafter == "draft_model":
        assert isinstance(tree_drafter.cache, StaticKV) and stats.draft_forwards > stats.rounds
    if kv in ("l2norm", "head_aware", "kivi4"):
        assert stats.compressions_target >= 1  # the prompt was compressed (and, for KIVI, groups packed since)


@pytest.mark.parametrize("name", list(POLICIES))
def test_greedy_eagle_trees_equal_ar_under_the_same_policy(eagle_pair, name):
    """EAGLE-2 trees of an EAGLE head: its expansions on its static head cache, the target's verify on the policy's
    static form (fp32: the head's target); with no policy, the head's steps and the target's forwards compiled too
    (dynamo traces: the head's tree step is a graph of its own, the target's verify the chains')."""
    target, head = eagle_pair
    prompt, shape = prompt_of(2), TreeShape(budget=10, depth=5, topk=2)
    ar, _, _ = decode(target, None, prompt, policy_of(name))
    ids, stats, decoder = decode(target, EagleDrafter(target, head), prompt, policy_of(name), shape)
    assert ids == ar
    assert_real_tree_rounds(stats)
    assert isinstance(decoder.cache, StaticKV) and isinstance(decoder.drafter.cache, StaticKV)
    if name == "none":
        drafter = EagleDrafter(target, head, compile=True, backend="eager")
        forward = TargetForward(target, compile=True, backend="eager")
        assert decode(target, drafter, prompt, None, shape, forward)[0] == ar
        assert (False, 1, 2, "tree") in drafter.step._seen and (1, 2, drafter.features) in forward.compile_s


def test_tree_rounds_keep_exact_lengths_through_compressions(llama):
    """L2-norm and head-aware tiers compacted at commit points after tree rounds (interval 2): after every round the
    row represents the committed sequence but its last token, and every tier's fill stays within its budget +
    interval (what the next tree forward may add is the slack of its buffers)."""
    for spec in ({"budget": 10, "sink_tokens": 2, "protect_recent": 2, "skip_layers": [0], "compress_interval": 2},
                 {"budget": 10, "sink_tokens": 2, "protect_recent": 2, "skip_layers": [0], "compress_interval": 2,
                  "tiers": 2, "importance": [[0.5, 0.5], [0.1, 0.9]]}):
        policy = make_policy(KVSpec("head_aware" if "tiers" in spec else "l2norm", spec))
        prompt = prompt_of(3, 12)
        decoder = SpeculativeDecoder(llama, DraftModel(perturbed_copy(llama, scale=0.1, seed=1)), ConstantK(3),
                                     policy, tree=SHAPE)
        stats, committed = GenerationStats(), prompt.shape[1]
        for chunk in decoder.decode(prompt, GenerationSpec(max_new_tokens=40, ignore_eos=True), stats):
            committed += len(chunk)
            cache = decoder.cache
            assert cache.held[0] == committed - 1 == int(cache.lengths[0])
            for factor in cache.factors:
                assert cache.fill_held[factor][0] == int(cache.fill[factor][0]) <= \
                    cache.budget(factor, committed - 1) + 2
        assert stats.compressions_target >= 5 and 0 < stats.accepted < stats.drafted


# ------------------------------------------------------------------------------------------------ the gather
#: per static form: (policy, model, prompt length); KIVI: the deepest query (position 21) sees the group [10, 18) in
#: the shadow; L2-norm / head-aware: the prefill compacts, and so does the commit after the tree round
FORMS = {
    "plain": (None, "llama", 19),
    "ring": ({"policy": "streaming", "sink_tokens": 2, "window": 6, "compress_interval": 2}, "llama", 19),
    "l2norm": ({"policy": "l2norm", "budget": 8, "sink_tokens": 2, "protect_recent": 2, "skip_layers": [0],
                "compress_interval": 2}, "llama", 14),
    "head_aware": ({"policy": "head_aware", "budget": 8, "sink_tokens": 2, "protect_recent": 2, "skip_layers": [0],
                    "compress_interval": 2, "tiers": 2, "importance": [[0.5, 0.5], [0.1, 0.9]]}, "llama", 14),
    "kivi": ({"policy": "quantized", "quant_bits": 4, "quant_group_size": 8, "residual_length": 10,
              "sink_tokens": 2}, "llama", 19),
    "sliding": (None, "sliding", 19),
    # StreamingLLM's other modes (toolkit.kv.static_stream): not AR-exact under any speculation (what a query sees,
    # or its sinks' relative positions, depends on when the commit points compacted), so only the gather is checked
    "reindex": ({"policy": "streaming", "sink_tokens": 2, "window": 8, "compress_interval": 2,
                 "position_mode": "reindex"}, "llama", 19),
    "rolling": ({"policy": "streaming", "sink_tokens": 2, "window": 8, "compress_interval": 2, "exact_window": False},
                "llama", 19),
}


def hand_tree() -> TokenTree:
    """root -> a -> c -> e and branches: nodes [a, b, c, d, e], parents [-1, -1, 0, 0, 2] (path to e: 0, 2, 4)."""
    return TokenTree(torch.tensor([3, 9, 40, 41, 77]), torch.tensor([-1, -1, 0, 0, 2]))


def region_entries(cache, kept: int) -> list[torch.Tensor]:
    """The first ``kept`` slots after the region's start (``kept`` tokens before row 0's length) of every buffer a
    forward writes."""
    with cache._rewound(kept):
        cache.prepare(kept, range(0, 1))
    return [buffer[0].index_select(1, index[0]).clone() for buffer, index in cache.tree_entries()]


@pytest.mark.parametrize("form", list(FORMS))
def test_after_a_tree_round_the_cache_holds_the_path_as_a_chain_forward_would(llama, sliding, form):
    spec, model_name, length = FORMS[form]
    model = {"llama": llama, "sliding": sliding}[model_name]
    engine = TargetForward(model)
    prompt = prompt_of(4, length)
    tree = hand_tree()
    path = tree.path_to(4)
    keep = [0] + [i + 1 for i in path]

    def prefilled():
        policy = None if spec is None else make_policy(KVSpec(spec["policy"], {k: v for k, v in spec.items()
                                                                                if k != "policy"}))
        cache = rows_cache(policy, model, 1, 64, 8)
        begun, kwargs = cache.begin_row(length - 1)
        engine.prefill(prompt[:, :-1], kwargs)
        cache.add_row(begun, length - 1)
        return cache

    with torch.inference_mode(), engine.attached():
        cache = prefilled()
        tokens = torch.cat([prompt[:, -1:], tree.tokens.view(1, -1)], 1)
        region = TreeInputs.build([-1] + [p + 1 for p in tree.parent_list()], [0] + tree.depth_list(), 6, True, "cpu")
        tree_logits = engine(cache, tokens, tree=region)[0]
        cache.keep_tree(torch.tensor(keep + [i for i in range(6) if i not in keep]))
        cache.accept(torch.tensor([4]), [4])
        chain = prefilled()
        chain_logits = engine(chain, tokens[:, keep])[0]
        chain.accept(torch.tensor([4]), [4])
        torch.testing.assert_close(tree_logits[keep], chain_logits, rtol=0, atol=1e-10)
        for got, want in zip(region_entries(cache, 4), region_entries(chain, 4)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        compressions = (cache.compressions, chain.compressions)
        cache.commit(), chain.commit()
        if form in ("l2norm", "head_aware", "kivi", "reindex", "rolling"):
            assert cache.compressions == chain.compressions > compressions[1]  # the commit point compressed both
        counters, chain_counters = cache.row_counters(), chain.row_counters()
        assert [c[0] for c in counters[1]] == [c[0] for c in chain_counters[1]]  # lengths, fills, packed tokens
        assert all(torch.equal(a[:1], b[:1]) for a, b in zip(counters[0], chain_counters[0]))
        after = prompt[:, :3]  # the next forward sees exactly what the chain's sees
        torch.testing.assert_close(engine(cache, after), engine(chain, after), rtol=0, atol=1e-10)


def test_a_tree_reaching_a_quantization_group_is_refused(llama):
    """KIVI on the static engine: a tree whose nodes would fall into a quantization group (the plan's check
    ``residual_length >= tree_depth + quant_group_size - 2`` not met) raises instead of decoding wrongly."""
    policy = make_policy(KVSpec("quantized", {"quant_bits": 4, "quant_group_size": 8, "residual_length": 5,
                                              "sink_tokens": 0}))
    cache = rows_cache(policy, llama, 1, 64, 8)
    engine = TargetForward(llama)
    with torch.inference_mode(), engine.attached():
        begun, kwargs = cache.begin_row(6)
        engine.prefill(prompt_of(5, 6), kwargs)
        cache.add_row(begun, 6)
        region = TreeInputs.build([-1, 0, 0, 1, 3, 4], [0, 1, 1, 2, 3, 4], 6, True, "cpu")  # boundary(10) = 8 > 7
        with pytest.raises(ValueError, match="quantization group"):
            engine(cache, torch.zeros(1, 6, dtype=torch.long), tree=region)


# ------------------------------------------------------------------------------------------------ compiled
def test_compiled_tree_rounds_equal_eager_through_the_chain_graphs(llama):
    """Dynamo traces the target's and the draft model's forwards: tree verifies and expansions run in the chain
    forwards' graphs (CPU: one per class of widths), and padded to CUDA's width buckets, with the eager tokens."""
    from toolkit.engine.forward import _graphs

    torch._dynamo.reset()
    draft = perturbed_copy(llama, scale=0.1, seed=1)
    prompt = prompt_of(6, 16)
    reference, _, _ = decode(llama, DraftModel(draft), prompt, None, SHAPE, new=12)
    for buckets in (False, True):
        forward = TargetForward(llama, compile=True, backend="eager", buckets=buckets)
        draft_forward = TargetForward(draft, compile=True, backend="eager", buckets=buckets, name="draft")
        decode(llama, DraftModel(draft, forward=draft_forward), prompt, None, None, forward, new=12)  # chains
        graphs = _graphs()
        ids, stats, _ = decode(llama, DraftModel(draft, forward=draft_forward), prompt, None, SHAPE, forward, new=12)
        assert ids == reference and stats.tokens_per_round > 1
        if buckets:
            assert all(width in forward.widths for _, width in forward.compile_s)  # the tree's 9 ran in 16
        else:  # CPU's dynamic widths: the tree forwards ran in the chains' graphs, nothing was traced for them
            assert _graphs() == graphs and set(forward.compile_s) == {(1, 1), (1, 2)}
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------ sampling
V = 6


@pytest.mark.slow
def test_sampling_through_tree_rounds_on_the_static_cache_is_lossless():
    """A tiny target over 6 tokens; every draw runs one sampled tree round (root children 0, 2, 4; below 0: 1, 3;
    below 2: 5 — one-hot drafts) on the static cache from the same committed prompt, then rolls it back. The round's
    first two tokens (the second from the target's own p(x2 | x1) when the round commits one) follow p(x1) p(x2 | x1)
    exactly (chi-square over the 36 cells, the rare ones pooled); a round whose tree mask let a node see its siblings
    fails it (p < 1e-100)."""
    from toolkit.engine.rows import Row
    from toolkit.engine.tree import tree_round
    from toolkit.speculative.drafters.rows import RowDrafters

    target = tiny_llama(seed=3, vocab=V, **INIT)
    prompt = torch.tensor([[1, 4, 2, 5, 0, 3, 1]])
    with torch.no_grad():
        p1 = torch.softmax(target(prompt).logits[0, -1].double(), -1)
        p2 = torch.stack([torch.softmax(target(torch.cat([prompt, torch.tensor([[x]])], 1)).logits[0, -1].double(), -1)
                          for x in range(V)])
    tree = TokenTree(torch.tensor([0, 2, 4, 1, 3, 5]), torch.tensor([-1, -1, -1, 0, 0, 1]))

    class FixedTree(Drafter):
        def propose(self, input_ids, num_draft_tokens):
            raise NotImplementedError("trees only")

        def propose_tree(self, input_ids, budget, depth, topk):
            return tree

        def commit_tree(self, accepted_nodes):
            pass

    decoder = SpeculativeDecoder(target, FixedTree(), ConstantK(3), tree=TreeShape(6, 2, 3))
    gen = GenerationSpec(max_new_tokens=8, do_sample=True, ignore_eos=True)
    drafting = RowDrafters(FixedTree, trees=True)
    rng, counts = np.random.default_rng(0), np.zeros((V, V))
    draws = 3000
    with torch.inference_mode(), decoder.forward.attached():
        decoder.cache = decoder.forward.cache_for(None, 1, 64, 7)
        begun, kwargs = decoder.cache.begin_row(prompt.shape[1] - 1)
        decoder.forward.prefill(prompt[:, :-1], kwargs)
        decoder.cache.add_row(begun, prompt.shape[1] - 1)
        row = Row(0, prompt.shape[1], prompt[0].tolist(), GenerationStats(), torch.Generator().manual_seed(1), 0.0)
        drafting.begin(row)
        for _ in range(draws):
            ids = tree_round(decoder, row, gen, 8, drafting)
            decoder.cache.accept(torch.tensor([-len(ids)]), [-len(ids)])  # back to the prompt
            second = ids[1] if len(ids) > 1 else int(rng.choice(V, p=(p2[ids[0]] / p2[ids[0]].sum()).numpy()))
            counts[ids[0], second] += 1
    assert row.stats.accepted > 0 and row.stats.rounds == draws
    expected = (p1[:, None] * p2).numpy().ravel()
    expected = expected / expected.sum() * draws
    rare = expected < 5  # cells expected fewer than 5 times are pooled into one (the chi-square approximation)
    observed = np.append(counts.ravel()[~rare], counts.ravel()[rare].sum())
    assert chisquare(observed, np.append(expected[~rare], expected[rare].sum())).pvalue > 0.01


# ------------------------------------------------------------------------------------------------ refusals
def recipe(kv: dict, draft_kv: dict | None = None, drafter: str = "suffix") -> Recipe:
    return Recipe.from_dict({"spec": {"drafter": drafter, "tree": True, "tree_depth": 4}, "kv": kv,
                             "draft": None if drafter == "suffix" else {"source": "embedded"},
                             **({"draft_kv": draft_kv} if draft_kv else {})})


@pytest.mark.parametrize("owner", ["target", "draft"])
def test_trees_are_refused_where_a_policy_has_no_static_form(owner):
    """Every shipped policy has a static form; a policy that declares none (a user's own) cannot hold trees."""
    from toolkit.engine.tree import check_tree_support
    from toolkit.kv.base import KVPolicy

    with pytest.raises(ConfigError) as info:
        check_tree_support(KVPolicy(), None, owner)
    assert info.value.field == "spec.tree" and "static cache" in str(info.value)
    assert "has no static form" in str(info.value) and f"{owner}'s" in str(info.value)


def test_trees_are_refused_on_a_model_the_static_cache_does_not_hold():
    chunked = tiny_llama(seed=0)
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ConfigError) as info:
        SpeculativeDecoder(chunked, OracleTrees([]), tree=SHAPE)
    assert info.value.field == "spec.tree" and "chunked_attention" in str(info.value)

"""One host sync per round: the decode loop and the target's cache read nothing back from the device but each round's
accepted counts and next tokens (and the prefill's first token).

Every way a tensor reaches the host (``tolist``, ``item``, ``int()``, ``float()``, ``bool()``, ``cpu()``,
``numpy()``) is patched to count the calls made from the decoder's own modules (``toolkit.engine``) and the target's
caches (``toolkit.kv``). On a CPU every tensor is already on the host, so the count is of the calls that would be
device-to-host transfers on a GPU, plus one per request that is not: the prompt's ids, read once from the caller's
host tensor. Drafters (``toolkit.speculative.drafters``) are not counted: model-free ones keep their state on the host
by design (the main recipe's lookup drafter) — except in the network drafters' test, which watches the draft model
and the EAGLE head too (``toolkit.speculative.drafters``, ``toolkit.eagle``): under a planner that does not read draft
confidences they leave their tokens on the device, and the decoder reads them with the round's one transfer. Token
trees read once per round too (verified on the device, greedy or sampled: the deepest accepted node and the next
token).
"""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

import pytest
import torch
from conftest import batch_decoder, tiny_llama
from test_decoder import INIT, make_prompt

import toolkit.engine.accept as accept_module
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.forward import TargetForward
from toolkit.engine.planner import CostAwareK
from toolkit.recipe import GenerationSpec
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import LookupDrafter
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.verify_length import Calibrator

READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")
WATCHED = ("toolkit.engine", "toolkit.kv")
#: the network drafters' modules, watched too where they draft
NETWORK = ("toolkit.speculative.drafters", "toolkit.eagle")


@contextlib.contextmanager
def counted_reads(watched: tuple[str, ...] = WATCHED):
    """Count device-to-host reads made from ``watched`` modules inside the block (``counts["n"]``)."""
    counts = {"n": 0, "where": []}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(watched):
                counts["n"] += 1
                counts["where"].append(f"{caller}:{sys._getframe(1).f_lineno} {name}")
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:  # the CPU-only NumPy acceptance off: the device path's reads are the ones counted (what a GPU runs)
        with mock.patch.object(accept_module, "on_host", lambda tensor: False):
            yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def repetitive(seed: int) -> torch.Tensor:
    base = make_prompt(seed, length=8)[0]
    return torch.cat([base, base, base[:3]]).view(1, -1)


#: KV policies on the static engine (test id: policy, fields): none, L2-norm / head-aware eviction and StreamingLLM
#: with reindexed positions or the rolling window compacted at commit points (budgets small enough that the 30 new
#: tokens compact several times), KIVI quantization packing groups at commit points, alone or evicting them under the
#: rolling window
POLICIES = {"none": None,
            "l2norm": ("l2norm", {"budget": 12, "sink_tokens": 2, "protect_recent": 4, "skip_layers": [0],
                                  "compress_interval": 3}),
            "head_aware": ("head_aware", {"budget": 12, "sink_tokens": 2, "protect_recent": 4, "skip_layers": [0],
                                          "tiers": 2, "compress_interval": 3, "importance": [[0.5, 0.5], [0.1, 0.9]]}),
            "quantized": ("quantized", {"quant_bits": 8, "quant_group_size": 8, "residual_length": 8,
                                        "sink_tokens": 2}),
            "streaming_reindex": ("streaming", {"sink_tokens": 4, "window": 16, "compress_interval": 4,
                                                "position_mode": "reindex"}),
            "streaming_rolling": ("streaming", {"sink_tokens": 4, "window": 20, "compress_interval": 2,
                                                "exact_window": False}),
            "streaming_quantized": ("streaming", {"sink_tokens": 4, "window": 20, "compress_interval": 3,
                                                  "exact_window": False, "quant_bits": 8, "quant_group_size": 8,
                                                  "residual_length": 8})}


#: compiled policies whose static form another case here already traces (L2-norm: head-aware's tiered buffers; the
#: rolling ring: the quantized rolling ring's): their compiled greedy cases run in make test-system with the rest
TRACED_ALIKE = ("l2norm", "streaming_rolling")


def _cases():
    """Every policy x eager/compiled x greedy/sampling; sampling through a compiled compressing cache (3-8 s each:
    the graphs are traced again) runs in make test-system, its greedy twin and sampling on the plain cache here;
    so do the compiled greedy cases of :data:`TRACED_ALIKE`."""
    for do_sample in (False, True):
        for compiled in (False, True):
            for policy in POLICIES:
                heavy = compiled and policy != "none" and (do_sample or policy in TRACED_ALIKE)
                yield pytest.param(compiled, do_sample, policy, marks=pytest.mark.heavy if heavy else (),
                                   id=f"{'sampling' if do_sample else 'greedy'}-{'compiled' if compiled else 'eager'}"
                                      f"-{policy}")


@pytest.mark.parametrize("compiled,do_sample,policy", list(_cases()))
def test_the_default_path_reads_the_device_once_per_round(compiled, do_sample, policy):
    from toolkit.kv import make_policy
    from toolkit.recipe import KVSpec

    target = tiny_llama(seed=0, **INIT)
    forward = TargetForward(target, compile=compiled, backend="eager")
    controller = CostAwareK(VerifyCost([1.0] * 64, learn=False), Calibrator(), 6, 7)  # the main recipe's planner
    kv = None if POLICIES[policy] is None else make_policy(KVSpec(*POLICIES[policy]))
    decoder = SpeculativeDecoder(target, LookupDrafter(max_cached_requests=0), controller, kv, forward=forward)
    gen = GenerationSpec(max_new_tokens=30, ignore_eos=True, do_sample=do_sample, temperature=0.3, top_k=5, seed=3)
    list(decoder.decode(repetitive(0), gen, GenerationStats()))  # warm: graphs traced outside the count
    stats = GenerationStats()
    with counted_reads() as counts:
        list(decoder.decode(repetitive(1), gen, stats))
    assert stats.rounds >= 5 and stats.accepted > 0
    assert kv is None or stats.compressions_target > 2  # commit points compacted the static buffers or packed groups
    # exactly one read per round (+ 2 per request: the prefill's first token, the prompt's host ids): the instrument
    # sees the loop's own reads, and there are no others
    assert counts["n"] == stats.rounds + 2, counts["where"]


def test_a_batch_reads_the_device_once_per_round_for_all_its_rows():
    target = tiny_llama(seed=0, **INIT)
    decoder = batch_decoder(target, lambda: LookupDrafter(max_cached_requests=0), VerifyCost([1.0] * 64, learn=False),
                            num_draft_tokens=4, batch_size=4)
    prompts = [repetitive(seed) for seed in range(4)]
    gen = GenerationSpec(max_new_tokens=20, ignore_eos=True)
    with counted_reads() as counts:
        rows = decoder.decode_batch(prompts, gen)
    rounds = max(stats.rounds for _, stats in rows)  # every round serves every row still in flight
    assert counts["n"] <= rounds + 2 * len(prompts), counts["where"]


@pytest.mark.parametrize("drafter", ["draft_model", "eagle"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_compiled_network_drafters_read_the_device_once_per_round(eagle_pair, drafter, do_sample):
    """A compiled draft model and a compiled EAGLE head (constant K): the drafter's round (catch-up, steps,
    rollback) reads nothing back; its tokens come to the host with the round's accepted counts, in one transfer."""
    from conftest import perturbed_copy

    from toolkit.engine.planner import ConstantK
    from toolkit.speculative.drafters import DraftModel
    from toolkit.speculative.drafters.eagle import EagleDrafter

    target, head = eagle_pair
    forward = TargetForward(target, compile=True, backend="eager")
    if drafter == "eagle":
        make = lambda: EagleDrafter(target, head, do_sample=do_sample, top_k=5, compile=True, backend="eager")  # noqa: E731
    else:
        draft_forward = TargetForward(perturbed_copy(target, scale=0.05), compile=True, backend="eager", name="draft")
        make = lambda: DraftModel(draft_forward.model, do_sample=do_sample, top_k=5, forward=draft_forward)  # noqa: E731
    gen = GenerationSpec(max_new_tokens=24, ignore_eos=True, do_sample=do_sample, temperature=0.3, top_k=5, seed=3)
    list(SpeculativeDecoder(target, make(), ConstantK(3), forward=forward).decode(make_prompt(100, length=8), gen,
                                                                                   GenerationStats()))  # warm
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, make(), ConstantK(3), forward=forward)
    with counted_reads(WATCHED + NETWORK) as counts:
        list(decoder.decode(make_prompt(101, length=8), gen, stats))
    assert stats.rounds >= 4 and stats.drafted > 0 and stats.tokens_per_round > 1
    assert counts["n"] == stats.rounds + 2, counts["where"]


@pytest.mark.parametrize("do_sample,compiled,policy", [(False, False, "none"), (True, False, "none"),
                                                        pytest.param(False, True, "quantized",
                                                                     marks=pytest.mark.heavy)],  # ~10 s compiling
                         ids=["greedy-eager", "sampling-eager", "greedy-compiled-quantized"])
def test_tree_rounds_read_the_device_once_per_round(compiled, do_sample, policy):
    """Token trees of a model-free drafter on the static engine: greedy and sampled trees are verified on the device
    (``accept_tree``; the rejection-sampling walk of ``tree_verify``), and the decoder, the walk and the cache (the
    tree forward, the gather of the accepted path in place, the commit point) read it once per round."""
    from toolkit.engine.planner import ConstantK
    from toolkit.kv import make_policy
    from toolkit.recipe import KVSpec
    from toolkit.speculative.drafters.suffix import SuffixDrafter
    from toolkit.speculative.tree import TreeShape

    target = tiny_llama(seed=0, **INIT)
    forward = TargetForward(target, compile=compiled, backend="eager")
    kv = None if POLICIES[policy] is None else make_policy(KVSpec(*POLICIES[policy]))
    drafter = SuffixDrafter(max_spec_factor=2.0, min_token_prob=0.05)  # remembers the warm-up request
    decoder = SpeculativeDecoder(target, drafter, ConstantK(4), kv, tree=TreeShape(8, 5, 1), forward=forward)
    gen = GenerationSpec(max_new_tokens=30, ignore_eos=True, do_sample=do_sample, temperature=0.3, top_k=5, seed=3)
    list(decoder.decode(repetitive(0), gen, GenerationStats()))  # warm: graphs traced outside the count
    stats = GenerationStats()
    with counted_reads(WATCHED + ("toolkit.speculative.tree_verify",)) as counts:
        list(decoder.decode(repetitive(1), gen, stats))
    assert stats.rounds >= 5 and stats.accepted > 0
    assert counts["n"] == stats.rounds + 2, counts["where"]

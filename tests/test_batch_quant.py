"""The KIVI-quantized KV cache per row of a batch (toolkit/kv/quantized_rows.py): every row's greedy output is
what its prompt gives alone under the same quantized cache — rows packing groups at different rounds, verify forwards
straddling a group boundary (the shadow) — and the batch holds packed groups, not full-precision history."""

from __future__ import annotations

import pytest
from conftest import batch_decoder, tiny_llama
from test_batch import prompts
from test_decoder import INIT

import toolkit
from toolkit.recipe import Recipe


def quant_recipe(bits: int, drafter: str = "lookup") -> Recipe:
    return Recipe.from_dict({"name": "quant-batch", "target": {"device": "cpu"}, "draft": None,
                             "kv": {"policy": "quantized", "quant_bits": bits, "quant_group_size": 8,
                                    "residual_length": 6, "sink_tokens": 2},
                             "spec": {"drafter": drafter, "num_draft_tokens": 4},
                             "generation": {"max_new_tokens": 48, "ignore_eos": True}})


@pytest.mark.parametrize("bits", [2, 4])
def test_quantized_kv_per_row_equals_each_prompt_alone_under_the_policy(bits):
    target = tiny_llama(seed=0, **INIT)
    generator = toolkit.build(quant_recipe(bits), target=target, tokenizer=None)
    assert generator.batchable
    batch = prompts(5)  # 12..20 tokens, + 48: every row packs several groups of 8, at its own rounds
    alone = [generator.generate(p).token_ids for p in batch]
    rows = generator.generate_batch(batch, batch_size=3)
    assert [r.token_ids for r in rows] == alone
    assert sum(r.stats.accepted for r in rows) > 0  # drafts verified: forwards of up to 5 positions
    plain = toolkit.build(quant_recipe(bits).replace(kv=toolkit.recipe.KVSpec()), target=target, tokenizer=None)
    assert [r.token_ids for r in plain.generate_batch(batch, batch_size=3)] != alone  # the cache is really quantized


def test_quantized_batch_cache_holds_packed_groups_and_a_bounded_residual():
    from toolkit.kv.quantized import QuantizedKV
    from toolkit.recipe import GenerationSpec
    from toolkit.kv.quantized_rows import QuantBatchCache
    from toolkit.speculative.cost_model import VerifyCost

    target = tiny_llama(seed=0, **INIT)
    policy = QuantizedKV(quant_bits=4, quant_group_size=8, residual_length=6, sink_tokens=2)
    seen = []

    class Watch(QuantBatchCache):
        def compress(self):
            super().compress()
            seen.append((self.committed.tolist(), self.evicted.tolist(), self.lengths.tolist()))

    decoder = batch_decoder(target, lambda: None, VerifyCost([1.0] * 64, learn=False), num_draft_tokens=1,
                            batch_size=2, policy=policy)
    decoder._new_cache = lambda prompts, gen: Watch.for_model(target, policy)
    decoder.decode_batch(prompts(2), GenerationSpec(max_new_tokens=40, ignore_eos=True))
    for committed, packed, fp in seen:
        for c, q, n in zip(committed, packed, fp):
            held = c - 1
            # packed: whole groups after the sinks, up to boundary(held); the fp buffer: sinks + the residual
            expected = max(0, 8 * min((held - 2) // 8, -(-(held - 2 - 6) // 8))) if held - 2 - 6 > 0 else 0
            assert q == expected and n == held - q and n <= 2 + max(6, 7) + 1
    assert seen and isinstance(decoder.cache, Watch)

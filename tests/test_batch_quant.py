"""The KIVI-quantized KV cache per row of a batch, on the static engine (toolkit/kv/static_quant.py): every row's
greedy output is what its prompt gives alone under the same quantized cache — rows packing groups at different
rounds, verify forwards straddling a group boundary (the shadow), rows leaving and joining — and every row holds
packed groups up to its own boundary and a bounded full-precision residual, not full-precision history."""

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


def test_quantized_rows_hold_packed_groups_and_a_bounded_residual():
    from toolkit.kv.quantized import QuantizedKV
    from toolkit.kv.static_quant import StaticQuantKV
    from toolkit.recipe import GenerationSpec
    from toolkit.speculative.cost_model import VerifyCost
    from toolkit.speculative.drafters import LookupDrafter

    target = tiny_llama(seed=0, **INIT)
    policy = QuantizedKV(quant_bits=4, quant_group_size=8, residual_length=6, sink_tokens=2)
    seen = []

    class Watch(StaticQuantKV):
        def commit(self):
            super().commit()
            seen.append((self.held[:self.active], self.quantized_held[:self.active], self.quantized.tolist()))

    decoder = batch_decoder(target, lambda: LookupDrafter(max_cached_requests=0), VerifyCost([1.0] * 64, learn=False),
                            num_draft_tokens=4, batch_size=2, policy=policy)
    decoder._new_cache = lambda prompts, gen: Watch(target, 2, 128, decoder._widest(), policy)
    decoder.decode_batch(prompts(3), GenerationSpec(max_new_tokens=40, ignore_eos=True))
    for held, packed, on_device in seen:
        assert on_device[:len(packed)] == packed
        for n, q in zip(held, packed):
            # packed: whole groups after the 2 sinks up to boundary(n); the fp residual: at most max(6, 8 - 1) tokens
            expected = 8 * min((n - 2) // 8, -(-(n - 2 - 6) // 8)) if n - 2 - 6 > 0 else 0
            assert q == expected and n - 2 - q <= 7
    assert max(q for _, packed, _ in seen for q in packed) >= 48  # every row ran past several groups
    assert isinstance(decoder.cache, Watch) and decoder.cache.fp_slots == 2 + 7 + 5
